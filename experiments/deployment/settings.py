"""Deployment settings: a SuperLink and SuperNodes on Flower's Deployment Engine.

``conf/deployment/*.yaml`` compose against :class:`DeploymentSettings` (the
``deployment`` key of ``python -m experiments.deploy``). These settings describe
processes (addresses, ports, certificates, GPUs), not the federated job, so they
are deliberately NOT part of :class:`fedcomp.settings.Settings` and never enter
Flower's run config; the job's settings travel as always (``flatten``).

Nothing here starts a process: :func:`validate_deployment` checks values (and that
configured files exist) before anything starts, and :func:`node_specs` turns the
settings and the host's GPU ids (the one hardware fact, passed in so tests can mock
it) into one spec per SuperNode.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: ``supernodes.count`` meaning "one SuperNode per client".
ONE_PER_CLIENT = -1
#: ``supernodes.gpus`` meaning "every GPU this host shows".
ALL_GPUS = -1
MAX_PORT = 65535


@dataclass
class SuperLinkSettings:
    """The SuperLink the launcher starts (Fleet, Control and runtime APIs share one port)."""

    #: Bind address: 127.0.0.1 for loopback, 0.0.0.0 to accept remote SuperNodes.
    host: str = "127.0.0.1"
    #: 0: a free port picked at start.
    port: int = 0
    #: How SuperNodes and the flwr CLI reach it ("" = host:port, 127.0.0.1 for 0.0.0.0).
    #: With TLS, the certificate must name this host.
    address: str = ""
    #: Seconds to wait for its health endpoint.
    ready_timeout: float = 60.0
    extra_args: list[str] = field(default_factory=list)


@dataclass
class SuperNodeSettings:
    """The SuperNodes the launcher starts on this host (node i trains partition i)."""

    #: -1: one per client (num_clients); 0: none (edge devices connect themselves);
    #: k: partitions 0..k-1 here, the others connect from elsewhere.
    count: int = ONE_PER_CLIENT
    #: Bind address of each SuperNode's own runtime API (ClientApp processes).
    host: str = "127.0.0.1"
    #: One runtime-API port per node; empty: free ports.
    ports: list[int] = field(default_factory=list)
    #: 0: CPU only; n > 0: nodes take GPUs round-robin (CUDA_VISIBLE_DEVICES);
    #: -1: every GPU this host shows.
    gpus: int = 0
    #: Extra node-config keys for every node (partition-id/num-partitions are set; so
    #: are data-path, client-state-dir and diagnostics-dir from the job's dataset.path,
    #: client_state_dir and diagnostics_dir when set, unless given here).
    node_config: dict[str, Any] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    #: Each SuperNode writes every Fleet API call it makes (sizes of the HTTP bodies,
    #: the messages and objects they carried) to deploy/transport-<i>.jsonl
    #: (experiments/deployment/tap.py): the bytes that crossed, message by message.
    transport_log: bool = False
    #: The SuperNodes started here reach the SuperLink through a counting proxy
    #: (experiments/deployment/socket_count.py): every byte of their connections, both
    #: ways, per call (deploy/socket.jsonl) and per round in results.json's "socket".
    #: SuperNodes that connect from elsewhere are not counted.
    socket_count: bool = True


@dataclass
class TlsSettings:
    """TLS for every connection to the SuperLink. Off: ``--insecure`` (loopback only)."""

    enabled: bool = False
    #: The CA that signed the SuperLink's certificate (SuperNodes' --root-certificates,
    #: the flwr CLI's root-certificates, the SuperLink's --ssl-ca-certfile).
    ca_certfile: str = ""
    #: The SuperLink's certificate (--ssl-certfile) and private key (--ssl-keyfile).
    certfile: str = ""
    keyfile: str = ""


@dataclass
class AuthSettings:
    """SuperNode authentication (needs TLS): the SuperLink accepts registered keys only."""

    enabled: bool = False
    #: SuperNode public keys (OpenSSH format, NIST EC curve) the launcher registers
    #: with ``flwr supernode register`` before the run.
    public_keys: list[str] = field(default_factory=list)
    #: Private keys of the SuperNodes the launcher starts, one per node, in order.
    private_keys: list[str] = field(default_factory=list)


@dataclass
class DeploymentSettings:
    """A whole deployment: one SuperLink, its SuperNodes, security, time limits."""

    name: str = "local"
    superlink: SuperLinkSettings = field(default_factory=SuperLinkSettings)
    supernodes: SuperNodeSettings = field(default_factory=SuperNodeSettings)
    tls: TlsSettings = field(default_factory=TlsSettings)
    auth: AuthSettings = field(default_factory=AuthSettings)
    #: Seconds for the whole run (from ``flwr run`` to its end).
    run_timeout: float = 1800.0
    #: Seconds between SIGTERM and SIGKILL when stopping a process.
    stop_timeout: float = 10.0


@dataclass(frozen=True)
class NodeSpec:
    """One SuperNode to start: its stable id, node config, port and environment."""

    partition_id: int
    node_config: dict[str, Any]
    port: int  # 0: pick a free port at start
    env: dict[str, str]
    private_key: str = ""


def _fail(key: str, value: Any, allowed: str) -> None:
    raise ValueError(f"invalid setting deployment.{key}={value!r}: {allowed}")


def _check_port(key: str, port: int) -> None:
    if not 0 <= port <= MAX_PORT:
        _fail(key, port, f"a TCP port in [1, {MAX_PORT}], or 0 for a free port")


def is_loopback(host: str) -> bool:
    """True for 127.x.y.z, ::1 and localhost."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def num_local_nodes(deployment: DeploymentSettings, num_clients: int) -> int:
    """How many SuperNodes the launcher starts."""
    count = deployment.supernodes.count
    return num_clients if count == ONE_PER_CLIENT else count


