"""examples/quickstart_fedcomp, a Flower app in the quickstart shape with fedcomp's two
lines, run as a user runs it: `flwr run` against a SuperLink in simulation mode that
this test starts itself, with runtime dependency installation disabled (fedcomp comes
from this environment, as a pre-installed wheel would)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from experiments.deployment.argv import wait_ready
from experiments.deployment.flwr_cli import FlwrCli, write_connection
from experiments.deployment.processes import (
    _binary,
    child_env,
    free_port,
    start_component,
    stop_components,
)
from experiments.runtime import PROJECT_ROOT

EXAMPLE = PROJECT_ROOT / "examples" / "quickstart_fedcomp"


@pytest.mark.deployment
def test_the_quickstart_example_runs_compressed_under_a_simulation_superlink(
    tmp_path: Path,
) -> None:
    home = tmp_path / "flwr-home"
    port = free_port("127.0.0.1")
    env = child_env({"FLWR_HOME": str(home)})
    argv = [
        _binary("flower-superlink"),
        "--insecure",
        "--simulation",
        "--disable-runtime-dependency-installation",
        *("--host", "127.0.0.1", "--port", str(port)),
    ]
    link = start_component("SuperLink", argv, tmp_path / "superlink.log", port, env, cwd=tmp_path)
    try:
        wait_ready(link, f"http://127.0.0.1:{port}/health", 60, None)
        entry = {"address": f"127.0.0.1:{port}", "insecure": True}
        write_connection(home, "sim", {**entry, "options": {"num-supernodes": 4}})
        cli = FlwrCli("sim", env, tmp_path, tmp_path / "flwr-cli.log")
        reply = cli.call(
            ["run", str(EXAMPLE), "sim", "--format", "json", "--run-config", "num-server-rounds=2"],
            what="flwr run",
        )
        run_id = int(reply["run-id"])
        deadline = time.monotonic() + 300
        while (status := cli.run_status(run_id))[0] != "finished:completed":
            assert not status[0].startswith("finished"), status
            assert time.monotonic() < deadline, "the example run did not finish"
            time.sleep(2)
        log = _run_log(cli, run_id)
    finally:
        stop_components([link], grace_s=10)
    # fedcomp's lines reach Flower's log; FedAvg's own fraction_evaluate is respected.
    assert "CompressedStrategy: codec" in log and "stable ids known for 4 of 4" in log
    assert log.count("configure_evaluate: Sampled 2 nodes (out of 4)") == 2
    rounds = re.findall(r"round (\d)/2 \|.*?fp32/total ([\d.]+)\).*?(\d)/(\d) replied", log)
    assert [r[0] for r in rounds] == ["1", "2"]
    assert all(r[2] == r[3] == "4" for r in rounds)
    # 2-bit up, 4-bit down: after the first round (full models to new replicas) the
    # total traffic is several times below fp32's.
    assert float(rounds[1][1]) > 4
    assert (tmp_path / "final_model.pt").stat().st_size > 10_000


def _run_log(cli: FlwrCli, run_id: int) -> str:
    import subprocess

    out = subprocess.run(
        [_binary("flwr"), "log", str(run_id), cli.connection, "--show"],
        capture_output=True,
        text=True,
        env=cli.env,
        cwd=cli.cwd,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    return out.stdout + out.stderr
