"""``rotate``: a randomized Hadamard rotation in front of any stateless quantizer.

``make_codec("rotate", inner="uniform", bits=2)`` sends ``Q(R x)`` and decodes
``R^T decode(Q(R x))`` (fedcomp.codecs.rotation). ``R`` is orthogonal, so the inner
codec's unbiasedness and its variance factor (on the padded length) carry over, while
its error now depends on the rotated vector, whose coordinates are close to Gaussian:
block scales set by max|x| (uniform) or ||x|| (QSGD) stop being dominated by a few
large coordinates of a heavy-tailed update.

Body layout (little-endian), after the common header (its seed is the rotation's
public seed, checked by the server)::

    u8 rotations, u8 0, u16 0, u32 rotation block
    the inner codec's payload for the padded float32 vector, as
    fedcomp.codecs.base.pack_inner writes it (one byte: inner codec id and seed flag,
    then its body; payload format 1 carried the inner header in full)
"""

from __future__ import annotations

import struct
from typing import Any

import torch

from fedcomp.codecs.base import (
    Codec,
    decode_inner,
    header_for,
    inner_seed,
    pack_inner,
    parse_inner_vector,
    register,
)
from fedcomp.codecs.blocks import check_range
from fedcomp.codecs.rotation import (
    MAX_BLOCK,
    MIN_BLOCK,
    check_rotation_block,
    padded_length,
    rotate,
    unrotate,
)
from fedcomp.codecs.wire import Payload, PayloadError, check_field

_PARAMS = struct.Struct("<BBHI")


@register
class RotatedCodec(Codec):
    """A rotation stage composed in front of a stateless codec (see the module).

    Parameters
    ----------
    inner : Codec
        A stateless codec (not a memory, not a joint code, not another rotation).
    rotations : 1 or 2
    rotation_block : int, power of two in [256, 2^20] (default 1024)
    """

    codec_id = 12
    name = "rotate"
    unbiased = False  # set from the inner codec
    needs_seed = True

    def __init__(self, inner: Codec, *, rotations: int = 1, rotation_block: int = 1024) -> None:
        if not isinstance(inner, Codec) or isinstance(inner, RotatedCodec):
            raise ValueError(f"rotate: inner must be a stateless codec, got {inner!r}")
        if isinstance(rotations, bool) or rotations not in (1, 2):
            raise ValueError(f"rotate: rotations must be 1 or 2, got {rotations!r}")
        self.inner = inner
        self.rotations = rotations
        self.rotation_block = check_rotation_block(rotation_block)
        self.unbiased = inner.unbiased

    def spec(self) -> dict[str, Any]:
        inner = self.inner.spec()
        return {
            "name": self.name,
            "inner": inner.pop("name"),
            "rotations": self.rotations,
            "rotation_block": self.rotation_block,
            **inner,
        }

    @classmethod
    def _split(cls, payload: Payload) -> tuple[dict[str, int], Payload]:
        """The rotation parameters and the inner payload, checked against the header."""
        body = memoryview(payload.body)
        if len(body) < _PARAMS.size:
            raise PayloadError(f"{cls.name}: body too short for its parameters")
        if not payload.header.dtype.is_floating_point:
            raise PayloadError(f"{cls.name}: payload declares a non-float dtype")
        rotations, zero, zero2, block = _PARAMS.unpack_from(body, 0)
        check_range(cls.name, "reserved", zero + zero2, 0, 0)
        block = check_range(cls.name, "rotation_block", block, MIN_BLOCK, MAX_BLOCK)
        if block & (block - 1):
            raise PayloadError(f"{cls.name}: rotation_block {block} is not a power of two")
        params = {
            "rotations": check_range(cls.name, "rotations", rotations, 1, 2),
            "rotation_block": block,
        }
        padded = padded_length(payload.header.numel, block)
        return params, parse_inner_vector(
            cls, body[_PARAMS.size :], padded, payload.header.seed
        )

    @classmethod
    def read_params(cls, payload: Payload) -> dict[str, int]:
        params, inner = cls._split(payload)
        return {**params, "inner codec id": inner.header.codec_id}

    def expected_params(self, numel: int) -> dict[str, int]:
        return {
            "rotations": self.rotations,
            "rotation_block": self.rotation_block,
            "inner codec id": self.inner.codec_id,
        }

    def check_payload(self, payload: Payload) -> None:
        """The rotation's parameters, then the inner payload against the inner codec
        (its parameters and its seed)."""
        super().check_payload(payload)
        _, inner = self._split(payload)
        self.inner.check_payload(inner)
        want = inner_seed(payload.header.seed) if self.inner.needs_seed else 0
        check_field(f"{self.name} inner {self.inner.name}", "seed", inner.header.seed, want)

    def variance_factor(self, numel: int) -> float | None:
        if not self.unbiased:
            return None
        return self.inner.variance_factor(padded_length(max(numel, 1), self.rotation_block))

    def nominal_bits(self, numel: int) -> float:
        padded = padded_length(max(numel, 1), self.rotation_block)
        return self.inner.nominal_bits(padded) * padded / max(numel, 1)

    def encode(self, x: torch.Tensor, *, seed: int) -> Payload:
        if not x.is_floating_point():
            raise ValueError(f"{self.name} codec needs a floating-point tensor, got {x.dtype}")
        # refuses NaN/Inf (checked on the rotated vector: no pass over x of its own)
        y = rotate(x, seed=seed, block=self.rotation_block, rotations=self.rotations)
        inner = self.inner.encode(y, seed=inner_seed(seed))
        params = _PARAMS.pack(self.rotations, 0, 0, self.rotation_block)
        return Payload(header_for(self.codec_id, x, seed), params + pack_inner(inner))

    @classmethod
    def decode_payload(cls, payload: Payload) -> torch.Tensor:
        h = payload.header
        params, inner = cls._split(payload)
        y = decode_inner(inner, cls.name)
        x = unrotate(
            y,
            numel=h.numel,
            seed=h.seed,
            block=params["rotation_block"],
            rotations=params["rotations"],
        )
        return x.reshape(h.shape).to(h.dtype)
