"""Public randomness of the one-bit code: who answers which query, with which U.

All draws are a counter-based hash (SplitMix64's finalizer) of a 64-bit key and a
position, so a client computes only its own slots and the server recomputes any slot,
in any order, in any process, bit for bit. The key comes from
:func:`fedcomp.rng.derive_seed` of (run seed, round, tensor); positions are the
coordinate k (offset u_k, cyclic shift) and the slot ``k * n b + s`` (the slot's U).

Assignment (docs/onebit.md, "Bit budget and assignment"): slot ``s`` in ``[0, n b)`` answers
the query q with ``C_q <= s + u_k < C_{q+1}`` and belongs to client
``(s + shift_k) mod n``; client i therefore holds slots ``(i - shift_k) mod n + m n``,
m = 0..b-1, which are n apart, so its b queries are distinct (``t_q <= n``).
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_TO_UNIT = 2.0**-53

STREAM_OFFSET = 1
STREAM_SHIFT = 2
STREAM_SLOT = 3


def _finalize(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function, in place on a uint64 array."""
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


def stream_key(seed: int, stream: int) -> np.uint64:
    """A 64-bit key for one named stream of the tensor's public draws."""
    z = np.array([(seed * 4 + stream) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
    return _finalize(z)[0]


def uniform(key: np.uint64, counter: np.ndarray) -> np.ndarray:
    """Uniform float64 draws in [0, 1) at the given non-negative integer positions."""
    z = counter.astype(np.uint64)
    z += np.uint64(1)
    z *= _GOLDEN
    z += key
    _finalize(z)
    z >>= np.uint64(11)
    return z.astype(np.float64) * _TO_UNIT


def coordinate_draws(seed: int, first: int, count: int, num_clients: int):
    """Per-coordinate systematic offset ``u_k`` and cyclic shift ``shift_k``.

    Returns
    -------
    offsets : ndarray of float64, shape (count,)
    shifts : ndarray of int32, shape (count,)
    """
    k = np.arange(first, first + count, dtype=np.int64)
    offsets = uniform(stream_key(seed, STREAM_OFFSET), k)
    shifts = np.floor(uniform(stream_key(seed, STREAM_SHIFT), k) * num_clients).astype(np.int32)
    np.minimum(shifts, num_clients - 1, out=shifts)
    return offsets, shifts


def client_slots(
    client_index: np.ndarray | int, shifts: np.ndarray, num_clients: int, bits: int
) -> np.ndarray:
    """Slot numbers of client(s) ``client_index``: shape ``(..., count, bits)``.

    ``client_index`` may be an int or an array of shape ``(R, 1)`` for R clients.
    The trailing (coordinate, bit) order is the order of the packed bits on the wire.
    """
    # index and shift are both in [0, n): one conditional add replaces a modulo.
    first = (np.asarray(client_index) - shifts).astype(np.int32)
    first += (first < 0) * np.int32(num_clients)
    return first[..., None] + np.arange(bits, dtype=np.int32) * np.int32(num_clients)


class SlotLookup:
    """``q(s, u)``: the query answered by integer slot s at systematic offset u.

    Equivalent to ``searchsorted(C, s + u, "right") - 1`` but without a binary search
    per entry (the decoder's hot path): the query at the slot's left end, plus one for
    every cut ``C_q`` inside ``(s, s + u]``, read from per-slot tables of the cuts'
    fractional positions. Encoder and decoder both use it, so they agree bit for bit.
    """

    def __init__(self, cuts: np.ndarray) -> None:
        num_slots = round(float(cuts[-1]))
        left = np.arange(num_slots, dtype=np.float64)
        self.base = (np.searchsorted(cuts, left, side="right") - 1).astype(np.int16)
        inner = cuts[1:-1]
        floor = np.floor(inner).astype(np.int64)
        frac = inner - floor
        inside = (frac > 0) & (floor < num_slots)
        floor, frac = floor[inside], frac[inside]
        per_slot = np.bincount(floor, minlength=num_slots)
        depth = int(per_slot.max(initial=0))
        # steps[d, s]: the d-th cut's fractional position inside slot s (2.0: none).
        self.steps = np.full((depth, num_slots), 2.0)
        rank = np.arange(floor.size) - np.searchsorted(floor, floor, side="left")
        self.steps[rank, floor] = frac

        # Slots holding several cuts (the tiny shares of the coarsest scales) are few:
        # their entries take an exact binary search instead of one pass per cut.
        self.cuts = cuts
        self.deep = per_slot > 1

    def __call__(self, slots: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        q = self.base[slots]
        if len(self.steps):
            q += offsets >= self.steps[0][slots]
        if len(self.steps) > 1:
            deep = self.deep[slots]
            if deep.any():
                at = np.broadcast_to(offsets, slots.shape)[deep] + slots[deep]
                q[deep] = np.searchsorted(self.cuts, at, side="right") - 1
        return q


def slot_uniforms(seed: int, coords: np.ndarray, slots: np.ndarray, num_slots: int) -> np.ndarray:
    """Each slot's own public U (BASE threshold, SREF coin)."""
    return uniform(stream_key(seed, STREAM_SLOT), coords.astype(np.int64) * num_slots + slots)
