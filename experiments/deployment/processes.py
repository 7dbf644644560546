"""The processes the launcher owns: starting components in their own sessions,
waiting for ports, and stopping every process of a tree, also on SIGINT/SIGTERM.

Each component starts in its own session (its own process group), so a Ctrl-C in the
terminal reaches only the launcher, which then stops them all. A component's children
(SuperExec, ServerApp and ClientApp processes) may start their own sessions, so
stopping walks the process tree (``/proc``) as well as the groups.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("experiments.deployment")

LOG_TAIL_LINES = 15


class DeploymentError(RuntimeError):
    """A deployment that failed; ``component`` names the part that failed."""

    def __init__(self, component: str, message: str) -> None:
        super().__init__(f"{component}: {message}")
        self.component = component


class Interrupted(BaseException):
    """SIGTERM or SIGHUP: unwinds like Ctrl-C so the ``finally`` blocks stop everything."""


#: Linux's ephemeral range when /proc does not say (outgoing connections' local ports).
DEFAULT_EPHEMERAL = (32768, 60999)
#: How many ports below the ephemeral range free_port draws from.
LISTEN_SPAN = 12000


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections."""
    try:
        low, high = (int(v) for v in Path(path).read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return (low, high) if 1024 < low <= high <= 65535 else DEFAULT_EPHEMERAL


def free_port(host: str, tries: int = 64, draw: Callable[[int, int], int] | None = None) -> int:
    """A port nothing listens on right now, drawn below the ephemeral range.

    A port the OS hands out for binding port 0 comes from the ephemeral range, where
    every outgoing connection also takes its local port: with 20 SuperNodes connecting
    while the launcher starts them, one of those connections took a port picked for a
    node's own API before the node bound it ("address already in use"). Below the
    range only listeners compete, and this checks for them. The draw uses the OS's
    randomness: it picks ports, it is no part of a run's results (``draw(start, stop)``
    replaces it in tests).
    """
    low, _ = ephemeral_range()
    start = max(1025, low - LISTEN_SPAN)
    draw = draw or random.SystemRandom().randrange
    for _ in range(tries):
        port = draw(start, low)
        with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:  # all taken: any port
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


def start_component(
    name: str, argv: list[str], log_path: Path, port: int, env: dict, cwd: Path | None = None
) -> Component:
    """Start ``argv`` in a new session (in ``cwd``), output to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
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

    All the given components are signalled at once and given ``grace_s`` seconds
    together (:func:`stop_in_stages` stops groups of them one after the other).
    Descendants are tracked from a snapshot taken before the signal, since a SuperExec
    in its own session is reparented when its parent exits and would otherwise be
    lost. Returns the pids that survived even SIGKILL (normally none).
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


def stop_in_stages(stages: list[list[Component]], grace_s: float) -> list[int]:
    """:func:`stop_components` on each stage in turn, each given ``grace_s`` seconds
    and waited for before the next stage is signalled; returns every survivor.

    The launcher's stages are the SuperNodes, then the SuperLink: a SuperNode's
    sign-off (DeactivateNode, UnregisterNode) on SIGTERM needs the SuperLink still
    up, so stopping both at once loses it.
    """
    survivors: list[int] = []
    for stage in stages:
        survivors += stop_components(stage, grace_s)
    return survivors


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
