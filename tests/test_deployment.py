"""Flower's Deployment Engine: settings, node specs, the staged app, and real deployments.

The real ones start a SuperLink and SuperNodes on loopback (a round costs 12-19 s
there: a new process per message, 3 s idle polls), so they are few: one whole job
through ``python -m experiments.deploy`` compared with the in-process path, and the
faults (a pinned port in use, a SuperLink that never answers or exits, a SuperNode
killed mid-run, a run timeout, Ctrl-C), each checked for a clear error naming the
component and for processes left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from experiments.deploy import CONF_DIR, deploy_schema, split_cfg
from experiments.deployment.argv import superlink_argv, supernode_argv
from experiments.deployment.flwr_cli import remove_connection, stage_app, write_connection
from experiments.deployment.launcher import Launch, launch, salvaged_results
from experiments.deployment.processes import (
    DEFAULT_EPHEMERAL,
    LISTEN_SPAN,
    DeploymentError,
    child_env,
    ephemeral_range,
    free_port,
    tail,
)
from experiments.deployment.settings import (
    AuthSettings,
    DeploymentSettings,
    SuperLinkSettings,
    SuperNodeSettings,
    TlsSettings,
    gpu_ids,
    node_config_arg,
    node_specs,
    validate_deployment,
)
from experiments.deployment.tap import read_log, summarise
from experiments.inprocess import InProcessGrid
from experiments.run import settings_from_cfg
from experiments.runtime import PROJECT_ROOT
from fedcomp.results_file import load_results
from fedcomp.settings import Settings, settings_from_dict, settings_from_run_config

FLOWER_NAMES = ("flower-superlink", "flower-supernode", "flower-superexec", "flwr-")

#: A small job: 2 clients, 1 local epoch, top-k (its payload sizes depend on the
#: trained values, so equal bytes mean equal updates), no client-side evaluation
#: (each evaluate message would cost another ClientApp process per node).
JOB = {
    "num_clients": 2,
    "num_rounds": 2,
    "codec": {"name": "topk", "fraction": 0.01},
    "downlink": {
        "name": "uniform",
        "bits": 4,
        "block": 256,
        "memory": "error_feedback",
        "initial": "seeded",
    },
    "train": {"local_epochs": 1},
    "fraction_evaluate": 1.0,
}
JOB_OVERRIDES = [
    "num_clients=2",
    "num_rounds=2",
    "codec=topk",
    "downlink=uniform4",
    "train.local_epochs=1",
    "fraction_evaluate=1.0",
]


# ---------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------


def _cmdlines() -> dict[int, str]:
    """pid -> command line of every live, non-zombie process."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if stat[stat.rindex(")") + 2] == "Z":
                continue
            raw = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        out[int(entry.name)] = raw.replace(b"\0", b" ").decode(errors="replace")
    return out


def flower_processes(ports: set[int]) -> dict[int, str]:
    """Live Flower processes that mention one of ``ports`` (ours, not another run's)."""
    pattern = re.compile(r"[: ](" + "|".join(str(p) for p in ports) + r")\b")
    return {
        pid: cmd
        for pid, cmd in _cmdlines().items()
        if any(name in cmd for name in FLOWER_NAMES) and pattern.search(cmd)
    }


def wait_gone(ports: set[int], bound: float = 60.0) -> dict[int, str]:
    """Our Flower processes still alive after up to ``bound`` seconds, returning as soon
    as there are none. The launcher waits for its own children; their descendants, which
    it kills too, can take a moment to go on a loaded machine. The bound is generous, not
    a deadline: what the launcher fails to stop (a SuperLink, a SuperNode that retries
    forever without one) is still alive after it."""
    deadline = time.monotonic() + bound
    left = flower_processes(ports)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = flower_processes(ports)
    return left


def assert_all_stopped(state: Launch) -> None:
    """Every component exited, nothing of theirs is alive, and nothing survived."""
    assert state.components, "the launch started nothing"
    for comp in state.components:
        assert comp.proc.returncode is not None, f"{comp.name} still running"
    assert state.survivors == []
    # The launcher waits for every process it signals, so this holds at once.
    assert flower_processes({c.port for c in state.components}) == {}


# ---------------------------------------------------------------------------------
# settings, node specs, commands (no processes)
# ---------------------------------------------------------------------------------


