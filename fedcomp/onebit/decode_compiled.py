"""The one-bit joint decoder compiled with Numba: the estimate of
:func:`fedcomp.onebit.decode_runs.decode_runs`, in one pass per coordinate.

The NumPy decoders spend their time in about ten whole-array stages per chunk
(unpacking bits, prefix sums, gathers, the control variates' public uniforms), each
reading and writing arrays of clients x coordinates. Here one compiled loop per
coordinate (:func:`_decode_chunk`, in parallel over coordinates) keeps everything in
registers:

1. the public draws of the coordinate (its offset and cyclic shift), and per query the
   run of slots that answers it (the comparisons of
   :func:`fedcomp.onebit.ranges.run_starts`);
2. the coarse center, level by level, from the LOC answers of each level's two runs;
   the arctan2 of a vote is looked up in a table NumPy computed (:func:`vote_table`);
3. the safe phases, and per used query its Horvitz-Thompson term from the answers of
   its run only; a BASE/SREF query's control variate regenerates each slot's public U
   with :mod:`fedcomp.onebit.public`'s hash.

Formulas and their order of operations are those of the NumPy decoders: with equal
client weights every sum is an integer count and the estimate is the same to the last
bit (tested); with unequal weights the float64 sums are taken in slot order rather than
as differences of prefix sums, so they agree to rounding.

Numba is optional (the ``fast`` extra, installed with ``sim``): without it, or for a
query set whose scales are not powers of two, :func:`available` is False and
:func:`fedcomp.onebit.code.decode_one_group` takes the NumPy decoder.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from fedcomp import compiled
from fedcomp.onebit import public, queries
from fedcomp.onebit.decode import JointDecode, Received, coefficient_table, used_queries
from fedcomp.onebit.public import (
    STREAM_OFFSET,
    STREAM_SHIFT,
    STREAM_SLOT,
    SlotLookup,
    stream_key,
)
from fedcomp.onebit.queries import QuerySet

#: Numba, bound by :data:`KERNELS` when it compiles; the kernel bodies name it.
numba: Any = None

#: Largest answers per LOC query + 1 tabulated (32^4 entries, 8 MB at most; the
#: default 20 votes per query need 23^4): more votes compute their arctan2 in place.
VOTE_TABLE_SIDE = 32
#: Bytes of packed bits per chunk (clients x coordinates x bits / 8): about 1 MB stays
#: in cache while a chunk is decoded (measured: 2^16 coordinates of 100 clients decode
#: fastest among 2^14..2^20).
COMPILED_CHUNK_BYTES = 1 << 20


def installed() -> bool:
    """Whether Numba can be imported (the ``fast`` extra). Tried once, on first use:
    importing it costs 0.2 s, which every process that imports the one-bit code (each
    client too) would otherwise pay, while only the server decodes."""
    return compiled.installed()


def available(qs: QuerySet) -> bool:
    """Whether the compiled decoder can decode this query set: Numba is installed, the
    scales are powers of two (``a0`` one, as the default 8), so that every remainder
    it takes is exact (:func:`_mod`), and it is compiled or can be
    (:func:`fedcomp.compiled.can_compile`)."""
    return installed() and _exact_inverse(qs.geometry.base) > 0 and KERNELS.available()


#: The helpers the kernel inlines; :func:`_kernel` compiles them in place.
_INLINED = (
    "_unit",
    "_mod",
    "_answer",
    "_plane",
    "_boundary",
    "_run",
    "_drawn",
    "_phase",
    "_localize_at",
    "_estimate_at",
)


#: The kernel, compiled on its first use (its first call with the decoder's argument
#: types, in :func:`decode_compiled`; the fuzz tests decode once before their caps).
KERNELS = compiled.Kernels(
    globals(),
    what="onebit",
    fallback="decoding with NumPy (about 6x slower)",
    inlined=_INLINED,
    plain=("_vote_angle",),
    parallel=("_decode_chunk",),
)


def _kernel() -> Any:
    """:func:`_decode_chunk` compiled (on the first call in a process; later processes
    load it from Numba's on-disk cache). The helpers are compiled first and replace
    their Python definitions here, which is what the kernel then calls."""
    return KERNELS.get()["_decode_chunk"]


#: public.py's hash constants and queries.py's SREF kind, restated: Numba's on-disk
#: cache is keyed on this file only, so a change there must be made here too (checked
#: at import), or a cached kernel would keep the old values.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
KIND_SREF = 3
if (_GOLDEN, _M1, _M2, KIND_SREF) != (public._GOLDEN, public._M1, public._M2, queries.KIND_SREF):
    raise ImportError("fedcomp.onebit.decode_compiled: restate public.py's hash constants here")
_S30, _S27, _S31, _S11 = (np.uint64(s) for s in (30, 27, 31, 11))
_ONE = np.uint64(1)
_TO_UNIT = 2.0**-53


def _unit(key, counter):
    """:func:`fedcomp.onebit.public.uniform` of one position (SplitMix64's finalizer)."""
    z = (np.uint64(counter) + _ONE) * _GOLDEN + key
    z ^= z >> _S30
    z *= _M1
    z ^= z >> _S27
    z *= _M2
    z ^= z >> _S31
    return np.float64(z >> _S11) * _TO_UNIT


def _mod(a, b, inv):
    """``np.mod(a, b)`` to the last bit, for a power-of-two b with ``inv = 1 / b``:
    ``a * inv`` and ``floor(.) * b`` are exact, so ``a - floor(a / b) b`` is the
    exact remainder rounded once, as NumPy's fmod-then-adjust. Not for a subnormal
    ``a * inv`` or an overflowing ``floor(.) * b`` (values no decoder meets: centers
    and scales are within a few orders of magnitude of 1 in units of tau). An fmod
    fallback in a branch is not an option: LLVM evaluates it on both sides."""
    return a - np.floor(a * inv) * b


def _answer(table, kind, q, z, u):
    """:func:`fedcomp.onebit.bits.answer` of one query at one value, as 0 or 1.

    ``table[q]`` is (offset, period, threshold, dither, phase, phase2, 1 / period,
    1 / L_j) with a zero inverse where it is not exact (:func:`_query_table`).
    """
    offset, period, threshold, dither = table[q, 0], table[q, 1], table[q, 2], table[q, 3]
    if kind[q] != KIND_SREF:
        return 1 if _mod(z - offset, period, table[q, 6]) >= threshold + u * dither else 0
    lj = dither / 3.0
    inv = table[q, 7]
    fine = _mod(z - table[q, 4] * lj / 2, lj, inv)
    coarse = _mod(z - table[q, 5] * lj, 2 * lj, inv * 0.5)
    return 1 if u * dither <= coarse - fine + lj else 0


def _boundary(cut_table, q, u, num_slots):
    """``a_q``: the first slot answering query q or a later one, at offset u (the
    comparisons of :func:`fedcomp.onebit.ranges.run_starts`); ``cut_table`` rows are
    each cut's floor, fractional part, several-cuts-in-its-slot flag, and the cut."""
    floor = cut_table[0, q]
    if cut_table[2, q] != 0.0:
        later = cut_table[3, q] > floor + u
    else:
        later = u < cut_table[1, q]
    return min(np.int64(floor) + (1 if later else 0), num_slots)


def _plane(s, n):
    """``divmod(s, n)`` for a slot s < n b by subtraction: b is a few planes, and an
    integer division per run would cost more than the run."""
    j = 0
    while s >= n:
        s -= n
        j += 1
    return j, s


def _run(bits_t, replied, client_weight, b, i, lo, hi, shift, weighted):
    """The answers of slots ``[lo, hi)`` at coordinate i, walked in slot order: (ones,
    answers received, weighted ones, weights), the weighted pair only with ``weighted``."""
    n = replied.size
    ones, answers, w1, w0 = 0, 0, 0.0, 0.0
    if hi <= lo:
        return ones, answers, w1, w0
    j, m = _plane(lo, n)
    client = m + shift
    client = client - n if client >= n else client
    local = i * b + j  # chunks start on a byte boundary
    byte, bit_shift = local >> 3, local & 7
    for _ in range(hi - lo):
        bit = (bits_t[byte, client] >> bit_shift) & 1
        ones += bit
        answers += replied[client]
        if weighted:
            w1 += client_weight[client] * bit
            w0 += client_weight[client]
        client = 0 if client == n - 1 else client + 1
        m += 1
        if m == n:  # the next plane: the next bit of this coordinate
            m = 0
            local += 1
            byte, bit_shift = local >> 3, local & 7
    return ones, answers, w1, w0


def _drawn(table, kind, client_weight, replied, q, c, lo, hi, shift, key, coord, weighted):
    """A public-U query's control variate: ``sum w B_c(U_s)`` over its slots
    ``[lo, hi)``, each U the slot's own public draw (:func:`fedcomp.onebit.ranges.
    drawn_control`); ``coord`` is the coordinate's first slot number, ``k n b``.

    Branch-free, so that the compiler can vectorize the hashes: a run is at most n
    slots (``t_q <= n``), so its clients are ``first + t`` less n at most twice; with
    equal weights the sum is an integer count (as NumPy's sum of ones, exactly).
    """
    n = replied.size
    first_client = _plane(lo, n)[1] + shift  # < 2 n
    if weighted:
        control = 0.0
        for t in range(hi - lo):
            client = first_client + t
            client = client - n if client >= n else client
            client = client - n if client >= n else client
            bit = _answer(table, kind, q, c, _unit(key, coord + lo + t))
            control += client_weight[client] * bit
        return control
    count = 0
    for t in range(hi - lo):
        client = first_client + t
        client = client - n if client >= n else client
        client = client - n if client >= n else client
        count += replied[client] * _answer(table, kind, q, c, _unit(key, coord + lo + t))
    return float(count)


def _vote_angle(ones0, n0, ones1, n1, min_resultant):
    """One level's vote as a fraction of its period, in [0, 1) (``y / P`` of
    :func:`fedcomp.onebit.decode._snap`), or NaN when its resultant is below
    ``min_resultant`` (:func:`fedcomp.onebit.decode.localize` stops there). For
    votes beyond :func:`vote_table`: the C library's arctan2 may differ from NumPy's
    vectorized one in the last bit."""
    sin_part = 1 - 2 * (ones0 / n0)
    cos_part = 2 * (ones1 / n1) - 1
    if not np.hypot(sin_part, cos_part) >= min_resultant:
        return np.nan
    return _mod(np.arctan2(sin_part, cos_part) / (2 * np.pi), 1.0, 1.0)


def _phase(c, lj, inv):
    """:func:`fedcomp.onebit.decode.safe_phases` at one scale: 1 when c is within
    ``L_j / 4`` of a phase-0 cell boundary."""
    r0 = _mod(c, lj, inv)
    return 1 if min(r0, lj - r0) < lj / 4 else 0


def _localize_at(bits_t, replied, cut_table, b, i, u, shift, c, periods, votes, min_resultant):
    """Step 2 at coordinate i (:func:`fedcomp.onebit.decode.localize`): the center
    snapped level by level from the LOC votes, one per client whatever its weight
    (LOC rows 2l and 2l + 1 are level l's quadrature pair); and False when the votes
    stop it early."""
    num_slots = replied.size * b
    side = round(votes.size**0.25)
    for level in range(periods.size):
        lo = _boundary(cut_table, 2 * level, u, num_slots)
        mid = _boundary(cut_table, 2 * level + 1, u, num_slots)
        hi = _boundary(cut_table, 2 * level + 2, u, num_slots)
        ones0, n0, _, _ = _run(bits_t, replied, replied, b, i, lo, mid, shift, False)
        ones1, n1, _, _ = _run(bits_t, replied, replied, b, i, mid, hi, shift, False)
        if n0 <= 0 or n1 <= 0:
            return c, False
        if n0 < side and n1 < side:  # the common case: a few votes each
            angle = votes[((ones0 * side + n0) * side + ones1) * side + n1]
        else:
            angle = _vote_angle(ones0, n0, ones1, n1, min_resultant)
        if np.isnan(angle):  # a resultant below min_resultant: no information
            return c, False
        period = periods[level]
        y = period * angle
        c = y + period * np.rint((c - y) / period)
    return c, True


def _estimate_at(
    bits_t, replied, client_weight, cut_table, query_table, kind, inclusion, scales,
    rows, row_query, row_coef, b, i, u, shift, c, key, coord, weighted, w0,
):  # fmt: skip
    """Steps 3-4 at coordinate i (:func:`fedcomp.onebit.decode_runs._refine_runs`):
    the estimate of ``sum w (z - c)``, per used row the Horvitz-Thompson term of the
    query the safe phases pick."""
    num_slots = replied.size * b
    phases = 0  # bit j: the safe phase b_j (decode.safe_phases; b_{J+1} = 0)
    for j in range(scales.shape[1]):
        phases |= _phase(c, scales[0, j], scales[1, j]) << j
    est = 0.0
    for row in range(rows.shape[0]):
        j = rows[row, 0]
        pattern = ((phases >> j) & 1) * 2 + ((phases >> (j + 1)) & 1)
        q, cf = row_query[row, pattern], row_coef[row, pattern]
        if cf == 0.0:  # the pattern uses no query of this row: a term of +-0
            continue
        lo = _boundary(cut_table, q, u, num_slots)
        hi = _boundary(cut_table, q + 1, u, num_slots)
        ones, answers, w1, w_sum = _run(
            bits_t, replied, client_weight, b, i, lo, hi, shift, weighted
        )
        if rows[row, 1]:  # a public U: the control variate visits each answer
            control = _drawn(
                query_table, kind, client_weight, replied, q, c, lo, hi, shift, key, coord, weighted
            )  # fmt: skip
            value = w1 - control if weighted else (ones - control) * w0
        else:
            at_center = _answer(query_table, kind, q, c, 0.0)
            if weighted:
                value = w1 - at_center * w_sum
            else:
                value = ones * w0 - at_center * (answers * w0)
        est += cf * value / inclusion[q]
    return est


def _decode_chunk(
    bits_t, replied, client_weight, b, weighted, w0, total_weight, plan, votes, keys,
    first, min_resultant, center, mean, stopped,
):  # fmt: skip
    """Steps 1-4 of :func:`fedcomp.onebit.decode_runs.decode_runs` for every coordinate
    of a chunk, in parallel over coordinates: ``center`` holds the start and receives
    the center. Arrays reach the per-coordinate code as plain arguments of inlined
    functions: an array taken from a tuple inside the loop, or passed to a call that
    is not inlined, costs two atomic reference counts, more than a run's work."""
    cut_table, query_table, kind, inclusion = plan[0], plan[1], plan[2], plan[3]
    scales, rows, row_query, row_coef, periods = plan[4], plan[5], plan[6], plan[7], plan[8]
    n = replied.size
    for i in numba.prange(center.size):
        # public.coordinate_draws: the offset u_k and the cyclic shift of the slots.
        u = _unit(keys[0], first + i)
        shift = min(np.int64(np.floor(_unit(keys[1], first + i) * n)), n - 1)
        c, finished = _localize_at(
            bits_t, replied, cut_table, b, i, u, shift, center[i], periods, votes, min_resultant
        )  # fmt: skip
        coord = np.int64(first + i) * (n * b)  # the coordinate's first slot number
        est = _estimate_at(
            bits_t, replied, client_weight, cut_table, query_table, kind, inclusion, scales,
            rows, row_query, row_coef, b, i, u, shift, c, keys[2], coord, weighted, w0,
        )  # fmt: skip
        mean[i] = c + est / total_weight
        center[i] = c
        stopped[i] = not finished


@functools.lru_cache(maxsize=8)
def vote_table(side: int, min_resultant: float) -> np.ndarray:
    """Every level's vote with fewer than ``side`` answers per LOC query, as the
    fraction of the period :func:`fedcomp.onebit.decode.localize` snaps to (NaN: no
    information), flat in (ones0, n0, ones1, n1) order.

    Votes are small counts, so a level's arctan2 becomes a lookup. The table is
    computed with NumPy and the same operations as ``localize``, so the compiled
    decoder's centers are NumPy's to the last bit. Cached (19 ms at side 23).
    """
    ones0, n0, ones1, n1 = np.meshgrid(*[np.arange(side)] * 4, indexing="ij")
    with np.errstate(invalid="ignore", divide="ignore"):
        sin_part = 1 - 2 * (ones0 / n0)
        cos_part = 2 * (ones1 / n1) - 1
        angle = np.mod(np.arctan2(sin_part, cos_part) / (2 * np.pi), 1.0)
        informative = np.hypot(sin_part, cos_part) >= min_resultant
    valid = (ones0 <= n0) & (ones1 <= n1) & (n0 > 0) & (n1 > 0) & informative
    table = np.where(valid, angle, np.nan).reshape(-1)
    table.flags.writeable = False  # cached: the same table serves every tensor and round
    return table


def _plan(qs: QuerySet) -> tuple:
    """The round's public tables, as the kernel reads them: the cuts (per ``C_q`` its
    floor, fractional part, whether its slot holds several cuts, and ``C_q``: the
    comparisons of :func:`fedcomp.onebit.ranges.run_starts`); the query table
    (:func:`_query_table`), kinds and inclusion probabilities; per scale ``L_j`` and
    its inverse; the used-query rows (scale, drawn), queries and coefficients per
    phase pattern; the localization periods."""
    lookup = SlotLookup(qs.cuts)
    cuts = np.asarray(qs.cuts, np.float64)
    floor = np.floor(cuts)
    inside = floor < lookup.base.size
    deep = np.zeros(cuts.size)
    deep[inside] = lookup.deep[floor[inside].astype(np.int64)]
    used = used_queries(qs, coefficient_table(qs))
    lengths = [qs.geometry.scale(j) for j in range(qs.geometry.num_scales + 1)]
    return (
        np.stack([floor, cuts - floor, deep, cuts]),
        _query_table(qs),
        qs.kind.astype(np.int64),
        np.asarray(qs.inclusion, np.float64),
        np.array([lengths, [_exact_inverse(x) for x in lengths]]),
        np.array([[r.scale, r.drawn] for r in used], np.int64).reshape(-1, 2),
        np.stack([r.query for r in used]).astype(np.int64),
        np.stack([r.coef for r in used]).astype(np.float64),
        np.asarray(qs.geometry.periods, np.float64),
    )


def _exact_inverse(x: float) -> float:
    """``1 / x`` when multiplying by it is exact division (x a power of two), else 0."""
    return 1.0 / x if x > 0 and math.frexp(x)[0] == 0.5 else 0.0


def _query_table(qs: QuerySet) -> np.ndarray:
    """Per query (offset, period, threshold, dither, phase, phase2, 1 / period,
    1 / L_j), float64; an inverse is 0 where multiplying by it would not be exact, and
    ``L_j = dither / 3`` is the scale of an SREF query."""
    columns = [qs.offset, qs.period, qs.threshold, qs.dither, qs.phase, qs.phase2]
    columns = [np.asarray(c, np.float64) for c in columns]
    inverse = [_exact_inverse(float(p)) for p in columns[1]]
    sref = [
        _exact_inverse(float(d) / 3.0) if k == KIND_SREF else 0.0
        for k, d in zip(qs.kind, columns[3], strict=True)
    ]
    return np.ascontiguousarray(np.stack([*columns, np.array(inverse), np.array(sref)], 1))


def _clients(received: Received, n: int) -> tuple:
    """Per reply its weight; whether they differ; per client (of n) whether it replied
    and its weight (1 for each reply when they are equal: counts stay integers); and
    the total weight, summed as the per-answer decoder's group weight, to the last bit."""
    weights = np.asarray(received.weights, np.float64)
    weighted = not bool(np.all(weights == weights[0]))
    replied = np.zeros(n, np.int32)
    replied[received.client_indices] = 1
    client_weight = np.zeros(n)
    client_weight[received.client_indices] = weights if weighted else 1.0
    total_weight = float(np.bincount(np.zeros(weights.size, int), weights)[0])
    return weights, weighted, replied, client_weight, total_weight


def decode_compiled(
    received: Received,
    qs: QuerySet,
    *,
    numel: int,
    seed: int,
    start: np.ndarray | None,
    localize_center: bool,
    min_resultant: float,
) -> JointDecode:
    """The weighted mean of z, as :func:`fedcomp.onebit.decode_runs.decode_runs`
    (same parameters and result); needs :func:`available`."""
    if not available(qs):
        raise RuntimeError(
            "onebit: the compiled decoder needs numba (pip install fedcomp[fast]) and a"
            f" power-of-two a0, got a0={qs.geometry.base}"
        )
    n, b = qs.num_clients, qs.bits
    weights, weighted, replied, client_weight, total_weight = _clients(received, n)
    plan = _plan(qs)
    if not (localize_center and qs.num_loc):
        plan = (*plan[:8], np.zeros(0))
    keys = np.array([stream_key(seed, s) for s in (STREAM_OFFSET, STREAM_SHIFT, STREAM_SLOT)])
    # A LOC run holds at most ceil(t_q) + 1 slots (t_q its planned answers): the table
    # covers every vote but those of very many clients, which are computed in place.
    loc_slots = int(np.ceil(qs.counts[: qs.num_loc].max(initial=0))) + 2
    votes = vote_table(min(loc_slots, VOTE_TABLE_SIDE), float(min_resultant))
    mean = np.empty(numel)
    center = np.zeros(numel) if start is None else np.array(start, np.float64)
    stopped = np.zeros(numel, np.bool_)
    kernel = _kernel()
    chunk = max(1024, COMPILED_CHUNK_BYTES * 8 // (n * b) // 8 * 8)  # a byte boundary
    with compiled.parallel_region():
        for first in range(0, numel, chunk):
            count = min(chunk, numel - first)
            lo, hi = first * b // 8, -(-(first + count) * b // 8)
            # Byte-major, one column per client (zeros for the silent ones): the bits of
            # one coordinate are then contiguous, in client order.
            silent = received.client_indices.size < n
            bits_t = (np.zeros if silent else np.empty)((hi - lo, n), np.uint8)
            bits_t[:, received.client_indices] = received.packed[:, lo:hi].T
            part = slice(first, first + count)
            kernel(
                bits_t,
                replied,
                client_weight,
                b,
                weighted,
                float(weights[0]),
                total_weight,
                plan,
                votes,
                keys,
                first,
                float(min_resultant),
                center[part],
                mean[part],
                stopped[part],
            )
    return JointDecode(mean=mean, center=center, stopped_early=int(np.count_nonzero(stopped)))
