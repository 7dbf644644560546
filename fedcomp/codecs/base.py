"""The stateless codec shape, the codec registry, and context-free decoding."""

from __future__ import annotations

import contextvars
import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from fedcomp.codecs.wire import (
    DEFAULT_MAX_NUMEL,
    Payload,
    PayloadError,
    PayloadHeader,
    check_field,
    compact_bytes,
    compact_parts,
    parse_payload,
)


class Codec(ABC):
    """A stateless per-client codec: ``encode(x, seed=...) -> Payload`` and back.

    Subclasses are thin classes around pure functions; their parameters are
    validated at construction. Everything :meth:`decode` needs travels in the
    payload, so decoding is a class-level operation (:meth:`decode_payload`).
    """

    #: Wire id (one byte). Part of the format: never reuse a retired id.
    codec_id: ClassVar[int]
    #: Registry name, as used by ``make_codec`` and Hydra's ``codec.name``.
    name: ClassVar[str]
    #: The protocol family (fedcomp.flower.families): stateless codecs encode each
    #: update alone and the server decodes each reply alone.
    family: ClassVar[str] = "stateless"
    #: True when E[decode(encode(x))] = x (a claim backed by a test).
    unbiased: ClassVar[bool]
    #: True when E||decode(encode(x)) - x||^2 < ||x||^2 for every finite x != 0 (a
    #: contraction, what EF21 needs at step 1; a claim backed by a test).
    contractive: ClassVar[bool] = False
    #: True when decode regenerates public draws from the seed in the header; the
    #: server then checks that seed against the one it derives itself.
    needs_seed: ClassVar[bool] = False

    @abstractmethod
    def encode(self, x: torch.Tensor, *, seed: int) -> Payload:
        """Encode one tensor; ``seed`` is the derived public seed for this tensor."""

    @classmethod
    @abstractmethod
    def decode_payload(cls, payload: Payload) -> torch.Tensor:
        """Decode a payload of this codec (header already parsed)."""

    def decode(self, payload: Payload) -> torch.Tensor:
        """Decode a payload produced by :meth:`encode`."""
        return type(self).decode_payload(payload)

    @classmethod
    def read_params(cls, payload: Payload) -> dict[str, int]:
        """The parameters the payload's body declares (bits, block, levels, k, ...),
        each checked against this codec's hard bounds before anything is allocated.

        Decoders call it first; their work and memory are then bounded by a small
        multiple of the claimed tensor size, whatever the parameters say.

        Raises
        ------
        PayloadError
            Naming the field and its bound.
        """
        return {}

    def expected_params(self, numel: int) -> dict[str, int]:
        """The body parameters this codec writes for a tensor of ``numel`` elements."""
        return {}

    def check_payload(self, payload: Payload) -> None:
        """Check a received payload against THIS codec (the spec the server sent):
        the codec id and every body parameter, before decoding.

        Raises
        ------
        SpecMismatch
            Naming the field, the value and the value the server asked for.
        PayloadError
            When a parameter is beyond its hard bound.
        """
        check_field(self.name, "codec id", payload.header.codec_id, self.codec_id)
        got = type(self).read_params(payload)
        for key, want in self.expected_params(payload.header.numel).items():
            check_field(self.name, key, got[key], want)

    def spec(self) -> dict[str, Any]:
        """The spec that rebuilds this codec with ``make_codec(**spec)``."""
        return {"name": self.name}

    def variance_factor(self, numel: int) -> float | None:
        """omega with E||decode(encode(x)) - x||^2 <= omega ||x||^2 (unbiased codecs),
        or None when the codec gives no such bound."""
        return 0.0 if self.unbiased else None

    def nominal_bits(self, numel: int) -> float:
        """Bits per coordinate this codec should produce (scales included, header not)."""
        raise NotImplementedError

    def nominal_bytes(self, shape: tuple[int, ...]) -> float:
        """Body bytes this codec should produce for a tensor of ``shape`` (its scales
        and padding included, the header and the few bytes of parameters not): what
        the tensor policy weighs against the raw bytes. Codecs whose size depends on
        more than the element count (low rank) override it."""
        numel = math.prod(shape)
        return self.nominal_bits(numel) * numel / 8


_BY_ID: dict[int, type[Codec]] = {}
_BY_NAME: dict[str, type[Codec]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator adding a codec to the registry (ids and names are unique)."""
    if cls.codec_id in _BY_ID or cls.name in _BY_NAME:
        raise RuntimeError(f"codec {cls.name!r} / id {cls.codec_id} registered twice")
    _BY_ID[cls.codec_id] = cls
    _BY_NAME[cls.name] = cls
    return cls


def codec_names() -> list[str]:
    """Names accepted by ``make_codec``."""
    return sorted(_BY_NAME)


def codec_class_by_id(codec_id: int) -> type[Codec] | None:
    """The codec class behind a wire id, or None."""
    return _BY_ID.get(codec_id)


def codec_class(name: str) -> type[Codec]:
    """Look up a codec class by name, with an error listing the known ones."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(
            f"unknown codec {name!r}; known codecs: {', '.join(codec_names())}"
        ) from None