def _compose_deploy(*overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"), deploy_schema():
        return split_cfg(compose(config_name="deploy", overrides=list(overrides)))


def test_deployment_configs_compose_with_the_experiment_settings() -> None:
    run_cfg, local = _compose_deploy(*JOB_OVERRIDES)
    assert settings_from_cfg(run_cfg) == replace(settings_from_dict(JOB), results_path="")
    assert local == DeploymentSettings()  # local.yaml states the schema's defaults
    _, gpu = _compose_deploy("deployment=multi_gpu")
    assert (gpu.name, gpu.supernodes.gpus, gpu.superlink.host) == ("multi_gpu", -1, "127.0.0.1")
    _, edge = _compose_deploy("deployment=edge", "deployment.superlink.address=fl.example:9093")
    assert edge.tls.enabled and edge.auth.enabled and edge.supernodes.count == 0
    assert (edge.superlink.host, edge.superlink.port) == ("0.0.0.0", 9093)
    assert edge.superlink.address == "fl.example:9093"
    # The simulation entry point's schema is untouched afterwards.
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        assert "deployment" not in compose(config_name="config")


@pytest.mark.parametrize(
    ("deployment", "key"),
    [
        (DeploymentSettings(superlink=SuperLinkSettings(port=70000)), "superlink.port"),
        (DeploymentSettings(supernodes=SuperNodeSettings(count=3)), "supernodes.count"),
        (DeploymentSettings(supernodes=SuperNodeSettings(ports=[9100])), "supernodes.ports"),
        (
            DeploymentSettings(
                superlink=SuperLinkSettings(port=9100),
                supernodes=SuperNodeSettings(ports=[9100, 9101]),
            ),
            "supernodes.ports",
        ),
        (
            DeploymentSettings(supernodes=SuperNodeSettings(node_config={"partition-id": 5})),
            "supernodes.node_config",
        ),
        (DeploymentSettings(superlink=SuperLinkSettings(host="0.0.0.0")), "superlink.host"),
        (DeploymentSettings(auth=AuthSettings(enabled=True)), "auth.enabled"),
        (
            DeploymentSettings(tls=TlsSettings(enabled=True, ca_certfile="/nonexistent/ca.crt")),
            "tls.",
        ),
        (DeploymentSettings(run_timeout=0), "run_timeout"),
    ],
)
def test_bad_deployment_settings_name_the_key(deployment: DeploymentSettings, key: str) -> None:
    with pytest.raises(ValueError, match=rf"deployment\.{re.escape(key)}"):
        validate_deployment(deployment, num_clients=2)


def test_node_specs_give_each_node_its_partition_and_one_gpu() -> None:
    local = node_specs(DeploymentSettings(), 3, available_gpus=[])
    assert [s.node_config for s in local] == [
        {"partition-id": i, "num-partitions": 3} for i in range(3)
    ]
    assert all(s.env == {} and s.port == 0 for s in local)

    # multi_gpu on a (mocked) 4-GPU host: 8 clients, two SuperNodes per GPU.
    gpu = DeploymentSettings(supernodes=SuperNodeSettings(gpus=-1))
    specs = node_specs(gpu, 8, available_gpus=["0", "1", "2", "3"])
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0", "1", "2", "3"] * 2
    assert [s.partition_id for s in specs] == list(range(8))
    # One per GPU on a host whose launcher only sees GPUs 4-7.
    visible = gpu_ids("4,5,6,7", device_count=4)
    specs = node_specs(gpu, 4, available_gpus=visible)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["4", "5", "6", "7"]
    two = DeploymentSettings(supernodes=SuperNodeSettings(gpus=2))
    assert {s.env["CUDA_VISIBLE_DEVICES"] for s in node_specs(two, 4, ["0", "1", "2"])} == {
        "0",
        "1",
    }
    assert gpu_ids(None, 3) == ["0", "1", "2"] and gpu_ids("", 0) == []
    with pytest.raises(ValueError, match=r"deployment\.supernodes\.gpus=-1.*0 GPU"):
        node_specs(gpu, 2, available_gpus=[])
    with pytest.raises(ValueError, match=r"deployment\.supernodes\.gpus=4.*2 GPU"):
        node_specs(replace(gpu, supernodes=SuperNodeSettings(gpus=4)), 4, ["0", "1"])
    # Edge: no local nodes; the devices connect themselves.
    assert node_specs(DeploymentSettings(supernodes=SuperNodeSettings(count=0)), 5, []) == []


def test_a_failed_runs_salvaged_results_are_read_for_its_socket_bytes(tmp_path: Path) -> None:
    # A run that failed (the ServerApp wrote its rounds and its failure) gets the socket
    # section all the same; anything else is not a salvaged file: nothing to add it to.
    path = tmp_path / "results.json"
    salvaged = {"rounds": [{"round": 1}], "failure": {"kind": "RunFailed", "message": "m"}}
    path.write_text(json.dumps(salvaged))
    assert salvaged_results(path) == salvaged
    for text in ('{"rounds": []}', "[1]", "not json", "{"):
        path.write_text(text)
        assert salvaged_results(path) == {}
    assert salvaged_results(tmp_path / "missing.json") == {}


EPHEMERAL_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def test_free_ports_are_drawn_below_the_ephemeral_range_and_are_free(tmp_path: Path) -> None:
    # Outgoing connections take local ports from the ephemeral range: a listening port
    # picked there can be taken before its server binds it (a 20-node run did).
    low, high = ephemeral_range()
    assert (low, high) == tuple(int(v) for v in open(EPHEMERAL_FILE).read().split())
    ports = {free_port("127.0.0.1") for _ in range(20)}
    assert all(max(1025, low - LISTEN_SPAN) <= p < low for p in ports)
    taken = min(ports)
    with socket.socket() as held:  # a port something listens on is never returned
        held.bind(("127.0.0.1", taken))
        held.listen()
        draws = iter([taken, taken, max(ports)])
        assert free_port("127.0.0.1", draw=lambda a, b: next(draws)) == max(ports)
        fallback = free_port("127.0.0.1", tries=3, draw=lambda a, b: taken)
        assert fallback != taken and low <= fallback <= high  # the OS's pick
    for text in ("", "a b", "70000 80000", "5000 100"):
        (tmp_path / "range").write_text(text)
        assert ephemeral_range(str(tmp_path / "range")) == DEFAULT_EPHEMERAL


def test_node_config_argument_is_flowers_key_value_syntax() -> None:
    arg = node_config_arg({"partition-id": 0, "num-partitions": 2, "site": 'a "b"', "x": 0.5})
    assert arg == 'partition-id=0 num-partitions=2 site="a \\"b\\"" x=0.5'
    with pytest.raises(ValueError, match="node_config"):
        node_config_arg({"bad": [1]})


def test_every_flag_the_launcher_passes_exists_in_flower(tmp_path: Path) -> None:
    """TLS and node-authentication flags included: checked against the real binaries."""
    for name in ("ca.crt", "server.pem", "server.key", "node.key", "node.key.pub"):
        (tmp_path / name).write_text("x")
    d = DeploymentSettings(
        tls=TlsSettings(True, *(str(tmp_path / n) for n in ("ca.crt", "server.pem", "server.key"))),
        auth=AuthSettings(enabled=True, private_keys=[str(tmp_path / "node.key")]),
    )
    validate_deployment(d, num_clients=1)
    spec = node_specs(d, 1, [])[0]
    for argv in (superlink_argv(d, 9093), supernode_argv(d, spec, "127.0.0.1:9093", 9094)):
        flags = {a for a in argv if a.startswith("--")}
        assert {"--ssl-certfile", "--root-certificates", "--enable-supernode-auth"} & flags
        out = subprocess.run(
            [argv[0], "--help"], capture_output=True, text=True, env=child_env(), timeout=60
        )
        assert out.returncode == 0
        documented = set(re.findall(r"--[a-z][a-z-]+", out.stdout))
        assert flags <= documented, flags - documented


def test_staged_app_carries_this_runs_settings_as_its_run_config(tmp_path: Path) -> None:
    """The SuperLink only accepts overrides of declared keys; codec.fraction is not one."""
    settings = settings_from_dict({**JOB, "results_path": str(tmp_path / "results.json")})
    app = stage_app(settings, tmp_path / "app")
    staged = tomllib.loads((app / "pyproject.toml").read_text())
    config = staged["tool"]["flwr"]["app"]["config"]
    assert config["codec.fraction"] == 0.01
    assert settings_from_run_config(config) == settings
    # Everything else in the project file is unchanged, and the FAB's files are there.
    original = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())
    staged["tool"]["flwr"]["app"].pop("config")
    original["tool"]["flwr"]["app"].pop("config")
    assert staged == original
    for module in ("strategies/server_app.py", "clients/client_app.py", "fedcomp/settings.py"):
        assert (app / module).read_bytes() == (PROJECT_ROOT / module).read_bytes()
    assert not list(app.rglob("*.pyc")) and not list(app.rglob("*.yaml"))


