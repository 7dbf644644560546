"""The one-bit joint decoder from run sums: the estimate of :func:`decode_joint`,
without visiting every answer.

Each query's answers at a coordinate come from a run of slots, hence from cyclic runs of
client indices, and their sums are differences of prefix sums
(:mod:`fedcomp.onebit.ranges`). Steps and formulas are :func:`decode_joint`'s
(docs/onebit.md, "Decoder"); with equal client weights every sum is the same integer
count and the estimate is the same to the last bit (tested), otherwise the float64
sums differ only in their order. Median of means (``groups > 1``) stays with the
per-answer decoder.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from fedcomp.onebit.bits import answer
from fedcomp.onebit.decode import (
    JointDecode,
    Received,
    UsedRow,
    coefficient_table,
    localize,
    safe_phases,
    used_queries,
)
from fedcomp.onebit.public import SlotLookup, coordinate_draws
from fedcomp.onebit.queries import QuerySet
from fedcomp.onebit.ranges import ClientPrefix, drawn_control, run_starts, weight_runs

#: Prefix-table entries (bits x 2 (clients + 1) x coordinates) per chunk: about 512K
#: keeps one chunk's tables near the CPU's cache.
RUN_ENTRIES = 1 << 19


@dataclass
class _Runs:
    """One chunk's answers summed per (query, coordinate) from prefix sums."""

    starts: np.ndarray  # (Q + 1, count) first slot of each query's run
    shifts: np.ndarray  # (count,) cyclic shift of the slots
    ones: np.ndarray  # (Q, count) answers that were 1, unweighted
    answers: np.ndarray  # (Q, count) answers received
    s1: np.ndarray  # (Q, count) weighted ones (unit weights: ones x w)
    s0: np.ndarray  # (Q, count) weights of the answers


def _sum_runs(
    received: Received, qs: QuerySet, lookup: SlotLookup, *, seed: int, first: int, count: int
) -> _Runs:
    """Step 1 without visiting answers: each query's answers at a coordinate are a run
    of slots, hence cyclic runs of client indices (:mod:`fedcomp.onebit.ranges`)."""
    n, b = qs.num_clients, qs.bits
    rows, weights = received.client_indices, received.weights
    offsets, shifts = coordinate_draws(seed, first, count, n)
    starts = run_starts(lookup, offsets)
    lo, hi = first * b // 8, -(-(first + count) * b // 8)
    bits = np.unpackbits(received.packed[:, lo:hi], axis=1, bitorder="little")
    planes = bits[:, : count * b].reshape(rows.size, count, b).transpose(2, 0, 1)
    ones = ClientPrefix(planes, rows, n, np.int32).runs(starts, shifts)
    if rows.size == n:  # everyone replied: a run's answers are its length
        answers = np.diff(starts, axis=0).astype(np.float64)
    else:
        answers = weight_runs(_twice_prefix(rows, 1.0, n), starts, shifts, b)
    if np.all(weights == weights[0]):
        return _Runs(starts, shifts, ones, answers, ones * weights[0], answers * weights[0])
    s1 = ClientPrefix(planes * weights[None, :, None], rows, n, np.float64).runs(starts, shifts)
    s0 = weight_runs(_twice_prefix(rows, weights, n), starts, shifts, b)
    return _Runs(starts, shifts, ones, answers, s1, s0)


def _twice_prefix(rows: np.ndarray, values: np.ndarray | float, n: int) -> np.ndarray:
    """Prefix sums of a per-client value over the n clients listed twice."""
    table = np.zeros(2 * n + 1)
    table[rows + 1] = values
    table[rows + 1 + n] = values
    return np.cumsum(table)


def _refine_runs(
    runs: _Runs,
    received: Received,
    qs: QuerySet,
    used: list[UsedRow],
    center: np.ndarray,
    *,
    seed: int,
    first: int,
) -> np.ndarray:
    """Steps 3-4 on run sums: as :func:`_refine`, with the public-U queries' control
    variates ``sum w B_c(U)`` summed over their own answers (:func:`drawn_control`)."""
    count = center.size
    k = np.arange(count)
    unit = np.all(received.weights == received.weights[0])
    client_weight = np.zeros(qs.num_clients)
    client_weight[received.client_indices] = 1.0 if unit else received.weights
    phases = safe_phases(center, qs)
    est = np.zeros(count)
    for row in used:
        pattern = phases[row.scale] * 2 + phases[row.scale + 1]
        qsel, cf = row.query[pattern], row.coef[pattern]
        if row.drawn:
            value = np.zeros(count)
            on = np.flatnonzero(cf)
            control = drawn_control(
                qs,
                qsel[on],
                runs.starts[:, on],
                runs.shifts[on],
                center[on],
                client_weight,
                seed=seed,
                coords=first + on,
            )
            if unit:  # integers until the one product, as the per-answer sums
                value[on] = (runs.ones[qsel[on], on] - control) * received.weights[0]
            else:
                value[on] = runs.s1[qsel[on], on] - control
        else:
            at_center = answer(qs, qsel, center, None)
            value = runs.s1[qsel, k] - at_center * runs.s0[qsel, k]
        est += cf * value / qs.inclusion[qsel]
    return est


def decode_runs(
    received: Received,
    qs: QuerySet,
    *,
    numel: int,
    seed: int,
    start: np.ndarray | None,
    localize_center: bool,
    min_resultant: float,
) -> JointDecode:
    """The weighted mean of z, as :func:`fedcomp.onebit.decode.decode_joint` with one
    group (same parameters and result)."""
    lookup = SlotLookup(qs.cuts)
    used = used_queries(qs, coefficient_table(qs))
    chunk_size = max(8, RUN_ENTRIES // (qs.bits * (qs.num_clients + 1)) // 8 * 8)
    mean, center_all = np.empty(numel), np.empty(numel)
    # As the per-answer decoder's group weight, to the last bit.
    total_weight = np.bincount(np.zeros(received.weights.size, int), received.weights)[0]

    def chunk(first: int) -> int:
        """Decode coordinates [first, first + chunk_size) into ``mean``; the number of
        coordinates whose localization stopped early."""
        count = min(chunk_size, numel - first)
        runs = _sum_runs(received, qs, lookup, seed=seed, first=first, count=count)
        center = np.zeros(count) if start is None else start[first : first + count]
        center = np.asarray(center, dtype=np.float64)
        stopped = 0
        if localize_center and qs.num_loc:
            center, early = localize(
                runs.ones[: qs.num_loc],
                runs.answers[: qs.num_loc],
                center,
                qs.geometry.periods,
                min_resultant,
            )
            stopped = int(np.count_nonzero(early))
        est = _refine_runs(runs, received, qs, used, center, seed=seed, first=first)
        mean[first : first + count] = center + est / total_weight
        center_all[first : first + count] = center
        return stopped

    # Chunks are independent and write disjoint slices, and NumPy's loops release the
    # GIL: as many threads as torch uses (the same result whatever the number).
    firsts = range(0, numel, chunk_size)
    workers = max(1, min(torch.get_num_threads(), len(firsts)))
    if workers == 1:
        stopped_total = sum(map(chunk, firsts))
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            stopped_total = sum(pool.map(chunk, firsts))
    return JointDecode(mean=mean, center=center_all, stopped_early=stopped_total)
