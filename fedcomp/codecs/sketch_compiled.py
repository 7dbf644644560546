"""The count sketch's loops compiled with Numba: the sketch of a tensor and its unsketch,
with each bucket and sign hashed where it is used instead of read from stored draws.

The NumPy path (:mod:`fedcomp.codecs.sketch`) materializes the draws of a tensor (one
8-byte slot and a sign per row and coordinate, cached) and scatter-adds with
``np.bincount``. Here every word is splitmix64 of its row key plus the coordinate's
counter (:func:`fedcomp.codecs.sketch.words`), computed in registers: no draw is stored
or read. The sums are the NumPy path's exactly (each bucket adds its coordinates in
increasing order, in float64; tested), the medians too.

- ``_sketch_rows``: one row per thread (the rows' tables are disjoint);
- ``_unsketch_run``: chunks of coordinates per thread; a chunk's row estimates row by
  row, then each coordinate's median (min/max networks for up to 5 rows, an insertion
  sort of at most MAX_ROWS values beyond).

Numba is optional (the ``fast`` extra): :func:`available` says whether this path runs;
tensors below :data:`MIN_COMPILED` coordinates always take the NumPy path.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedcomp import compiled
from fedcomp.codecs.sketch import _MIX1, _MIX2, GOLDEN

#: Numba, bound by :data:`KERNELS` when it compiles; the kernel bodies name it.
numba: Any = None

#: Coordinates below which the NumPy path runs (no Numba import in a process of small
#: tensors; the draws of a small tensor cost little to keep).
MIN_COMPILED = 1 << 16
#: Coordinates per parallel chunk of the unsketch.
_CHUNK = 1 << 14

#: Called once per coordinate: inlined into the kernels.
_INLINED = ("_word", "_median_small")
_PARALLEL = ("_sketch_rows", "_unsketch_run")


def _word(key, i):  # pragma: no cover - compiled
    """Word i of a row's stream (fedcomp.codecs.sketch.words), as uint64."""
    z = key + np.uint64(i + 1) * np.uint64(GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    return z ^ (z >> np.uint64(31))


def _sketch_rows(x, keys, cols, table):  # pragma: no cover - compiled
    low, c = np.uint64(0xFFFFFFFF), np.uint64(cols)
    for j in numba.prange(keys.size):
        row = table[j]
        key = keys[j]
        for i in range(x.size):
            w = _word(key, i)
            b = ((w & low) * c) >> np.uint64(32)
            if (w >> np.uint64(32)) & np.uint64(1):
                row[b] -= x[i]
            else:
                row[b] += x[i]


def _median_small(est, rows, i, buf):  # pragma: no cover - compiled
    """The median of column i of est[:rows]: min/max networks for 1 to 5 rows, an
    insertion sort into ``buf`` beyond (np.median's value: the mean of the middle two
    when even)."""
    if rows == 1:
        return est[0, i]
    if rows == 2:
        return 0.5 * (est[0, i] + est[1, i])
    if rows == 3:
        a, b, c = est[0, i], est[1, i], est[2, i]
        return max(min(a, b), min(max(a, b), c))
    if rows == 4:  # the middle two: the larger of the pairs' minima, the smaller maximum
        a, b, c, d = est[0, i], est[1, i], est[2, i], est[3, i]
        return 0.5 * (max(min(a, b), min(c, d)) + min(max(a, b), max(c, d)))
    if rows == 5:  # a sorting network of 9 compare-exchanges (Knuth 5.3.4), then v2
        v0, v1, v2, v3, v4 = est[0, i], est[1, i], est[2, i], est[3, i], est[4, i]
        v0, v1 = min(v0, v1), max(v0, v1)
        v3, v4 = min(v3, v4), max(v3, v4)
        v2, v4 = min(v2, v4), max(v2, v4)
        v2, v3 = min(v2, v3), max(v2, v3)
        v0, v3 = min(v0, v3), max(v0, v3)
        v0, v2 = min(v0, v2), max(v0, v2)
        v1, v4 = min(v1, v4), max(v1, v4)
        v1, v3 = min(v1, v3), max(v1, v3)
        v1, v2 = min(v1, v2), max(v1, v2)
        return v2
    for j in range(rows):
        v, k = est[j, i], j
        while k > 0 and buf[k - 1] > v:
            buf[k] = buf[k - 1]
            k -= 1
        buf[k] = v
    half = rows // 2
    return buf[half] if rows % 2 else 0.5 * (buf[half - 1] + buf[half])


def _unsketch_run(table, keys, numel, out):  # pragma: no cover - compiled
    rows, cols = table.shape
    low, c = np.uint64(0xFFFFFFFF), np.uint64(cols)
    chunks = (numel + _CHUNK - 1) // _CHUNK
    for chunk in numba.prange(chunks):
        start = chunk * _CHUNK
        size = min(numel, start + _CHUNK) - start
        est, buf = np.empty((rows, size)), np.empty(rows)
        for j in range(rows):  # each row's estimates of the chunk: one pass per row
            key, row, mine = keys[j], table[j], est[j]
            for t in range(size):
                w = _word(key, start + t)
                v = row[((w & low) * c) >> np.uint64(32)]
                mine[t] = -v if (w >> np.uint64(32)) & np.uint64(1) else v
        for t in range(size):
            out[start + t] = _median_small(est, rows, t, buf)


def _warm_up(kernels: dict[str, Any]) -> None:
    """Run each kernel once with the types the entry points pass."""
    keys = np.arange(1, 4, dtype=np.uint64)
    table = np.zeros((3, 4))
    with compiled.parallel_region():
        for dtype in (np.float32, np.float64):
            kernels["_sketch_rows"](np.zeros(8, dtype), keys, 4, table)
        kernels["_unsketch_run"](table, keys, 8, np.zeros(8))


#: The kernels, compiled and warmed up on first use.
KERNELS = compiled.Kernels(
    globals(),
    what="count sketch",
    fallback="sketching with NumPy",
    inlined=_INLINED,
    parallel=_PARALLEL,
    warm_up=lambda kernels: _warm_up(kernels),
)


def available(numel: int) -> bool:
    """Whether the compiled path runs for a tensor of ``numel`` coordinates."""
    return numel >= MIN_COMPILED and KERNELS.available()


def sketch(x: np.ndarray, keys: np.ndarray, cols: int) -> np.ndarray:
    """The (rows x cols) count sketch of flat ``x`` (float32 or float64), in float64."""
    table = np.zeros((keys.size, cols))
    kernels = KERNELS.get()
    with compiled.parallel_region():
        kernels["_sketch_rows"](np.ascontiguousarray(x), keys, cols, table)
    return table


def unsketch(table: np.ndarray, keys: np.ndarray, numel: int) -> np.ndarray:
    """Every coordinate's median over the rows of its row estimates (float64)."""
    out = np.empty(numel)
    kernels = KERNELS.get()
    with compiled.parallel_region():
        kernels["_unsketch_run"](np.ascontiguousarray(table, dtype=np.float64), keys, numel, out)
    return out