def test_connections_are_added_and_removed_leaving_others(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text(
        '[superlink]\ndefault = "mine"\n[superlink.mine]\naddress = "h:1"\ninsecure = true\n'
    )
    write_connection(tmp_path, "fedcomp-local-5", {"address": "127.0.0.1:5", "insecure": True})
    data = tomllib.loads((tmp_path / "config.toml").read_text())
    assert data["superlink"]["fedcomp-local-5"] == {"address": "127.0.0.1:5", "insecure": True}
    remove_connection(tmp_path, "fedcomp-local-5")
    data = tomllib.loads((tmp_path / "config.toml").read_text())
    assert data == {"superlink": {"default": "mine", "mine": {"address": "h:1", "insecure": True}}}


# ---------------------------------------------------------------------------------
# faults, with real processes
# ---------------------------------------------------------------------------------


@pytest.fixture
def job() -> Settings:
    return settings_from_dict(JOB)


def test_pinned_port_in_use_fails_before_any_process_starts(job, tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        state = Launch(tmp_path)
        d = DeploymentSettings(superlink=SuperLinkSettings(port=port))
        with pytest.raises(DeploymentError, match=rf"SuperLink: port {port} on 127.0.0.1 is "):
            launch(job, d, tmp_path, state=state)
        assert state.components == []
        nodes = DeploymentSettings(supernodes=SuperNodeSettings(ports=[port, 0]))
        with pytest.raises(ValueError, match=r"deployment\.supernodes\.ports\[1\]=0"):
            launch(job, nodes, tmp_path)
        free = free_port("127.0.0.1")
        d = DeploymentSettings(supernodes=SuperNodeSettings(ports=[free, port]))
        with pytest.raises(DeploymentError, match=rf"SuperNode 1 \(partition-id=1\): port {port}"):
            launch(job, d, tmp_path)


def test_diagnostics_are_refused_on_a_deployment_before_any_process(job, tmp_path: Path):
    """The exact updates of the diagnostics travel beside the messages: simulation only."""
    state = Launch(tmp_path)
    with pytest.raises(ValueError, match=r"^invalid setting diagnostics_dir='/tmp/d': simulation"):
        launch(replace(job, diagnostics_dir="/tmp/d"), DeploymentSettings(), tmp_path, state=state)
    assert state.components == []


@pytest.mark.deployment
def test_superlink_that_never_answers_is_stopped(job, tmp_path: Path) -> None:
    state = Launch(tmp_path)
    d = DeploymentSettings(superlink=SuperLinkSettings(ready_timeout=0.05))
    with pytest.raises(DeploymentError, match=r"^SuperLink: did not answer at http://127"):
        launch(job, d, tmp_path, state=state)
    assert [c.name for c in state.components] == ["SuperLink"]
    assert_all_stopped(state)


@pytest.mark.deployment
def test_superlink_that_exits_at_start_is_reported_with_its_log(job, tmp_path: Path) -> None:
    state = Launch(tmp_path)
    d = DeploymentSettings(superlink=SuperLinkSettings(extra_args=["--no-such-flag"]))
    with pytest.raises(DeploymentError, match=r"(?s)^SuperLink: exited with code 2.*no-such-flag"):
        launch(job, d, tmp_path, state=state)
    assert_all_stopped(state)


def _when_running(state: Launch, action, timeout: float = 120.0) -> threading.Thread:
    """Run ``action`` in a thread once the launch has a run id."""

    def watch() -> None:
        deadline = time.monotonic() + timeout
        while state.run_id is None and time.monotonic() < deadline:
            time.sleep(0.1)
        action()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.deployment
def test_supernode_killed_mid_run_names_it_and_stops_everything(job, tmp_path: Path) -> None:
    state = Launch(tmp_path)

    def kill_node_1() -> None:
        os.kill(state.components[2].proc.pid, signal.SIGKILL)

    thread = _when_running(state, kill_node_1)
    with pytest.raises(
        DeploymentError, match=r"^SuperNode 1 \(partition-id=1\): exited with code -9"
    ):
        launch(job, DeploymentSettings(), tmp_path, state=state)
    thread.join()
    assert state.run_id is not None and state.status == ""
    assert_all_stopped(state)


@pytest.mark.deployment
def test_serverapp_failure_is_reported_with_its_log(tmp_path: Path) -> None:
    """No SuperNode connects (none started here, as with edge devices that stay away):
    the ServerApp gives up after simulation.round_timeout and the run fails."""
    settings = settings_from_dict({**JOB, "simulation": {"round_timeout": 1.0}})
    state = Launch(tmp_path)
    d = DeploymentSettings(supernodes=SuperNodeSettings(count=0))
    with pytest.raises(
        DeploymentError, match=r"(?s)^run \d+: ended finished:failed.*only 0 of 2 nodes connected"
    ):
        launch(settings, d, tmp_path, state=state)
    assert [c.name for c in state.components] == ["SuperLink"]
    assert_all_stopped(state)


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


@pytest.mark.deployment
def test_run_timeout_names_the_run_and_stops_everything(job, tmp_path: Path) -> None:
    """Also multi_gpu's boundary: with a (mocked) 2-GPU host, each SuperNode process
    really runs with its own CUDA_VISIBLE_DEVICES (torch then finds no GPU behind it
    here, and the example ClientApp trains on the CPU)."""
    state = Launch(tmp_path)
    seen: dict[str, str] = {}
    before = os.environ.get("CUDA_VISIBLE_DEVICES")

    def read_node_env() -> None:
        for comp in state.components[1:]:
            seen[comp.name] = _environ(comp.proc.pid).get("CUDA_VISIBLE_DEVICES", "unset")

    thread = _when_running(state, read_node_env)
    d = DeploymentSettings(run_timeout=1.0, supernodes=SuperNodeSettings(gpus=-1))
    with pytest.raises(DeploymentError, match=r"^run \d+: not finished after 1 s"):
        launch(job, d, tmp_path, state=state, available_gpus=lambda: ["0", "1"])
    thread.join()
    assert_all_stopped(state)
    assert seen == {
        "SuperNode 0 (partition-id=0, GPU 0)": "0",
        "SuperNode 1 (partition-id=1, GPU 1)": "1",
    }
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == before  # only the children's


# ---------------------------------------------------------------------------------
# the command line: a whole job, and Ctrl-C
# ---------------------------------------------------------------------------------


def _deploy_cmd(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "experiments.deploy", *overrides, f"hydra.run.dir={run_dir}"]


def _started(output: str) -> dict[int, int]:
    """pid -> port of every component the launcher logged as started."""
    return {int(p): int(q) for p, q in re.findall(r"started .*? \(pid (\d+), port (\d+)", output)}


@pytest.mark.deployment
@pytest.mark.slow  # about 60 s: `make deploy-test` and `make test-slow` run it
def test_loopback_job_matches_the_in_process_path_byte_for_byte(tmp_path: Path) -> None:
    """2 SuperNodes, 2 rounds, top-k up and 4-bit down (replicas built from the seed on
    the SuperNodes): the real deployment computes the same updates.

    Codec and record bytes are equal to the byte, and so are the centralized
    accuracies. Wire bytes differ a little: they are the deflated messages, whose
    metadata holds Flower's ids. In deployment those are the 64-bit run id and node ids
    and, on every reply, the 64-character id of the instruction it answers; the
    in-process grid uses run id 1, shorter node ids and empty message ids (measured:
    +90 B per reply, +23 B per instruction).
    """
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    out = subprocess.run(
        _deploy_cmd(run_dir, *JOB_OVERRIDES, "deployment.supernodes.transport_log=true"),
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    elapsed = time.monotonic() - t0
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    started = _started(log)
    assert len(started) == 3, log  # a SuperLink and 2 SuperNodes
    assert wait_gone(set(started.values())) == {}
    assert all(not Path(f"/proc/{pid}").exists() or _zombie(pid) for pid in started)
    unpacked = Path(re.search(r"removed the run's unpacked app (\S+)", log).group(1))
    assert unpacked.parent == Path(os.environ["FLWR_HOME"]).resolve() / "apps"
    assert not unpacked.exists()
    connection = re.search(r"connection '(fedcomp-local-\d+)'", log).group(1)
    flwr_config = Path(os.environ["FLWR_HOME"]) / "config.toml"
    assert connection not in tomllib.loads(flwr_config.read_text()).get("superlink", {})
    assert {p.name for p in (run_dir / "deploy").iterdir()} >= {
        "superlink.log",
        "supernode-0.log",
        "supernode-1.log",
        "run.log",
        "app",
    }

    deployed = load_results(run_dir / "results.json")  # validates the schema
    settings = settings_from_dict({**deployed["config"], "results_path": ""})
    assert settings == settings_from_dict(JOB)
    from clients.client_app import make_client_app
    from strategies.server_app import run_server

    local = run_server(InProcessGrid(make_client_app(), 2), settings)
    assert len(deployed["rounds"]) == len(local["rounds"]) == 2
    for dep, ref in zip(deployed["rounds"], local["rounds"], strict=True):
        assert (dep["selected"], dep["replied"], dep["failures"]) == (2, 2, 0)
        assert dep["accuracy"] == ref["accuracy"]
        assert dep["loss"] == pytest.approx(ref["loss"], rel=1e-9)
        for key in ("uplink_codec_bytes", "uplink_record_bytes", "downlink_record_bytes"):
            assert dep[key] == ref[key], key
        rows = zip(dep["per_client"], ref["per_client"], strict=True)
        for d_row, r_row in rows:
            assert d_row["client"] == r_row["client"]
            assert d_row["uplink_codec_bytes"] == r_row["uplink_codec_bytes"]
            assert 0 < d_row["uplink_wire_bytes"] - r_row["uplink_wire_bytes"] < 160
            assert 0 < d_row["downlink_wire_bytes"] - r_row["downlink_wire_bytes"] < 80
    _check_against_the_transport(deployed, run_dir / "deploy")
    print(f"\nloopback deployment, 2 SuperNodes x 2 rounds: {elapsed:.1f} s end to end")


@pytest.mark.deployment
@pytest.mark.slow  # about 35 s: `make deploy-test` and `make test-slow` run it
def test_socket_bytes_account_for_every_message_fedcomp_counted(tmp_path: Path) -> None:
    """The network comparison, in make test: one SuperNode, one round, through the
    launcher's counting proxy and the SuperNode's own call log (tap.py).

    Equalities that must hold: (1) every byte of every connection belongs to one call
    (heads and bodies), and the run's constants, its teardown and its rounds add up to
    the total; (2) the bodies at the socket are the protobuf bodies the SuperNode
    serialized, call for call; (3) per round and message kind, the messages and the
    object bytes that crossed the socket are results.json's traffic (fedcomp's count).
    And the socket costs more than the objects: what a user pays on top."""
    from experiments.deployment.socket_count import check_totals, read_socket_log

    # No client-side evaluation: one ClientApp process fewer, and train messages suffice.
    one = {**JOB, "num_clients": 1, "num_rounds": 1, "fraction_evaluate": 0.0}
    settings = settings_from_dict(one)
    d = DeploymentSettings(supernodes=SuperNodeSettings(transport_log=True), run_timeout=300.0)
    state = Launch(tmp_path)
    results = launch(settings, d, tmp_path, state=state)
    assert_all_stopped(state)
    assert load_results(tmp_path / "results.json")["socket"] == results["socket"]
    sock = results["socket"]
    rows, connections = read_socket_log(tmp_path / "deploy" / "socket.jsonl")

    # (1) closed accounting
    assert check_totals(rows, connections) == sock["total_bytes"]
    assert (sock["opaque_connections"], sock["unattributed_bytes"]) == (0, 0)
    assert all(c["unanswered"] == 0 for c in connections)
    parts = sock["setup_bytes"] + sock["teardown_bytes"]
    assert parts + sum(r["socket_bytes"] for r in sock["rounds"]) == sock["total_bytes"]
    assert sock["setup_calls"]["GetFab"] > 0

    # (2) the socket's bodies are the SuperNode's serialized requests and responses
    tapped = read_log(tmp_path / "deploy" / "transport-0.jsonl")
    at_tap = sorted((r["rpc"], r["request"], r["response"]) for r in tapped)
    at_socket = sorted((r["rpc"], r["up_body"], r["down_body"]) for r in rows)
    assert at_socket == at_tap

    # (3) fedcomp's traffic is what crossed, kind by kind
    (record,) = results["rounds"]
    (sock_round,) = sock["rounds"]
    counted = {k: (v["messages"], v["wire_bytes"]) for k, v in record["traffic"].items()}
    crossed = {k: (v["messages"], v["object_bytes"]) for k, v in sock_round["kinds"].items()}
    assert crossed == counted
    assert {"identity_query", "identity_reply", "train_instruction", "train_reply"} == set(crossed)
    for kind in sock_round["kinds"].values():
        assert kind["socket_bytes"] > kind["object_bytes"]
    print(
        f"\nsocket: {sock['total_bytes']} B in {sock['calls']} calls; set-up "
        f"{sock['setup_bytes']} B; round 1 {sock_round['socket_bytes']} B for "
        f"{record['total_wire_bytes']} B of objects"
    )


def _check_against_the_transport(results: dict, deploy_dir: Path) -> None:
    """What fedcomp counted equals what crossed the network, kind by kind: every
    message the SuperNodes pulled or pushed over the Fleet API (their own log of each
    HTTP call, experiments/deployment/tap.py) against results.json's traffic."""
    crossed: dict[int, dict[str, list[int]]] = {}
    overhead = 0
    for log in sorted(deploy_dir.glob("transport-*.jsonl")):
        summary = summarise(read_log(log))
        overhead += summary["other_body_bytes"]
        for m in summary["messages"].values():
            assert m["skipped"] == []  # the SuperLink asked for every object
            reply = m["direction"] == "up"
            first_contact = not m["group"].isdigit()
            kind = "identity" if first_contact else m["type"]
            name = f"{kind}_{'reply' if reply else 'instruction'}"
            name = {"identity_instruction": "identity_query"}.get(name, name)
            row = crossed.setdefault(int(m["group"]) if not first_contact else 1, {})
            counts = row.setdefault(name, [0, 0, 0])
            counts[0] += 1
            counts[1] += m["object_bytes"]
            counts[2] += int(m["body_bytes"])
    assert len(list(deploy_dir.glob("transport-*.jsonl"))) == 2
    kinds = set()
    for record in results["rounds"]:
        counted = {k: [v["messages"], v["wire_bytes"]] for k, v in record["traffic"].items()}
        seen = {k: v[:2] for k, v in crossed[record["round"]].items()}
        assert counted == seen, (record["round"], counted, seen)
        for _, objects, body in crossed[record["round"]].values():
            assert body > objects  # the HTTP bodies add ids and framing to the objects
        kinds |= set(seen)
    assert kinds == {
        "identity_query",
        "identity_reply",
        "train_instruction",
        "train_reply",
        "evaluate_instruction",
        "evaluate_reply",
    }
    assert overhead > 0  # heartbeats and polls: real traffic that moves no message


def _zombie(pid: int) -> bool:
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] == "Z"
    return True


@pytest.mark.deployment
def _interrupted_once_running(run_dir: Path, overrides: list[str], timeout: float):
    """Start the launcher, send SIGINT once its run started; (exit code, its output)."""
    proc = subprocess.Popen(
        _deploy_cmd(run_dir, *overrides),
        cwd=PROJECT_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if re.search(r"run \d+ started", line):
                proc.send_signal(signal.SIGINT)
                break
        rest, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, "".join(lines) + rest


@pytest.mark.deployment
@pytest.mark.slow  # make deploy-test runs it; kept out of make test's 10 minutes
def test_ctrl_c_stops_every_process_and_exits_130(tmp_path: Path) -> None:
    code, log = _interrupted_once_running(tmp_path / "run", JOB_OVERRIDES, timeout=120)
    assert code == 130, log[-3000:]
    assert "interrupted" in log
    started = _started(log)
    assert len(started) == 3
    assert wait_gone(set(started.values())) == {}


@pytest.mark.deployment
@pytest.mark.slow  # make deploy-test runs it; kept out of make test's 10 minutes
def test_port_in_use_on_the_command_line_exits_1_naming_the_component(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run(
            _deploy_cmd(tmp_path / "run", *JOB_OVERRIDES, f"deployment.superlink.port={port}"),
            cwd=PROJECT_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert out.returncode == 1
    assert f"SuperLink: port {port} on 127.0.0.1 is already in use" in out.stdout + out.stderr


def _tls_files(tmp: Path) -> dict[str, str]:
    """A CA, a SuperLink certificate for 127.0.0.1 signed by it, and a SuperNode key
    pair (EC P-384, OpenSSH format, as ``ssh-keygen -t ecdsa -b 384`` writes)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, key, issuer: str, signer, *, ca: bool) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            import ipaddress

            san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(signer, hashes.SHA256())

    pem = serialization.Encoding.PEM
    ca_key, server_key = (
        ec.generate_private_key(ec.SECP384R1()),
        ec.generate_private_key(ec.SECP384R1()),
    )
    files = {
        "ca.crt": cert("test CA", ca_key, "test CA", ca_key, ca=True).public_bytes(pem),
        "server.pem": cert("127.0.0.1", server_key, "test CA", ca_key, ca=False).public_bytes(pem),
        "server.key": server_key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    }
    node_key = ec.generate_private_key(ec.SECP384R1())
    files["node0.key"] = node_key.private_bytes(
        pem, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    files["node0.key.pub"] = node_key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    return {name: str(tmp / name) for name in files}


@pytest.mark.deployment
@pytest.mark.slow
def test_tls_and_supernode_authentication_on_loopback(tmp_path: Path) -> None:
    """The edge configuration's security, end to end: the SuperLink serves HTTPS only,
    the SuperNode verifies it with the CA and authenticates with its registered key;
    a SuperNode with an unregistered key is refused."""
    files = _tls_files(tmp_path)
    (tmp_path / "other").mkdir()
    settings = settings_from_dict({**JOB, "num_clients": 1, "num_rounds": 1})
    d = DeploymentSettings(
        name="edge",
        tls=TlsSettings(True, files["ca.crt"], files["server.pem"], files["server.key"]),
        auth=AuthSettings(enabled=True, private_keys=[files["node0.key"]]),
        run_timeout=300.0,
    )
    state = Launch(tmp_path)
    results = launch(settings, d, tmp_path, state=state)
    assert results["rounds"][0]["replied"] == 1
    assert_all_stopped(state)
    cli_log = (tmp_path / "deploy" / "flwr-cli.log").read_text()
    assert "supernode register" in cli_log and '"node-id"' in cli_log
    link_log = tail(tmp_path / "deploy" / "superlink.log", 400)
    assert "running on https://127.0.0.1" in link_log
    assert "SuperNode authentication is disabled" not in link_log

    # A node whose registered key is another one's is refused (Flower's code 305).
    stranger = _tls_files(tmp_path / "other")
    Path(files["node0.key.pub"]).write_bytes(Path(stranger["node0.key.pub"]).read_bytes())
    state = Launch(tmp_path)
    with pytest.raises(
        DeploymentError,
        match=r"(?s)^SuperNode 0 \(partition-id=0\): exited.*Exit Code: 305.*activate SuperNode",
    ):
        launch(settings, d, tmp_path / "refused", state=state)
    assert_all_stopped(state)


SCALE_OVERRIDES = [
    "num_clients=20",
    "num_rounds=2",
    "codec=uniform2",
    "train.local_epochs=1",
    "fraction_evaluate=0.5",
]


@pytest.mark.slow
@pytest.mark.deployment
def test_twenty_supernodes_on_loopback_run_and_leave_nothing_behind(tmp_path: Path) -> None:
    """The launcher at scale: a SuperLink and 20 SuperNodes (20 Python processes with
    torch) on this machine, 2 rounds. Prints each round's time and the launcher's own
    peak memory (the launcher only watches: its memory must not grow with the nodes)."""
    run_dir = tmp_path / "run"
    out = subprocess.run(
        _deploy_cmd(run_dir, *SCALE_OVERRIDES),
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    started = _started(log)
    assert len(started) == 21
    assert wait_gone(set(started.values())) == {}
    assert all(not Path(f"/proc/{pid}").exists() or _zombie(pid) for pid in started)
    results = load_results(run_dir / "results.json")
    assert [(r["selected"], r["replied"]) for r in results["rounds"]] == [(20, 20)] * 2
    assert all(r["traffic"]["evaluate_instruction"]["messages"] == 10 for r in results["rounds"])
    rss = float(re.search(r"launcher's own peak memory (\d+) MB", log).group(1))
    assert re.search(r"20 SuperNode\(s\)", log)
    rounds = ", ".join(f"{r['round_s']:.1f} s" for r in results["rounds"])
    print(f"\n20 SuperNodes x 2 rounds: rounds {rounds}; launcher peak {rss:.0f} MB")


@pytest.mark.slow
@pytest.mark.deployment
def test_ctrl_c_with_twenty_supernodes_stops_every_process(tmp_path: Path) -> None:
    code, log = _interrupted_once_running(tmp_path / "run", SCALE_OVERRIDES, timeout=300)
    assert code == 130, log[-3000:]
    started = _started(log)
    assert len(started) == 21
    assert wait_gone(set(started.values())) == {}
    assert all(not Path(f"/proc/{pid}").exists() or _zombie(pid) for pid in started)


def test_a_component_that_ignores_sigterm_is_killed_after_the_stop_timeout(tmp_path) -> None:
    """The launcher's stop: SIGTERM to every component and its descendants, then
    SIGKILL to what is still alive after ``deployment.stop_timeout``: a process that
    ignores SIGTERM (and a child it started) ends by SIGKILL, the one that obeys by
    SIGTERM."""
    from experiments.deployment.processes import descendants, start_component, stop_components

    stubborn = (
        "import signal, subprocess, sys, time;"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        "subprocess.Popen([sys.executable, '-c', "
        "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)']);"
        "print('ready', flush=True); time.sleep(120)"
    )
    obeying = "import time; print('ready', flush=True); time.sleep(120)"
    env = child_env({})
    comps = [
        start_component(name, [sys.executable, "-c", code], tmp_path / f"{name}.log", 0, env)
        for name, code in (("stubborn", stubborn), ("obeying", obeying))
    ]
    deadline = time.monotonic() + 120  # a generous bound: they print at once
    while not all("ready" in (tmp_path / f"{c.name}.log").read_text() for c in comps):
        assert time.monotonic() < deadline, "the stub components never printed 'ready'"
        time.sleep(0.1)
    child = descendants([comps[0].proc.pid]) - {comps[0].proc.pid}
    assert len(child) == 1
    assert stop_components(comps, grace_s=1.0) == []
    assert comps[0].proc.returncode == -signal.SIGKILL
    assert comps[1].proc.returncode == -signal.SIGTERM
    (pid,) = child
    assert not Path(f"/proc/{pid}").exists() or _zombie(pid)


def test_supernodes_are_stopped_before_the_superlink_so_their_sign_off_arrives(
    tmp_path: Path,
) -> None:
    """The launcher's stop order: a SuperNode signs off on SIGTERM (flwr 1.42 sends
    DeactivateNode and UnregisterNode from its connection's ``finally``), which needs
    the SuperLink still up. Stubs: a "SuperLink" that writes down what it receives and
    dies at SIGTERM, and a "SuperNode" that on SIGTERM takes a moment (as flwr's exit
    handlers do) and then sends its sign-off. Signalled together (the launcher's old
    stop), the sign-off met a closed port; stopped nodes first, it arrives."""
    from experiments.deployment.launcher import SUPERLINK, stop_deployment
    from experiments.deployment.processes import start_component

    port = free_port("127.0.0.1")
    link_code = (
        "import socket, sys;"
        "s = socket.create_server(('127.0.0.1', int(sys.argv[1])));"
        "print('ready', flush=True)\n"
        "while True:\n"
        "    c, _ = s.accept(); print('got', c.recv(100).decode(), flush=True); c.close()"
    )
    node_code = (
        "import signal, socket, sys, time\n"
        "def bye(*_):\n"
        "    time.sleep(0.5)\n"
        "    try:\n"
        "        link = ('127.0.0.1', int(sys.argv[1]))\n"
        "        socket.create_connection(link, timeout=5).sendall(b'sign-off')\n"
        "        print('signed off', flush=True)\n"
        "    except OSError as exc:\n"
        "        print('sign-off failed:', exc, flush=True)\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "print('ready', flush=True)\n"
        "while True: time.sleep(0.1)"
    )
    env = child_env({})
    link = start_component(
        SUPERLINK, [sys.executable, "-c", link_code, str(port)], tmp_path / "link.log", port, env
    )
    comps = [link]
    for i in range(2):
        comps.append(
            start_component(
                f"SuperNode {i}",
                [sys.executable, "-c", node_code, str(port)],
                tmp_path / f"n{i}.log",
                0,
                env,
            )
        )
    deadline = time.monotonic() + 120  # a generous bound: they print at once
    while not all("ready" in c.log_path.read_text() for c in comps):
        assert time.monotonic() < deadline, "the stub components never printed 'ready'"
        time.sleep(0.1)
    assert stop_deployment(comps, grace_s=10.0) == []
    for node in comps[1:]:
        assert node.proc.returncode == 0
        assert "signed off" in node.log_path.read_text()
    assert link.log_path.read_text().count("got sign-off") == 2
    assert link.proc.returncode == -signal.SIGTERM
