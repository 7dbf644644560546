"""Whole-run checkpoints: the global model, the strategy's state and the round records
after every round, so ``resume=<run dir>`` continues a stopped run.

Layout in ``<run dir>/checkpoint/``: ``model-<round>.npz`` (the global arrays),
``state-<round>.npz`` (the arrays inside the strategy's state) and ``state.json``
(format, round number, the settings, and the wrapper's state as plain data: the inner
Flower strategy's state through an explicit adapter; the round records and the initial
evaluation), the arrays in it replaced by references into ``state-<round>.npz``
(:mod:`fedcomp.plaindata`, exact for int dict keys, tuples, NaN and numpy scalars).
Nothing is pickled: both ``.npz`` files load with ``allow_pickle=False``. Every file is
written to a temporary file and renamed, ``state.json`` last: it names the round the
other two belong to, so a crash while writing leaves the previous complete checkpoint.
The counter-based randomness needs nothing saved.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedcomp.npzfile import write_npz_atomic
from fedcomp.plaindata import PlainDataError, decode, encode

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
#: ``state.json``'s ``format`` (a later layout changes the number).
FORMAT = "fedcomp-checkpoint-2"
STATE_FILE = "state.json"
#: The pickle the first formats wrote: refused, never opened.
OLD_STATE_FILE = "state.pkl"


@dataclass
class Checkpoint:
    """A run stopped after ``round``."""

    round: int
    arrays: dict[str, np.ndarray]
    strategy: dict[str, Any]
    settings: dict[str, Any]


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoint"


def _model_file(round_: int) -> str:
    return f"model-{round_:05d}.npz"


def _arrays_file(round_: int) -> str:
    return f"state-{round_:05d}.npz"


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def save_checkpoint(run_dir: str | Path, ckpt: Checkpoint) -> None:
    """Write a checkpoint atomically (the model and state arrays first, then the state
    file that names their round).

    Raises
    ------
    fedcomp.plaindata.PlainDataError
        When the state holds a value that is not plain data (naming where).
    """
    folder = checkpoint_dir(run_dir)
    tree, state_arrays = encode({"strategy": ckpt.strategy, "settings": ckpt.settings})
    # allow_nan=False: encode() tags non-finite floats, so strict JSON suffices
    text = json.dumps({"format": FORMAT, "round": ckpt.round, "state": tree}, allow_nan=False)
    write_npz_atomic(folder / _model_file(ckpt.round), ckpt.arrays)
    write_npz_atomic(folder / _arrays_file(ckpt.round), state_arrays)
    _write_text_atomic(folder / STATE_FILE, text)
    keep = {_model_file(ckpt.round), _arrays_file(ckpt.round)}
    for old in [*folder.glob("model-*.npz"), *folder.glob("state-*.npz")]:
        if old.name not in keep:  # only the files the state names
            old.unlink(missing_ok=True)


def _read_npz(path: Path, run_dir: str | Path) -> dict[str, np.ndarray]:
    if not path.exists():
        raise FileNotFoundError(f"resume={run_dir}: {path} is missing")
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise ValueError(f"resume={run_dir}: {path} is not a readable .npz ({exc})") from None


def _read_state(folder: Path, run_dir: str | Path) -> dict[str, Any]:
    state_path = folder / STATE_FILE
    if not state_path.exists():
        if (folder / OLD_STATE_FILE).exists():  # never opened: unpickling runs code
            raise ValueError(
                f"resume={run_dir}: {folder / OLD_STATE_FILE} is a checkpoint in the old "
                f"pickle format, which this fedcomp does not load (loading a pickle runs "
                f"code); rerun the job from the start to get a {STATE_FILE} checkpoint"
            )
        raise FileNotFoundError(
            f"resume={run_dir}: no checkpoint at {state_path} (runs write one after every "
            "round when they have a results_path; was this run started by experiments.run?)"
        )
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"resume={run_dir}: {state_path} is not JSON ({exc!s:.200})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"resume={run_dir}: {state_path} has format {found!r}, this fedcomp reads "
            f"{FORMAT!r}; rerun the job to resume it with this version"
        )
    if type(state.get("round")) is not int or state["round"] < 0:
        raise ValueError(f"resume={run_dir}: {state_path} names round {state.get('round')!r}")
    return state


def load_checkpoint(run_dir: str | Path) -> Checkpoint:
    """Read the checkpoint of a run directory (no pickle is ever loaded).

    Raises
    ------
    FileNotFoundError
        When the directory holds no complete checkpoint (naming what is missing).
    ValueError
        When it holds an old pickle checkpoint or a malformed one (naming the file).
    """
    folder = checkpoint_dir(run_dir)
    state = _read_state(folder, run_dir)
    round_ = state["round"]
    arrays = _read_npz(folder / _model_file(round_), run_dir)
    state_arrays = _read_npz(folder / _arrays_file(round_), run_dir)
    try:
        tree = decode(state["state"], state_arrays)
        return Checkpoint(
            round=round_, arrays=arrays, strategy=tree["strategy"], settings=tree["settings"]
        )
    except (PlainDataError, KeyError, TypeError, ValueError, RecursionError) as exc:
        raise ValueError(
            f"resume={run_dir}: {folder / STATE_FILE} is malformed ({type(exc).__name__}: "
            f"{exc!s:.200})"
        ) from None


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


def check_layout(
    saved: Mapping[str, np.ndarray], model: Mapping[str, np.ndarray], where: str
) -> None:
    """The checkpoint's model has exactly the run's tensors: names in order, shapes
    and dtypes (a model of another shape would load and train silently).

    Raises
    ------
    ValueError
        Naming ``where`` (the file) and the first difference.
    """
    if list(saved) != list(model):
        raise ValueError(
            f"{where}: tensors {list(saved)!r:.200} are not the model's {list(model)!r:.200}"
        )
    for name, value in saved.items():
        ref = np.asarray(model[name])
        if value.shape != ref.shape or value.dtype != ref.dtype:
            raise ValueError(
                f"{where}: tensor {name!r} is {value.dtype}{list(value.shape)}, the model's is "
                f"{ref.dtype}{list(ref.shape)}"
            )
