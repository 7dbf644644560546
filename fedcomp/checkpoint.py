"""Whole-run checkpoints: the global model, the strategy's state and the round records
after every round, so ``resume=<run dir>`` continues a stopped run.

Layout in ``<run dir>/checkpoint/``: ``model.npz`` (the global arrays) and
``state.pkl`` (round number, the settings, and the wrapper's state as plain data: the
inner Flower strategy's state through an explicit adapter, never the pickled object;
the round records and the initial evaluation). Both are written to temporary files and
renamed, ``state.pkl`` last: it names the round the model belongs to, so a crash while
writing leaves the previous complete checkpoint. The counter-based randomness needs
nothing saved. ``state.pkl`` is a pickle: load only checkpoints you wrote yourself.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: Settings that may differ between the stopped run and its continuation.
RESUMABLE_DIFFERENCES = (
    "num_rounds",
    "resume",
    "results_path",
    "diagnostics_dir",
    "progress",
    "client_state_dir",
    "client_state",
)


@dataclass
class Checkpoint:
    """A run stopped after ``round``."""

    round: int
    arrays: dict[str, np.ndarray]
    strategy: dict[str, Any]
    settings: dict[str, Any]


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoint"


def save_checkpoint(run_dir: str | Path, ckpt: Checkpoint) -> None:
    """Write a checkpoint atomically (model first, then the state that names it)."""
    folder = checkpoint_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "model.tmp.npz"
    np.savez(tmp, **ckpt.arrays)
    os.replace(tmp, folder / f"model-{ckpt.round:05d}.npz")
    state = {
        "round": ckpt.round,
        "strategy": ckpt.strategy,
        "settings": ckpt.settings,
    }
    tmp = folder / "state.tmp.pkl"
    with open(tmp, "wb") as fh:
        pickle.dump(state, fh, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, folder / "state.pkl")
    for old in folder.glob("model-*.npz"):  # keep only the model the state names
        if old.name != f"model-{ckpt.round:05d}.npz":
            old.unlink(missing_ok=True)


def load_checkpoint(run_dir: str | Path) -> Checkpoint:
    """Read the checkpoint of a run directory.

    Raises
    ------
    FileNotFoundError
        When the directory holds no complete checkpoint (naming what is missing).
    """
    folder = checkpoint_dir(run_dir)
    state_path = folder / "state.pkl"
    if not state_path.exists():
        raise FileNotFoundError(
            f"resume={run_dir}: no checkpoint at {state_path} (runs write one after every "
            "round when they have a results_path; was this run started by experiments.run?)"
        )
    with open(state_path, "rb") as fh:
        state = pickle.load(fh)
    if "inner" in state:  # the first format pickled the Flower strategy object itself
        raise ValueError(
            f"resume={run_dir}: this checkpoint was written by an older fedcomp (it holds "
            "a pickled Flower strategy); rerun the job to resume it with this version"
        )
    model_path = folder / f"model-{state['round']:05d}.npz"
    if not model_path.exists():
        raise FileNotFoundError(f"resume={run_dir}: {model_path} is missing")
    with np.load(model_path) as data:
        arrays = {k: data[k] for k in data.files}
    return Checkpoint(arrays=arrays, **state)


def check_compatible(saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """The continuation must be the same run: only RESUMABLE_DIFFERENCES may change.

    Raises
    ------
    ValueError
        Naming every setting that differs.
    """
    keys = (set(saved) | set(current)) - set(RESUMABLE_DIFFERENCES)
    differ = sorted(k for k in keys if saved.get(k) != current.get(k))
    if differ:
        detail = "; ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in differ)
        raise ValueError(f"resume: the settings differ from the stopped run's ({detail})")
