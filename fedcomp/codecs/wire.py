"""The payload wire format: a fixed little-endian header, then the codec's body.

Layout (all little-endian)::

    offset  size  field
    0       2     magic b"FC"
    2       1     format version (WIRE_VERSION)
    3       1     codec id
    4       1     dtype code of the original tensor
    5       1     ndim (<= MAX_NDIM)
    6       2     reserved, zero
    8       8     derived seed (0 when the codec draws nothing the server regenerates)
    16      4*nd  shape, one uint32 per dimension
    ...           body (codec specific; starts with the codec's own parameters)

Everything decode needs is here, so :func:`decode_bytes` works with no context.
Parsing checks sizes before anything is allocated from them.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from fedcomp.failures import Failure, Rejection

MAGIC = b"FC"
#: Largest tensor a payload may claim unless the caller says otherwise (2^28 elements,
#: 1 GiB in float32). Sparse codecs decode a few bytes into a dense tensor of the claimed
#: shape, so an untrusted shape must be bounded BEFORE decoding allocates it; the server
#: passes the global model's exact size instead.
DEFAULT_MAX_NUMEL = 1 << 28
#: 2: stages (rotate, subsample) carry their inner payload without its header
#: (fedcomp.codecs.base.pack_inner); 1: with it.
WIRE_VERSION = 2
MAX_NDIM = 8
_FIXED = struct.Struct("<2sBBBBHQ")
HEADER_FIXED_BYTES = _FIXED.size

#: dtype <-> one-byte code. Codes are part of the wire format: never renumber.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float64: 3,
    torch.int64: 4,
    torch.int32: 5,
    torch.int16: 6,
    torch.int8: 7,
    torch.uint8: 8,
    torch.bool: 9,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class PayloadError(Rejection):
    """A buffer that is not a valid fedcomp payload (truncated, malformed, unknown)."""

    default_kind = Failure.MALFORMED


class SpecMismatch(PayloadError):
    """A well-formed payload whose codec or parameters are not the ones the server asked
    for (the server compares every body parameter with the spec it sent that client)."""

    default_kind = Failure.SPEC_MISMATCH


def check_field(what: str, field: str, got: object, want: object) -> None:
    """Raise :class:`SpecMismatch` naming the field, the value and the expected value."""
    if got != want:
        raise SpecMismatch(
            f"{what}: {field} is {got!r}, the server asked for {want!r}",
            field=field,
            value=got,
            expected=want,
        )


@dataclass(frozen=True)
class PayloadHeader:
    """The decoded fixed header of a payload."""

    codec_id: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    seed: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def pack(self) -> bytes:
        if len(self.shape) > MAX_NDIM:
            raise ValueError(f"tensors of more than {MAX_NDIM} dimensions are not supported")
        if any(not 0 <= d < 2**32 for d in self.shape):
            raise ValueError(f"shape {self.shape} does not fit the wire format")
        fixed = _FIXED.pack(
            MAGIC,
            WIRE_VERSION,
            self.codec_id,
            DTYPE_CODES[self.dtype],
            len(self.shape),
            0,
            self.seed,
        )
        return fixed + struct.pack(f"<{len(self.shape)}I", *self.shape)


@dataclass(frozen=True)
class Payload:
    """A packed, self-describing encoding of one tensor: header + body bytes."""

    header: PayloadHeader
    #: The body; a zero-copy memoryview into the received buffer after parsing.
    body: bytes | memoryview

    def __bytes__(self) -> bytes:
        return self.header.pack() + bytes(self.body)

    def __len__(self) -> int:
        return HEADER_FIXED_BYTES + 4 * len(self.header.shape) + len(self.body)


#: The flag bit of a compact entry's first byte (:func:`compact_bytes`): the payload
#: carries a public seed, the one its reader derives.
SEEDED = 0x80
#: The largest codec id a compact entry can name (ids are one byte below the flag).
MAX_CODEC_ID = SEEDED - 1


def compact_bytes(payload: Payload) -> bytes:
    """A payload less the header its reader knows: one byte (its codec id, and
    :data:`SEEDED` when it carries a seed), then its body. A message's payloads
    (fedcomp.compact) and a stage's inner payload (fedcomp.codecs.base.pack_inner)
    travel so; :func:`compact_parts` is the other half.

    Raises
    ------
    ValueError
        A codec id above :data:`MAX_CODEC_ID`.
    """
    h = payload.header
    if h.codec_id > MAX_CODEC_ID:
        raise ValueError(f"codec id {h.codec_id} does not fit a compact entry (max {MAX_CODEC_ID})")
    return bytes([h.codec_id | (SEEDED if h.seed else 0)]) + bytes(payload.body)


def compact_parts(entry: bytes | memoryview) -> tuple[int, bool, memoryview]:
    """A compact entry's codec id, whether it carries a seed, and its body (a view).

    Raises
    ------
    PayloadError
        An empty entry (its codec id is missing).
    """
    view = memoryview(entry)
    if len(view) == 0:
        raise PayloadError("an empty compact entry (its codec id is missing)")
    return view[0] & MAX_CODEC_ID, bool(view[0] & SEEDED), view[1:]


def parse_payload(
    buf: bytes | bytearray | memoryview, max_numel: int = DEFAULT_MAX_NUMEL
) -> Payload:
    """Split a buffer into header and body, validating the fixed fields.

    Raises
    ------
    PayloadError
        On a short buffer, a wrong magic, an unsupported format version, an unknown
        dtype code, too many dimensions, or more than ``max_numel`` claimed elements.
    """
    view = memoryview(buf).cast("B")
    if len(view) < HEADER_FIXED_BYTES:
        raise PayloadError(
            f"truncated payload: {len(view)} bytes, header needs {HEADER_FIXED_BYTES}"
        )
    magic, version, codec_id, dtype_code, ndim, reserved, seed = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise PayloadError(f"not a fedcomp payload (magic {bytes(magic)!r})")
    if version != WIRE_VERSION:
        raise PayloadError(f"unsupported payload format version {version} (this is {WIRE_VERSION})")
    if dtype_code not in CODE_DTYPES:
        raise PayloadError(f"unknown dtype code {dtype_code}")
    if ndim > MAX_NDIM:
        raise PayloadError(f"payload claims {ndim} dimensions (max {MAX_NDIM})")
    if reserved != 0:
        raise PayloadError("reserved header field is not zero")
    end = HEADER_FIXED_BYTES + 4 * ndim
    if len(view) < end:
        raise PayloadError(f"truncated payload: shape needs {end} bytes, got {len(view)}")
    shape = struct.unpack_from(f"<{ndim}I", view, HEADER_FIXED_BYTES)
    numel = math.prod(shape)
    if numel > max_numel:
        raise PayloadError(f"payload claims {numel} elements, above the limit of {max_numel}")
    header = PayloadHeader(codec_id=codec_id, dtype=CODE_DTYPES[dtype_code], shape=shape, seed=seed)
    return Payload(header=header, body=view[end:])
