"""Answering queries: the client's bits, and the bit a client at the center would send.

One function, :func:`answer`, serves the encoder (at the client's value z) and the
decoder (at the center c, with the same public U: the control variate ``B_c``).
"""

from __future__ import annotations

import numpy as np

from fedcomp.onebit.public import SlotLookup, client_slots, coordinate_draws, slot_uniforms
from fedcomp.onebit.queries import KIND_SREF, QuerySet

#: Coordinates per chunk in the encoder: every array of a chunk stays in cache.
ENCODE_CHUNK = 1 << 16


def answer(qs: QuerySet, q: np.ndarray, z: np.ndarray, u: np.ndarray | None) -> np.ndarray:
    """The bit of query ``q`` at value ``z`` (units of tau), with public uniforms ``u``.

    ``q``, ``z`` and ``u`` broadcast together; ``u`` is needed only where the query
    draws one (BASE, SREF) and may be None when no such query is present.
    """
    if u is None:
        u = 0.0
    period = qs.period[q]
    if qs.kind.max(initial=0) < KIND_SREF:
        rho = np.mod(z - qs.offset[q], period)
        return rho >= qs.threshold[q] + u * qs.dither[q]
    sref = qs.kind[q] == KIND_SREF
    safe_period = np.where(sref, 1.0, period)
    rho = np.mod(z - qs.offset[q], safe_period)
    plain = rho >= qs.threshold[q] + u * qs.dither[q]
    # SREF(j, b, b'): 1{3 L_j U <= f + L_j}, f = rho(2 L_j, b', z) - rho(L_j, b, z).
    lj = qs.dither[q] / 3.0
    lj = np.where(sref, lj, 1.0)
    fine = np.mod(z - qs.phase[q] * lj / 2, lj)
    coarse = np.mod(z - qs.phase2[q] * lj, 2 * lj)
    coin = u * qs.dither[q] <= coarse - fine + lj
    return np.where(sref, coin, plain)


def encode_bits(z: np.ndarray, qs: QuerySet, *, client_index: int, seed: int) -> np.ndarray:
    """The client's b bits per coordinate, shape ``(numel, b)``, as uint8 0/1.

    ``z`` is the client's value divided by the public tau (float64, flat).
    """
    n, b = qs.num_clients, qs.bits
    out = np.empty((z.size, b), dtype=np.uint8)
    needs_u = qs.needs_uniform()
    lookup = SlotLookup(qs.cuts)
    for first in range(0, z.size, ENCODE_CHUNK):
        count = min(ENCODE_CHUNK, z.size - first)
        offsets, shifts = coordinate_draws(seed, first, count, n)
        slots = client_slots(client_index, shifts, n, b)  # (count, b)
        q = lookup(slots, offsets[:, None])
        zc = z[first : first + count]
        u = None
        draw = needs_u[q]
        if draw.any():
            coords = np.broadcast_to(np.arange(first, first + count)[:, None], q.shape)
            u = np.zeros(q.shape)
            u[draw] = slot_uniforms(seed, coords[draw], slots[draw], n * b)
        out[first : first + count] = answer(qs, q, zc[:, None], u)
    return out
