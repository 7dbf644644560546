"""The joint decoder of the one-bit code: coarse center, safe phases, refinement.

Pure functions over chunks of coordinates, in units of tau (docs/onebit.md, "Decoder").
The server holds every received client's packed bits; for each chunk it regenerates
the public assignment of all those clients at once (a ``(R, b, chunk)`` array of query
numbers), decodes the center from the LOC answers, and sums the Horvitz-Thompson
weighted contributions ``coef(q, c) (B - B_c)`` of the other answers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedcomp.onebit.bits import answer
from fedcomp.onebit.public import SlotLookup, client_slots, coordinate_draws, slot_uniforms
from fedcomp.onebit.queries import (
    KIND_BASE,
    KIND_LOC,
    KIND_REF,
    KIND_SREF,
    QuerySet,
)

#: Entries (clients x bits x coordinates) per decoder chunk: about 4M keeps the
#: temporaries of one chunk near 100 MB whatever the number of clients.
DECODE_ENTRIES = 1 << 22


@dataclass
class JointDecode:
    """What the decoder found, in units of tau.

    Attributes
    ----------
    mean : ndarray of float64
        The estimate of the weighted mean of z, per coordinate.
    center : ndarray of float64
        The coarse center c per coordinate.
    stopped_early : int
        Coordinates whose localization stopped before the finest level (no votes, or a
        resultant below the threshold).
    """

    mean: np.ndarray
    center: np.ndarray
    stopped_early: int


def coefficient_table(qs: QuerySet) -> np.ndarray:
    """``coef[q, b_j, b_{j+1}]``: what one answer of q is worth, given the safe phases.

    docs/onebit.md, step 3: BASE(b_0) is worth L_0; REF(j, 0, 1) +-L_j when b_j = 0 (sign by
    b_{j+1}); REF(j, b', t != 1) L_j when b_j = 1 and b' = b_{j+1}; SREF(j, b, b') 3 L_j
    when (b, b') = (b_j, b_{j+1}); anything else 0 (the bit is not used for this c).
    """
    table = np.zeros((qs.num_queries, 2, 2))
    for q in range(qs.num_queries):
        kind = qs.kind[q]
        lj = qs.geometry.scale(int(qs.scale_index[q]))
        if kind == KIND_BASE:
            table[q, qs.phase[q], :] = qs.geometry.base
        elif kind == KIND_REF:
            if qs.threshold[q] == lj:  # REF(j, 0, 1)
                table[q, 0, 0] = lj
                table[q, 0, 1] = -lj
            else:
                table[q, 1, qs.phase[q]] = lj
        elif kind == KIND_SREF:
            table[q, qs.phase[q], qs.phase2[q]] = 3 * lj
    return table


@dataclass(frozen=True)
class UsedRow:
    """One 'used query' per coordinate, chosen by the safe phases ``(b_j, b_{j+1})``.

    ``query[p]`` and ``coef[p]`` for the phase pattern ``p = 2 b_j + b_{j+1}``; a
    pattern that uses no query of this row points at query 0 with coefficient 0.
    """

    scale: int
    query: np.ndarray  # int64 (4,)
    coef: np.ndarray  # float64 (4,)
    drawn: bool  # the row's queries draw a public U


def used_queries(qs: QuerySet, table: np.ndarray) -> list[UsedRow]:
    """Rows of used queries: BASE(b_0), then per scale the (at most two) refinement
    queries whose coefficient is non-zero for each phase pattern."""
    rows = []
    needs_u = qs.needs_uniform()
    for scale in range(qs.geometry.num_scales + 1):
        candidates = [
            q
            for q in range(qs.num_queries)
            if qs.kind[q] != KIND_LOC and int(qs.scale_index[q]) == scale
        ]
        per_pattern = [[q for q in candidates if table[q].reshape(-1)[p] != 0] for p in range(4)]
        for kind_is_base in (True, False):
            lists = [
                [q for q in qq if (qs.kind[q] == KIND_BASE) == kind_is_base] for qq in per_pattern
            ]
            depth = max(len(x) for x in lists)
            for t in range(depth):
                query = np.zeros(4, dtype=np.int64)
                coef = np.zeros(4)
                for p, qq in enumerate(lists):
                    if t < len(qq):
                        query[p], coef[p] = qq[t], table[qq[t]].reshape(-1)[p]
                drawn = {bool(needs_u[q]) for qq in lists for q in qq}
                assert len(drawn) == 1  # a row is all-deterministic or all-drawn
                rows.append(UsedRow(scale, query, coef, drawn.pop()))
    return rows


def safe_phases(center: np.ndarray, qs: QuerySet) -> np.ndarray:
    """``b_j`` for j = 0..J (and a zero row J+1): the phase whose cell boundaries
    ``{b L_j / 2 + m L_j}`` are farthest from c. Shape ``(J + 2, count)``, int64."""
    num = qs.geometry.num_scales
    phases = np.zeros((num + 2, center.size), dtype=np.int64)
    for j in range(num + 1):
        lj = qs.geometry.scale(j)
        r0 = np.mod(center, lj)
        # Phase 1's boundaries are L_j / 2 from phase 0's: it is the safer one exactly
        # when c is within L_j / 4 of a phase-0 boundary.
        phases[j] = np.minimum(r0, lj - r0) < lj / 4
    return phases


def localize(
    sums: np.ndarray,
    counts: np.ndarray,
    start: np.ndarray,
    periods: tuple[float, ...],
    min_resultant: float,
) -> tuple[np.ndarray, np.ndarray]:
    """The coarse center from LOC votes, level by level (docs/onebit.md, step 1).

    Parameters
    ----------
    sums, counts : ndarray, shape (2 * levels, count)
        Per LOC query (rows ``2 l + phi``) and coordinate: answers that were 1, answers.
    start : ndarray
        The starting center (0, or side information).
    periods : tuple of float
        ``P_0 > P_1 > ...``.
    min_resultant : float
        A level whose vote resultant ``sqrt((1 - 2 p_0)^2 + (2 p_1 - 1)^2)`` is below
        this is no information: localization stops there (a balanced vote would
        otherwise snap c to a multiple of ``P_l``).

    Returns
    -------
    center : ndarray
    stopped : ndarray of bool
        Coordinates that stopped before the finest level.
    """
    center = start.astype(np.float64, copy=True)
    active = np.ones(center.size, dtype=bool)
    for level, period in enumerate(periods):
        n0, n1 = counts[2 * level], counts[2 * level + 1]
        with np.errstate(invalid="ignore", divide="ignore"):
            p0 = sums[2 * level] / n0
            p1 = sums[2 * level + 1] / n1
        sin_part = 1 - 2 * p0
        cos_part = 2 * p1 - 1
        resultant = np.hypot(sin_part, cos_part)
        active &= (n0 > 0) & (n1 > 0) & (resultant >= min_resultant)
        if not active.any():
            break
        if active.all():  # the common case: no masked copies
            center = _snap(center, sin_part, cos_part, period)
        else:
            center[active] = _snap(center[active], sin_part[active], cos_part[active], period)
    return center, ~active


def _snap(center: np.ndarray, sin_part: np.ndarray, cos_part: np.ndarray, period: float):
    """The vote's angle as a position y in [0, P), and the center moved to the copy of
    y (mod P) nearest to it."""
    y = period * np.mod(np.arctan2(sin_part, cos_part) / (2 * np.pi), 1.0)
    return y + period * np.round((center - y) / period)


@dataclass
class Received:
    """The replies that arrived: bits, positions among the n selected, weights."""

    packed: np.ndarray  # uint8 (R, bytes): each client's packed bits, (numel, b) order
    client_indices: np.ndarray  # int64 (R,)
    weights: np.ndarray  # float64 (R,)


@dataclass
class _ChunkAnswers:
    """One chunk's received answers, summed per entry (group, query, coordinate)."""

    q: np.ndarray  # (R, count, b) query of each answer
    slots: np.ndarray  # (R, count, b) slot of each answer
    bits: np.ndarray  # (R, count, b) the answer bits
    key: np.ndarray  # flattened entry of each answer
    s1: np.ndarray  # (groups, queries, count) weighted ones
    s0: np.ndarray  # (groups, queries, count) weights
    ones: np.ndarray | None  # unweighted ones per entry (None until needed)
    answers: np.ndarray | None  # unweighted answer counts per entry


def _sum_answers(
    received: Received,
    qs: QuerySet,
    lookup: SlotLookup,
    *,
    seed: int,
    first: int,
    count: int,
    groups: int,
    group_of: np.ndarray,
    unit_weights: bool,
) -> _ChunkAnswers:
    """Step 1: regenerate each answer's query from public randomness and sum the
    answers per (group, query, coordinate): ``S1`` weighted ones, ``S0`` weights."""
    n, b, num_q = qs.num_clients, qs.bits, qs.num_queries
    num_rx = received.client_indices.size
    weights = received.weights
    size = groups * num_q * count
    offsets, shifts = coordinate_draws(seed, first, count, n)
    slots = client_slots(received.client_indices.reshape(-1, 1), shifts, n, b)  # wire order
    q = lookup(slots, offsets[:, None])
    lo, hi = first * b // 8, -(-(first + count) * b // 8)
    bits = np.unpackbits(received.packed[:, lo:hi], axis=1, bitorder="little")
    bits = bits[:, : count * b].reshape(num_rx, count, b)
    key = q.astype(np.int64)
    if groups > 1:
        key += (group_of * num_q).reshape(-1, 1, 1)
    key *= count
    key += np.arange(count)[:, None]
    key = key.reshape(-1)
    shape3 = (groups, num_q, count)
    if unit_weights:
        # One integer bincount of (key, bit) pairs gives both answers and ones.
        pairs = np.bincount(key * 2 + bits.reshape(-1), minlength=2 * size)
        ones, answers = pairs[1::2], pairs[0::2] + pairs[1::2]
        s1 = ones * weights[0]
        s0 = answers * weights[0]
    else:
        w_full = np.broadcast_to(weights.reshape(-1, 1, 1), q.shape).reshape(-1)
        s1 = np.bincount(key, weights=bits.reshape(-1) * w_full, minlength=size)
        s0 = np.bincount(key, weights=w_full, minlength=size)
        ones = answers = None
    return _ChunkAnswers(q, slots, bits, key, s1.reshape(shape3), s0.reshape(shape3), ones, answers)


def _center(
    chunk: _ChunkAnswers,
    qs: QuerySet,
    c0: np.ndarray,
    *,
    groups: int,
    count: int,
    localize_center: bool,
    min_resultant: float,
) -> tuple[np.ndarray, int]:
    """Step 2: the coarse center, localized from the LOC answers (one vote per client,
    whatever its weight) or the side information; and how many coordinates stopped."""
    num_loc = qs.num_loc  # LOC rows come first in the table
    if not (localize_center and num_loc):
        return np.asarray(c0, dtype=np.float64), 0
    shape3 = (groups, qs.num_queries, count)
    ones, answers = chunk.ones, chunk.answers
    if ones is None:
        loc = (chunk.q < num_loc).reshape(-1)
        loc_size = groups * qs.num_queries * count  # LOC rows are the first of each group
        ones = np.bincount(chunk.key[loc], weights=chunk.bits.reshape(-1)[loc], minlength=loc_size)
        answers = np.bincount(chunk.key[loc], minlength=loc_size)
    center, stopped = localize(
        ones.reshape(shape3)[:, :num_loc].sum(axis=0),
        answers.reshape(shape3)[:, :num_loc].sum(axis=0),
        c0,
        qs.geometry.periods,
        min_resultant,
    )
    return center, int(np.count_nonzero(stopped))


def _drawn_sums(
    chunk: _ChunkAnswers,
    qs: QuerySet,
    received: Received,
    center: np.ndarray,
    u_range: tuple[int, int],
    *,
    seed: int,
    first: int,
    count: int,
    groups: int,
    unit_weights: bool,
) -> np.ndarray | None:
    """Step 3: answers of the queries with a public U (BASE, SREF): per entry, the
    sum of w (B - B_c(U)), with the U regenerated from the public seed."""
    q, weights = chunk.q, received.weights
    draw = (q >= u_range[0]) & (q < u_range[1])
    if not draw.any():
        return None
    coords = np.broadcast_to(np.arange(first, first + count)[:, None], q.shape)[draw]
    u = slot_uniforms(seed, coords, chunk.slots[draw], qs.num_clients * qs.bits)
    bc = answer(qs, q[draw], center[coords - first], u)
    diff = chunk.bits[draw] - bc.astype(np.float64)
    if not unit_weights:
        diff *= np.broadcast_to(weights.reshape(-1, 1, 1), q.shape)[draw]
    else:
        diff *= weights[0]
    size = groups * qs.num_queries * count
    sums = np.bincount(chunk.key[draw.reshape(-1)], weights=diff, minlength=size)
    return sums.reshape(groups, qs.num_queries * count)


def _refine(
    chunk: _ChunkAnswers,
    qs: QuerySet,
    used: list,
    center: np.ndarray,
    drawn_sums: np.ndarray | None,
    *,
    groups: int,
    count: int,
) -> np.ndarray:
    """Step 4: the telescoping estimate of z - center per group: only the queries the
    safe phases use carry weight (per coordinate at most one BASE and two refinement
    queries per scale, docs/onebit.md), each Horvitz-Thompson weighted by its planned
    inclusion probability.

    Missing replies need no special estimator: whether a client answers query q is
    public randomness, independent of who replied, so Horvitz-Thompson with the
    PLANNED inclusion probabilities ``pi_q`` and ``W`` = the weight of the clients that
    replied is unbiased for their weighted mean. (A per-coordinate ratio
    ``pi_q' = answers received / n received`` is biased toward c: a coarse query with
    no received answer at a coordinate drops its whole contribution. Measured: all
    x = 300, 40 of 60 replying, the ratio decoder gave 113.)
    """
    phases = safe_phases(center, qs)
    flat_s1 = chunk.s1.reshape(groups, -1)
    flat_s0 = chunk.s0.reshape(groups, -1)
    est = np.zeros((groups, count))
    arange = np.arange(count)
    for row in used:
        pattern = phases[row.scale] * 2 + phases[row.scale + 1]
        qsel = row.query[pattern]
        cf = row.coef[pattern]
        idx = qsel * count + arange
        if row.drawn:
            value = drawn_sums[:, idx] if drawn_sums is not None else 0.0
        else:
            at_center = answer(qs, qsel, center, None)
            value = flat_s1[:, idx] - at_center * flat_s0[:, idx]
        est += cf * value / qs.inclusion[qsel]
    return est


def _median_of_means(est: np.ndarray, group_weight: np.ndarray) -> np.ndarray:
    """Step 5: each live group's weighted mean, then their median (one group: the mean).
    A group whose clients all weigh 0 says nothing and is left out."""
    live = group_weight > 0
    per_group = est[live] / group_weight[live, None]
    return per_group[0] if per_group.shape[0] == 1 else np.median(per_group, axis=0)


@dataclass(frozen=True)
class _Shared:
    """What every chunk of one decode shares: public tables and the replies' groups."""

    lookup: SlotLookup
    used: list[UsedRow]
    #: The rows of the queries with a public U: one contiguous run (BASE, then SREF).
    u_range: tuple[int, int]
    group_of: np.ndarray
    groups: int
    #: All weights equal: each answer's weight is one number, not a gather.
    unit_weights: bool


def _shared(received: Received, qs: QuerySet, groups: int) -> _Shared:
    num_rx = received.client_indices.size
    table = coefficient_table(qs).reshape(qs.num_queries, 4)
    weights = received.weights
    groups = max(1, min(groups, num_rx))
    drawn = np.flatnonzero(qs.needs_uniform())
    u_range = (int(drawn.min()), int(drawn.max()) + 1)
    assert drawn.size == u_range[1] - u_range[0]
    return _Shared(
        lookup=SlotLookup(qs.cuts),
        used=used_queries(qs, table.reshape(qs.num_queries, 2, 2)),
        u_range=u_range,
        group_of=np.arange(num_rx) % groups,
        groups=groups,
        unit_weights=bool(np.all(weights == weights[0])),
    )


def _chunk_estimate(
    received: Received,
    qs: QuerySet,
    shared: _Shared,
    c0: np.ndarray,
    *,
    seed: int,
    first: int,
    count: int,
    localize_center: bool,
    min_resultant: float,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Steps 1 to 4 on coordinates [first, first + count): the center, the refined
    estimate of z - center per group, and how many coordinates stopped early."""
    shape = {"groups": shared.groups}
    chunk = _sum_answers(
        received,
        qs,
        shared.lookup,
        seed=seed,
        first=first,
        count=count,
        group_of=shared.group_of,
        unit_weights=shared.unit_weights,
        **shape,
    )
    center, stopped = _center(
        chunk,
        qs,
        c0,
        count=count,
        localize_center=localize_center,
        min_resultant=min_resultant,
        **shape,
    )
    sums = _drawn_sums(
        chunk,
        qs,
        received,
        center,
        shared.u_range,
        seed=seed,
        first=first,
        count=count,
        unit_weights=shared.unit_weights,
        **shape,
    )
    est = _refine(chunk, qs, shared.used, center, sums, count=count, **shape)
    return center, est, stopped


def decode_joint(
    received: Received,
    qs: QuerySet,
    *,
    numel: int,
    seed: int,
    start: np.ndarray | None,
    localize_center: bool,
    min_resultant: float,
    groups: int = 1,
) -> JointDecode:
    """Decode the weighted mean of z from the received clients' bits.

    Chunk by chunk of coordinates, in named steps: sum the answers per (group, query,
    coordinate) (:func:`_sum_answers`: ``S1`` the weighted ones, ``S0`` the weights),
    find the coarse center (:func:`_center`), sum the public-U queries' answers
    (:func:`_drawn_sums`), refine (:func:`_refine`, which says why missing replies
    need no special estimator) and take the median of means
    (:func:`_median_of_means`). A deterministic query's control variate ``B_c`` and
    coefficient depend only on (query, coordinate), so its contribution is
    ``coef (S1 - B_c S0)``; queries with a public U (BASE, SREF) sum ``w (B - B_c(U))``
    per answer. Per-answer work is thus a table lookup and a few bincounts, whatever
    the number of queries.

    Parameters
    ----------
    start : ndarray or None
        Side information for the center, units of tau (None: 0).
    localize_center : bool
        Refine the center from the LOC answers (``center="inband"``).
    groups : int
        Median of means over this many client groups (1: plain mean; at most one group
        per received client).
    """
    shared = _shared(received, qs, groups)
    num_rx = received.client_indices.size
    group_weight = np.bincount(shared.group_of, weights=received.weights, minlength=shared.groups)
    chunk_size = max(8, (DECODE_ENTRIES // max(1, num_rx * qs.bits)) // 8 * 8)
    mean = np.empty(numel)
    center_all = np.empty(numel)
    stopped_total = 0
    for first in range(0, numel, chunk_size):
        count = min(chunk_size, numel - first)
        c0 = np.zeros(count) if start is None else start[first : first + count]
        center, est, stopped = _chunk_estimate(
            received, qs, shared, c0, seed=seed, first=first, count=count,
            localize_center=localize_center, min_resultant=min_resultant,
        )  # fmt: skip
        stopped_total += stopped
        mean[first : first + count] = center + _median_of_means(est, group_weight)
        center_all[first : first + count] = center
    return JointDecode(mean=mean, center=center_all, stopped_early=stopped_total)
