"""Small pure helpers shared by the block-scaled codecs: blocking, dithers, checks."""

from __future__ import annotations

import numpy as np
import torch

from fedcomp.codecs.wire import PayloadError

#: Dithers are 16-bit: u = (k + 1/2) / 2^16. Stochastic rounding with them rounds up
#: with probability round(2^16 f) / 2^16 instead of f, a bias of at most 2^-17 of one
#: quantization step (documented; far below what any test or training can see).
DITHER_BITS = 16


def check_block(block: object) -> int:
    """Validate a block size parameter."""
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= 2**31:
        raise ValueError(f"block must be an integer in [1, 2^31], got {block!r}")
    return block


def check_finite(x: torch.Tensor, codec: str) -> None:
    """Encoders refuse NaN/Inf: a scale computed from them would poison a whole block."""
    if x.numel() and not torch.isfinite(x).all():
        raise ValueError(f"{codec}: the update holds NaN or Inf values")


def as_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Flatten to float32 and view as (num_blocks, block), zero-padding the last block."""
    flat = x.detach().reshape(-1).to(torch.float32)
    pad = (-flat.numel()) % block
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block)


def num_blocks(numel: int, block: int) -> int:
    return (numel + block - 1) // block


def block_counts(numel: int, block: int) -> torch.Tensor:
    """Number of real (unpadded) elements in each block."""
    counts = torch.full((num_blocks(numel, block),), block, dtype=torch.float32)
    if numel % block:
        counts[-1] = numel % block
    return counts


def dither(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Uniform dithers in (0, 1) from 16-bit draws of a counter-based generator.

    Philox's raw 64-bit output is split into four 16-bit draws: about 1 G dithers/s
    here, five times torch.rand, which is what makes encoding memory-bound.
    """
    n = int(np.prod(shape, dtype=np.int64))
    words = np.random.Philox(seed).random_raw((n + 3) // 4)
    draws = torch.from_numpy(np.ascontiguousarray(words).view(np.uint16)[:n])
    return draws.to(torch.float32).add_(0.5).mul_(2.0**-DITHER_BITS).view(shape)


def read_scales(body: memoryview, offset: int, count: int) -> torch.Tensor:
    """Read ``count`` float32 scales, rejecting negative or non-finite ones."""
    end = offset + 4 * count
    if len(body) < end:
        raise PayloadError(f"body too short for {count} scales")
    scales = torch.from_numpy(np.frombuffer(body[offset:end], dtype="<f4").copy())
    if count and (not torch.isfinite(scales).all() or (scales < 0).any()):
        raise PayloadError("scales must be finite and non-negative")
    return scales


def expect_length(body: memoryview | bytes, expected: int, what: str) -> None:
    """Compare the body length with what the header implies, before decoding anything."""
    if len(body) != expected:
        raise PayloadError(f"{what}: body has {len(body)} bytes, header implies {expected}")
