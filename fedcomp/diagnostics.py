"""Simulation diagnostics: the aggregate's error against the clients' exact mean.

The server never sees a client's exact update; to MEASURE how far a compressed
aggregate is from FedAvg's, the example ClientApp can also write its exact float
update to a directory shared with the server (simulation only: the deployment launcher
refuses the setting), outside the messages, so no byte count changes. The wrapper then
compares the update it applied with the exact weighted mean of the clients it accepted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from fedcomp.regime import spread_statistics

#: Coordinates the regime statistics sample at most (a fixed stride over the model).
SAMPLED = 65536


def update_path(directory: str | Path, server_round: int, stable_id: int) -> Path:
    return Path(directory) / f"round-{server_round:05d}" / f"client-{stable_id:06d}.npz"


def write_update(
    directory: str | Path,
    server_round: int,
    stable_id: int,
    weight: float,
    update: Mapping[str, np.ndarray],
) -> None:
    """Save one client's exact update (float64) and weight; atomic by rename."""
    path = update_path(directory, server_round, stable_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    arrays = {f"t/{k}": np.asarray(v, dtype=np.float64) for k, v in update.items()}
    np.savez(tmp, weight=np.float64(weight), **arrays)
    tmp.replace(path)


def aggregate_error(
    directory: str | Path,
    server_round: int,
    stable_ids: Sequence[int],
    global_arrays: Mapping[str, np.ndarray],
    new_arrays: Mapping[str, np.ndarray],
) -> dict[str, float]:
    """Mean squared error of the applied update against the exact weighted mean.

    Returns ``update_mse`` (per coordinate, float tensors), ``update_power`` (the
    exact mean's mean square) and ``update_rel_mse`` (their ratio), and the round's
    regime statistics (``regime_*``: fedcomp.regime, on at most SAMPLED coordinates of
    the float tensors, a fixed stride); the round's files are removed afterwards.
    Missing files give an empty dict (diagnostics only).
    """
    total_w, exact, rows = 0.0, None, []
    floats = [n for n, a in global_arrays.items() if np.asarray(a).dtype.kind == "f"]
    stride = max(1, sum(np.asarray(global_arrays[n]).size for n in floats) // SAMPLED)
    for sid in stable_ids:
        path = update_path(directory, server_round, sid)
        if not path.exists():
            return {}
        with np.load(path) as data:
            w = float(data["weight"])
            update = {k[2:]: data[k] for k in data.files if k.startswith("t/")}
        rows.append(np.concatenate([update[n].reshape(-1) for n in floats])[::stride])
        total_w += w
        if exact is None:
            exact = {k: w * v for k, v in update.items()}
        else:
            for k, v in update.items():
                exact[k] += w * v
    if exact is None or total_w <= 0:
        return {}
    sq_err = power = count = 0.0
    for name, acc in exact.items():
        if np.asarray(global_arrays[name]).dtype.kind != "f":
            continue
        mean = acc / total_w
        applied = np.asarray(new_arrays[name], np.float64) - np.asarray(global_arrays[name])
        sq_err += float(np.sum((applied - mean) ** 2))
        power += float(np.sum(mean**2))
        count += mean.size
    for path in Path(directory, f"round-{server_round:05d}").glob("client-*.npz"):
        path.unlink(missing_ok=True)
    regime = spread_statistics(np.stack(rows)) if rows else {}
    return {
        "update_mse": sq_err / count,
        "update_power": power / count,
        "update_rel_mse": sq_err / power if power > 0 else float("nan"),
        **{f"regime_{k}": v for k, v in regime.items()},
    }
