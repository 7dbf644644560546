"""Randomized Hadamard rotations from public randomness, blockwise (pure functions).

A rotation is ``R x = H D x / sqrt(n)`` on each block of ``n = 2^k`` coordinates, with
``D`` a diagonal of random signs drawn from a public seed and ``H`` the Walsh-Hadamard
matrix; two rotations apply it twice with independent signs. ``R`` is orthogonal, so
``R^T`` undoes it exactly (up to float rounding) and any unbiased quantizer applied to
``R x`` stays unbiased after ``R^T``. After the rotation the coordinates of a block are
close to Gaussian whatever ``x`` looked like (heavy tails included), which is what
DRIVE/EDEN-style quantizers are designed for (docs/codecs.md).

Blocks. A tensor of ``numel`` coordinates is cut into full blocks of ``block``
coordinates (a power of two) and a tail. The tail is padded with zeros to a multiple
of :data:`MIN_BLOCK` and cut into decreasing powers of two (its binary expansion), so
the padding is below ``MIN_BLOCK`` coordinates per tensor; the padded coordinates
travel in the payload and are counted in its bytes.

Speed. ``H_n`` is the Kronecker product of small Hadamard matrices, so one block is
transformed by a few small matrix products (BLAS) instead of ``log2 n`` passes of
butterflies over memory. The blocks are processed in pieces of about CHUNK
coordinates (:class:`Rotation`): a piece's sign flips and the products of every
rotation run while it is in cache, so a whole rotation reads and writes memory once,
and a quantizer behind it (EDEN) can take the piece before it leaves the cache.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from fedcomp.codecs import rotation_compiled
from fedcomp.codecs.blocks import all_finite

#: The smallest rotation block; a tensor's tail is padded to a multiple of it.
MIN_BLOCK = 256
#: The largest rotation block accepted on the wire.
MAX_BLOCK = 1 << 20
#: Largest factor of the Kronecker decomposition (one small dense matmul per factor).
_FACTOR = 64
#: Coordinates rotated per step (a piece): its flips and products stay in cache.
CHUNK = 1 << 18


def check_rotation_block(block: object) -> int:
    """A power of two in [MIN_BLOCK, MAX_BLOCK], else ValueError naming the range."""
    if (
        isinstance(block, bool)
        or not isinstance(block, int)
        or not MIN_BLOCK <= block <= MAX_BLOCK
        or block & (block - 1)
    ):
        raise ValueError(
            f"rotation block must be a power of two in [{MIN_BLOCK}, {MAX_BLOCK}], got {block!r}"
        )
    return block


def block_runs(numel: int, block: int) -> list[tuple[int, int, int]]:
    """The rotation blocks of a tensor as runs (start offset, block size, count): the
    full blocks, then the padded tail cut into decreasing powers of two. They end at
    the padded length (``numel`` rounded up to MIN_BLOCK)."""
    full, rest = divmod(numel, block)
    runs = [(0, block, full)] if full else []
    offset = full * block
    tail = -(-rest // MIN_BLOCK) * MIN_BLOCK  # <= block: both are multiples of MIN_BLOCK
    size = block
    while size >= MIN_BLOCK:
        if tail >= size:
            runs.append((offset, size, 1))
            offset += size
            tail -= size
        size //= 2
    return runs


def block_sizes(numel: int, block: int) -> list[int]:
    """The size of every rotation block, in order (:func:`block_runs` expanded)."""
    return [size for _, size, count in block_runs(numel, block) for _ in range(count)]


def padded_length(numel: int, block: int) -> int:
    """Coordinates after padding (what the quantizer encodes)."""
    return sum(size * count for _, size, count in block_runs(numel, block))


@functools.lru_cache(maxsize=16)
def _hadamard(n: int) -> torch.Tensor:
    """The orthonormal n x n Sylvester Hadamard matrix (entries +-1/sqrt(n)), float32."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def _factors(n: int) -> tuple[int, int]:
    """``n = a * b`` with ``b = min(n, _FACTOR)``: ``H_n = H_a (x) H_b``."""
    b = min(n, _FACTOR)
    return n // b, b


