"""Run the job on Flower's Deployment Engine: processes this launcher owns, start to stop.

:func:`launch` starts a SuperLink (ready when its ``/health`` answers) and the
configured SuperNodes, writes the connection into ``$FLWR_HOME/config.toml``, starts
the run with ``flwr run``, follows it to its end (``flwr log --stream``, ``flwr ls``,
and the PIDs of every component), checks the ``results.json`` the ServerApp wrote,
and stops every process it started, also on an error, SIGTERM or Ctrl-C. The pieces:
:mod:`experiments.deployment.processes`, :mod:`experiments.deployment.flwr_cli`,
:mod:`experiments.deployment.argv`, and the settings in
:mod:`experiments.deployment.settings`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from clients.paths import node_config_of, paths_of
from experiments.deployment.argv import (
    _public_keys,
    _tls_context,
    connection_entry,
    detect_gpus,
    superlink_address,
    superlink_argv,
    supernode_argv,
    tap_argv,
    wait_ready,
)
from experiments.deployment.flwr_cli import FlwrCli, remove_connection, stage_app, write_connection
from experiments.deployment.processes import (
    Component,
    DeploymentError,
    check_port_free,
    child_env,
    connect_host,
    free_port,
    host_port,
    signals_ignored,
    signals_raise,
    start_component,
    stop_in_stages,
    tail,
)
from experiments.deployment.settings import (
    DeploymentSettings,
    NodeSpec,
    node_specs,
    validate_deployment,
)
from experiments.deployment.socket_count import CountingProxy, socket_section
from experiments.framing import fp32_reference_fields
from experiments.runtime import PROJECT_ROOT
from fedcomp.results_file import ResultsError, load_results, write_results
from fedcomp.settings import Settings, validate

log = logging.getLogger("experiments.deployment")


#: How often the PIDs are checked, and how often ``flwr ls`` is asked while the log
#: stream runs (each call starts a Python process: about 1.4 s of CPU here).
POLL_S = 0.5


STATUS_EVERY_S = 10.0

#: The SuperLink component's name (:func:`stop_deployment` stops it last).
SUPERLINK = "SuperLink"


@dataclass
class Launch:
    """What :func:`launch` started and learned (for logs and tests)."""

    run_dir: Path
    components: list[Component] = field(default_factory=list)
    connection: str = ""
    run_id: int | None = None
    fab: str = ""
    status: str = ""
    survivors: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    #: The launcher's own peak resident memory (its children not included).
    peak_rss_mb: float = 0.0


def own_peak_rss_mb() -> float:
    """This process's peak resident set size in MB (Linux reports kilobytes)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def follow_run(
    cli: FlwrCli,
    run_id: int,
    components: list[Component],
    timeout: float,
    log_path: Path,
) -> tuple[str, str]:
    """Wait for the run to finish while every component stays alive.

    Returns ``(status, details)`` from ``flwr ls`` once it starts with ``finished``.

    Raises
    ------
    DeploymentError
        Naming the component that exited, or the run when ``timeout`` passes.
    """
    deadline = time.monotonic() + timeout
    stream: subprocess.Popen | None = cli.stream_logs(run_id, log_path)
    next_status = time.monotonic() + STATUS_EVERY_S
    try:
        while True:
            for comp in components:
                if (why := comp.died()) is not None:
                    raise DeploymentError(comp.name, f"{why}\n(while run {run_id} was running)")
            now = time.monotonic()
            if now > deadline:
                raise DeploymentError(
                    f"run {run_id}",
                    f"not finished after {timeout:g} s (deployment.run_timeout); "
                    f"its log so far: {log_path}",
                )
            stream_ended = stream is not None and stream.poll() is not None
            if stream_ended or now >= next_status:
                status, details = cli.run_status(run_id)
                if status.startswith("finished"):
                    return status, details
                if stream_ended:
                    stream = None  # it ended a moment early, or failed: poll `flwr ls`
                next_status = now + (STATUS_EVERY_S if stream is not None else 2.0)
            time.sleep(POLL_S)
    finally:
        if stream is not None and stream.poll() is None:
            stream.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                stream.wait(timeout=5)
            if stream.poll() is None:
                stream.kill()
                stream.wait()


