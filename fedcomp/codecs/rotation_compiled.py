"""The rotation codecs' loops compiled with Numba: the randomized Hadamard rotation,
EDEN's quantization and their inverses, one rotation block at a time while it is in
the L1 cache, in parallel over blocks.

The torch path (:mod:`fedcomp.codecs.rotation`, :mod:`fedcomp.codecs.eden`) rotates a
block with two small matrix products (80 multiply-adds per coordinate at 1,024) and
quantizes in whole-piece tensor passes. Here a block is transformed by the fast
Walsh-Hadamard butterflies (``log2 n`` additions per coordinate), then normalized,
quantized and packed before it leaves the cache:

- the first three butterfly stages in registers, eight coordinates at a time; the wider
  stages as vector loops (SIMD). Their indices are unsigned: Numba wraps negative
  signed indices around, and that check alone kept LLVM from vectorizing them
  (measured: 2.4x slower);
- the sign diagonal and the ``1/sqrt(n)`` of each rotation in one multiplication, from a
  256 x 8 table of each sign byte's eight factors;
- EDEN: the block's sum of squares (float64), its codes (comparisons with the
  Lloyd-Max thresholds times the block's RMS), ``<y, c>`` and ``||c||^2`` (float64),
  its scale, then the codes packed eight at a time (``bits`` bytes, MSB first, the
  layout of :mod:`fedcomp.codecs.packing`).

The result is the torch path's up to float rounding: the same rotation (the same public
signs, applied to the same blocks), the same codes except for coordinates within
rounding of a threshold, scales equal to a few ulps (tested against the dense float64
definition and against the torch path). A client with Numba and one without both
produce valid payloads of the same layout; the server decodes either with either.

Numba is optional (the ``fast`` extra, installed with ``sim``): :func:`available` says
whether this path runs; tensors below :data:`MIN_COMPILED` coordinates always take the
torch path, so that a process that only ever rotates small tensors never imports Numba.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from fedcomp import compiled

#: Numba, bound by :data:`KERNELS` when it compiles; the kernel bodies name it.
numba: Any = None

#: Coordinates below which the torch path runs (it is as fast there, and needs no
#: Numba import, 0.2 s, nor a cache load, 0.3 s, in a process of small tensors).
MIN_COMPILED = 1 << 16

#: The helpers the kernels call; :data:`KERNELS` compiles them in place, as functions
#: of their own: a call per block costs nothing, and inlining them into each kernel
#: doubled the first compilation (17 s against 9 s, measured).
_HELPERS = (
    "_butterflies",
    "_scale_signs",
    "_load",
    "_forward",
    "_normalize",
    "_inverse",
    "_sum_squares",
    "_quantize",
    "_pack8",
    "_unpack8",
    "_crop",
)
#: The parallel kernels.
_PARALLEL = ("_rotate_run", "_unrotate_run", "_eden_encode_run", "_eden_decode_run")


#: The kernels, compiled and warmed up (:func:`_warm_up`) on first use.
KERNELS = compiled.Kernels(
    globals(),
    what="rotation",
    fallback="rotating with torch",
    plain=_HELPERS,
    parallel=_PARALLEL,
    # float sums may be reordered, so that they vectorize; no other flag: the
    # non-finite checks must see NaN and Inf
    fastmath=frozenset({"reassoc"}),
    warm_up=lambda kernels: _warm_up(kernels),
)


def available(numel: int) -> bool:
    """Whether the compiled path runs for a tensor of ``numel`` coordinates: large
    enough, Numba installed, and compiled or compilable here."""
    return numel >= MIN_COMPILED and KERNELS.available()


def _kernels() -> dict[str, Any]:
    """The parallel kernels (compiled on the first call in a process; later processes
    load them from Numba's on-disk cache)."""
    return KERNELS.get()


def _warm_up(kernels: dict[str, Any]) -> None:
    """Run each kernel once on one block, with arguments of the types the entry points
    pass (the public signs and a payload's codes are read-only arrays; see
    :class:`fedcomp.compiled.Kernels`)."""
    n = 256
    x = np.zeros(n, np.float32)
    signs = np.frombuffer(bytes(n // 8), np.uint8)
    table, unit = sign_table(n), sign_table(1)
    centroids, thresholds = np.zeros(4), np.zeros(3)
    packed = np.zeros(n // 4, np.uint8)
    scales = np.zeros(1, np.float32)
    with compiled.parallel_region():
        kernels["_rotate_run"](x, n, 0, n, 1, 1, signs, signs, 2, table, x.copy())
        kernels["_unrotate_run"](x, n, 0, n, 1, 1, signs, signs, 2, table, unit, x.copy())
        kernels["_eden_encode_run"](
            x, n, 0, n, 1, 1, signs, signs, 2, table, 2, True, centroids, thresholds, packed,
            scales, 0,
        )  # fmt: skip
        kernels["_eden_decode_run"](
            np.frombuffer(packed.tobytes(), np.uint8), scales, 0, n, 0, n, 1, 1, signs, signs,
            2, table, unit, 2, centroids, x.copy(),
        )  # fmt: skip


@functools.lru_cache(maxsize=16)
def sign_table(n: int) -> np.ndarray:
    """For each sign byte, the factors of its eight coordinates (MSB first): ``-1/sqrt(n)``
    where the bit is set (a flip), ``+1/sqrt(n)`` elsewhere; float32, shape (256, 8).
    ``sign_table(1)`` is the signs alone."""
    bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1)
    return ((1.0 - 2.0 * bits) / math.sqrt(n)).astype(np.float32)


# ---- helpers: one block ``v[o : o + n]`` (n a power of two >= 8) --------------------


def _butterflies(v, o, n):
    """The unnormalized Walsh-Hadamard transform of ``v[o : o + n]`` in place."""
    eight = np.uint64(8)
    for i in range(o, o + n, eight):  # stages 1, 2, 4 in registers
        a0, a1, a2, a3 = v[i], v[i + 1], v[i + 2], v[i + 3]
        a4, a5, a6, a7 = v[i + 4], v[i + 5], v[i + 6], v[i + 7]
        b0, b1, b2, b3 = a0 + a1, a0 - a1, a2 + a3, a2 - a3
        b4, b5, b6, b7 = a4 + a5, a4 - a5, a6 + a7, a6 - a7
        c0, c1, c2, c3 = b0 + b2, b1 + b3, b0 - b2, b1 - b3
        c4, c5, c6, c7 = b4 + b6, b5 + b7, b4 - b6, b5 - b7
        v[i], v[i + 1], v[i + 2], v[i + 3] = c0 + c4, c1 + c5, c2 + c6, c3 + c7
        v[i + 4], v[i + 5], v[i + 6], v[i + 7] = c0 - c4, c1 - c5, c2 - c6, c3 - c7
    h = eight
    while h < n:  # the wider stages: contiguous runs of h, vectorized
        for i in range(o, o + n, 2 * h):
            for t in range(h):
                a = v[i + t]
                b = v[i + h + t]
                v[i + t] = a + b
                v[i + h + t] = a - b
        h *= np.uint64(2)


def _scale_signs(v, o, n, signs, base, table):
    """``v[o : o + n]`` times one rotation's signs over ``1/sqrt(n)`` (padded offset
    ``base``, a multiple of 8)."""
    first = base >> np.uint64(3)
    for k in range(n >> np.uint64(3)):
        byte = signs[first + k]
        at = o + (k << np.uint64(3))
        for t in range(8):
            v[at + t] *= table[byte, t]


def _load(x, numel, v, o, n, signs, base, table):
    """``v[o : o + n]`` = the input's coordinates at ``base`` (zero past its end) times
    the first rotation's signs over ``1/sqrt(n)``."""
    first = base >> np.uint64(3)
    if base + n <= numel:  # a whole block: no bounds test in the loop
        for k in range(n >> np.uint64(3)):
            byte = signs[first + k]
            at = k << np.uint64(3)
            for t in range(8):
                v[o + at + t] = x[base + at + t] * table[byte, t]
        return
    for k in range(n >> np.uint64(3)):
        byte = signs[first + k]
        at = k << np.uint64(3)
        for t in range(8):
            j = base + at + t
            value = x[j] if j < numel else np.float32(0.0)
            v[o + at + t] = value * table[byte, t]


def _forward(x, numel, v, o, n, signs0, signs1, rotations, base, table):
    """``R x`` of one block into ``v[o : o + n]``."""
    _load(x, numel, v, o, n, signs0, base, table)
    _butterflies(v, o, n)
    if rotations == 2:
        _scale_signs(v, o, n, signs1, base, table)
        _butterflies(v, o, n)


def _normalize(v, o, n):
    """``v[o : o + n]`` over ``sqrt(n)``."""
    root = np.float32(1.0 / math.sqrt(np.float64(n)))
    for j in range(o, o + n):
        v[j] *= root


def _inverse(v, o, n, signs0, signs1, rotations, base, table, signs_only):
    """``R^T`` of one block in place: per rotation, last first, ``D H / sqrt(n)``.

    Each ``1/sqrt(n)`` comes before its butterflies, as in the forward direction, so
    that no intermediate exceeds ``sqrt(n)`` times the block's largest value (dividing
    after them overflowed float32 from about 1e37 at blocks of 1,024). The second
    rotation's signs and the first's ``1/sqrt(n)`` are one multiplication (``table``);
    the first's signs alone are ``signs_only`` (+-1)."""
    _normalize(v, o, n)
    if rotations == 2:
        _butterflies(v, o, n)
        _scale_signs(v, o, n, signs1, base, table)
    _butterflies(v, o, n)
    _scale_signs(v, o, n, signs0, base, signs_only)


def _sum_squares(v, o, n):
    """``sum v[o : o + n]^2`` in float64."""
    total = 0.0
    for j in range(o, o + n):
        total += np.float64(v[j]) * np.float64(v[j])
    return total


def _quantize(v, n, norm2, bits, centroids, thresholds, codes):
    """EDEN's codes of one rotated block ``v[0 : n]`` into ``codes``; returns ``<v, c>``
    and ``||c||^2`` (float64), ``c`` the codes' centroids.

    Each code counts the thresholds (times the block's RMS) below its coordinate: one
    vector loop per threshold, which also sums the coordinates and counts above it.
    Code k's coordinates then sum to the difference of two such sums, and
    ``<v, c> = sum_k centroid_k (sum of code k)``: no gather of centroids per coordinate.
    """
    if bits == 1:  # codes are signs: <y, c> = c1 ||y||_1, ||c||^2 = n c1^2
        total = 0.0
        for j in range(n):
            codes[j] = np.uint8(v[j] > 0)
            total += abs(np.float64(v[j]))
        return centroids[1] * total, np.float64(n) * centroids[1] * centroids[1]
    rms = math.sqrt(norm2 / np.float64(n))
    rms = rms if rms > 0 else 1.0
    below_sum = 0.0  # sum and count of the coordinates above the previous threshold
    for j in range(n):
        codes[j] = 0
        below_sum += np.float64(v[j])
    below_count = n
    dot = 0.0
    c_norm2 = 0.0
    for k in range(thresholds.size):
        cut = np.float32(thresholds[k] * rms)
        above_sum = 0.0
        above_count = 0
        for j in range(n):
            above = v[j] > cut
            codes[j] += np.uint8(above)
            above_sum += np.float64(v[j]) if above else 0.0
            above_count += np.int64(above)
        c = centroids[k]
        dot += c * (below_sum - above_sum)
        c_norm2 += c * c * np.float64(below_count - above_count)
        below_sum, below_count = above_sum, above_count
    c = centroids[thresholds.size]
    return dot + c * below_sum, c_norm2 + c * c * np.float64(below_count)


def _pack8(codes, i, bits, packed, at):
    """Codes ``i .. i + 8`` into ``bits`` bytes at ``packed[at]``, MSB first."""
    word = np.uint32(0)
    for t in range(8):
        word = (word << np.uint32(bits)) | np.uint32(codes[i + t])
    for k in range(bits):
        packed[at + k] = np.uint8((word >> np.uint32(8 * (bits - 1 - k))) & np.uint32(255))


def _unpack8(packed, at, bits, codes):
    """The eight codes of ``bits`` bytes at ``packed[at]`` into ``codes[0 .. 8]``."""
    word = np.uint32(0)
    for k in range(bits):
        word = (word << np.uint32(8)) | np.uint32(packed[at + k])
    mask = np.uint32((1 << bits) - 1)
    for t in range(8):
        codes[t] = np.uint8((word >> np.uint32(bits * (7 - t))) & mask)


def _crop(v, n, base, numel, out):
    """``out[base : base + n] = v[0 : n]``, cropped to ``numel`` coordinates."""
    stop = min(base + n, numel)
    for j in range(base, stop):
        out[j] = v[j - base]


# ---- parallel kernels: one run of ``count`` blocks of ``n`` at padded offset ``start``,
# in ``parts`` parts of consecutive blocks, each with one scratch block ----------------


def _rotate_run(x, numel, start, n, count, parts, signs0, signs1, rotations, table, out):
    """``R x`` of the run's blocks into ``out`` (the padded rotated vector); returns how
    many blocks hold a non-finite value."""
    n = np.uint64(n)
    bad = np.zeros(count, np.uint8)
    for part in numba.prange(parts):
        for blk in range(part * count // parts, (part + 1) * count // parts):
            base = np.uint64(start) + np.uint64(blk) * n
            _forward(x, np.uint64(numel), out, base, n, signs0, signs1, rotations, base, table)
            bad[blk] = not np.isfinite(_sum_squares(out, base, n))
    return bad.sum()


def _unrotate_run(
    y, numel, start, n, count, parts, signs0, signs1, rotations, table, signs_only, out
):
    """``R^T y`` of the run's blocks into ``out``, cropped to ``numel`` coordinates."""
    n = np.uint64(n)
    for part in numba.prange(parts):
        v = np.empty(n, np.float32)
        for blk in range(part * count // parts, (part + 1) * count // parts):
            base = np.uint64(start) + np.uint64(blk) * n
            for j in range(n):
                v[j] = y[base + j]
            _inverse(v, np.uint64(0), n, signs0, signs1, rotations, base, table, signs_only)
            _crop(v, n, base, np.uint64(numel), out)


def _eden_encode_run(
    x, numel, start, n, count, parts, signs0, signs1, rotations, table,
    bits, unbiased, centroids, thresholds, packed, scales, first_scale,
):  # fmt: skip
    """EDEN's codes (packed) and scales of the run's blocks of ``R x``; returns how many
    blocks hold a non-finite value (their scale is NaN)."""
    n = np.uint64(n)
    zero = np.uint64(0)
    bad = np.zeros(count, np.uint8)
    for part in numba.prange(parts):
        v = np.empty(n, np.float32)
        codes = np.empty(n, np.uint8)
        for blk in range(part * count // parts, (part + 1) * count // parts):
            base = np.uint64(start) + np.uint64(blk) * n
            _forward(x, np.uint64(numel), v, zero, n, signs0, signs1, rotations, base, table)
            norm2 = _sum_squares(v, zero, n)
            if not np.isfinite(norm2):
                bad[blk] = 1
                scales[first_scale + blk] = np.nan
                continue
            dot, c_norm2 = _quantize(v, n, norm2, bits, centroids, thresholds, codes)
            if unbiased:
                scale = norm2 / dot if dot > 0 else 0.0
            else:
                scale = dot / c_norm2
            scales[first_scale + blk] = np.float32(scale)
            at = base * np.uint64(bits) // np.uint64(8)
            for i in range(0, n, np.uint64(8)):
                _pack8(codes, i, bits, packed, at + i // np.uint64(8) * np.uint64(bits))
    return bad.sum()


def _eden_decode_run(
    packed, scales, first_scale, numel, start, n, count, parts, signs0, signs1, rotations,
    table, signs_only, bits, centroids, out,
):  # fmt: skip
    """``R^T`` of ``scale * centroid[code]`` of the run's blocks into ``out``, cropped to
    ``numel`` coordinates."""
    n = np.uint64(n)
    for part in numba.prange(parts):
        v = np.empty(n, np.float32)
        eight = np.empty(8, np.uint8)
        for blk in range(part * count // parts, (part + 1) * count // parts):
            base = np.uint64(start) + np.uint64(blk) * n
            scale = scales[first_scale + blk]
            at = base * np.uint64(bits) // np.uint64(8)
            for i in range(0, n, np.uint64(8)):
                _unpack8(packed, at + i // np.uint64(8) * np.uint64(bits), bits, eight)
                for t in range(8):
                    v[i + t] = np.float32(centroids[eight[t]]) * scale
            _inverse(v, np.uint64(0), n, signs0, signs1, rotations, base, table, signs_only)
            _crop(v, n, base, np.uint64(numel), out)


# ---- the Python side -----------------------------------------------------------------


#: Parts a run's blocks are split into (each a parallel task with one scratch block):
#: enough for the threads to share the work evenly.
PARTS = 64


def _parts(count: int) -> int:
    return max(1, min(count, PARTS))


def _signs(signs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, int]:
    """The two sign arrays the kernels take (the first twice for one rotation)."""
    return signs[0], signs[-1], len(signs)


def rotate(
    flat: np.ndarray, runs: list[tuple[int, int, int]], signs: list[np.ndarray], padded: int
) -> np.ndarray:
    """``R x`` of a flat float32 array, zero-padded to its blocks (``runs`` and ``signs``
    as :class:`fedcomp.codecs.rotation.Rotation` holds them).

    Raises
    ------
    ValueError
        When the rotated vector holds NaN or Inf (the input did, or overflowed).
    """
    kernels = _kernels()
    out = np.empty(padded, np.float32)
    signs0, signs1, rotations = _signs(signs)
    bad = 0
    with compiled.parallel_region():
        for start, size, count in runs:
            bad += kernels["_rotate_run"](
                flat, flat.size, start, size, count, _parts(count), signs0, signs1,
                rotations, sign_table(size), out,
            )  # fmt: skip
    if bad:
        raise ValueError("rotate: the input holds NaN or Inf values (or overflows when rotated)")
    return out


def unrotate(
    y: np.ndarray, numel: int, runs: list[tuple[int, int, int]], signs: list[np.ndarray]
) -> np.ndarray:
    """``R^T y`` cropped to ``numel`` coordinates (``y`` the padded float32 vector)."""
    kernels = _kernels()
    out = np.empty(numel, np.float32)
    signs0, signs1, rotations = _signs(signs)
    with compiled.parallel_region():
        for start, size, count in runs:
            kernels["_unrotate_run"](
                y, numel, start, size, count, _parts(count), signs0, signs1, rotations,
                sign_table(size), sign_table(1), out,
            )  # fmt: skip
    return out


def eden_encode(
    flat: np.ndarray,
    runs: list[tuple[int, int, int]],
    signs: list[np.ndarray],
    *,
    bits: int,
    unbiased: bool,
    centroids: np.ndarray,
    thresholds: np.ndarray,
    packed: np.ndarray,
    scales: np.ndarray,
) -> None:
    """EDEN's packed codes and per-block scales of ``R x`` into ``packed`` and
    ``scales`` (:func:`fedcomp.codecs.eden.rotate_and_quantize`'s result).

    Raises
    ------
    ValueError
        On a block holding NaN or Inf (the input did, or overflowed when rotated).
    """
    kernels = _kernels()
    signs0, signs1, rotations = _signs(signs)
    index = bad = 0
    with compiled.parallel_region():
        for start, size, count in runs:
            bad += kernels["_eden_encode_run"](
                flat, flat.size, start, size, count, _parts(count), signs0, signs1,
                rotations, sign_table(size), bits, unbiased, centroids, thresholds, packed,
                scales, index,
            )  # fmt: skip
            index += count
    if bad:
        raise ValueError("eden: the update holds NaN or Inf values (or overflows when rotated)")


def eden_decode(
    packed: np.ndarray,
    scales: np.ndarray,
    numel: int,
    runs: list[tuple[int, int, int]],
    signs: list[np.ndarray],
    *,
    bits: int,
    centroids: np.ndarray,
) -> np.ndarray:
    """``R^T`` of ``scale * centroid[code]``, cropped to ``numel`` coordinates
    (:func:`fedcomp.codecs.eden.dequantize_and_unrotate`'s result)."""
    kernels = _kernels()
    out = np.empty(numel, np.float32)
    signs0, signs1, rotations = _signs(signs)
    index = 0
    with compiled.parallel_region():
        for start, size, count in runs:
            kernels["_eden_decode_run"](
                packed, scales, index, numel, start, size, count, _parts(count), signs0,
                signs1, rotations, sign_table(size), sign_table(1), bits, centroids, out,
            )  # fmt: skip
            index += count
    return out
