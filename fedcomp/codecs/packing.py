"""Bit packing of small unsigned codes and varint coding of index gaps (numpy, vectorized).

- ``pack_bits(codes, bits)``: ``n`` codes of ``bits`` bits each (1..8) into
  ``ceil(n * bits / 8)`` bytes, most significant bit first. 1-bit codes take one bit,
  4-bit codes half a byte.
- ``encode_varints(values)``: unsigned LEB128, 7 bits per byte; used for the gaps
  between sorted top-k indices, so indices cost about log2(gap) bits, never 64.
"""

from __future__ import annotations

import numpy as np

from fedcomp.codecs.wire import PayloadError


def packed_size(n: int, bits: int) -> int:
    """Bytes taken by ``n`` codes of ``bits`` bits."""
    return (n * bits + 7) // 8


#: 2 and 4 bits: the ``8 / bits`` codes of one output byte, read as one little-endian
#: word ``w = sum c_j 2^(8j)``, times the multiplier put ``sum c_j 2^(8 - bits (j+1))``
#: (MSB first) in the word's top byte. The other products either overflow the word or
#: stay below its top byte without carrying into it (at 2 bits they sum to at most
#: 3 (2^20 + 2^18 + 2^16 + 2^10 + 2^8 + 1) < 2^24; at 4 bits to at most 15 < 2^8).
_GATHER = {
    2: (np.dtype("<u4"), np.uint32((1 << 30) | (1 << 20) | (1 << 10) | 1), np.uint32(24)),
    4: (np.dtype("<u2"), np.uint16((1 << 12) | 1), np.uint16(8)),
}


def pack_bits(codes: np.ndarray, bits: int) -> bytes:
    """Pack unsigned codes (each < 2**bits) into bytes, MSB first."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits!r}")
    codes = np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1)
    if bits == 8:
        return codes.tobytes()
    if bits == 1:
        return np.packbits(codes).tobytes()
    if 8 % bits == 0:  # 2 or 4 bits: the codes of one byte gathered by one multiply
        per = 8 // bits
        if codes.size % per:
            codes = np.concatenate([codes, np.zeros(per - codes.size % per, np.uint8)])
        word, multiplier, shift = _GATHER[bits]
        return ((codes.view(word) * multiplier) >> shift).astype(np.uint8).tobytes()
    # 3, 5, 6, 7 bits: eight codes make exactly ``bits`` bytes, one big-endian integer.
    groups = np.zeros(-(-codes.size // 8) * 8, dtype=np.uint8)
    groups[: codes.size] = codes
    groups = groups.reshape(-1, 8)
    word = groups[:, 0].astype(np.uint64) << np.uint64(7 * bits)
    for j in range(1, 8):
        word |= groups[:, j].astype(np.uint64) << np.uint64((7 - j) * bits)
    out = word.astype(">u8").view(np.uint8).reshape(-1, 8)[:, 8 - bits :]
    return out.tobytes()[: packed_size(codes.size, bits)]


class BitWriter:
    """:func:`pack_bits` fed piece by piece (each piece packed while still in cache,
    measured 2x faster than one whole-tensor pack of 6-bit codes at 25M): the codes
    are packed in runs of whole groups of eight, a shorter rest waits for the next
    piece. ``finish()`` returns exactly ``pack_bits`` of all the codes fed."""

    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.parts: list[bytes] = []
        self.rest = np.zeros(0, dtype=np.uint8)

    def add(self, codes: np.ndarray) -> None:
        codes = np.concatenate([self.rest, codes]) if self.rest.size else codes
        whole = codes.size - codes.size % 8
        self.parts.append(pack_bits(codes[:whole], self.bits))
        self.rest = codes[whole:].copy()

    def finish(self) -> bytes:
        self.parts.append(pack_bits(self.rest, self.bits))
        return b"".join(self.parts)


def _spread_table(bits: int) -> np.ndarray:
    """For each byte value, its ``8 / bits`` codes (MSB first) as one little-endian word."""
    per = 8 // bits
    values = np.arange(256, dtype=np.uint8)
    codes = np.stack(
        [(values >> np.uint8(8 - bits * (j + 1))) & np.uint8((1 << bits) - 1) for j in range(per)],
        axis=1,
    )
    return np.ascontiguousarray(codes).view(_GATHER[bits][0])[:, 0]


_SPREAD = {bits: _spread_table(bits) for bits in _GATHER}


def unpack_bits(buf: bytes | memoryview, n: int, bits: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`; the buffer must have exactly the packed size."""
    if not 1 <= bits <= 8:
        raise PayloadError(f"bits must be in 1..8, got {bits!r}")
    expected = packed_size(n, bits)
    if len(buf) != expected:
        raise PayloadError(f"{n} codes of {bits} bits need {expected} bytes, got {len(buf)}")
    raw = np.frombuffer(buf, dtype=np.uint8)
    if bits == 8:
        return raw.copy()
    if bits == 1:
        return np.unpackbits(raw, count=n)
    if 8 % bits == 0:  # one gather: each byte value's codes, precomputed
        return np.take(_SPREAD[bits], raw, mode="clip").view(np.uint8)[:n]
    groups = -(-n // 8)
    whole = np.zeros(groups * bits, dtype=np.uint8)
    whole[: raw.size] = raw  # whole groups of eight codes, zero-padded
    padded = np.zeros((groups, 8), dtype=np.uint8)
    padded[:, 8 - bits :] = whole.reshape(groups, bits)
    word = padded.view(">u8").reshape(-1).astype(np.uint64)
    mask = np.uint64((1 << bits) - 1)
    out = np.empty((groups, 8), dtype=np.uint8)
    for j in range(8):
        out[:, j] = (word >> np.uint64((7 - j) * bits)) & mask
    return out.reshape(-1)[:n]


def encode_varints(values: np.ndarray) -> bytes:
    """Unsigned LEB128 of a 1-d array of non-negative integers (< 2**63)."""
    v = np.ascontiguousarray(values, dtype=np.uint64).reshape(-1)
    if v.size == 0:
        return b""
    # Number of 7-bit groups per value (at least one).
    nbytes = np.ones(v.size, dtype=np.int64)
    rest = v >> np.uint64(7)
    while rest.any():
        nbytes += rest > 0
        rest >>= np.uint64(7)
    out = np.empty(int(nbytes.sum()), dtype=np.uint8)
    starts = np.concatenate(([0], np.cumsum(nbytes)[:-1]))
    for j in range(int(nbytes.max())):
        has = nbytes > j
        group = ((v[has] >> np.uint64(7 * j)) & np.uint64(0x7F)).astype(np.uint8)
        more = (nbytes[has] > j + 1).astype(np.uint8) << 7
        out[starts[has] + j] = group | more
    return out.tobytes()


def decode_varints(buf: bytes | memoryview, count: int) -> np.ndarray:
    """Decode exactly ``count`` LEB128 values that fill ``buf`` completely."""
    raw = np.frombuffer(buf, dtype=np.uint8)
    ends = np.flatnonzero((raw & 0x80) == 0)
    if ends.size != count or (count and ends[-1] != raw.size - 1) or (not count and raw.size):
        raise PayloadError(f"varint stream does not hold exactly {count} values")
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts + 1
    if lengths.size and lengths.max() > 9:
        raise PayloadError("varint longer than 63 bits")
    values = np.zeros(count, dtype=np.uint64)
    for j in range(int(lengths.max()) if lengths.size else 0):
        has = lengths > j
        group = (raw[starts[has] + j] & 0x7F).astype(np.uint64)
        values[has] |= group << np.uint64(7 * j)
    return values