def launch(
    settings: Settings,
    deployment: DeploymentSettings,
    run_dir: Path,
    *,
    state: Launch | None = None,
    available_gpus: Callable[[], list[str]] = detect_gpus,
) -> dict[str, Any]:
    """Deploy, run the job to its end, stop everything; return the results.

    ``results.json`` lands in ``run_dir`` (the ServerApp writes it; the launcher
    validates it), process logs in ``run_dir/deploy/``. ``state`` (optional) is filled
    in as things start, so a caller can inspect what ran.

    Raises
    ------
    ValueError
        On bad settings, before any process starts.
    DeploymentError
        Naming the failing component (SuperLink, SuperNode i, the run, the flwr CLI).
    """
    run_dir = run_dir.resolve()
    results_path = run_dir / "results.json"
    # The ServerApp and ClientApps run elsewhere (FLWR_HOME/apps): absolute paths only.
    from experiments.simulate import absolute_paths, preflight

    if settings.diagnostics_dir:
        # the exact updates would travel outside the messages, and be compared with
        raise ValueError(
            f"invalid setting diagnostics_dir={settings.diagnostics_dir!r}: simulation "
            "only (its clients write their exact updates beside the messages); leave it "
            "empty on a deployment"
        )
    settings = absolute_paths(validate(replace(settings, results_path=str(results_path))))
    if deployment.auth.enabled:  # nodes keep their keys: bind each stable id to one
        settings = replace(settings, bind_keys=True)
    validate_deployment(deployment, settings.num_clients)
    preflight(settings, ray=False)  # data sizes, codec and strategy specs, devices
    needs_gpus = deployment.supernodes.gpus != 0
    specs = node_specs(
        deployment,
        settings.num_clients,
        available_gpus() if needs_gpus else [],
        client_paths=node_config_of(paths_of(settings)),  # the ClientApps' own paths
    )
    st = state or Launch(run_dir)
    deploy_dir = run_dir / "deploy"
    deploy_dir.mkdir(parents=True, exist_ok=True)
    flwr_home = Path(os.environ.get("FLWR_HOME", PROJECT_ROOT / ".flwr")).resolve()
    env = child_env({"FLWR_HOME": str(flwr_home)})
    sl = deployment.superlink

    # Pinned ports: fail now, naming the component, rather than in a log later.
    if sl.port:
        check_port_free(sl.host, sl.port, "SuperLink", "deployment.superlink.port")
    for i, spec in enumerate(specs):
        if spec.port:
            key = f"deployment.supernodes.ports[{i}]"
            check_port_free(deployment.supernodes.host, spec.port, _node_name(spec), key)
    port = sl.port or free_port(sl.host)
    address = superlink_address(deployment, port)
    st.connection = f"fedcomp-{deployment.name}-{port}"
    app_dir = stage_app(settings, deploy_dir / "app")
    cli = FlwrCli(st.connection, env, run_dir, deploy_dir / "flwr-cli.log")

    t0 = time.monotonic()
    proxy: CountingProxy | None = None
    results: dict[str, Any] = {}
    failure: DeploymentError | None = None
    with signals_raise():
        try:
            argv = superlink_argv(deployment, port)
            link = start_component(SUPERLINK, argv, deploy_dir / "superlink.log", port, env)
            st.components.append(link)
            scheme = "https" if deployment.tls.enabled else "http"
            url = f"{scheme}://{host_port(connect_host(sl.host), port)}/health"
            st.timings["superlink_ready_s"] = wait_ready(
                link, url, sl.ready_timeout, _tls_context(deployment)
            )
            write_connection(flwr_home, st.connection, connection_entry(deployment, address))
            log.info("SuperLink ready at %s; connection '%s'", address, st.connection)
            if deployment.auth.enabled:
                for key in _public_keys(deployment):
                    cli.register_node(key)
            node_address = address
            if specs and deployment.supernodes.socket_count:
                proxy = CountingProxy((connect_host(sl.host), port), deploy_dir / "socket.jsonl")
                node_address = host_port("127.0.0.1", proxy.start())
                log.info("SuperNodes connect through the byte-counting proxy %s", node_address)
            for spec in specs:
                st.components.append(
                    start_supernode(deployment, spec, node_address, deploy_dir, env)
                )
            if len(specs) < settings.num_clients:
                log.info(
                    "waiting for %d SuperNode(s) started elsewhere (partitions %d..%d) "
                    "to connect to %s",
                    settings.num_clients - len(specs),
                    len(specs),
                    settings.num_clients - 1,
                    address,
                )
            st.run_id, st.fab = cli.start_run(app_dir)
            log.info("run %d started (flwr log %d %s)", st.run_id, st.run_id, st.connection)
            t_run = time.monotonic()
            status, details = follow_run(
                cli, st.run_id, st.components, deployment.run_timeout, deploy_dir / "run.log"
            )
            st.status = status
            st.timings["run_s"] = time.monotonic() - t_run
            try:
                results = collect_results(st.run_id, status, details, results_path, deploy_dir)
            except DeploymentError as exc:
                # The ServerApp wrote what it had, with its failure: the bytes its
                # connections carried are measured all the same (below), then it raises.
                failure, results = exc, salvaged_results(results_path)
        finally:
            with signals_ignored():
                st.survivors = stop_deployment(st.components, deployment.stop_timeout)
                if proxy is not None:  # after the nodes: their sign-off is counted too
                    proxy.stop()
                remove_connection(flwr_home, st.connection)
                if st.fab:  # each run's FAB differs (its results_path): do not pile up
                    unpacked = flwr_home / "apps" / st.fab
                    if unpacked.exists():
                        shutil.rmtree(unpacked, ignore_errors=True)
                        log.info("removed the run's unpacked app %s", unpacked)
                st.timings["total_s"] = time.monotonic() - t0
                st.peak_rss_mb = own_peak_rss_mb()
            if st.survivors:
                log.error("processes still alive after SIGKILL: %s", st.survivors)
    if proxy is not None and results:
        results["socket"] = socket_section(deploy_dir / "socket.jsonl", len(specs))
        # A deployment runs its own recipe only: its fp32 reference at the socket is modelled.
        try:
            results["socket"].update(fp32_reference_fields(results))
        except (OSError, ValueError, KeyError, TypeError) as exc:  # the measurement stands
            log.warning("no fp32 reference at the socket (framing model: %s)", exc)
        write_results(results_path, results, salvage=failure is not None)
    if failure is not None:
        raise failure
    return results


