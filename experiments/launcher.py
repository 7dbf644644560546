"""Run the job on Flower's Deployment Engine: processes this launcher owns, start to stop.

:func:`launch` starts a SuperLink (ready when its ``/health`` answers) and the
configured SuperNodes, writes the connection into ``$FLWR_HOME/config.toml``, starts
the run with ``flwr run``, follows it to its end (``flwr log --stream``, ``flwr ls``,
and the PIDs of every component), checks the ``results.json`` the ServerApp wrote,
and stops every process it started, also on an error, SIGTERM or Ctrl-C.

Why the app is staged: the SuperLink accepts run-config overrides only for keys that
the app's ``[tool.flwr.app.config]`` already declares (flwr 1.42, ``check_keys``), and
codec or strategy parameters (``codec.bits``) are not among the defaults. So the
launcher copies the FAB's files into the run directory with a ``pyproject.toml``
whose run config IS this run's flattened settings, and runs that app unchanged.

Processes: each component starts in its own session (its own process group), so a
Ctrl-C in the terminal reaches only the launcher, which then stops them all. A
component's children (SuperExec, ServerApp and ClientApp processes) may start their
own sessions, so stopping walks the process tree (``/proc``) as well as the groups.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import tomli_w

from experiments.runtime import PROJECT_ROOT
from fedcomp.deployment import (
    DeploymentSettings,
    NodeSpec,
    gpu_ids,
    node_config_arg,
    node_specs,
    validate_deployment,
)
from fedcomp.results import ResultsError, load_results
from fedcomp.settings import Settings, flatten, settings_to_dict, validate

log = logging.getLogger("experiments.launcher")

BEGIN_MARK = "# BEGIN GENERATED RUN CONFIG"
END_MARK = "# END GENERATED RUN CONFIG"
#: Seconds a flwr CLI call (run, ls, supernode register) may take.
CLI_TIMEOUT = 120.0
#: How often the PIDs are checked, and how often ``flwr ls`` is asked while the log
#: stream runs (each call starts a Python process: about 1.4 s of CPU here).
POLL_S = 0.5
STATUS_EVERY_S = 10.0
LOG_TAIL_LINES = 15


class DeploymentError(RuntimeError):
    """A deployment that failed; ``component`` names the part that failed."""

    def __init__(self, component: str, message: str) -> None:
        super().__init__(f"{component}: {message}")
        self.component = component


class Interrupted(BaseException):
    """SIGTERM or SIGHUP: unwinds like Ctrl-C so the ``finally`` blocks stop everything."""


# ---------------------------------------------------------------------------------
# ports, files, the staged app
# ---------------------------------------------------------------------------------


def free_port(host: str) -> int:
    """A port nothing listens on right now (bind to port 0; the OS picks)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def check_port_free(host: str, port: int, component: str, key: str) -> None:
    """Fail before anything starts when a pinned port is taken."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise DeploymentError(
                component,
                f"port {port} on {host} is already in use ({exc.strerror}); "
                f"stop what listens there or set {key}=0 for a free port",
            ) from exc


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def connect_host(bind_host: str) -> str:
    """Where a local client reaches a server bound to ``bind_host``."""
    return "127.0.0.1" if bind_host in ("0.0.0.0", "", "::") else bind_host


def host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of a log file, for error messages."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # Flower colours its log lines
    return "\n".join(text.rstrip().splitlines()[-lines:]) or "(empty log)"


def run_config_toml(settings: Settings) -> str:
    """The ``[tool.flwr.app.config]`` body holding exactly these settings."""
    return tomli_w.dumps(flatten(settings_to_dict(settings))).rstrip()


def stage_app(settings: Settings, dest: Path, root: Path = PROJECT_ROOT) -> Path:
    """Copy the FAB's files (``fab-include``) to ``dest`` with this run's run config.

    Returns ``dest``; ``flwr run dest`` then needs no overrides (see the module doc).
    """
    text = (root / "pyproject.toml").read_text()
    if BEGIN_MARK not in text or END_MARK not in text:
        raise DeploymentError("app", f"{root / 'pyproject.toml'} lacks the {BEGIN_MARK} block")
    head, rest = text.split(BEGIN_MARK, 1)
    _, end = rest.split(END_MARK, 1)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    include = tomllib.loads(text)["tool"]["flwr"]["app"]["fab-include"]
    for pattern in include:
        for src in sorted(root.glob(pattern)):
            rel = src.relative_to(root)
            if src.is_file() and rel.name != "pyproject.toml" and "__pycache__" not in rel.parts:
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / rel)
    body = f"{BEGIN_MARK}\n{run_config_toml(settings)}\n{END_MARK}"
    (dest / "pyproject.toml").write_text(head + body + end)
    return dest


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write_connection(flwr_home: Path, name: str, entry: dict[str, Any]) -> Path:
    """Add (or replace) ``[superlink.<name>]`` in ``$FLWR_HOME/config.toml``."""
    path = flwr_home / "config.toml"
    with _locked(path):
        data = tomllib.loads(path.read_text()) if path.exists() else {}
        data.setdefault("superlink", {})[name] = entry
        path.write_text(tomli_w.dumps(data))
    return path


def remove_connection(flwr_home: Path, name: str) -> None:
    """Drop ``[superlink.<name>]`` again (the SuperLink behind it is gone)."""
    path = flwr_home / "config.toml"
    with _locked(path):
        if not path.exists():
            return
        data = tomllib.loads(path.read_text())
        if data.get("superlink", {}).pop(name, None) is not None:
            path.write_text(tomli_w.dumps(data))


# ---------------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------------


@dataclass
class Component:
    """One process the launcher started (a SuperLink or a SuperNode)."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    port: int

    def died(self) -> str | None:
        """None while running, else a message with its exit code and last log lines."""
        code = self.proc.poll()
        if code is None:
            return None
        return f"exited with code {code}; last lines of {self.log_path}:\n{tail(self.log_path)}"


