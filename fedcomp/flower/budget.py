"""Whether a round's dense updates fit in this machine's memory, said before they exist.

The streaming paths (the pre-aggregated plain mean and reduction trees, with or without
residual compression) keep at most two decoded updates alive. The per-client hand-off
holds one dense update per client until the round ends: it gives the inner strategy one
dense model per client (and Flower's aggregation copies them once more). Residual
compression's mirrors, one per client, are state kept in memory unless
``aggregation.mirror_dir`` puts them on disk. For n clients of a model of M float32
parameters that is about 4 n M bytes per copy: 1,000 clients of ResNet-18 need 45 GB.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np

log = logging.getLogger("fedcomp.flower.strategy")

#: Above this fraction of the available memory the round is allowed but warned about.
WARN_FRACTION = 0.5


class RoundMemoryError(RuntimeError):
    """The round would need more memory than the machine has available."""


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The kernel's estimate of memory available without swapping (bytes; None when
    it cannot be read, e.g. not on Linux)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_round_memory(
    clients: int, model_bytes: int, copies: int, mode: str, available: int | None
) -> int:
    """Refuse a round whose ``copies`` dense updates per client exceed ``available``
    memory, warn above half of it. Returns the bytes the round needs.

    Raises
    ------
    RoundMemoryError
        Naming the need, what is available and the settings that avoid it.
    """
    need = clients * model_bytes * copies
    if available is None or need == 0:
        return need
    message = (
        f"{mode} holds {copies} dense update(s) of {model_bytes / 1e6:.1f} MB for each of "
        f"{clients} clients this round: about {need / 1e9:.2f} GB, and this machine has "
        f"{available / 1e9:.2f} GB available. The pre-aggregated hand-off with a "
        "mean-based inner strategy streams (at most two updates alive): "
        "aggregation.handoff=pre_aggregated; residual compression keeps its mirrors "
        "on disk with aggregation.mirror_dir=<dir>; or sample fewer clients "
        "(fraction_train)"
    )
    _refuse_or_warn(need, available, message)
    return need


def check_client_state(clients: int, model_bytes: int, copies: int, available: int | None) -> int:
    """In one simulation process (run_simulation's driver, or an in-process grid) every
    client's Context.state stays in memory: refuse a run whose clients' state of
    ``copies`` models each (codec memory: committed and pending; downlink replica: one)
    would exceed ``available`` memory once every client has been reached, warn above
    half of it. Returns the bytes that takes.

    Raises
    ------
    RoundMemoryError
        Naming the need, what is available and ``client_state=disk``.
    """
    need = clients * model_bytes * copies
    if available is None or need == 0:
        return need
    message = (
        f"client_state=memory keeps {copies} model-sized array(s) of "
        f"{model_bytes / 1e6:.1f} MB per client in this process's Context.state; for "
        f"{clients} clients that is up to {need / 1e9:.2f} GB, and this machine has "
        f"{available / 1e9:.2f} GB available: set client_state=disk (with "
        "client_state_dir=<dir>) to keep it in files instead"
    )
    _refuse_or_warn(need, available, message)
    return need


def _refuse_or_warn(need: int, available: int, message: str) -> None:
    """Raise above the available memory, warn above WARN_FRACTION of it."""
    if need > available:
        raise RoundMemoryError(message)
    if need > WARN_FRACTION * available:
        log.warning("%s", message)


def check_round_copies(
    clients: int,
    global_arrays: Mapping[str, np.ndarray],
    *,
    per_client: bool,
    mirrors_in_memory: bool,
) -> None:
    """Refuse, before any instruction leaves, a round whose dense copies cannot fit:
    the per-client hand-off holds two per client; residual compression's mirrors, one
    per client, live in memory unless mirror_dir keeps them on disk (state, not round
    memory, but they grow with the clients reached: counted here for this round's);
    the streaming paths hold none."""
    if per_client:
        copies, mode = 2, "aggregation.handoff=per_client"
    elif mirrors_in_memory:
        copies, mode = 1, "residual compression (mirrors in memory)"
    else:
        return
    model = sum(np.asarray(v).size * 4 for v in global_arrays.values())
    check_round_memory(clients, model, copies, mode, available_memory())