def stop_deployment(components: list[Component], grace_s: float) -> list[int]:
    """Stop the SuperNodes (and wait for them), then the SuperLink; the survivors.

    On SIGTERM a SuperNode signs off: flwr 1.42's exit handler raises ``SystemExit``
    in its main loop, and the connection's ``finally`` sends ``DeactivateNode`` and
    ``UnregisterNode`` (``flwr/supernode/fleet_http_connection.py``), which needs the
    SuperLink still up. Signalled together, the SuperLink was gone before the nodes
    signed off: their sign-off calls met a refused connection (0-byte connections at
    the proxy, ``teardown_bytes`` 0). Each stage gets ``grace_s`` seconds.
    """
    links = [c for c in components if c.name == SUPERLINK]
    nodes = [c for c in components if c.name != SUPERLINK]
    return stop_in_stages([nodes, links], grace_s)


def salvaged_results(results_path: Path) -> dict[str, Any]:
    """A failed run's results.json as its ServerApp salvaged it (the rounds it ran and
    its ``failure``), not validated; {} when there is none."""
    try:
        data = json.loads(results_path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and "failure" in data else {}


def start_supernode(
    d: DeploymentSettings, spec: NodeSpec, address: str, deploy_dir: Path, env: dict[str, str]
) -> Component:
    """Start one SuperNode on a free (or its pinned) port, with its own environment."""
    port = spec.port or free_port(d.supernodes.host)
    argv = supernode_argv(d, spec, address, port)
    if d.supernodes.transport_log:
        argv = tap_argv(argv, deploy_dir / f"transport-{spec.partition_id}.jsonl")
    return start_component(
        _node_name(spec),
        argv,
        deploy_dir / f"supernode-{spec.partition_id}.log",
        port,
        {**env, **spec.env},
    )


def collect_results(
    run_id: int, status: str, details: str, results_path: Path, deploy_dir: Path
) -> dict[str, Any]:
    """The validated results of a finished run, or an error naming the run."""
    run_log = deploy_dir / "run.log"
    if status != "finished:completed":
        raise DeploymentError(
            f"run {run_id}",
            f"ended {status} {details}; the ServerApp's log: {run_log}\n{tail(run_log)}",
        )
    try:
        return load_results(results_path)
    except (OSError, ResultsError) as exc:
        raise DeploymentError(
            f"run {run_id}", f"completed but wrote no valid results.json: {exc}"
        ) from exc


def _node_name(spec: NodeSpec) -> str:
    gpu = f", GPU {spec.env['CUDA_VISIBLE_DEVICES']}" if "CUDA_VISIBLE_DEVICES" in spec.env else ""
    return f"SuperNode {spec.partition_id} (partition-id={spec.partition_id}{gpu})"
