"""examples/quickstart_fedcomp, a Flower app in the quickstart shape with fedcomp's two
lines, run as a user runs it: `flwr run` against a SuperLink in simulation mode that
this test starts itself, with runtime dependency installation disabled (fedcomp comes
from this environment, as a pre-installed wheel would)."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
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
from fedcomp.keys import KEY_PAYLOADS, RECORD_HEADER

EXAMPLE = PROJECT_ROOT / "examples" / "quickstart_fedcomp"


def _flwr_run(app: Path, tmp_path: Path, rounds: int) -> str:
    """``flwr run <app>`` against a simulation SuperLink (4 SuperNodes) started here;
    the run's log once it completed (stopping everything it started)."""
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
            [
                "run",
                str(app),
                "sim",
                "--format",
                "json",
                "--run-config",
                f"num-server-rounds={rounds}",
            ],
            what="flwr run",
        )
        run_id = int(reply["run-id"])
        _await_run(cli, run_id, tmp_path / "flwr-log-stream.log", timeout_s=300)
        return _run_log(cli, run_id)
    finally:
        stop_components([link], grace_s=10)


def _await_run(cli: FlwrCli, run_id: int, stream_log: Path, timeout_s: float) -> None:
    """Return once the run completed (fail if it finished otherwise or took longer).

    ``flwr log --stream`` returns when the run finishes, so one waiting process
    replaces a ``flwr ls`` every 2 s (each a Python start that competed with the run
    for this machine's cores); if the stream ends early, ``flwr ls`` polls as before.
    """
    stream = cli.stream_logs(run_id, stream_log)
    deadline = time.monotonic() + timeout_s
    try:
        while (status := cli.run_status(run_id))[0] != "finished:completed":
            assert not status[0].startswith("finished"), status
            remaining = deadline - time.monotonic()
            assert remaining > 0, "the example run did not finish"
            if stream.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    stream.wait(timeout=min(remaining, 30))
            else:
                time.sleep(2)  # the stream ended before the run did: poll
    finally:
        if stream.poll() is None:
            stream.kill()
        stream.wait()


@pytest.mark.deployment
def test_the_quickstart_example_runs_compressed_under_a_simulation_superlink(
    tmp_path: Path,
) -> None:
    log = _flwr_run(EXAMPLE, tmp_path, rounds=2)
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


#: A mod outside fedcomp's that truncates partition 0's first payload after encoding:
#: the malformed reply then crosses Flower's real transport (gRPC, the SuperLink).
_TAMPER = """
from fedcomp.bundle import repack_like, unpack_bundle


def _truncate_partition_0(msg, context, call_next):
    reply = call_next(msg, context)
    header = None if reply.has_error() else reply.content.config_records.get("fedcomp.header")
    if int(context.node_config["partition-id"]) == 0 and header and "fedcomp.payloads" in header:
        blob = header["fedcomp.payloads"]
        stored = unpack_bundle(blob, max_entries=1 << 16, expand=False)
        entries = {n: bytes(e) for n, e in stored.items()}
        name = next(iter(entries))
        entries[name] = entries[name][:-7]
        header["fedcomp.payloads"] = repack_like(blob, entries, stored=True)
    return reply


app = ClientApp(mods=[_truncate_partition_0, CompressionMod()])
"""


@pytest.mark.deployment
@pytest.mark.slow  # make deploy-test runs it (the same checks run in-process in make test)
def test_a_truncated_payload_through_a_real_superlink_is_one_clients_failure(
    tmp_path: Path,
) -> None:
    """The quickstart app with a hostile mod on one SuperNode: its reply is rejected as
    malformed in every round, logged with its kind, and the other three aggregate."""
    app = tmp_path / "app"
    shutil.copytree(EXAMPLE, app, ignore=shutil.ignore_patterns("__pycache__", "*.pt"))
    client = app / "quickstart_fedcomp" / "client_app.py"
    source = client.read_text()
    assert (RECORD_HEADER, KEY_PAYLOADS) == ("fedcomp.header", "fedcomp.payloads")
    assert "app = ClientApp(" in source
    source = source.replace("app = ClientApp(mods=[CompressionMod()])", _TAMPER.strip())
    client.write_text(source)
    log = _flwr_run(app, tmp_path, rounds=2)
    rounds = re.findall(r"round (\d)/2 \|.*?(\d)/(\d) replied", log)
    assert [(r[0], r[1], r[2]) for r in rounds] == [("1", "3", "4"), ("2", "3", "4")]
    rejected = re.findall(r"round (\d): rejected reply of client 0 \[malformed\]", log)
    assert rejected == ["1", "2"]


def _run_log(cli: FlwrCli, run_id: int) -> str:
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
