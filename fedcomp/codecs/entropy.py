"""A lossless stage behind any stateless codec: ``codec.entropy=zstd``.

``make_codec("uniform", bits=2, entropy="zstd")`` compresses the uniform codec's whole
payload with Zstandard (the maintained ``zstandard`` binding, extra ``fedcomp[entropy]``)
and the receiver decompresses it before decoding. It pays where the inner payload has
redundancy (skewed codes, float scales, top-k index gaps); dithered or stochastically
rounded codes are close to uniformly random bits and gain about nothing (measured per
codec by ``python -m experiments.bench_entropy``).

Body layout (little-endian), after the common header (shape and dtype of the tensor,
the inner payload's seed)::

    u8 method (1: zstd), u8 level, u16 0, u32 decompressed size
    one zstd frame holding the inner codec's complete payload

Decompression bombs: the decompressed size is declared up front and bounded by what
any codec can produce for the tensor the header claims (:func:`max_inner_size`); the
frame's own content size must agree, and decompression never writes beyond it.
"""

from __future__ import annotations

import struct
from typing import Any

import torch

from fedcomp.codecs.base import Codec, codec_class_by_id, decode_inner, header_for, register
from fedcomp.codecs.blocks import check_range
from fedcomp.codecs.wire import Payload, PayloadError, check_field, parse_payload
from fedcomp.codecs.zstdframes import compress, inflate, zstd

_PARAMS = struct.Struct("<BBHI")
METHODS = {"zstd": 1}
DEFAULT_LEVEL = 3
MAX_LEVEL = 19


def max_inner_size(numel: int, ndim: int) -> int:
    """An upper bound on any codec's payload for ``numel`` elements: 8 bytes per value
    (float64 raw), 10 per sparse index varint, the header and parameter slack."""
    return 18 * numel + 16 + 4 * ndim + 4096


@register
class EntropyCodec(Codec):
    """A lossless stage (zstd) around a stateless codec (see the module)."""

    codec_id = 13
    name = "entropy"
    unbiased = False  # set from the inner codec

    def __init__(self, inner: Codec, *, method: str = "zstd", level: int = DEFAULT_LEVEL) -> None:
        if not isinstance(inner, Codec) or isinstance(inner, EntropyCodec):
            raise ValueError(f"entropy: the inner codec must be a stateless codec, got {inner!r}")
        if method not in METHODS:
            raise ValueError(f"entropy must be one of {', '.join(METHODS)}, got {method!r}")
        if isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= MAX_LEVEL:
            raise ValueError(f"entropy_level must be an integer in 1..{MAX_LEVEL}, got {level!r}")
        zstd("codec entropy=zstd")  # a missing package is a settings error, not a failed round
        self.inner, self.method, self.level = inner, method, level
        self.unbiased = inner.unbiased
        self.contractive = inner.contractive
        self.needs_seed = inner.needs_seed

    def spec(self) -> dict[str, Any]:
        level = {} if self.level == DEFAULT_LEVEL else {"entropy_level": self.level}
        return {**self.inner.spec(), "entropy": self.method, **level}

    @classmethod
    def _inner_payload(cls, payload: Payload) -> tuple[dict[str, int], Payload]:
        """Decompress (bounded) and parse the inner payload, checked against the header."""
        h = payload.header
        body = memoryview(payload.body)
        if len(body) < _PARAMS.size:
            raise PayloadError(f"{cls.name}: body too short for its parameters")
        method, level, zero, size = _PARAMS.unpack_from(body, 0)
        check_range(cls.name, "method", method, 1, max(METHODS.values()))
        check_range(cls.name, "reserved", zero, 0, 0)
        check_range(cls.name, "decompressed size", size, 1, max_inner_size(h.numel, len(h.shape)))
        inner_bytes = inflate(
            bytes(body[_PARAMS.size :]),
            limit=max_inner_size(h.numel, len(h.shape)),
            what=cls.name,
            expected=size,
        )
        inner = parse_payload(inner_bytes, max_numel=h.numel)
        ih = inner.header
        if ih.shape != h.shape or ih.dtype != h.dtype or ih.seed != h.seed:
            raise PayloadError(f"{cls.name}: the inner payload's header differs from the outer one")
        inner_cls = codec_class_by_id(ih.codec_id)
        if inner_cls is None or inner_cls is EntropyCodec:
            raise PayloadError(f"{cls.name}: inner codec id {ih.codec_id} not allowed")
        return {"method": method, "level": level}, inner

    @classmethod
    def read_params(cls, payload: Payload) -> dict[str, int]:
        params, inner = cls._inner_payload(payload)
        return {"method": params["method"], "inner codec id": inner.header.codec_id}

    def expected_params(self, numel: int) -> dict[str, int]:
        return {"method": METHODS[self.method], "inner codec id": self.inner.codec_id}

    def check_payload(self, payload: Payload) -> None:
        """The stage's parameters, then the inner payload against the inner codec."""
        check_field(self.name, "codec id", payload.header.codec_id, self.codec_id)
        params, inner = self._inner_payload(payload)
        check_field(self.name, "method", params["method"], METHODS[self.method])
        self.inner.check_payload(inner)

    def variance_factor(self, numel: int) -> float | None:
        return self.inner.variance_factor(numel)

    def nominal_bits(self, numel: int) -> float:
        return self.inner.nominal_bits(numel)  # an upper bound: zstd only removes bytes

    def encode(self, x: torch.Tensor, *, seed: int) -> Payload:
        inner = self.inner.encode(x, seed=seed)
        raw = bytes(inner)
        frame = compress(raw, self.level)
        params = _PARAMS.pack(METHODS[self.method], self.level, 0, len(raw))
        return Payload(header_for(self.codec_id, x, inner.header.seed), params + frame)

    @classmethod
    def decode_payload(cls, payload: Payload) -> torch.Tensor:
        _, inner = cls._inner_payload(payload)
        return decode_inner(inner, cls.name)


def work_size(payload: bytes) -> int:
    """The bytes a decoder reads for this payload: the declared decompressed size of a
    lossless-stage payload (zstd can expand a few bytes into a model's worth), else
    its length. A payload too short to declare one counts as its length (it is
    refused when it is checked)."""
    try:
        parsed = parse_payload(payload)
    except PayloadError:
        return len(payload)
    if parsed.header.codec_id != EntropyCodec.codec_id or len(parsed.body) < _PARAMS.size:
        return len(payload)
    return max(len(payload), _PARAMS.unpack_from(memoryview(parsed.body), 0)[3])
