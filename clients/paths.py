"""The paths a client reads and writes come from the client itself, never the server.

A client reads its data (``dataset.path``) and writes its codec memories
(``client_state_dir``) and diagnostics (``diagnostics_dir``). Were those taken from the
server's task message, a hostile server could make any client read or write any path
the client process can reach. So the ClientApp takes them from its own node config
(SuperNode ``--node-config``, keys below; what the deployment launcher sets) or, in
simulation, from the settings handed to ``make_client_app`` in the same process; the
node config wins when both name one. A task that still carries such a path is ignored
for it (clients.client_app logs a warning once).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedcomp.settings import Settings

#: SuperNode node-config keys, one per client-side path setting.
NODE_DATA_PATH = "data-path"
NODE_CLIENT_STATE_DIR = "client-state-dir"
NODE_DIAGNOSTICS_DIR = "diagnostics-dir"


@dataclass(frozen=True)
class ClientPaths:
    """Where one client reads its data and writes its state ("" = none)."""

    #: The local dataset copy (the client's ``dataset.path``).
    data_path: str = ""
    #: Codec memories and downlink replicas on disk (``client_state_dir``).
    state_dir: str = ""
    #: Exact updates for the diagnostics (``diagnostics_dir``).
    diagnostics_dir: str = ""


#: Each path's node-config key, ClientPaths field and settings key, in one place.
_KEYS = (
    (NODE_DATA_PATH, "data_path", "dataset.path"),
    (NODE_CLIENT_STATE_DIR, "state_dir", "client_state_dir"),
    (NODE_DIAGNOSTICS_DIR, "diagnostics_dir", "diagnostics_dir"),
)


def paths_of(settings: Settings) -> ClientPaths:
    """The client paths that local settings name (simulation: the run's own settings)."""
    return ClientPaths(
        data_path=settings.dataset.path,
        state_dir=settings.client_state_dir,
        diagnostics_dir=settings.diagnostics_dir,
    )


def node_config_of(paths: ClientPaths) -> dict[str, str]:
    """The node-config entries that give a SuperNode these paths (absolute: a
    SuperNode runs its ClientApp in another directory); empty paths are left out."""
    return {
        key: os.path.abspath(getattr(paths, name)) for key, name, _ in _KEYS if getattr(paths, name)
    }


def resolve(node_config: Mapping[str, Any], default: ClientPaths) -> ClientPaths:
    """The node config's paths, each falling back to ``default``'s.

    Raises
    ------
    ValueError
        When a node-config path is not a string (naming the key and the value).
    """
    found = {}
    for key, name, _ in _KEYS:
        if key not in node_config:
            continue
        value = node_config[key]
        if not isinstance(value, str):
            raise ValueError(
                f"node config {key}={value!r}: must be a path string (--node-config "
                f"\"{key}='/some/dir'\")"
            )
        found[name] = value
    return dataclasses.replace(default, **found)


def task_paths(task: Mapping[str, Any]) -> dict[str, str]:
    """The path settings a server's task tree carries (non-empty ones, by settings key)."""
    dataset = task.get("dataset")
    values = {
        "dataset.path": dataset.get("path") if isinstance(dataset, Mapping) else None,
        "client_state_dir": task.get("client_state_dir"),
        "diagnostics_dir": task.get("diagnostics_dir"),
    }
    return {k: str(v) for k, v in values.items() if v}


def with_paths(task: dict[str, Any], paths: ClientPaths) -> dict[str, Any]:
    """A copy of a task tree whose path settings are the client's own (``paths``)."""
    out = dict(task)
    out["dataset"] = {**dict(task.get("dataset") or {}), "path": paths.data_path}
    out["client_state_dir"] = paths.state_dir
    out["diagnostics_dir"] = paths.diagnostics_dir
    return out