def _binary(name: str) -> str:
    """A Flower executable from this interpreter's environment (else from PATH)."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else (shutil.which(name) or name)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of every process started here: this venv's bin first on PATH (the
    SuperLink and SuperNodes start ``flower-superexec`` by name), no telemetry."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    env.update(extra or {})
    return env


def start_component(name: str, argv: list[str], log_path: Path, port: int, env: dict) -> Component:
    """Start ``argv`` in a new session, output to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            raise DeploymentError(name, f"cannot start {argv[0]}: {exc}") from exc
    log.info("started %s (pid %d, port %d, log %s)", name, proc.pid, port, log_path)
    return Component(name, proc, log_path, port)


def _proc_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, process group, state) from /proc (Linux)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may contain spaces and parentheses.
        fields = stat[stat.rindex(")") + 2 :].split()
        table[int(entry.name)] = (int(fields[1]), int(fields[2]), fields[0])
    return table


def descendants(roots: list[int]) -> set[int]:
    """Every live (non-zombie) process below ``roots`` or in their process groups."""
    if not Path("/proc").is_dir():  # not Linux: the process groups must do
        return set()
    table = _proc_table()
    found = {p for p, (_, pgid, _) in table.items() if pgid in roots}
    frontier = set(roots) | found
    while frontier:
        children = {p for p, (ppid, _, _) in table.items() if ppid in frontier} - found
        found |= children
        frontier = children
    return {p for p in found if p in table and table[p][2] != "Z"} - set(roots)


def _signal(pids: set[int], groups: list[int], sig: int) -> None:
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
        return state[state.rindex(")") + 2] != "Z"
    except OSError:
        return False


