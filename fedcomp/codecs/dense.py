"""Dense codecs: ``raw`` (the tensor's own bytes) and ``fp32`` (the identity baseline)."""

from __future__ import annotations

import numpy as np
import torch

from fedcomp.codecs.base import Codec, header_for, register
from fedcomp.codecs.blocks import all_finite
from fedcomp.codecs.wire import Payload, PayloadError


def tensor_to_bytes(x: torch.Tensor) -> bytes:
    """The little-endian bytes of a tensor's elements in its own dtype."""
    flat = x.detach().reshape(-1).contiguous().cpu()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8).numpy().tobytes()


def bytes_to_tensor(
    body: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """Inverse of :func:`tensor_to_bytes`; checks the size before building anything."""
    storage_dtype = torch.uint8 if dtype == torch.bool else dtype
    itemsize = torch.empty((), dtype=storage_dtype).element_size()
    numel = 1
    for d in shape:
        numel *= d
    if len(body) != numel * itemsize:
        raise PayloadError(
            f"body has {len(body)} bytes, shape {tuple(shape)} of {dtype} needs {numel * itemsize}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    raw = np.frombuffer(body, dtype=np.uint8).copy()  # the one copy: out of the message
    out = torch.from_numpy(raw).view(storage_dtype).reshape(shape)
    return out.to(torch.bool) if dtype == torch.bool else out


@register
class RawCodec(Codec):
    """Exact bytes in the tensor's own dtype: integer buffers and small tensors."""

    codec_id = 0
    name = "raw"
    contractive = True
    unbiased = True

    def encode(self, x: torch.Tensor, *, seed: int = 0) -> Payload:
        return Payload(header_for(self.codec_id, x), tensor_to_bytes(x))

    def nominal_bits(self, numel: int) -> float:
        return 32.0

    @classmethod
    def decode_payload(cls, payload: Payload) -> torch.Tensor:
        h = payload.header
        return bytes_to_tensor(payload.body, h.dtype, h.shape)


@register
class Fp32Codec(Codec):
    """The identity baseline: float32 values (exact for fp32, fp16 and bf16 inputs)."""

    codec_id = 1
    name = "fp32"
    contractive = True
    unbiased = True

    def encode(self, x: torch.Tensor, *, seed: int = 0) -> Payload:
        if not x.is_floating_point():
            raise ValueError(f"fp32 codec needs a floating-point tensor, got {x.dtype}")
        return Payload(header_for(self.codec_id, x), tensor_to_bytes(x.to(torch.float32)))

    def nominal_bits(self, numel: int) -> float:
        return 32.0

    @classmethod
    def decode_payload(cls, payload: Payload) -> torch.Tensor:
        h = payload.header
        if not h.dtype.is_floating_point:
            raise PayloadError(f"fp32 payload declares a non-float dtype {h.dtype}")
        return bytes_to_tensor(payload.body, torch.float32, h.shape).to(h.dtype)


class _CastCodec(Codec):
    """Round to a 16-bit float format (round to nearest even: deterministic, biased)."""

    unbiased = False
    wire_dtype: torch.dtype

    def encode(self, x: torch.Tensor, *, seed: int = 0) -> Payload:
        if not x.is_floating_point():
            raise ValueError(f"{self.name} codec needs a floating-point tensor, got {x.dtype}")
        cast = x.detach().to(self.wire_dtype)
        # the input is only scanned when the cast is not finite (the rare case)
        if not all_finite(cast) and all_finite(x):
            limit = torch.finfo(self.wire_dtype).max
            raise ValueError(f"{self.name}: values beyond +-{limit:g} overflow the format")
        return Payload(header_for(self.codec_id, x), tensor_to_bytes(cast))

    @classmethod
    def decode_payload(cls, payload: Payload) -> torch.Tensor:
        h = payload.header
        if not h.dtype.is_floating_point:
            raise PayloadError(f"{cls.name} payload declares a non-float dtype {h.dtype}")
        return bytes_to_tensor(payload.body, cls.wire_dtype, h.shape).to(h.dtype)

    def nominal_bits(self, numel: int) -> float:
        return 16.0


@register
class Fp16Codec(_CastCodec):
    """IEEE half precision (overflow beyond 65504 is an encode error, not an inf)."""

    codec_id = 2
    name = "fp16"
    wire_dtype = torch.float16


@register
class Bf16Codec(_CastCodec):
    """bfloat16: float32's range, 8 bits of mantissa."""

    codec_id = 3
    name = "bf16"
    wire_dtype = torch.bfloat16
    # float32's range: no finite value rounds to zero or overflows (fp16's underflow
    # sends a tensor of tiny values to 0, an error as large as the tensor: not claimed)
    contractive = True
