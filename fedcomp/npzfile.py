"""One atomic .npz writer for every piece of state kept on disk (client codec memories,
downlink replicas, the server's control-variate mirrors): written to a temporary file
in the same folder, then renamed, so a crash leaves the previous complete file."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np


def write_npz_atomic(path: str | os.PathLike[str], arrays: Mapping[str, np.ndarray]) -> Path:
    """Write ``arrays`` to ``path`` atomically; return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp.npz")
    try:
        with os.fdopen(fd, "wb") as handle:
            np.savez(handle, **arrays)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_npz_meta(
    path: str | os.PathLike[str], meta: Mapping[str, object], arrays: Mapping[str, np.ndarray]
) -> Path:
    """Write JSON ``meta`` and ``arrays`` (in order) to ``path`` atomically."""
    blob = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    return write_npz_atomic(path, {"meta": blob, **{f"a/{k}": v for k, v in arrays.items()}})


def read_npz_meta(path: str | os.PathLike[str]) -> tuple[dict, dict[str, np.ndarray]] | None:
    """What :func:`write_npz_meta` wrote (arrays in their order), or None without a file."""
    path = Path(path)
    if not path.exists():
        return None
    with np.load(path) as data:
        meta = json.loads(bytes(data["meta"]).decode())
        arrays = {k[2:]: data[k] for k in data.files if k.startswith("a/")}
        if not arrays:  # files written before the prefix: every array but the meta
            arrays = {k: data[k] for k in data.files if k != "meta"}
    return meta, arrays