def validate_deployment(deployment: DeploymentSettings, num_clients: int) -> DeploymentSettings:
    """Check values (and that configured files exist) before any process starts.

    Raises
    ------
    ValueError
        Naming the ``deployment.*`` key, its value and what is allowed.
    """
    d, sl, sn = deployment, deployment.superlink, deployment.supernodes
    _check_port("superlink.port", sl.port)
    if sl.ready_timeout <= 0:
        _fail("superlink.ready_timeout", sl.ready_timeout, "must be > 0 seconds")
    if sn.count < ONE_PER_CLIENT or sn.count > num_clients:
        _fail(
            "supernodes.count",
            sn.count,
            f"-1 (one per client), 0 (none: edge devices connect themselves) or at most "
            f"num_clients={num_clients} (node i trains partition i)",
        )
    n = num_local_nodes(d, num_clients)
    if sn.ports and len(sn.ports) != n:
        _fail("supernodes.ports", sn.ports, f"empty (free ports) or one port per node ({n})")
    for i, port in enumerate(sn.ports):
        _check_port(f"supernodes.ports[{i}]", port)
        if port == 0:
            _fail(f"supernodes.ports[{i}]", port, "pin all ports or none (empty list)")
    pinned = [p for p in (sl.port, *sn.ports) if p]
    if len(set(pinned)) != len(pinned):
        _fail("supernodes.ports", sn.ports, f"ports must differ (superlink.port={sl.port})")
    if sn.gpus < ALL_GPUS:
        _fail("supernodes.gpus", sn.gpus, "0 (CPU), a GPU count, or -1 (every GPU)")
    for key in ("partition-id", "num-partitions"):
        if key in sn.node_config:
            _fail("supernodes.node_config", sn.node_config, f"'{key}' is set by the launcher")
    if d.run_timeout <= 0:
        _fail("run_timeout", d.run_timeout, "must be > 0 seconds")
    if d.stop_timeout <= 0:
        _fail("stop_timeout", d.stop_timeout, "must be > 0 seconds")
    if not d.tls.enabled and not is_loopback(sl.host):
        _fail(
            "superlink.host",
            sl.host,
            "a SuperLink reachable from the network needs deployment.tls.enabled=true "
            "(certificates); without TLS bind it to 127.0.0.1",
        )
    if d.tls.enabled:
        for key in ("ca_certfile", "certfile", "keyfile"):
            _check_file(f"tls.{key}", getattr(d.tls, key))
    if d.auth.enabled and not d.tls.enabled:
        _fail("auth.enabled", True, "SuperNode authentication needs deployment.tls.enabled=true")
    if d.auth.enabled and n and len(d.auth.private_keys) != n:
        _fail(
            "auth.private_keys",
            d.auth.private_keys,
            f"one private key per SuperNode the launcher starts ({n})",
        )
    for i, path in enumerate(d.auth.public_keys):
        _check_file(f"auth.public_keys[{i}]", path)
    for i, path in enumerate(d.auth.private_keys):
        _check_file(f"auth.private_keys[{i}]", path)
        # The launcher registers <key>.pub (ssh-keygen writes both files).
        _check_file(f"auth.private_keys[{i}] (its public key)", path + ".pub")
    return d