def stop_components(components: list[Component], grace_s: float) -> list[int]:
    """SIGTERM every component with its group and descendants, SIGKILL what remains.

    All components are signalled at once (SuperNodes first) and given ``grace_s``
    seconds together. Descendants are tracked from a snapshot taken before the
    signal, since a SuperExec in its own session is reparented when its parent exits
    and would otherwise be lost. Returns the pids that survived even SIGKILL
    (normally none).
    """
    if not components:
        return []
    roots = [c.proc.pid for c in reversed(components)]
    known = descendants(roots)
    _signal(known, roots, signal.SIGTERM)
    deadline = time.monotonic() + grace_s

    def remaining() -> set[int]:
        running = {c.proc.pid for c in components if c.proc.poll() is None}
        late = descendants(roots + sorted(known)) - known  # started after the snapshot
        if late:
            _signal(late, [], signal.SIGTERM)
            known.update(late)
        return running | {p for p in known if _alive(p)}

    rest = remaining()
    while rest and time.monotonic() < deadline:
        time.sleep(0.1)
        rest = remaining()
    if rest:
        log.warning("SIGKILL to %s after %g s", sorted(rest), grace_s)
        _signal(rest, roots, signal.SIGKILL)
        for comp in components:
            with contextlib.suppress(subprocess.TimeoutExpired):
                comp.proc.wait(timeout=5)
        time.sleep(0.2)
    for comp in components:
        log.info("stopped %s (pid %d, exit code %s)", comp.name, comp.proc.pid, comp.proc.poll())
    return sorted(p for p in rest if _alive(p))


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """SIGTERM and SIGHUP raise :class:`Interrupted`, SIGINT KeyboardInterrupt.

    SIGINT is set explicitly: a process started in the background by a non-interactive
    shell inherits SIGINT as IGNORED, and Python keeps it so; Ctrl-C (or ``kill -INT``)
    must still stop the deployment (measured: without this, a backgrounded launcher
    ran its job to the end after SIGINT)."""

    def handler(signum: int, _frame: Any) -> None:
        raise Interrupted(signal.Signals(signum).name)

    try:
        old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
        old[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:  # not the main thread: the caller owns signal handling
        yield
        return
    try:
        yield
    finally:
        for sig, prev in old.items():
            signal.signal(sig, prev)


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """While stopping, a second Ctrl-C must not abandon half-stopped processes."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    try:
        old = {s: signal.signal(s, signal.SIG_IGN) for s in sigs}
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        for sig, prev in old.items():
            signal.signal(sig, prev)


# ---------------------------------------------------------------------------------
# the flwr CLI
# ---------------------------------------------------------------------------------


@dataclass
class FlwrCli:
    """``flwr`` subcommands against one named connection, JSON output parsed."""

    connection: str
    env: dict[str, str]
    cwd: Path
    log_path: Path

    def call(self, args: list[str], *, what: str, timeout: float = CLI_TIMEOUT) -> dict:
        argv = [_binary("flwr"), *args]
        try:
            out = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                env=self.env,
                cwd=self.cwd,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            raise DeploymentError("flwr CLI", f"`{what}` took over {timeout:.0f} s") from exc
        with open(self.log_path, "a") as f:
            f.write(f"$ {' '.join(argv)}\n{out.stdout}{out.stderr}\n")
        try:
            reply = json.loads(out.stdout)
        except json.JSONDecodeError:
            reply = {"success": False, "error-message": (out.stdout + out.stderr).strip()}
        if out.returncode != 0 or not reply.get("success", False):
            message = reply.get("error-message") or (out.stdout + out.stderr).strip()
            raise DeploymentError("flwr CLI", f"`{what}` failed: {message}")
        return reply

    def start_run(self, app_dir: Path) -> tuple[int, str]:
        """Start the run; return its id and the directory its FAB unpacks to
        (``$FLWR_HOME/apps/<publisher>.<name>.<version>.<hash>``)."""
        reply = self.call(
            ["run", str(app_dir), self.connection, "--format", "json"], what="flwr run"
        )
        fab = f"{reply['fab-id'].replace('/', '.')}.{reply['fab-version']}.{reply['fab-hash']}"
        return int(reply["run-id"]), fab

    def run_status(self, run_id: int) -> tuple[str, str]:
        reply = self.call(
            ["ls", self.connection, "--run-id", str(run_id), "--format", "json"], what="flwr ls"
        )
        run = reply["runs"][0]
        return str(run["status"]), str(run.get("status-details", ""))

    def register_node(self, public_key: str) -> None:
        self.call(
            ["supernode", "register", public_key, self.connection, "--format", "json"],
            what=f"flwr supernode register {public_key}",
        )

    def stream_logs(self, run_id: int, path: Path) -> subprocess.Popen:
        with open(path, "ab") as out:
            return subprocess.Popen(
                [_binary("flwr"), "log", str(run_id), self.connection, "--stream"],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )


# ---------------------------------------------------------------------------------
# the deployment
# ---------------------------------------------------------------------------------


def superlink_argv(d: DeploymentSettings, port: int) -> list[str]:
    sl = d.superlink
    tls = ["--insecure"]
    if d.tls.enabled:
        tls = [
            *("--ssl-ca-certfile", _abs(d.tls.ca_certfile)),
            *("--ssl-certfile", _abs(d.tls.certfile)),
            *("--ssl-keyfile", _abs(d.tls.keyfile)),
        ]
    auth = ["--enable-supernode-auth"] if d.auth.enabled else []
    return [
        _binary("flower-superlink"),
        *tls,
        *auth,
        # Every component runs from this environment: no `uv sync` against a registry.
        "--disable-runtime-dependency-installation",
        "--host",
        sl.host,
        "--port",
        str(port),
        *sl.extra_args,
    ]


def supernode_argv(d: DeploymentSettings, spec: NodeSpec, address: str, port: int) -> list[str]:
    tls = ["--root-certificates", _abs(d.tls.ca_certfile)] if d.tls.enabled else ["--insecure"]
    auth = ["--auth-supernode-private-key", _abs(spec.private_key)] if spec.private_key else []
    return [
        _binary("flower-supernode"),
        *tls,
        *auth,
        "--superlink",
        address,
        "--host",
        d.supernodes.host,
        "--port",
        str(port),
        "--node-config",
        node_config_arg(spec.node_config),
        *d.supernodes.extra_args,
    ]


def _abs(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def superlink_address(d: DeploymentSettings, port: int) -> str:
    """What SuperNodes and the flwr CLI dial."""
    return d.superlink.address or host_port(connect_host(d.superlink.host), port)


def connection_entry(d: DeploymentSettings, address: str) -> dict[str, Any]:
    """The ``[superlink.<name>]`` table of ``config.toml``."""
    if d.tls.enabled:
        return {"address": address, "root-certificates": _abs(d.tls.ca_certfile)}
    return {"address": address, "insecure": True}


def wait_ready(comp: Component, url: str, timeout: float, context: ssl.SSLContext | None) -> float:
    """Poll ``url`` until it answers 200; return the seconds it took.

    Raises
    ------
    DeploymentError
        When the process exits first, or nothing answers within ``timeout``.
    """
    t0 = time.monotonic()
    last = "no answer yet"
    while True:
        if (why := comp.died()) is not None:
            raise DeploymentError(comp.name, f"{why}\n(it never answered at {url})")
        try:
            with urllib.request.urlopen(url, timeout=1.0, context=context) as resp:
                if resp.status == 200:
                    return time.monotonic() - t0
                last = f"HTTP {resp.status}"
        except (urllib.error.URLError, OSError) as exc:
            last = str(getattr(exc, "reason", exc))
        if time.monotonic() - t0 > timeout:
            raise DeploymentError(
                comp.name,
                f"did not answer at {url} within {timeout:g} s "
                f"(deployment.superlink.ready_timeout; last error: {last}); "
                f"last lines of {comp.log_path}:\n{tail(comp.log_path)}",
            )
        time.sleep(0.2)


def _tls_context(d: DeploymentSettings) -> ssl.SSLContext | None:
    if not d.tls.enabled:
        return None
    ctx = ssl.create_default_context(cafile=_abs(d.tls.ca_certfile))
    ctx.check_hostname = False  # readiness only; SuperNodes and the CLI check the name
    return ctx


def detect_gpus() -> list[str]:
    """GPU ids children may use (torch's device count, CUDA_VISIBLE_DEVICES honoured)."""
    import torch

    return gpu_ids(os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count())


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

    settings = absolute_paths(validate(replace(settings, results_path=str(results_path))))
    validate_deployment(deployment, settings.num_clients)
    preflight(settings)  # data sizes, codec and strategy specs, devices
    needs_gpus = deployment.supernodes.gpus != 0
    specs = node_specs(deployment, settings.num_clients, available_gpus() if needs_gpus else [])
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
    with signals_raise():
        try:
            argv = superlink_argv(deployment, port)
            link = start_component("SuperLink", argv, deploy_dir / "superlink.log", port, env)
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
            for spec in specs:
                st.components.append(start_supernode(deployment, spec, address, deploy_dir, env))
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
            return collect_results(st.run_id, status, details, results_path, deploy_dir)
        finally:
            with signals_ignored():
                st.survivors = stop_components(st.components, deployment.stop_timeout)
                remove_connection(flwr_home, st.connection)
                if st.fab:  # each run's FAB differs (its results_path): do not pile up
                    shutil.rmtree(flwr_home / "apps" / st.fab, ignore_errors=True)
                st.timings["total_s"] = time.monotonic() - t0
            if st.survivors:
                log.error("processes still alive after SIGKILL: %s", st.survivors)


def start_supernode(
    d: DeploymentSettings, spec: NodeSpec, address: str, deploy_dir: Path, env: dict[str, str]
) -> Component:
    """Start one SuperNode on a free (or its pinned) port, with its own environment."""
    port = spec.port or free_port(d.supernodes.host)
    return start_component(
        _node_name(spec),
        supernode_argv(d, spec, address, port),
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


def _public_keys(d: DeploymentSettings) -> list[str]:
    """Keys to register: the configured ones and those of the nodes started here
    (``ssh-keygen`` writes ``<key>.pub`` next to each private key)."""
    keys = [_abs(k) for k in d.auth.public_keys]
    keys += [_abs(k) + ".pub" for k in d.auth.private_keys]
    return list(dict.fromkeys(keys))