def hadamard(rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform of each row of a (m, n) float32 tensor, n a
    power of two, into ``out`` (a new tensor when None; never ``rows`` itself).

    ``H_n = H_a (x) H_b``: a block seen as an a x b matrix X becomes ``H_a X H_b``, two
    small matrix products (BLAS) instead of log2(n) passes of butterflies.
    """
    m, n = rows.shape
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    a, b = _factors(n)
    if a == 1:
        return torch.matmul(rows, _hadamard(n), out=out)
    y = (rows.reshape(m * a, b) @ _hadamard(b)).reshape(m, a, b)
    if a <= _FACTOR:
        torch.matmul(_hadamard(a), y, out=out.view(m, a, b))
        return out
    # a large first factor: transform it as rows of its own
    y = hadamard(y.transpose(1, 2).reshape(m * b, a)).reshape(m, b, a)
    out.view(m, a, b).copy_(y.transpose(1, 2))
    return out


def _hadamard_(rows: torch.Tensor, work: torch.Tensor) -> None:
    """:func:`hadamard` of contiguous rows in place, through ``work`` (a scratch of at
    least ``rows.numel()`` floats): no allocation for blocks up to ``_FACTOR**2``."""
    m, n = rows.shape
    a, b = _factors(n)
    if a > _FACTOR:
        rows.copy_(hadamard(rows))
        return
    scratch = work[: m * n]
    if a == 1:
        scratch.view(m, n).copy_(rows)
        torch.matmul(scratch.view(m, n), _hadamard(n), out=rows)
        return
    torch.matmul(rows.view(m * a, b), _hadamard(b), out=scratch.view(m * a, b))
    torch.matmul(_hadamard(a), scratch.view(m, a, b), out=rows.view(m, a, b))


def _sign_bytes(seed: int, rotation: int, n: int) -> np.ndarray:
    """The sign diagonal of one rotation, packed: n random bits (1: flip), MSB first,
    from the public seed (Philox: counter-based, the same on client and server)."""
    gen = np.random.Generator(np.random.Philox(key=seed + rotation))
    return np.frombuffer(gen.bytes((n + 7) // 8), dtype=np.uint8)


#: Each byte value's eight sign-bit masks (MSB first, 128 where the bit is set) as one
#: uint64: a single gather turns packed signs into masks.
_MASKS = (np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1) << 7).view("<u8")[:, 0]


def _sign_masks(packed: np.ndarray, start: int, count: int) -> torch.Tensor:
    """Sign-bit masks of coordinates ``start .. start + count`` (both multiples of 8):
    one uint8 each, 128 where the sign flips, else 0."""
    masks = np.take(_MASKS, packed[start // 8 : (start + count) // 8], mode="clip")
    return torch.from_numpy(masks.view(np.uint8))


def _flip_signs_(rows: torch.Tensor, masks: torch.Tensor) -> None:
    """Multiply contiguous float32 rows by the sign diagonal in place: XOR of each
    float's sign bit (the high bit of its last byte, little-endian)."""
    if rows.numel():
        rows.reshape(-1).view(torch.uint8)[3::4].bitwise_xor_(masks)


def pieces(runs: list[tuple[int, int, int]], chunk: int) -> Iterator[tuple[int, int, int]]:
    """The blocks of ``runs`` in order, in pieces of equal-size blocks of at most
    ``chunk`` coordinates (one block at least): (start offset, block size, count)."""
    for start, size, count in runs:
        step = max(1, chunk // size)
        for first in range(0, count, step):
            yield start + first * size, size, min(step, count - first)


@dataclass
class Rotation:
    """One tensor's rotation: its blocks, each rotation's packed signs and a scratch
    piece; applied piece by piece so that the sign flips and both matrix products of
    every rotation run while the piece is in cache (one pass over memory in all).

    Build it with :func:`rotation_for`; ``forward_`` and ``inverse_`` are ``R`` and
    ``R^T`` on the piece of rows starting at a padded offset.
    """

    numel: int
    runs: list[tuple[int, int, int]]
    signs: list[np.ndarray]
    work: torch.Tensor
    chunk: int

    @property
    def padded(self) -> int:
        """Coordinates after padding."""
        start, size, count = self.runs[-1] if self.runs else (0, 0, 0)
        return start + size * count

    @property
    def blocks(self) -> int:
        """Number of rotation blocks (one scale each in EDEN)."""
        return sum(count for _, _, count in self.runs)

    def pieces(self) -> Iterator[tuple[int, int, int]]:
        return pieces(self.runs, self.chunk)

    def forward_(self, start: int, rows: torch.Tensor) -> None:
        """``R`` on the contiguous (count, size) rows at padded offset ``start``."""
        for signs in self.signs:
            _flip_signs_(rows, _sign_masks(signs, start, rows.numel()))
            _hadamard_(rows, self.work)

    def inverse_(self, start: int, rows: torch.Tensor) -> None:
        """``R^T`` on the rows at padded offset ``start`` (H = H^T = H^-1)."""
        for signs in reversed(self.signs):
            _hadamard_(rows, self.work)
            _flip_signs_(rows, _sign_masks(signs, start, rows.numel()))

    def load(self, flat: torch.Tensor, start: int, rows: torch.Tensor) -> torch.Tensor:
        """Copy the input's coordinates at ``start`` into ``rows`` (float32), zero past
        the input's end (the padding)."""
        out = rows.reshape(-1)
        have = max(0, min(out.numel(), self.numel - start))
        out[:have].copy_(flat[start : start + have])
        out[have:].zero_()
        return rows


def rotation_for(numel: int, *, seed: int, block: int, rotations: int) -> Rotation:
    """The rotation of a tensor of ``numel`` coordinates (its signs drawn here)."""
    runs = block_runs(numel, block)
    padded = padded_length(numel, block)
    signs = [_sign_bytes(seed, r, padded) for r in range(rotations)]
    largest = max((size for _, size, _ in runs), default=0)
    work = torch.empty(min(padded, max(CHUNK, largest)), dtype=torch.float32)
    return Rotation(numel, runs, signs, work, CHUNK)


def float32_flat(x: torch.Tensor) -> np.ndarray:
    """The tensor flattened as a contiguous float32 array (no copy when it is one)."""
    return x.detach().reshape(-1).to(torch.float32).contiguous().numpy()


def rotate(x: torch.Tensor, *, seed: int, block: int, rotations: int) -> torch.Tensor:
    """``R x``: the flattened tensor, zero-padded to its blocks, rotated (float32).
    Compiled (:mod:`fedcomp.codecs.rotation_compiled`) when available for its size.

    Raises
    ------
    ValueError
        When the result holds NaN or Inf: the input did (a NaN spreads over its whole
        block) or overflowed float32 when rotated. Checked on the result, in cache on
        the compiled path, so that no caller needs a pass over the input of its own.
    """
    flat = x.detach().reshape(-1)
    rot = rotation_for(flat.numel(), seed=seed, block=block, rotations=rotations)
    if rotation_compiled.available(rot.padded):
        out = rotation_compiled.rotate(float32_flat(flat), rot.runs, rot.signs, rot.padded)
        return torch.from_numpy(out)
    out = torch.empty(rot.padded, dtype=torch.float32)
    for start, size, count in rot.pieces():
        rows = rot.load(flat, start, out[start : start + size * count].view(count, size))
        rot.forward_(start, rows)
    if not all_finite(out):
        raise ValueError("rotate: the input holds NaN or Inf values (or overflows when rotated)")
    return out


def unrotate(y: torch.Tensor, *, numel: int, seed: int, block: int, rotations: int) -> torch.Tensor:
    """``R^T y`` cropped to ``numel`` coordinates (``y`` as :func:`rotate` returns it;
    left unchanged)."""
    rot = rotation_for(numel, seed=seed, block=block, rotations=rotations)
    if y.numel() != rot.padded:
        raise ValueError(f"rotated length {y.numel()} does not match {numel} coordinates")
    if rotation_compiled.available(rot.padded):
        out = rotation_compiled.unrotate(float32_flat(y), numel, rot.runs, rot.signs)
        return torch.from_numpy(out)
    out = y.reshape(-1).to(torch.float32, copy=True)
    for start, size, count in rot.pieces():
        rot.inverse_(start, out[start : start + size * count].view(count, size))
    return out[:numel]
