"""Sums over the clients that answer a query, without visiting each answer.

Systematic sampling gives every query ``q`` a run of consecutive slots at coordinate k,
``[a_q(k), a_{q+1}(k))`` with ``a_q(k)`` the first slot whose ``s + u_k`` reaches the
cut ``C_q``, and slot ``s`` (plane ``j = s // n``, position ``m = s % n``) belongs to
client ``(m + shift_k) mod n`` (:mod:`fedcomp.onebit.public`). Within a plane a run
of slots is therefore a cyclic run of client indices, and the sum of any per-client
quantity over it is a difference of prefix sums taken over the clients in index
order: two lookups per run boundary instead of one pass per answer. The decoder's
per-answer work shrinks to one cumulative sum over the bits; only queries with a
public U (BASE, SREF) still visit their own answers, since each has its own U.

The run boundaries are computed with the same comparisons :class:`SlotLookup` makes,
so encoder and decoder agree on every slot's query bit for bit.
"""

from __future__ import annotations

import numpy as np

from fedcomp.onebit.bits import answer
from fedcomp.onebit.public import SlotLookup, slot_uniforms
from fedcomp.onebit.queries import QuerySet


def run_starts(lookup: SlotLookup, offsets: np.ndarray) -> np.ndarray:
    """``a_q(k)`` for q = 0..Q: the first slot answering query q (or a later one).

    Slot ``F = floor(C_q)`` answers q or later iff ``u_k >= C_q - F`` (one cut inside
    the slot) or ``C_q <= F + u_k`` (several cuts inside: :class:`SlotLookup` then
    searches, with exactly this comparison); slots below F answer an earlier query.

    Returns
    -------
    ndarray of int64, shape (Q + 1, count), non-decreasing along axis 0, in [0, n b].
    """
    cuts = lookup.cuts
    num_slots = lookup.base.size
    floor = np.floor(cuts).astype(np.int64)
    frac = cuts - floor
    inside = floor < num_slots
    deep = np.zeros(cuts.size, dtype=bool)
    deep[inside] = lookup.deep[floor[inside]]
    u = offsets[None, :]
    later = np.where(deep[:, None], cuts[:, None] > floor[:, None] + u, u < frac[:, None])
    return np.minimum(floor[:, None] + later, num_slots)


class ClientPrefix:
    """Prefix sums of one per-(client, plane, coordinate) quantity over client index.

    ``table[j, i, k]`` is the sum over the selected clients ``i' < i`` of plane j at
    coordinate k (clients that did not reply count 0), for ``i`` up to ``2 n``: the
    clients are listed twice, so that a cyclic run ``shift .. shift + m - 1 (mod n)``
    is the plain difference ``table[j, shift + m] - table[j, shift]``, one lookup per
    run boundary. :meth:`runs` turns it into the sum over each query's run of slots.
    """

    def __init__(self, values: np.ndarray, rows: np.ndarray, num_clients: int, dtype: type) -> None:
        planes, _, count = values.shape
        table = np.zeros((planes, 2 * num_clients + 1, count), dtype=dtype)
        table[:, rows + 1] = values
        table[:, rows + 1 + num_clients] = values
        np.cumsum(table, axis=1, out=table)
        self.table, self.n, self.count = table, num_clients, count

    def runs(self, starts: np.ndarray, shifts: np.ndarray) -> np.ndarray:
        """Sum over each run ``[starts[q], starts[q + 1])``: shape ``(Q, count)``."""
        return np.diff(self._at(starts, shifts), axis=0)

    def _at(self, slots: np.ndarray, shifts: np.ndarray) -> np.ndarray:
        """The sum over slots ``[0, g)`` for each boundary ``g`` (shape ``(B, count)``):
        the planes before g's, then the cyclic run of g's own plane."""
        n, count, planes = self.n, self.count, self.table.shape[0]
        flat = self.table.reshape(-1)
        k = np.arange(count)
        shift = shifts.astype(np.int64)
        before = self.table[:, shift, k]  # (planes, count)
        if planes == 1:
            out = flat[slots * count + (shift * count + k)]
            out -= before[0]
            return out
        plane = np.minimum(slots // n, planes - 1)
        row = plane * (2 * n + 1) + shift + (slots - plane * n)
        out = flat[row * count + k]
        totals = self.table[:, n, :]
        offset = np.cumsum(totals, axis=0) - totals - before  # (planes, count)
        out += np.take_along_axis(offset, plane, axis=0)
        return out


def weight_runs(
    prefix: np.ndarray, starts: np.ndarray, shifts: np.ndarray, planes: int
) -> np.ndarray:
    """:meth:`ClientPrefix.runs` for a per-client quantity that is the same in every
    plane and coordinate (the weights): ``prefix`` is its 1-D prefix over the clients
    listed twice (length 2 n + 1)."""
    n = (prefix.size - 1) // 2
    shift = shifts.astype(np.int64)
    if planes == 1:
        return np.diff(prefix[starts + shift], axis=0)
    plane = np.minimum(starts // n, planes - 1)
    at = plane * prefix[n] + prefix[shift + (starts - plane * n)]
    return np.diff(at, axis=0)


def client_of(slots: np.ndarray, shifts: np.ndarray, num_clients: int) -> np.ndarray:
    """The client holding each slot: ``(s mod n + shift_k) mod n``."""
    c = slots % num_clients + shifts
    c -= (c >= num_clients) * num_clients
    return c


def drawn_control(
    qs: QuerySet,
    query: np.ndarray,
    starts: np.ndarray,
    shifts: np.ndarray,
    center: np.ndarray,
    client_weight: np.ndarray,
    *,
    seed: int,
    coords: np.ndarray,
) -> np.ndarray:
    """Per coordinate, ``sum_s w(client(s)) B_c(U_s)`` over the slots answering ``query``.

    ``query``, ``center``, ``coords`` (absolute coordinate numbers) and the columns of
    ``starts`` and ``shifts`` are per coordinate; ``query`` is the one the safe phases
    use. Each of its slots draws its own public U, so these answers are visited one by
    one. ``client_weight`` is indexed by client (0 for a client that did not reply).
    """
    count = query.size
    k = np.arange(count)
    lo, hi = starts[query, k], starts[query + 1, k]
    width = int((hi - lo).max(initial=0))
    if width == 0:
        return np.zeros(count)
    slots = lo[:, None] + np.arange(width)
    live = slots < hi[:, None]
    last = qs.num_clients * qs.bits - 1
    who = client_of(np.minimum(slots, last), shifts[:, None], qs.num_clients)
    w = client_weight[who] * live
    take = w != 0
    row = np.broadcast_to(k[:, None], slots.shape)[take]
    u = slot_uniforms(seed, coords[row], slots[take], qs.num_clients * qs.bits)
    out = np.zeros(slots.shape)
    out[take] = w[take] * answer(qs, query[row], center[row], u)
    return out.sum(axis=1)