#: Wire id of the joint one-bit code (fedcomp.onebit), reserved in this id space.
JOINT_ONEBIT_ID = 9


def decode_bytes(
    buf: bytes | bytearray | memoryview, max_numel: int = DEFAULT_MAX_NUMEL
) -> torch.Tensor:
    """Decode a complete payload buffer with no other context.

    ``max_numel`` bounds the tensor the payload may claim (checked before anything is
    allocated); the server passes the size of the matching global tensor.

    Raises
    ------
    PayloadError
        When the buffer is malformed, truncated, oversized, claims too many elements,
        names an unknown codec or nests stages more than ``MAX_NESTING`` levels deep.
    """
    payload = parse_payload(buf, max_numel)
    cls = _BY_ID.get(payload.header.codec_id)
    if cls is None:
        if payload.header.codec_id == JOINT_ONEBIT_ID:
            raise PayloadError(
                "a onebit payload has no per-client decoder: decode all replies together"
                " with fedcomp.onebit.OneBitCode.decode_mean"
            )
        raise PayloadError(f"unknown codec id {payload.header.codec_id}")
    return cls.decode_payload(payload)


#: Deepest nesting of payloads a decoder follows: the outer payload is level 1, and
#: ``make_codec`` builds at most three levels (``entropy`` around ``rotate`` around a
#: quantizer). Stages check only their direct inner codec, so without this bound a
#: hand-made payload could alternate them (rotate in entropy in rotate ...) until
#: Python's recursion limit, each level decoding the whole tensor again.
MAX_NESTING = 3
#: How many stages enclose the payload being decoded (0: a top-level payload).
_ENCLOSING: contextvars.ContextVar[int] = contextvars.ContextVar("fedcomp_enclosing", default=0)


def inner_seed(seed: int) -> int:
    """A stage's inner codec's seed, derived from the stage's own (a different stream)."""
    return (seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) % (1 << 63)


def pack_inner(inner: Payload) -> bytes:
    """A stage's inner payload as its body carries it (payload format 2): a compact
    entry (wire.compact_bytes). Its header is what the reader knows: a float32 vector
    of the length the stage implies, seeded :func:`inner_seed` of the stage's seed."""
    return compact_bytes(inner)


def parse_inner_vector(outer: type[Codec], body: memoryview | bytes, n: int, seed: int) -> Payload:
    """The inner payload of a stage that codes a float32 vector of ``n`` values
    (``rotate``: the padded vector; ``subsample``: the kept values), from its
    :func:`pack_inner` entry: the header rebuilt (shape (n,), float32, the seed
    :func:`inner_seed` of the stage's ``seed`` when flagged), a known codec, not the stage.

    Raises
    ------
    PayloadError
        An empty entry, an unknown codec id, or the stage nested in itself.
    """
    try:
        codec_id, seeded, inner_body = compact_parts(body)
    except PayloadError as exc:
        raise PayloadError(f"{outer.name}: the inner payload: {exc}") from None
    header = PayloadHeader(codec_id, torch.float32, (n,), inner_seed(seed) if seeded else 0)
    inner = Payload(header, inner_body)
    inner_cls = _BY_ID.get(inner.header.codec_id)
    if inner_cls is None or inner_cls is outer:
        raise PayloadError(f"{outer.name}: inner codec id {inner.header.codec_id} not allowed")
    return inner


def decode_inner(payload: Payload, what: str) -> torch.Tensor:
    """Decode the inner payload of a stage (``rotate``, ``entropy``), counting levels.

    Raises
    ------
    PayloadError
        When the inner payload would be level ``MAX_NESTING + 1`` or deeper, or names an
        unknown codec.
    """
    level = _ENCLOSING.get() + 2  # the stage calling this is level _ENCLOSING + 1
    if level > MAX_NESTING:
        raise PayloadError(
            f"{what}: payload nested {level} levels deep, at most {MAX_NESTING} allowed"
        )
    cls = _BY_ID.get(payload.header.codec_id)
    if cls is None:
        raise PayloadError(f"{what}: unknown inner codec id {payload.header.codec_id}")
    token = _ENCLOSING.set(level - 1)
    try:
        return cls.decode_payload(payload)
    finally:
        _ENCLOSING.reset(token)


def header_for(codec_id: int, x: torch.Tensor, seed: int = 0) -> PayloadHeader:
    """The payload header describing tensor ``x``."""
    return PayloadHeader(codec_id=codec_id, dtype=x.dtype, shape=tuple(x.shape), seed=seed)
