"""SuperLink and SuperNode command lines, TLS and authentication arguments, and the
readiness check of a component (its ``/health`` endpoint)."""

from __future__ import annotations

import os
import ssl
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from experiments.deployment.processes import (
    Component,
    DeploymentError,
    _binary,
    connect_host,
    host_port,
    tail,
)
from experiments.deployment.settings import (
    DeploymentSettings,
    NodeSpec,
    gpu_ids,
    node_config_arg,
)


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


def tap_argv(argv: list[str], log_path: Path) -> list[str]:
    """The same SuperNode started through the transport tap (experiments/deployment/tap.py),
    which logs every Fleet API call to ``log_path``."""
    tap = Path(__file__).with_name("tap.py")
    return [sys.executable, str(tap), str(log_path), *argv[1:]]


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


def _public_keys(d: DeploymentSettings) -> list[str]:
    """Keys to register: the configured ones and those of the nodes started here
    (``ssh-keygen`` writes ``<key>.pub`` next to each private key)."""
    keys = [_abs(k) for k in d.auth.public_keys]
    keys += [_abs(k) + ".pub" for k in d.auth.private_keys]
    return list(dict.fromkeys(keys))
