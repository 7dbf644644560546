"""One atomic .npz writer for every piece of state kept on disk (client codec memories,
the server's control-variate mirrors): written to a temporary file in the same folder,
then renamed, so a crash leaves the previous complete file."""

from __future__ import annotations

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
