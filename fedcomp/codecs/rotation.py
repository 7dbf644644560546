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
butterflies over memory.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

#: The smallest rotation block; a tensor's tail is padded to a multiple of it.
MIN_BLOCK = 256
#: The largest rotation block accepted on the wire.
MAX_BLOCK = 1 << 20
#: Largest factor of the Kronecker decomposition (one small dense matmul per factor).
_FACTOR = 64


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


def block_sizes(numel: int, block: int) -> list[int]:
    """The rotation blocks of a tensor: full blocks, then the padded tail's powers of two
    (decreasing). Their sum is the padded length (``numel`` rounded up to MIN_BLOCK)."""
    full, rest = divmod(numel, block)
    sizes = [block] * full
    tail = -(-rest // MIN_BLOCK) * MIN_BLOCK  # <= block: both are multiples of MIN_BLOCK
    size = block
    while size >= MIN_BLOCK:
        if tail >= size:
            sizes.append(size)
            tail -= size
        size //= 2
    return sizes


def padded_length(numel: int, block: int) -> int:
    """Coordinates after padding (what the quantizer encodes)."""
    return sum(block_sizes(numel, block))


@functools.lru_cache(maxsize=16)
def _hadamard(n: int) -> torch.Tensor:
    """The orthonormal n x n Sylvester Hadamard matrix (entries +-1/sqrt(n)), float32."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def hadamard(rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform of each row of a (m, n) float32 tensor, n a
    power of two, into ``out`` (a new tensor when None; never ``rows`` itself).

    ``H_n = H_a (x) H_b``: a block seen as an a x b matrix X becomes ``H_a X H_b``, two
    small matrix products (BLAS) instead of log2(n) passes of butterflies.
    """
    m, n = rows.shape
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    if n <= _FACTOR:
        return torch.matmul(rows, _hadamard(n), out=out)
    b = _FACTOR
    a = n // b
    y = (rows.reshape(m * a, b) @ _hadamard(b)).reshape(m, a, b)
    if a <= _FACTOR:
        torch.matmul(_hadamard(a), y, out=out.view(m, a, b))
        return out
    # a large first factor: transform it as rows of its own
    y = hadamard(y.transpose(1, 2).reshape(m * b, a)).reshape(m, b, a)
    out.view(m, a, b).copy_(y.transpose(1, 2))
    return out


def _sign_bits(seed: int, rotation: int, n: int) -> torch.Tensor:
    """The sign diagonal of one rotation: n bits (1: -1), from the public seed
    (Philox: counter-based, the same on client and server), one uint8 per coordinate."""
    gen = np.random.Generator(np.random.Philox(key=seed + rotation))
    random_bytes = np.frombuffer(gen.bytes((n + 7) // 8), dtype=np.uint8)
    return torch.from_numpy(np.unpackbits(random_bytes)[:n])


def _flip_signs_(flat: torch.Tensor, bits: torch.Tensor) -> None:
    """Multiply a contiguous float32 tensor by the sign diagonal in place: XOR of each
    float's sign bit (the high bit of its last byte, little-endian)."""
    if flat.numel():
        flat.view(torch.uint8)[3::4].bitwise_xor_(bits << 7)


def size_runs(sizes: list[int]) -> list[tuple[int, int, int]]:
    """Runs of equal block sizes: (start offset, block size, count)."""
    runs: list[tuple[int, int, int]] = []
    offset = 0
    for size in sizes:
        if runs and runs[-1][1] == size:
            start, _, count = runs[-1]
            runs[-1] = (start, size, count + 1)
        else:
            runs.append((offset, size, 1))
        offset += size
    return runs


def _transform_blocks(flat: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The Hadamard transform of every block (one batch per run of equal sizes)."""
    out = torch.empty_like(flat)
    for start, size, count in size_runs(sizes):
        end = start + size * count
        hadamard(flat[start:end].view(count, size), out=out[start:end].view(count, size))
    return out


def rotate(x: torch.Tensor, *, seed: int, block: int, rotations: int) -> torch.Tensor:
    """``R x``: the flattened tensor, zero-padded to its blocks, rotated (float32)."""
    flat = x.detach().reshape(-1).to(torch.float32)
    sizes = block_sizes(flat.numel(), block)
    padded = torch.empty(sum(sizes), dtype=torch.float32)
    padded[: flat.numel()] = flat  # a copy: the signs are flipped in place
    padded[flat.numel() :] = 0.0
    for r in range(rotations):
        _flip_signs_(padded, _sign_bits(seed, r, padded.numel()))
        padded = _transform_blocks(padded, sizes)
    return padded


def unrotate(y: torch.Tensor, *, numel: int, seed: int, block: int, rotations: int) -> torch.Tensor:
    """``R^T y`` cropped to ``numel`` coordinates (``y`` as :func:`rotate` returns it)."""
    sizes = block_sizes(numel, block)
    if y.numel() != sum(sizes):
        raise ValueError(f"rotated length {y.numel()} does not match {numel} coordinates")
    out = y.to(torch.float32).reshape(-1)
    for r in reversed(range(rotations)):
        out = _transform_blocks(out.contiguous(), sizes)  # H = H^T = H^-1
        _flip_signs_(out, _sign_bits(seed, r, out.numel()))
    return out[:numel]
