"""Every bound a decoder checks, at the boundary value itself and one past it.

Row by row through docs/reliability.md, "Audit: every field a decoder reads": the
largest (and smallest) value a field may take is accepted, the next one is refused
with a PayloadError (a Rejection the server counts), never an IndexError or a silently
wrong tensor. An off-by-one in a bound (``>`` for ``>=``) passes any test that only
tries values far beyond it; these do not.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from fedcomp.codecs import PayloadError, decode_bytes, make_codec, parse_payload
from fedcomp.codecs.base import JOINT_ONEBIT_ID, codec_names
from fedcomp.codecs.entropy import max_inner_size
from fedcomp.codecs.packing import decode_varints, encode_varints, pack_bits
from fedcomp.codecs.sparse_quantized import BITMAP, GAPS, decode_indices
from fedcomp.codecs.wire import DTYPE_CODES, MAX_NDIM, WIRE_VERSION, Payload, PayloadHeader
from fedcomp.failures import Rejection

_FIXED = struct.Struct("<2sBBBBHQ")  # docs: magic, version, codec id, dtype, ndim, reserved, seed


def _header(
    codec_id=1, dtype=0, shape=(4,), version=WIRE_VERSION, reserved=0, magic=b"FC", seed=0
) -> bytes:
    """A payload header written field by field from the documented layout."""
    fixed = _FIXED.pack(magic, version, codec_id, dtype, len(shape), reserved, seed)
    return fixed + struct.pack(f"<{len(shape)}I", *shape)


def _fp32(shape: tuple[int, ...], **fields) -> tuple[bytes, np.ndarray]:
    """An fp32 payload of values 1..numel, and those values."""
    values = np.arange(1, int(np.prod(shape)) + 1, dtype="<f4")
    return _header(1, 0, shape, **fields) + values.tobytes(), values.reshape(shape)


def _refused(buf: bytes, match: str, **kwargs) -> PayloadError:
    with pytest.raises(PayloadError, match=match) as info:
        decode_bytes(buf, **kwargs)
    assert isinstance(info.value, Rejection)
    return info.value


def _range_field(buf: bytes) -> str | None:
    """The field a range check (``blocks.check_range``) refused, or None when the
    payload decoded or failed a later, different check."""
    try:
        decode_bytes(buf)
    except PayloadError as exc:
        return exc.field if isinstance(exc.expected, tuple) else None
    return None


def _with_body(payload: Payload, offset: int, fmt: str, value: int) -> bytes:
    """The payload with one body field overwritten (little-endian ``fmt``)."""
    body = bytearray(bytes(payload.body))
    struct.pack_into(fmt, body, offset, value)
    return bytes(Payload(payload.header, bytes(body)))


def _x(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------- the header


def test_magic_version_and_reserved() -> None:
    good, values = _fp32((4,))
    assert np.array_equal(decode_bytes(good).numpy(), values)
    _refused(_fp32((4,), magic=b"FD")[0], "magic")
    _refused(_fp32((4,), version=0)[0], "version 0")
    _refused(_fp32((4,), version=WIRE_VERSION - 1)[0], f"version {WIRE_VERSION - 1}")
    _refused(_fp32((4,), version=WIRE_VERSION + 1)[0], f"version {WIRE_VERSION + 1}")
    _refused(_fp32((4,), reserved=1)[0], "reserved")


def test_dtype_codes_last_known_accepted_next_refused() -> None:
    last = max(DTYPE_CODES.values())
    assert last == 9 and DTYPE_CODES[torch.bool] == last
    raw = _header(0, last, (3,)) + bytes([1, 0, 1])
    assert decode_bytes(raw).tolist() == [True, False, True]
    _refused(_header(0, last + 1, (3,)) + bytes([1, 0, 1]), f"unknown dtype code {last + 1}")


def test_ndim_eight_accepted_nine_refused() -> None:
    assert MAX_NDIM == 8
    buf, values = _fp32((1, 2, 1, 1, 1, 1, 1, 1))
    assert np.array_equal(decode_bytes(buf).numpy(), values)
    _refused(_fp32((1, 2, 1, 1, 1, 1, 1, 1, 1))[0], "9 dimensions")


def test_numel_at_the_limit_accepted_one_more_refused() -> None:
    buf, values = _fp32((3, 5))
    assert np.array_equal(decode_bytes(buf, max_numel=15).numpy(), values)
    _refused(buf, "15 elements, above the limit of 14", max_numel=14)
    # a product above the limit built from small dimensions (no wrap-around)
    _refused(_header(1, 0, (2**16, 2**16, 2**16)), "above the limit")


def test_codec_ids_unknown_and_onebit_refused() -> None:
    top = max(parse_payload(bytes(make_codec(n).encode(_x(4), seed=1))).header.codec_id
              for n in codec_names() if n not in ("rotate", "entropy", "subsample"))  # fmt: skip
    assert top >= 17
    body = np.ones(4, "<f4").tobytes()
    for unknown in (top + 1, 200, 255):
        _refused(_header(unknown, 0, (4,)) + body, f"unknown codec id {unknown}")
    _refused(_header(JOINT_ONEBIT_ID, 0, (4,)) + body, "onebit payload")


# ------------------------------------------------------------------ body lengths


SPECS = [
    {"name": "raw"},
    {"name": "fp32"},
    {"name": "fp16"},
    {"name": "bf16"},
    {"name": "uniform", "bits": 3, "block": 16},
    {"name": "dither", "bits": 2, "block": 32},
    {"name": "qsgd", "levels": 5, "block": 32},
    {"name": "sign", "block": 16},
    {"name": "topk", "fraction": 0.2},
    {"name": "randk", "fraction": 0.3},
    {"name": "sparseq", "fraction": 0.2, "bits": 3},
    {"name": "lowrank", "rank": 1},
    {"name": "eden", "bits": 2, "block": 256},
    {"name": "rotate", "inner": "qsgd", "levels": 4},
    {"name": "uniform", "bits": 2, "entropy": "zstd"},
    {"name": "subsample", "inner": "eden", "fraction": 0.3, "bits": 1},
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "-".join(map(str, s.values())))
def test_body_exactly_as_declared_one_byte_short_or_long_refused(spec: dict) -> None:
    params = dict(spec)
    codec = make_codec(params.pop("name"), **params)
    x = _x(300, seed=3).reshape(20, 15)
    buf = bytes(codec.encode(x, seed=9))
    assert torch.equal(decode_bytes(buf), codec.decode(codec.encode(x, seed=9)))
    with pytest.raises(PayloadError):
        decode_bytes(buf[:-1])
    with pytest.raises(PayloadError):
        decode_bytes(buf + b"\0")


# ------------------------------------------------------------- uniform, dither, qsgd


@pytest.mark.parametrize("name", ["uniform", "dither"])
def test_bits_one_to_eight(name: str) -> None:
    x = _x(50)
    for bits in (1, 8):  # both ends decode, to within one step of the block's range
        codec = make_codec(name, bits=bits, block=64)
        y = decode_bytes(bytes(codec.encode(x, seed=2)))
        assert float((y - x).abs().max()) <= 2 * float(x.abs().max()) / (2**bits - 1) + 1e-6
    top = make_codec(name, bits=8, block=64).encode(x, seed=2)
    assert _range_field(_with_body(top, 0, "<B", 9)) == "bits"
    assert _range_field(_with_body(top, 0, "<B", 0)) == "bits"
    with pytest.raises(ValueError, match=r"1\.\.8"):
        make_codec(name, bits=9)
    with pytest.raises(ValueError, match=r"1\.\.8"):
        make_codec(name, bits=0)


@pytest.mark.parametrize("name", ["uniform", "qsgd", "sign"])
def test_block_up_to_two_to_the_31(name: str) -> None:
    """77 values in one block of 128: the same bytes with block = 2^31 are still one
    block and decode to the same values (no padding to the block, docs); 2^31 + 1 and
    0 are refused."""
    codec = make_codec(name, block=128)
    p = codec.encode(_x(77), seed=4)
    offset, fmt = (0, "<I") if name == "sign" else (2, "<I")
    expected = codec.decode(p)
    assert torch.equal(decode_bytes(_with_body(p, offset, fmt, 2**31)), expected)
    assert _range_field(_with_body(p, offset, fmt, 2**31 + 1)) == "block"
    assert _range_field(_with_body(p, offset, fmt, 0)) == "block"
    with pytest.raises(ValueError, match="2\\^31"):
        make_codec(name, block=2**31 + 1)


def test_qsgd_levels_one_to_127() -> None:
    x = _x(64)
    for levels in (1, 127):
        codec = make_codec("qsgd", levels=levels, block=64)
        y = decode_bytes(bytes(codec.encode(x, seed=5)))
        # one level of ||x|| / levels at most from x, coordinate by coordinate
        assert float((y - x).abs().max()) <= float(x.norm()) / levels * (1 + 1e-5)
    top = make_codec("qsgd", levels=127, block=64).encode(x, seed=5)
    assert _range_field(_with_body(top, 0, "<B", 128)) == "levels"
    assert _range_field(_with_body(top, 0, "<B", 0)) == "levels"
    for bad in (0, 128):
        with pytest.raises(ValueError, match=r"1\.\.127"):
            make_codec("qsgd", levels=bad)


def test_qsgd_code_two_levels_accepted_one_more_refused() -> None:
    """levels = 2: codes of ceil(log2 5) = 3 bits hold 0..7; 4 = 2 levels decodes to
    +norm, 5 is refused."""
    header = PayloadHeader(5, torch.float32, (1,))
    norm = struct.pack("<f", 3.0)

    def payload(code: int) -> bytes:
        body = struct.pack("<BBI", 2, 0, 8) + norm + pack_bits(np.array([code]), 3)
        return bytes(Payload(header, body))

    assert decode_bytes(payload(4)).tolist() == [3.0]
    assert decode_bytes(payload(0)).tolist() == [-3.0]
    _refused(payload(5), "code beyond the level range")


def test_scales_zero_accepted_negative_or_non_finite_refused() -> None:
    codec = make_codec("uniform", bits=4, block=64)
    p = codec.encode(_x(64), seed=1)
    zero = decode_bytes(_with_body(p, 6, "<f", 0.0))
    assert torch.equal(zero, torch.zeros(64))  # scale 0: the block decodes to 0
    smallest = decode_bytes(_with_body(p, 6, "<I", 1))  # 2^-149, the smallest positive
    assert float(smallest.abs().max()) <= 2**-149
    for bad in (0x80000001, 0x7F800000, 0x7FC00000):  # -2^-149, +inf, nan
        _refused(_with_body(p, 6, "<I", bad), "finite and non-negative")


# ------------------------------------------------------------------ top-k, random-k


def _topk(n: int, gaps: list[int], nvar: int | None = None, k: int | None = None) -> bytes:
    """A top-k payload from its documented layout: u64 k, u64 varint bytes | LEB128
    gaps | float32 values 1..k."""
    varints = encode_varints(np.array(gaps, dtype=np.uint64))
    k = len(gaps) if k is None else k
    values = np.arange(1, len(gaps) + 1, dtype="<f4").tobytes()
    body = struct.pack("<QQ", k, len(varints) if nvar is None else nvar) + varints + values
    return bytes(Payload(PayloadHeader(7, torch.float32, (n,)), body))


def test_topk_index_numel_minus_one_accepted_numel_refused() -> None:
    n = 10
    out = decode_bytes(_topk(n, [n - 1]))
    assert out.tolist() == [0.0] * (n - 1) + [1.0]
    _refused(_topk(n, [n]), "index beyond the tensor")  # not an IndexError
    # the last of several indices: 2, then 2 + 1 + 6 = 9 accepted; 2 + 1 + 7 = 10 refused
    assert decode_bytes(_topk(n, [2, 6])).nonzero().reshape(-1).tolist() == [2, 9]
    _refused(_topk(n, [2, 7]), "index beyond the tensor")


def test_topk_k_numel_accepted_numel_plus_one_refused() -> None:
    n = 6
    out = decode_bytes(_topk(n, [0] * n))
    assert out.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    err = _refused(_topk(n, [0] * (n + 1)), "k=7 is outside 1..6")
    assert err.field == "k"
    assert _range_field(_topk(n, [], k=0)) == "k"  # k = 0 of a non-empty tensor
    empty = bytes(Payload(PayloadHeader(7, torch.float32, (0,)), struct.pack("<QQ", 0, 0)))
    assert decode_bytes(empty).shape == (0,)


def test_topk_varint_bytes_k_to_9k() -> None:
    n = 1000
    assert _range_field(_topk(n, [5, 7, 9], nvar=2)) == "varint bytes"  # k - 1
    assert _range_field(_topk(n, [5, 7, 9], nvar=28)) == "varint bytes"  # 9k + 1
    # at 9k the field is accepted; a varint stream of 9k bytes is then read (and this
    # one, not 27 bytes long, fails the length check instead)
    assert _range_field(_topk(n, [5, 7, 9], nvar=27)) is None
    assert decode_bytes(_topk(n, [5, 7, 9], nvar=3)).nonzero().reshape(-1).tolist() == [5, 13, 23]


def test_varints_nine_bytes_accepted_ten_refused() -> None:
    nine = encode_varints(np.array([2**63 - 1], dtype=np.uint64))
    assert len(nine) == 9
    assert decode_varints(nine, 1).tolist() == [2**63 - 1]
    with pytest.raises(PayloadError, match="longer than 63 bits"):
        decode_varints(b"\x80" * 9 + b"\x01", 1)
    with pytest.raises(PayloadError, match="exactly 2 values"):
        decode_varints(nine, 2)


def test_sparseq_indices_numel_minus_one_accepted_numel_refused() -> None:
    n = 10
    assert decode_indices(GAPS, encode_varints(np.array([n - 1])), 1, n).tolist() == [n - 1]
    with pytest.raises(PayloadError, match="beyond the tensor"):
        decode_indices(GAPS, encode_varints(np.array([n])), 1, n)
    # bitmap: bit 9 (the last coordinate) accepted, bit 10 (padding) refused
    assert decode_indices(BITMAP, bytes([0, 0b01000000]), 1, n).tolist() == [9]
    with pytest.raises(PayloadError, match="beyond the tensor"):
        decode_indices(BITMAP, bytes([0, 0b00100000]), 1, n)


def test_randk_k_numel_accepted_numel_plus_one_refused() -> None:
    n = 8
    codec = make_codec("randk", k=n)
    x = _x(n)
    p = codec.encode(x, seed=3)
    assert torch.equal(decode_bytes(bytes(p)), x)  # k = numel: every value, scale 1
    body = struct.pack("<Q", n + 1) + bytes(p.body)[8:] + b"\0\0\0\0"
    assert _range_field(bytes(Payload(p.header, body))) == "k"
    assert _range_field(_with_body(p, 0, "<Q", 0)) == "k"


@pytest.mark.parametrize("bad", [0x7F800000, 0x7FC00000])
def test_sparse_values_must_be_finite(bad: int) -> None:
    p = make_codec("randk", k=2).encode(_x(8), seed=3)
    _refused(_with_body(p, 8, "<I", bad), "non-finite")
    assert _range_field(_with_body(p, 8, "<f", 3.0e38)) is None


# ---------------------------------------------------------------- PowerSGD (lowrank)


def test_lowrank_rank_one_to_64() -> None:
    """A 1-d tensor travels dense (mode 1), where the rank is still range-checked."""
    assert make_codec("lowrank", rank=64).rank == 64
    for bad in (0, 65):
        with pytest.raises(ValueError, match=r"1\.\.64"):
            make_codec("lowrank", rank=bad)
    x = _x(10)
    p = make_codec("lowrank", rank=1).encode(x, seed=0)
    assert torch.equal(decode_bytes(_with_body(p, 0, "<B", 64)), x)
    assert _range_field(_with_body(p, 0, "<B", 65)) == "rank"
    assert _range_field(_with_body(p, 0, "<B", 0)) == "rank"
    assert _range_field(_with_body(p, 1, "<B", 2)) == "mode"
    # a 2x30 matrix in rank 1 (mode 0): r (rows + cols) = 32 values decode to P Q'^T
    m = make_codec("lowrank", rank=1).encode(_x(60).reshape(2, 30), seed=0)
    vals = np.frombuffer(bytes(m.body)[12:], "<f4")
    assert np.allclose(decode_bytes(bytes(m)).numpy(), np.outer(vals[:2], vals[2:]))


# -------------------------------------------------------------------- EDEN, rotate


def test_eden_block_powers_of_two_from_256_to_2_to_20() -> None:
    x = _x(300)
    for block in (256, 2**20):  # both ends decode (a tail padded to 256, not the block)
        codec = make_codec("eden", bits=2, block=block)
        p = codec.encode(x, seed=6)
        assert torch.equal(decode_bytes(bytes(p)), codec.decode(p))
    p = make_codec("eden", bits=2, block=256).encode(x, seed=6)
    for bad in (128, 255, 2**20 + 1, 2**21):
        assert _range_field(_with_body(p, 4, "<I", bad)) == "block"
    _refused(_with_body(p, 4, "<I", 384), "block 384 is not a power of two")
    for bad in (128, 384, 2**21):
        with pytest.raises(ValueError):
            make_codec("eden", block=bad)


def test_eden_small_fields_at_their_bounds() -> None:
    x = _x(300)
    p = make_codec("eden", bits=4, rotations=2, block=256).encode(x, seed=6)
    assert _range_field(bytes(p)) is None
    assert _range_field(_with_body(p, 0, "<B", 5)) == "bits"
    assert _range_field(_with_body(p, 0, "<B", 0)) == "bits"
    assert _range_field(_with_body(p, 1, "<B", 3)) == "rotations"
    assert _range_field(_with_body(p, 1, "<B", 0)) == "rotations"
    assert _range_field(_with_body(p, 2, "<B", 2)) == "unbiased"
    assert _range_field(_with_body(p, 3, "<B", 1)) == "reserved"
    # the other legal values of each decode (the same codes, read differently)
    for offset, value in ((1, 1), (2, 0)):
        assert decode_bytes(_with_body(p, offset, "<B", value)).shape == x.shape


def test_rotate_block_and_rotations_at_their_bounds() -> None:
    x = _x(300)
    for block in (256, 2**20):
        codec = make_codec("rotate", inner="uniform", bits=2, rotation_block=block)
        p = codec.encode(x, seed=6)
        assert torch.equal(decode_bytes(bytes(p)), codec.decode(p))
    codec = make_codec("rotate", inner="uniform", bits=2, rotations=2, rotation_block=256)
    p = codec.encode(x, seed=6)
    assert _range_field(_with_body(p, 4, "<I", 2**21)) == "rotation_block"
    assert _range_field(_with_body(p, 4, "<I", 128)) == "rotation_block"
    _refused(_with_body(p, 4, "<I", 384), "not a power of two")
    assert _range_field(_with_body(p, 0, "<B", 3)) == "rotations"
    assert _range_field(_with_body(p, 0, "<B", 0)) == "rotations"
    assert _range_field(_with_body(p, 1, "<B", 1)) == "reserved"
    assert decode_bytes(_with_body(p, 0, "<B", 1)).shape == x.shape


# ---------------------------------------------------------------------- entropy


def test_entropy_decompressed_size_bound() -> None:
    """1..max_inner_size: at the bound the field passes (the frame then disagrees with
    it, a different check); one above, and 0, are refused by the bound itself."""
    codec = make_codec("uniform", bits=2, entropy="zstd")
    x = _x(300).reshape(20, 15)
    p = codec.encode(x, seed=6)
    limit = max_inner_size(300, 2)
    assert limit == 18 * 300 + 16 + 8 + 4096
    assert _range_field(_with_body(p, 4, "<I", limit)) is None
    _refused(_with_body(p, 4, "<I", limit), "the frame declares")
    assert _range_field(_with_body(p, 4, "<I", limit + 1)) == "decompressed size"
    assert _range_field(_with_body(p, 4, "<I", 0)) == "decompressed size"
    assert _range_field(_with_body(p, 0, "<B", 2)) == "method"
    assert _range_field(_with_body(p, 0, "<B", 0)) == "method"
    assert _range_field(_with_body(p, 2, "<H", 1)) == "reserved"
