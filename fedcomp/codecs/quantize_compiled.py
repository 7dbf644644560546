"""The stochastic-rounding quantizers' encode compiled with Numba: ``uniform``,
subtractive-dither ``dither`` and ``qsgd`` codes computed and packed in one pass.

The torch path (:class:`fedcomp.codecs.quantizers.UniformCodec`) takes the block maxima
with ``aminmax`` (30 ms at 25M coordinates here: as long as all the rest), then runs
five passes per cache-sized chunk (the affine map, the clamp, the dither, the
conversion to uint8, the bit packing). Here one parallel loop takes the block maxima,
and another maps, clamps, dithers and truncates each block's run of coordinates in a
vector loop, then packs them eight at a time (``bits`` bytes per group, MSB first: the
layout of :mod:`fedcomp.codecs.packing`; QSGD's 6-bit codes too).

The result is the torch path's, byte for byte (tested):

- the dithers are the same draws: coordinate ``i`` takes the ``i``-th 16-bit word of
  the client's generator stream (:func:`fedcomp.codecs.blocks.private_generator`),
  drawn chunk by chunk in the same order, so a subtractive-dither payload decodes with
  the dithers the server regenerates;
- the arithmetic is the same float32 operations: ``x * mul + add`` as one fused
  multiply-add (torch's ``addcmul`` fuses it), the clamp, ``+ k 2^-16``, truncation;
- the block maxima are exact.

Numba is optional (the ``fast`` extra): :func:`available` says whether this path runs;
below :data:`MIN_COMPILED` coordinates the torch path always does. QSGD's block norms
are still taken by torch (float32 sums in torch's order, which a compiled sum would not
reproduce bit for bit); only its codes are compiled.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedcomp import compiled

#: Numba, bound by :data:`KERNELS` when it compiles; the kernel bodies name it.
numba: Any = None

#: Coordinates below which the torch path runs (no Numba import in a process of small
#: tensors).
MIN_COMPILED = 1 << 16
#: Coordinates per call of the kernel: the chunk's dithers (2 bytes each) stay in cache
#: (a multiple of :data:`PART`).
CHUNK = 1 << 18


def available(numel: int) -> bool:
    """Whether the compiled encoder runs for a tensor of ``numel`` coordinates."""
    return numel >= MIN_COMPILED and KERNELS.available()


def _kernels() -> dict[str, Any]:
    return KERNELS.get()


def _warm_up(kernels: dict[str, Any]) -> None:
    """Each kernel once, with the types :func:`block_amax` and :func:`dither_pack` pass
    (see :class:`fedcomp.compiled.Kernels`)."""
    x = np.zeros(16, np.float32)
    with compiled.parallel_region():
        kernels["_block_amax"](x, 8, np.zeros(2, np.float32))
        kernels["_dither_pack"](
            x, 16, 8, np.zeros(2, np.float32), np.float32(0.5), np.float32(1.0),
            np.zeros(16, np.uint16), 0, 16, 2, np.zeros(6, np.uint8),
        )  # fmt: skip


def _block_amax(x, block, out):
    """``out[b] = max |x|`` over each block (the last one may be short): exact, so the
    torch path's ``aminmax`` gives the same value. NaN propagates into its block's
    maximum (checked by the caller)."""
    n = np.uint64(x.size)
    size = np.uint64(block)
    for b in numba.prange(out.size):
        lo = np.uint64(b) * size
        hi = min(lo + size, n)
        peak = np.float32(0.0)
        nan = False
        for j in range(hi - lo):
            v = abs(x[lo + j])
            nan |= v != v
            peak = max(peak, v)
        out[b] = np.float32(np.nan) if nan else peak


#: Coordinates per parallel task (a multiple of 8: tasks pack whole groups of codes).
PART = 4096


def _dither_pack(x, numel, block, mul, add, top, draws, first, count, bits, packed):
    """Codes of coordinates ``first .. first + count`` (``first`` a multiple of 8; the
    last chunk may end at ``numel`` inside a group, whose rest packs as zeros):
    ``floor(clamp(add + x * mul[block], 0, top) + k 2^-16)`` with ``k`` the coordinate's
    draw (``draws[i - first]``), packed into ``packed``.

    Per task of :data:`PART` coordinates: the codes of each block's run of coordinates
    in a vector loop (unsigned indices: see :mod:`fedcomp.codecs.rotation_compiled`),
    then packed eight at a time into ``bits`` bytes."""
    step = np.float32(2.0**-16)
    zero = np.float32(0.0)
    part = np.uint64(PART)
    parts = (count + PART - 1) // PART
    for p in numba.prange(parts):
        lo = np.uint64(first) + np.uint64(p) * part
        hi = min(lo + part, np.uint64(first + count))
        codes = np.zeros(PART, np.uint8)
        i = lo
        while i < hi:
            b = i // np.uint64(block)
            end = min(hi, (b + np.uint64(1)) * np.uint64(block))
            m = mul[b]
            base = i - lo
            for j in range(end - i):
                v = add + x[i + j] * m
                v = min(max(v, zero), top) + np.float32(draws[i - np.uint64(first) + j]) * step
                codes[base + j] = np.uint8(v)
            i = end
        at = lo // np.uint64(8) * np.uint64(bits)
        for g in range((hi - lo + np.uint64(7)) // np.uint64(8)):
            word = np.uint64(0)
            for t in range(8):
                word = (word << np.uint64(bits)) | np.uint64(codes[g * np.uint64(8) + t])
            for k in range(bits):
                shift = np.uint64(8 * (bits - 1 - k))
                packed[at + g * np.uint64(bits) + k] = np.uint8((word >> shift) & np.uint64(255))


def block_amax(flat: np.ndarray, block: int) -> np.ndarray:
    """max |x| of each block of a flat float32 array (NaN where a block holds one)."""
    out = np.empty(-(-flat.size // block), np.float32)
    kernel = _kernels()["_block_amax"]
    with compiled.parallel_region():
        kernel(flat, block, out)
    return out


#: The kernels, compiled and warmed up on first use.
KERNELS = compiled.Kernels(
    globals(),
    what="quantize",
    fallback="quantizing with torch",
    parallel=("_block_amax", "_dither_pack"),
    # x * mul + add as one fused multiply-add, as torch.addcmul computes it (without,
    # 3 codes in 4M at 8 bits differed from the torch path's)
    fastmath=frozenset({"contract"}),
    warm_up=_warm_up,
)


def dither_pack(
    flat: np.ndarray,
    block: int,
    mul: np.ndarray,
    add: float,
    top: float,
    generator: np.random.BitGenerator,
    bits: int,
) -> memoryview:
    """``bits``-bit codes of ``floor(clamp(add + x mul, 0, top) + k 2^-16)`` (``mul`` one
    float32 per block, ``k`` the generator's 16-bit draws in coordinate order), packed
    as :func:`fedcomp.codecs.packing.pack_bits` packs them."""
    kernel = _kernels()["_dither_pack"]
    n = flat.size
    packed = np.empty((n * bits + 7) // 8 + bits, np.uint8)  # room for a last partial group
    mul = np.ascontiguousarray(mul, np.float32)
    with compiled.parallel_region():
        for first in range(0, n, CHUNK):
            count = min(CHUNK, n - first)
            # four 16-bit dithers per raw 64-bit word, as dithered_floor draws them
            draws = np.asarray(generator.random_raw((count + 3) // 4)).view(np.uint16)
            kernel(
                flat, n, block, mul, np.float32(add), np.float32(top), draws, first, count,
                bits, packed,
            )  # fmt: skip
    # a view: the caller's concatenation into the body is the only copy
    return memoryview(packed)[: (n * bits + 7) // 8]
