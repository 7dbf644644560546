"""Block-scaled quantizers: stochastic uniform b-bit, QSGD, and scaled sign.

Body layouts (little-endian), after the common header:

- uniform: ``u8 bits, u8 0, u32 block`` | float32 max|x| per block | codes, ``bits`` each
- qsgd:    ``u8 levels, u8 0, u32 block`` | float32 L2 norm per block | codes of
           ``ceil(log2(2 levels + 1))`` bits: signed level + levels
- sign:    ``u32 block`` | float32 mean|x| per block | one bit per coordinate (1 = negative)
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from fedcomp.codecs import quantize_compiled
from fedcomp.codecs.base import Codec, header_for, register
from fedcomp.codecs.blocks import (
    MAX_BLOCK,
    block_counts,
    block_reduce,
    check_block,
    check_finite_scales,
    check_range,
    chunk_blocks,
    chunks,
    dither_range,
    dithered_floor,
    expect_length,
    num_blocks,
    private_generator,
    read_scales,
    row_norms,
    scale_blocks_,
)
from fedcomp.codecs.packing import BitWriter, pack_bits, packed_size, unpack_bits
from fedcomp.codecs.wire import Payload, PayloadError

_BITS_BLOCK = struct.Struct("<BBI")
_BLOCK = struct.Struct("<I")


def _float_only(x: torch.Tensor, codec: str) -> None:
    if not x.is_floating_point():
        raise ValueError(f"{codec} codec needs a floating-point tensor, got {x.dtype}")


def _scales_bytes(scales: torch.Tensor) -> bytes:
    return scales.to(torch.float32).numpy().astype("<f4").tobytes()


def _read_bits_block(payload: Payload, codec: str, first: str, high: int) -> dict[str, int]:
    """The ``u8 first, u8 0, u32 block`` parameters of uniform/dither/qsgd, bounded."""
    body = memoryview(payload.body)
    if len(body) < _BITS_BLOCK.size:
        raise PayloadError(f"{codec}: body too short for its parameters")
    if not payload.header.dtype.is_floating_point:
        raise PayloadError(f"{codec}: payload declares a non-float dtype {payload.header.dtype}")
    value, _, block = _BITS_BLOCK.unpack_from(body, 0)
    return {
        first: check_range(codec, first, value, 1, high),
        "block": check_range(codec, "block", block, 1, MAX_BLOCK),
    }


#: _SIGNS[byte] = the eight signs of a packed byte, most significant bit first.
_SIGNS = 1 - 2 * np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).astype(np.float32)


def _finish(values: torch.Tensor, numel: int, shape: tuple[int, ...], dtype: torch.dtype):
    return values.reshape(-1)[:numel].reshape(shape).to(dtype)


@register
class UniformCodec(Codec):
    """Stochastic uniform quantization to ``2^bits`` levels on [-s, s], s = max|x| per block.

    Unbiased; per coordinate the error variance is at most (2s / (2^bits - 1))^2 / 4,
    so E||error||^2 <= block / (2^bits - 1)^2 * ||x||^2 (omega below).
    """

    codec_id = 4
    name = "uniform"
    unbiased = True

    def __init__(self, bits: int = 8, block: int = 256) -> None:
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
            raise ValueError(f"uniform: bits must be an integer in 1..8, got {bits!r}")
        self.bits = bits
        self.block = check_block(block)

    def spec(self) -> dict:
        return {"name": self.name, "bits": self.bits, "block": self.block}

    @classmethod
    def read_params(cls, payload: Payload) -> dict[str, int]:
        return _read_bits_block(payload, cls.name, "bits", 8)

    def expected_params(self, numel: int) -> dict[str, int]:
        return {"bits": self.bits, "block": self.block}

    def variance_factor(self, numel: int) -> float:
        return min(self.block, max(numel, 1)) / (2**self.bits - 1) ** 2

    def nominal_bits(self, numel: int) -> float:
        return self.bits + 32.0 / min(self.block, max(numel, 1))

    def encode(self, x: torch.Tensor, *, seed: int) -> Payload:
        _float_only(x, self.name)
        levels = 2**self.bits - 1
        flat = x.detach().reshape(-1).to(torch.float32).contiguous()
        # Compiled (fedcomp.codecs.quantize_compiled) for large tensors when Numba is
        # installed: the same block maxima and the same codes, bit for bit (tested).
        fast = quantize_compiled.available(flat.numel())
        if fast:
            scales = torch.from_numpy(quantize_compiled.block_amax(flat.numpy(), self.block))
        else:
            # max(-min, max) is -0.0 for a block of -0.0 (torch.maximum keeps the second
            # of two equal zeros): +0.0 on both paths, so that they send the same bytes
            scales = block_reduce(flat, self.block, "amax").abs_()
        check_finite_scales(scales, self.name)
        # t = (x + s) * levels / (2s) = x * inv + levels / 2 (zero blocks: t = levels / 2,
        # which decodes to 0 since s = 0).
        inv = torch.where(scales > 0, levels / (2 * scales), torch.zeros_like(scales))
        offset, top = dither_range(levels)
        half = torch.tensor(levels / 2 + offset)
        generator = private_generator(seed)
        if fast:
            packed = quantize_compiled.dither_pack(
                flat.numpy(), self.block, inv.numpy(), float(half), top, generator, self.bits
            )
        else:
            packed = self._dithered_codes(flat, inv, half, top, generator)
        body = _BITS_BLOCK.pack(self.bits, 0, self.block) + _scales_bytes(scales) + packed
        return Payload(header_for(self.codec_id, x, seed if self.needs_seed else 0), body)

    def _dithered_codes(
        self,
        flat: torch.Tensor,
        inv: torch.Tensor,
        half: torch.Tensor,
        top: float,
        generator: np.random.BitGenerator,
    ) -> bytes:
        """The packed codes ``floor(clamp(half + x inv, 0, top) + dither)`` (torch, in
        cache-sized chunks)."""
        levels = 2**self.bits - 1
        codes = torch.empty(flat.numel() + self.block, dtype=torch.uint8)
        buffer = torch.empty(chunk_blocks(self.block) * self.block, dtype=torch.float32)
        for first, chunk in chunks(flat, self.block):
            t = buffer[: chunk.numel()].view(chunk.shape)
            torch.addcmul(half, chunk, inv[first : first + chunk.shape[0], None], out=t)
            t.clamp_(0, top)
            begin = first * self.block
            dithered_floor(t, generator, levels, codes[begin : begin + chunk.numel()])
        return pack_bits(codes[: flat.numel()].numpy(), self.bits)

    @classmethod
    def _codes_and_scales(cls, payload: Payload) -> tuple[np.ndarray, torch.Tensor, int, int]:
        """Checked codes and scales of a uniform/dither body: (codes, scales, bits, block)."""
        params = cls.read_params(payload)
        bits, block = params["bits"], params["block"]
        body, n = memoryview(payload.body), payload.header.numel
        nb = num_blocks(n, block)
        expect_length(body, _BITS_BLOCK.size + 4 * nb + packed_size(n, bits), cls.name)
        scales = read_scales(body, _BITS_BLOCK.size, nb)
        return unpack_bits(body[_BITS_BLOCK.size + 4 * nb :], n, bits), scales, bits, block

    @classmethod
    def decode_payload(cls, payload: Payload) -> torch.Tensor:
        h = payload.header
        codes, scales, bits, block = cls._codes_and_scales(payload)
        levels = 2**bits - 1
        values = torch.from_numpy(codes).to(torch.float32)
        scale_blocks_(values, block, 2 * scales / levels, scales)
        return _finish(values, h.numel, h.shape, h.dtype)


@register
class DitheredUniformCodec(UniformCodec):
    """Uniform b-bit quantization with SUBTRACTIVE dither: the same codes as
    ``uniform``, but the dither is public (regenerated by the server from the seed in
    the header) and subtracted at decoding. The error is then uniform on one step,
    independent of x: variance step^2 / 12 instead of stochastic rounding's up to
    step^2 / 4 (the strongest fixed-codebook baseline of the one-bit comparison).
    """

    codec_id = 10
    name = "dither"
    needs_seed = True

    def variance_factor(self, numel: int) -> float:
        return min(self.block, max(numel, 1)) / (3 * (2**self.bits - 1) ** 2)

    @classmethod
    def decode_payload(cls, payload: Payload) -> torch.Tensor:
        h, n = payload.header, payload.header.numel
        codes, scales, bits, block = cls._codes_and_scales(payload)
        step = 2 * scales / (2**bits - 1)
        coarse = torch.from_numpy(codes).to(torch.float32)
        scale_blocks_(coarse, block, step, scales)
        # The encoder's dithers, in its order: k / 2^16 from the seeded generator.
        draws = np.asarray(private_generator(h.seed).random_raw((n + 3) // 4)).view(np.uint16)
        u = torch.from_numpy(draws[:n].astype(np.float32)) * 2.0**-16
        # code - u + 1/2 (minus the encoder's 2^-17 offset) is unbiased for t.
        correction = scale_blocks_(0.5 - 2.0**-17 - u, block, step)
        return _finish(coarse + correction, n, h.shape, h.dtype)


def _qsgd_width(levels: int) -> int:
    return max(1, math.ceil(math.log2(2 * levels + 1)))


@register
class QSGDCodec(Codec):
    """QSGD (Alistarh et al., 2017): |x_i| / ||x_block|| stochastically rounded to
    ``levels`` levels, plus the sign; one float32 norm per block. Unbiased, with
    omega = min(block / levels^2, sqrt(block) / levels).
    """

    codec_id = 5
    name = "qsgd"
    unbiased = True

    def __init__(self, levels: int = 16, block: int = 1024) -> None:
        if isinstance(levels, bool) or not isinstance(levels, int) or not 1 <= levels <= 127:
            raise ValueError(f"qsgd: levels must be an integer in 1..127, got {levels!r}")
        self.levels = levels
        self.block = check_block(block)

    def spec(self) -> dict:
        return {"name": self.name, "levels": self.levels, "block": self.block}

    @classmethod
    def read_params(cls, payload: Payload) -> dict[str, int]:
        return _read_bits_block(payload, cls.name, "levels", 127)

    def expected_params(self, numel: int) -> dict[str, int]:
        return {"levels": self.levels, "block": self.block}

    def variance_factor(self, numel: int) -> float:
        d = min(self.block, max(numel, 1))
        return min(d / self.levels**2, math.sqrt(d) / self.levels)

    def nominal_bits(self, numel: int) -> float:
        return _qsgd_width(self.levels) + 32.0 / min(self.block, max(numel, 1))

    def encode(self, x: torch.Tensor, *, seed: int) -> Payload:
        _float_only(x, self.name)
        flat = x.detach().reshape(-1).to(torch.float32).contiguous()
        n = flat.numel()
        generator = private_generator(seed)
        # The code is levels (1 + x / ||x||) in [0, 2 levels], stochastically rounded:
        # levels is an integer, so this is QSGD's sign and rounded level |x| levels / ||x||
        # shifted by levels, with the same distribution, in one pass with no sign work.
        offset, top = dither_range(2 * self.levels)
        shift = torch.tensor(self.levels + offset)
        if quantize_compiled.available(n):
            # the block norms as below (chunk by chunk, the same sums), then the codes
            # compiled: the same bytes (tested)
            norms = torch.cat([row_norms(chunk) for _, chunk in chunks(flat, self.block)])
            check_finite_scales(norms, self.name)
            inv = torch.where(norms > 0, self.levels / norms, torch.zeros_like(norms)).float()
            packed = quantize_compiled.dither_pack(
                flat.numpy(), self.block, inv.numpy(), float(shift), top, generator,
                _qsgd_width(self.levels),
            )  # fmt: skip
        else:
            norms, packed = self._norms_and_codes(flat, generator, shift, top)
        body = _BITS_BLOCK.pack(self.levels, 0, self.block) + _scales_bytes(norms) + packed
        return Payload(header_for(self.codec_id, x), body)

    def _norms_and_codes(
        self, flat: torch.Tensor, generator: np.random.BitGenerator, shift: torch.Tensor, top: float
    ) -> tuple[torch.Tensor, bytes]:
        """The block norms and packed codes (torch, chunk by chunk while in cache)."""
        n = flat.numel()
        norms = torch.empty(num_blocks(n, self.block), dtype=torch.float64)
        writer = BitWriter(_qsgd_width(self.levels))
        for first, chunk in chunks(flat, self.block):
            norm = row_norms(chunk)
            check_finite_scales(norm, self.name)
            norms[first : first + chunk.shape[0]] = norm
            inv = torch.where(norm > 0, self.levels / norm, torch.zeros_like(norm)).float()
            # x inv + shift as one fused multiply-add (as the compiled path computes it)
            t = torch.addcmul(shift, chunk, inv[:, None]).clamp_(0, top)
            codes = torch.empty(chunk.numel(), dtype=torch.uint8)
            dithered_floor(t, generator, 2 * self.levels, codes)
            writer.add(codes[: n - first * self.block].numpy())  # not the padding
        return norms, writer.finish()

    @classmethod
    def decode_payload(cls, payload: Payload) -> torch.Tensor:
        h, body = payload.header, memoryview(payload.body)
        params = cls.read_params(payload)
        levels, block = params["levels"], params["block"]
        n, nb, width = h.numel, num_blocks(h.numel, block), _qsgd_width(levels)
        expect_length(body, _BITS_BLOCK.size + 4 * nb + packed_size(n, width), "qsgd")
        norms = read_scales(body, _BITS_BLOCK.size, nb)
        codes = unpack_bits(body[_BITS_BLOCK.size + 4 * nb :], n, width)
        if n and int(codes.max()) > 2 * levels:
            raise PayloadError("qsgd: code beyond the level range")
        values = torch.from_numpy(codes.astype(np.float32)) - levels
        scale_blocks_(values, block, norms / levels)
        return _finish(values, n, h.shape, h.dtype)


@register
class SignCodec(Codec):
    """Scaled signSGD: one bit per coordinate and the mean |x| of each block.

    Biased (it is a deterministic 1-bit code); pair it with error feedback (``ef``).
    """

    codec_id = 6
    name = "sign"
    unbiased = False
    # per block, ||x - m sign(x)||^2 = ||x||^2 - b m^2 with m the block's mean |x|
    contractive = True

    def __init__(self, block: int = 1024) -> None:
        self.block = check_block(block)

    def spec(self) -> dict:
        return {"name": self.name, "block": self.block}

    @classmethod
    def read_params(cls, payload: Payload) -> dict[str, int]:
        body = memoryview(payload.body)
        if len(body) < _BLOCK.size:
            raise PayloadError("sign: body too short for its parameters")
        if not payload.header.dtype.is_floating_point:
            raise PayloadError(f"sign: payload declares a non-float dtype {payload.header.dtype}")
        (block,) = _BLOCK.unpack_from(body, 0)
        return {"block": check_range(cls.name, "block", block, 1, MAX_BLOCK)}

    def expected_params(self, numel: int) -> dict[str, int]:
        return {"block": self.block}

    def nominal_bits(self, numel: int) -> float:
        return 1.0 + 32.0 / min(self.block, max(numel, 1))

    def encode(self, x: torch.Tensor, *, seed: int = 0) -> Payload:
        _float_only(x, self.name)
        flat = x.detach().reshape(-1).to(torch.float32)
        scales = block_reduce(flat, self.block, "abssum") / block_counts(x.numel(), self.block)
        check_finite_scales(scales, self.name)
        negative = torch.signbit(flat).numpy()
        body = _BLOCK.pack(self.block) + _scales_bytes(scales) + np.packbits(negative).tobytes()
        return Payload(header_for(self.codec_id, x), body)

    @classmethod
    def decode_payload(cls, payload: Payload) -> torch.Tensor:
        h, body = payload.header, memoryview(payload.body)
        block = cls.read_params(payload)["block"]
        n, nb = h.numel, num_blocks(h.numel, block)
        expect_length(body, _BLOCK.size + 4 * nb + packed_size(n, 1), "sign")
        scales = read_scales(body, _BLOCK.size, nb)
        packed = body[_BLOCK.size + 4 * nb :]
        expect_length(packed, packed_size(n, 1), "sign")
        # One table lookup per byte gives its eight signs as float32 (+1 for bit 0,
        # -1 for bit 1): a single pass where unpacking, casting and 1 - 2b take three.
        raw = np.frombuffer(packed, dtype=np.uint8)
        signs = torch.from_numpy(np.take(_SIGNS, raw, axis=0).reshape(-1)[:n])
        scale_blocks_(signs, block, scales)
        return _finish(signs, n, h.shape, h.dtype)