def _check_file(key: str, path: str) -> None:
    if not path:
        _fail(key, path, "a file path is required")
    if not Path(path).expanduser().is_file():
        _fail(key, path, "no such file")


def gpu_ids(visible: str | None, device_count: int) -> list[str]:
    """The GPU ids this host offers to child processes.

    ``visible`` is the launcher's own ``CUDA_VISIBLE_DEVICES`` (None: unset): when it
    is set, children may only use those ids, so they are what nodes are given.
    """
    if visible is not None:
        return [v.strip() for v in visible.split(",") if v.strip()][:device_count]
    return [str(i) for i in range(device_count)]


def node_specs(
    deployment: DeploymentSettings,
    num_clients: int,
    available_gpus: list[str],
    client_paths: dict[str, str] | None = None,
) -> list[NodeSpec]:
    """One spec per SuperNode the launcher starts.

    Node i trains partition i (its stable id) of ``num_clients``. With
    ``supernodes.gpus`` != 0, node i sees exactly one GPU, assigned round-robin
    (one SuperNode per GPU when there are as many clients as GPUs).

    Parameters
    ----------
    available_gpus
        GPU ids of this host (:func:`gpu_ids`); the only hardware input.
    client_paths
        Node-config entries naming where every node's ClientApp reads data and writes
        state (``clients.paths.node_config_of``): clients never take paths from the
        server. ``supernodes.node_config`` overrides them key by key.

    Raises
    ------
    ValueError
        When GPUs are asked for and the host has none, or fewer than asked.
    """
    sn = deployment.supernodes
    n = num_local_nodes(deployment, num_clients)
    gpus: list[str] = []
    if sn.gpus == ALL_GPUS:
        gpus = list(available_gpus)
    elif sn.gpus > 0:
        gpus = list(available_gpus[: sn.gpus])
    if sn.gpus != 0 and (not gpus or (sn.gpus > 0 and len(gpus) < sn.gpus)):
        _fail(
            "supernodes.gpus",
            sn.gpus,
            f"this host shows {len(available_gpus)} GPU(s) "
            f"({', '.join(available_gpus) or 'none'}); use deployment=local on a CPU host",
        )
    specs = []
    for i in range(n):
        env = {"CUDA_VISIBLE_DEVICES": gpus[i % len(gpus)]} if gpus else {}
        specs.append(
            NodeSpec(
                partition_id=i,
                node_config={
                    "partition-id": i,
                    "num-partitions": num_clients,
                    **(client_paths or {}),
                    **sn.node_config,
                },
                port=sn.ports[i] if sn.ports else 0,
                env=env,
                private_key=deployment.auth.private_keys[i] if deployment.auth.enabled else "",
            )
        )
    return specs


def node_config_arg(node_config: dict[str, Any]) -> str:
    """``--node-config`` value: space-separated ``key=value`` (strings quoted, TOML style)."""
    parts = []
    for key, value in node_config.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, int | float):
            text = repr(value)
        elif isinstance(value, str):
            text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        else:
            raise ValueError(
                f"deployment.supernodes.node_config[{key!r}]={value!r}: "
                "node-config values must be bool, int, float or str"
            )
        parts.append(f"{key}={text}")
    return " ".join(parts)
