"""The codecs' maths and bounds from their definitions (fedcomp/codecs: base, quantizers,
sparse, wire), on small tensors so that each case takes milliseconds.

- every variance factor equals its closed form, at the sizes where its ``min`` and
  ``max`` switch (an empty tensor, one element, a block and one more);
- every decoder's bound check accepts the boundary and refuses one past it with a
  PayloadError whose message names the codec and the field;
- decode(encode(x)) stays within the codec's proven per-coordinate error, on its grid;
- the registry refuses a second codec with a taken name or id.
"""

from __future__ import annotations

import math
import re
import struct

import numpy as np
import pytest
import torch

from fedcomp.codecs import make_codec
from fedcomp.codecs.base import Codec, codec_class, codec_class_by_id, register
from fedcomp.codecs.sparse import kept
from fedcomp.codecs.wire import Payload, PayloadError


def _x(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------- registry


class _Probe(Codec):
    codec_id = 250
    name = "probe-codec"
    unbiased = False

    def encode(self, x, *, seed):  # pragma: no cover - never called
        raise NotImplementedError

    @classmethod
    def decode_payload(cls, payload):  # pragma: no cover - never called
        raise NotImplementedError


def test_a_new_codec_is_registered_under_its_name_and_id() -> None:
    from fedcomp.codecs import base

    assert codec_class_by_id(_Probe.codec_id) is None
    try:
        assert register(_Probe) is _Probe
        assert codec_class(_Probe.name) is _Probe
        assert codec_class_by_id(_Probe.codec_id) is _Probe
    finally:
        base._BY_ID.pop(_Probe.codec_id, None)
        base._BY_NAME.pop(_Probe.name, None)


@pytest.mark.parametrize(("codec_id", "name"), [(250, "uniform"), (4, "probe-codec")])
def test_a_taken_name_or_id_is_refused_naming_both(codec_id: int, name: str) -> None:
    from fedcomp.codecs import base

    probe = type("Probe", (_Probe,), {"codec_id": codec_id, "name": name})
    before = (dict(base._BY_ID), dict(base._BY_NAME))
    try:
        with pytest.raises(RuntimeError, match=f"codec '{name}' / id {codec_id} registered twice"):
            register(probe)
        assert (base._BY_ID, base._BY_NAME) == before
    finally:
        base._BY_ID.clear(), base._BY_ID.update(before[0])
        base._BY_NAME.clear(), base._BY_NAME.update(before[1])


# ----------------------------------------------------------------------- variance factors


SIZES = [0, 1, 2, 63, 64, 65, 1000]


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("bits", [1, 4, 8])
def test_uniform_and_dither_factors_are_their_closed_forms(numel: int, bits: int) -> None:
    d = min(64, max(numel, 1))  # coordinates per block; an empty tensor counts as one
    levels = 2**bits - 1
    uniform = make_codec("uniform", bits=bits, block=64)
    dither = make_codec("dither", bits=bits, block=64)
    assert uniform.variance_factor(numel) == pytest.approx(d / levels**2, rel=1e-15)
    assert dither.variance_factor(numel) == pytest.approx(d / (3 * levels**2), rel=1e-15)


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("levels", [1, 3, 16, 127])
def test_qsgd_factor_is_the_smaller_of_its_two_bounds(numel: int, levels: int) -> None:
    d = min(64, max(numel, 1))
    codec = make_codec("qsgd", levels=levels, block=64)
    want = min(d / levels**2, math.sqrt(d) / levels)
    assert codec.variance_factor(numel) == pytest.approx(want, rel=1e-15)


@pytest.mark.parametrize("numel", SIZES)
def test_randk_factor_is_numel_over_kept_minus_one(numel: int) -> None:
    by_k, by_fraction = make_codec("randk", k=5), make_codec("randk", fraction=0.3)
    k5 = min(numel, 5)
    k30 = 0 if numel == 0 else max(1, math.ceil(0.3 * numel))
    assert kept(numel, None, 5) == k5 and kept(numel, 0.3, None) == k30
    # an empty tensor keeps nothing and has no error: factor 0
    assert by_k.variance_factor(numel) == (numel / k5 - 1 if k5 else 0.0)
    assert by_fraction.variance_factor(numel) == (numel / k30 - 1 if k30 else 0.0)


@pytest.mark.parametrize(("name", "want"), [("raw", 0.0), ("fp32", 0.0), ("sign", None)])
def test_the_default_factor_is_zero_for_exact_codecs_and_none_for_biased(name, want) -> None:
    assert make_codec(name).variance_factor(100) == want


# ----------------------------------------------------------------------- bound messages


def _short(payload: Payload) -> bytes:
    """The payload with its body one byte short."""
    return bytes(payload)[:-1]


def _decode(cls, buf: bytes):
    from fedcomp.codecs.wire import parse_payload

    return cls.decode_payload(parse_payload(buf))


@pytest.mark.parametrize(
    "spec",
    [
        {"name": "uniform", "bits": 3, "block": 16},
        {"name": "dither", "bits": 2, "block": 16},
        {"name": "qsgd", "levels": 5, "block": 16},
        {"name": "sign", "block": 16},
        {"name": "topk", "k": 7},
        {"name": "randk", "k": 7},
    ],
    ids=lambda s: s["name"],
)
def test_a_body_one_byte_short_is_refused_naming_the_codec_and_both_lengths(spec) -> None:
    params = dict(spec)
    codec = make_codec(params.pop("name"), **params)
    payload = codec.encode(_x(50), seed=3)
    size = len(payload.body)
    with pytest.raises(PayloadError) as info:
        _decode(type(codec), _short(payload))
    assert str(info.value).startswith(f"{codec.name}: body has {size - 1} bytes")
    assert str(info.value).endswith(f"header implies {size}")


def _topk_payload(n: int, k: int, nvar: int, tail: bytes) -> bytes:
    payload = make_codec("topk", k=1).encode(_x(n), seed=0)
    return bytes(payload.header.pack()) + struct.pack("<QQ", k, nvar) + tail


def test_topk_varint_bytes_out_of_range_are_refused_naming_codec_and_field() -> None:
    with pytest.raises(PayloadError) as info:
        _decode(codec_class("topk"), _topk_payload(10, 2, 19, b""))
    assert str(info.value) == "topk: varint bytes=19 is outside 2..18"
    fields = (info.value.field, info.value.value, info.value.expected)
    assert fields == ("varint bytes", 19, (2, 18))


def test_a_topk_index_past_the_tensor_is_refused_and_the_last_one_accepted() -> None:
    n = 10
    values = np.array([1.5, -2.0], "<f4").tobytes()
    last = _decode(codec_class("topk"), _topk_payload(n, 2, 2, bytes([0, 8]) + values))
    assert last.tolist() == [1.5] + [0.0] * 8 + [-2.0]
    assert last.dtype == torch.float32
    with pytest.raises(PayloadError, match=r"^topk: index beyond the tensor$"):
        _decode(codec_class("topk"), _topk_payload(n, 2, 2, bytes([0, 9]) + values))


# ----------------------------------------------------------------------- proven errors


def _blocks(x: torch.Tensor, block: int) -> list[torch.Tensor]:
    flat = x.reshape(-1).double()
    return [flat[i : i + block] for i in range(0, flat.numel(), block)]


@pytest.mark.parametrize("bits", [1, 2, 5, 8])
def test_uniform_decodes_to_one_of_the_two_levels_around_each_coordinate(bits: int) -> None:
    """Levels -s + j 2s / (2^b - 1), s = max|x| of the block: the decoded value is the
    level just below x or just above it (one step apart), never further."""
    block, levels = 16, 2**bits - 1
    x = _x(70, seed=bits) * 3  # 4 full blocks and a tail of 6
    codec = make_codec("uniform", bits=bits, block=block)
    for seed in range(5):
        y = codec.decode(codec.encode(x, seed=seed)).double()
        for xb, yb in zip(_blocks(x, block), _blocks(y, block), strict=True):
            s = float(xb.abs().max())
            step = 2 * s / levels
            j = (yb + s) / step  # level index of each decoded value
            assert torch.allclose(j, j.round(), atol=1e-4)
            assert float((yb - xb).abs().max()) <= step * (1 + 1e-5)
            assert float(yb.abs().max()) <= s * (1 + 1e-6)


@pytest.mark.parametrize("bits", [1, 3, 8])
def test_dither_error_is_within_half_a_step(bits: int) -> None:
    """Subtractive dither: decode = x + e with e uniform on [-step/2, step/2]."""
    block, levels = 16, 2**bits - 1
    x = _x(50, seed=bits)
    codec = make_codec("dither", bits=bits, block=block)
    for seed in range(5):
        y = codec.decode(codec.encode(x, seed=seed)).double()
        for xb, yb in zip(_blocks(x, block), _blocks(y, block), strict=True):
            step = 2 * float(xb.abs().max()) / levels
            assert float((yb - xb).abs().max()) <= step / 2 * (1 + 1e-4)


@pytest.mark.parametrize("levels", [1, 4, 127])
def test_qsgd_decodes_on_the_norm_grid_within_one_level(levels: int) -> None:
    """|y_i| is a multiple of ||x_block|| / levels, with x_i's sign, one level from |x_i|."""
    block = 16
    x = _x(40, seed=levels)
    codec = make_codec("qsgd", levels=levels, block=block)
    for seed in range(5):
        y = codec.decode(codec.encode(x, seed=seed)).double()
        for xb, yb in zip(_blocks(x, block), _blocks(y, block), strict=True):
            unit = float(xb.norm()) / levels
            j = yb / unit
            assert torch.allclose(j, j.round(), atol=1e-4)
            assert float((yb - xb).abs().max()) <= unit * (1 + 1e-5)
            assert bool(((yb == 0) | (torch.sign(yb) == torch.sign(xb))).all())


def test_sign_decodes_to_the_sign_times_the_blocks_mean_magnitude() -> None:
    block = 16
    x = _x(40, seed=4)
    codec = make_codec("sign", block=block)
    y = codec.decode(codec.encode(x, seed=0)).double()
    for xb, yb in zip(_blocks(x, block), _blocks(y, block), strict=True):
        want = torch.where(xb < 0, -1.0, 1.0).double() * float(xb.abs().mean())
        assert torch.allclose(yb, want, rtol=1e-6)


def test_topk_keeps_the_k_largest_exactly_and_zeroes_the_rest() -> None:
    x = _x(60, seed=5)
    codec = make_codec("topk", k=9)
    y = codec.decode(codec.encode(x, seed=0))
    top = set(torch.topk(x.abs(), 9).indices.tolist())
    assert set(torch.nonzero(y).flatten().tolist()) == top
    assert all(y[i] == x[i] for i in top)


def test_randk_scales_its_public_subset_by_numel_over_k() -> None:
    from fedcomp.codecs.sparse import random_subset

    x = _x(60, seed=6)
    codec = make_codec("randk", k=12)
    y = codec.decode(codec.encode(x, seed=77)).double()
    subset = random_subset(77, 60, 12)
    want = torch.zeros(60, dtype=torch.float64)
    want[subset] = x.double()[subset] * (60 / 12)
    assert torch.allclose(y, want, rtol=1e-6)


SPECS = [
    {"name": "uniform", "bits": 4, "block": 8},
    {"name": "dither", "bits": 4, "block": 8},
    {"name": "qsgd", "levels": 8, "block": 8},
    {"name": "sign", "block": 8},
    {"name": "topk", "k": 5},
    {"name": "randk", "k": 5},
]


def _codec(spec: dict):
    params = dict(spec)
    return make_codec(params.pop("name"), **params)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s["name"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_decode_keeps_the_shape_and_dtype_of_the_input(spec: dict, dtype) -> None:
    codec = _codec(spec)
    x = _x(15, seed=2).reshape(3, 5).to(dtype)
    y = codec.decode(codec.encode(x, seed=9))
    assert y.shape == (3, 5) and y.dtype == dtype


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s["name"])
def test_integer_tensors_are_refused_naming_codec_and_dtype(spec: dict) -> None:
    codec = _codec(spec)
    with pytest.raises(ValueError, match=f"^{codec.name} codec needs a floating-point tensor"):
        codec.encode(torch.arange(10), seed=1)


@pytest.mark.parametrize("spec", [s for s in SPECS if s["name"] in ("uniform", "dither", "qsgd",
                                                                    "randk")],
                         ids=lambda s: s["name"])  # fmt: skip
def test_unbiased_codecs_average_to_the_input_on_a_small_tensor(spec: dict) -> None:
    """The mean of n decodes has E||mean - x||^2 <= omega ||x||^2 / n (independent
    draws of an unbiased codec): the seeded draws stay within 10 times that."""
    codec = _codec(spec)
    x = _x(8, seed=11)
    draws = 500
    total = torch.zeros(8, dtype=torch.float64)
    for seed in range(draws):
        total += codec.decode(codec.encode(x, seed=seed)).double()
    mean = total / draws
    x64 = x.double()
    bound = codec.variance_factor(8) * float((x64**2).sum()) / draws
    assert float(((mean - x64) ** 2).sum()) <= 10 * bound


@pytest.mark.parametrize("name", ["topk", "randk"])
def test_sparse_parameter_checks_name_the_codec(name: str) -> None:
    codec = make_codec(name, k=3)
    good = codec.encode(_x(10), seed=4)
    header = bytes(good.header.pack())
    with pytest.raises(PayloadError, match=f"^{name}: body too short for its parameters$"):
        _decode(type(codec), header + b"\x00" * 7)
    # k is bounded by the tensor size: numel accepted (above), numel + 1 refused
    k_past = bytes(good)[: len(header)] + struct.pack("<Q", 11) + bytes(good.body)[8:]
    with pytest.raises(PayloadError) as info:
        _decode(type(codec), k_past)
    assert str(info.value) == f"{name}: k=11 is outside 1..10"
    ints = make_codec("raw").encode(torch.zeros(10, dtype=torch.int32), seed=0).header
    from fedcomp.codecs.wire import PayloadHeader

    int_header = PayloadHeader(codec.codec_id, ints.dtype, ints.shape).pack()
    with pytest.raises(PayloadError, match=f"^{name}: payload declares a non-float dtype"):
        _decode(type(codec), int_header + bytes(good.body))


def test_sign_parameter_checks_name_the_codec_and_bound_the_block() -> None:
    codec = make_codec("sign", block=4)
    good = codec.encode(_x(10), seed=0)
    header = bytes(good.header.pack())
    sign = type(codec)
    with pytest.raises(PayloadError, match=r"^sign: body too short for its parameters$"):
        _decode(sign, header + b"\x00" * 3)
    with pytest.raises(PayloadError) as info:
        _decode(sign, header + struct.pack("<I", 0) + bytes(good.body)[4:])
    assert str(info.value) == f"sign: block=0 is outside 1..{2**31}"
    from fedcomp.codecs.wire import PayloadHeader

    int_header = PayloadHeader(codec.codec_id, torch.int32, (10,)).pack()
    with pytest.raises(PayloadError, match=r"^sign: payload declares a non-float dtype"):
        _decode(sign, int_header + bytes(good.body))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s["name"])
def test_a_non_finite_update_is_refused_at_encode_naming_the_codec(spec: dict) -> None:
    codec = _codec(spec)
    x = _x(20)
    x[3] = math.nan
    with pytest.raises(ValueError, match=f"^{codec.name}: the update holds NaN or Inf values$"):
        codec.encode(x, seed=1)


def test_a_spec_mismatch_names_what_field_value_and_expected() -> None:
    from fedcomp.codecs.wire import SpecMismatch, check_field

    check_field("w", "bits", 4, 4)
    with pytest.raises(SpecMismatch) as info:
        check_field("w (uniform)", "bits", 2, 4)
    assert str(info.value) == "w (uniform): bits is 2, the server asked for 4"
    assert (info.value.field, info.value.value, info.value.expected) == ("bits", 2, 4)
    # through a codec's own check of a received payload
    two_bits = make_codec("uniform", bits=2).encode(_x(9), seed=0)
    with pytest.raises(SpecMismatch) as info:
        make_codec("uniform", bits=4).check_payload(two_bits)
    assert (info.value.field, info.value.value, info.value.expected) == ("bits", 2, 4)
    with pytest.raises(SpecMismatch) as info:
        make_codec("uniform").check_payload(make_codec("qsgd").encode(_x(9), seed=0))
    assert (info.value.field, info.value.value, info.value.expected) == ("codec id", 5, 4)


def test_topk_on_the_sampled_path_keeps_the_exact_top_k() -> None:
    """Above 4 x SAMPLE coordinates top-k first thresholds a seeded sample: the kept
    set is still exactly the k largest magnitudes (distinct here), for any seed."""
    from fedcomp.codecs.sparse_quantized import SAMPLE

    n, k = 4 * SAMPLE + 1000, 50
    x = _x(n, seed=8)
    top = set(torch.topk(x.abs(), k).indices.tolist())
    codec = make_codec("topk", k=k)
    for seed in (0, 1, 2**40):
        y = codec.decode(codec.encode(x, seed=seed))
        assert set(torch.nonzero(y).flatten().tolist()) == top


@pytest.mark.parametrize("spec", SPECS[:4], ids=lambda s: s["name"])
def test_an_all_zero_block_decodes_to_zeros_next_to_a_nonzero_one(spec: dict) -> None:
    codec = _codec(spec)  # block 8: the first block is zero, the second is not
    x = torch.cat([torch.zeros(8), _x(8, seed=12)])
    for seed in range(5):
        y = codec.decode(codec.encode(x, seed=seed))
        assert torch.equal(y[:8], torch.zeros(8))


def test_sign_scales_are_the_mean_magnitude_of_a_half_precision_input() -> None:
    """The block's mean |x| is computed in float32 whatever the input's dtype (a float16
    sum of 64 terms would be off by about 2^-11 relative)."""
    x = (_x(64, seed=13) * 100).to(torch.float16)
    codec = make_codec("sign", block=64)
    payload = codec.encode(x, seed=0)
    scale = np.frombuffer(bytes(payload.body)[4:8], "<f4")[0]
    want = float(x.double().abs().mean())
    assert scale == pytest.approx(want, rel=2**-20)


@pytest.mark.parametrize("name", ["qsgd", "uniform"])
def test_the_torch_path_over_several_chunks_with_a_padded_block(monkeypatch, name) -> None:
    """Without Numba (the compiled encoders are optional) a tensor of several chunks
    with a last, partial block still decodes within one step of x."""
    from fedcomp.codecs import quantize_compiled
    from fedcomp.codecs.blocks import CHUNK

    monkeypatch.setattr(quantize_compiled, "available", lambda numel: False)
    block, n = 1000, 2 * CHUNK + 1500
    x = _x(n, seed=14)
    codec = make_codec(name, **({"levels": 4} if name == "qsgd" else {"bits": 2}), block=block)
    y = codec.decode(codec.encode(x, seed=3)).double()
    starts = torch.arange(0, n, block)
    for first in (0, int(starts[len(starts) // 2]), int(starts[-1])):
        xb, yb = x[first : first + block].double(), y[first : first + block]
        unit = float(xb.norm()) / 4 if name == "qsgd" else 2 * float(xb.abs().max()) / 3
        assert float((yb - xb).abs().max()) <= unit * (1 + 1e-5)


@pytest.mark.parametrize(
    ("name", "field", "high"),
    [("uniform", "bits", 8), ("dither", "bits", 8), ("qsgd", "levels", 127)],
)
def test_quantizer_parameters_out_of_range_are_refused_naming_codec_and_field(
    name: str, field: str, high: int
) -> None:
    codec = make_codec(name, block=8)
    good = codec.encode(_x(10), seed=0)
    header = bytes(good.header.pack())
    for bad in (0, high + 1):
        body = struct.pack("<BBI", bad, 0, 8) + bytes(good.body)[6:]
        with pytest.raises(PayloadError) as info:
            _decode(type(codec), header + body)
        assert str(info.value) == f"{name}: {field}={bad} is outside 1..{high}"


def test_qsgd_norms_of_a_half_precision_input_are_computed_in_float32() -> None:
    x = (_x(64, seed=15) * 100).to(torch.float16)
    payload = make_codec("qsgd", levels=4, block=64).encode(x, seed=0)
    norm = np.frombuffer(bytes(payload.body)[6:10], "<f4")[0]
    assert norm == pytest.approx(float(x.double().norm()), rel=2**-20)


def test_the_header_bounds_accept_their_exact_size_and_refuse_one_byte_less() -> None:
    from fedcomp.codecs.wire import HEADER_FIXED_BYTES, PayloadHeader, parse_payload

    scalar = PayloadHeader(codec_id=0, dtype=torch.float32, shape=()).pack()
    assert len(scalar) == HEADER_FIXED_BYTES == 16
    parsed = parse_payload(scalar)  # the fixed header alone: a 0-d tensor, empty body
    assert parsed.header.shape == () and len(parsed.body) == 0
    with pytest.raises(PayloadError, match=r"^truncated payload: 15 bytes, header needs 16$"):
        parse_payload(scalar[:15])
    matrix = PayloadHeader(codec_id=0, dtype=torch.float32, shape=(2, 3)).pack()
    assert parse_payload(matrix).header.shape == (2, 3)
    with pytest.raises(PayloadError, match=r"^truncated payload: shape needs 24 bytes, got 23$"):
        parse_payload(matrix[:23])


def test_packing_a_header_bounds_its_dimensions_and_each_size() -> None:
    from fedcomp.codecs.wire import PayloadHeader, parse_payload

    eight = PayloadHeader(0, torch.float32, (1,) * 8).pack()
    assert parse_payload(eight, max_numel=1).header.shape == (1,) * 8
    with pytest.raises(ValueError, match=r"^tensors of more than 8 dimensions are not supported$"):
        PayloadHeader(0, torch.float32, (1,) * 9).pack()
    top = 2**32 - 1
    wide = PayloadHeader(0, torch.float32, (top, 0)).pack()
    assert parse_payload(wide).header.shape == (top, 0)
    with pytest.raises(ValueError, match=r"^shape \(4294967296, 0\) does not fit the wire format$"):
        PayloadHeader(0, torch.float32, (2**32, 0)).pack()


@pytest.mark.parametrize(
    ("name", "field", "good"), [("uniform", "bits", 8), ("qsgd", "levels", 127)]
)
def test_quantizer_sizes_must_be_true_integers_in_range(name: str, field: str, good: int) -> None:
    assert getattr(make_codec(name, **{field: good}), field) == good
    for bad in (True, 4.0, "4", 0, good + 1):
        want = rf"^{name}: {field} must be an integer in 1\.\.{good}, got {re.escape(repr(bad))}$"
        with pytest.raises(ValueError, match=want):
            make_codec(name, **{field: bad})


@pytest.mark.parametrize("name", ["uniform", "dither", "qsgd"])
def test_the_body_starts_with_the_parameters_and_a_zero_byte(name: str) -> None:
    """Layout ``u8 bits|levels, u8 0, u32 block``: the second byte is reserved, zero."""
    codec = make_codec(name, block=8)
    body = bytes(codec.encode(_x(20), seed=1).body)
    first = codec.levels if name == "qsgd" else codec.bits
    assert struct.unpack_from("<BBI", body) == (first, 0, 8)


def test_an_unknown_codec_name_is_refused_listing_the_known_ones() -> None:
    from fedcomp.codecs.base import codec_names

    with pytest.raises(ValueError) as info:
        codec_class("nope")
    assert str(info.value) == f"unknown codec 'nope'; known codecs: {', '.join(codec_names())}"


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s["name"])
def test_the_header_carries_the_seed_only_for_codecs_whose_draws_the_server_repeats(spec) -> None:
    codec = _codec(spec)
    payload = codec.encode(_x(20), seed=12345)
    assert payload.header.seed == (12345 if codec.needs_seed else 0)
    assert codec.needs_seed == (codec.name in ("dither", "randk"))


@pytest.mark.parametrize("name", ["uniform", "qsgd"])
def test_quantizer_body_checks_name_the_codec(name: str) -> None:
    from fedcomp.codecs.wire import PayloadHeader

    codec = make_codec(name, block=8)
    good = codec.encode(_x(10), seed=0)
    header, body = bytes(good.header.pack()), bytes(good.body)
    with pytest.raises(PayloadError, match=rf"^{name}: body too short for its parameters$"):
        _decode(type(codec), header + body[:5])
    int_header = PayloadHeader(codec.codec_id, torch.int32, (10,)).pack()
    with pytest.raises(PayloadError, match=rf"^{name}: payload declares a non-float dtype"):
        _decode(type(codec), int_header + body)
    with pytest.raises(PayloadError) as info:
        _decode(type(codec), header + body[:2] + struct.pack("<I", 0) + body[6:])
    assert str(info.value) == f"{name}: block=0 is outside 1..{2**31}"


@pytest.mark.parametrize("name", ["uniform", "dither", "qsgd", "sign"])
def test_a_block_of_one_coordinate_is_accepted(name: str) -> None:
    codec = make_codec(name, block=1)
    x = _x(5, seed=16)
    y = codec.decode(codec.encode(x, seed=2))
    assert y.shape == (5,)
    if name == "sign":  # one coordinate per block: its own magnitude, exactly
        assert torch.allclose(y, x, rtol=1e-6)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s["name"])
def test_a_half_precision_tensor_encodes_as_its_float32_values(spec: dict) -> None:
    """The codecs compute in float32 whatever the input's dtype: the body of a float16
    tensor equals that of its float32 cast (only the header's dtype differs)."""
    codec = _codec(spec)
    x = (_x(40, seed=17) * 30).to(torch.float16)
    assert bytes(codec.encode(x, seed=6).body) == bytes(codec.encode(x.float(), seed=6).body)


@pytest.mark.parametrize("name", ["topk", "randk"])
def test_sparsifier_sizes_are_refused_outside_their_ranges_naming_the_codec(name: str) -> None:
    assert make_codec(name, fraction=1.0).fraction == 1.0 and make_codec(name, k=1).k == 1
    bad = [
        ({"fraction": 0.0}, "fraction must be in (0, 1], got 0.0"),
        ({"fraction": 1.5}, "fraction must be in (0, 1], got 1.5"),
        ({"fraction": "0.5"}, "fraction must be in (0, 1], got '0.5'"),
        ({"k": 0}, "k must be a positive integer, got 0"),
        ({"k": True}, "k must be a positive integer, got True"),
        ({"k": 2.5}, "k must be a positive integer, got 2.5"),
        ({"k": 3, "fraction": 0.5}, "give exactly one of fraction and k"),
    ]
    for params, message in bad:
        with pytest.raises(ValueError, match=f"^{re.escape(f'{name}: {message}')}$"):
            make_codec(name, **params)


def test_random_subset_refuses_more_indices_than_there_are() -> None:
    from fedcomp.codecs.sparse import random_subset

    assert random_subset(1, 5, 5).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"^cannot pick 6 of 5 indices$"):
        random_subset(1, 5, 6)


# ----------------------------------------------------------------------- compiled path


@pytest.fixture
def kernels_as_python(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The encoders' compiled path on a small tensor, its kernels run as Python.

    The path's own code in fedcomp/codecs/quantizers.py (which arrays and scalars it
    hands the kernels) is otherwise reached only by tensors of 2^16 coordinates or more
    with Numba, whose compilation (about 10 s) is too slow for a fast test. The kernel
    bodies are plain Python over NumPy scalars once ``numba.prange`` is ``range``;
    tests/test_codecs_compiled.py checks them compiled. Yields the kernels' calls.
    """
    import contextlib
    from types import SimpleNamespace

    from fedcomp import compiled
    from fedcomp.codecs import quantize_compiled as qc

    calls: list[str] = []

    def logged(kernel):
        def run(*args):
            calls.append(kernel.__name__)
            return kernel(*args)

        return run

    python = {"_block_amax": logged(qc._block_amax), "_dither_pack": logged(qc._dither_pack)}
    monkeypatch.setattr(qc, "MIN_COMPILED", 0)
    monkeypatch.setattr(qc.KERNELS, "available", lambda: True)
    monkeypatch.setattr(qc, "_kernels", lambda: python)
    monkeypatch.setattr(qc, "numba", SimpleNamespace(prange=range))
    monkeypatch.setattr(compiled, "parallel_region", contextlib.nullcontext)
    return calls


def _blocks_of_every_kind(block: int, seed: int) -> torch.Tensor:
    """Blocks of 0, of -0, of norm below 1, and heavy-tailed ones over decades; a last
    partial block."""
    gen = np.random.default_rng(seed)
    n = 9 * block + 3
    x = gen.standard_t(3, n) * np.geomspace(1e-2, 1e2, n)
    x[:block], x[block : 2 * block] = 0.0, -0.0
    x[2 * block : 3 * block] = gen.uniform(-0.1, 0.1, block)
    return torch.from_numpy(x.astype(np.float32))


def _torch_then_compiled(codec, x: torch.Tensor, seed: int, monkeypatch) -> tuple[bytes, bytes]:
    """The payload's bytes on the torch path, then on the compiled one."""
    from fedcomp.codecs import quantize_compiled as qc

    compiled_bytes = bytes(codec.encode(x, seed=seed))
    with monkeypatch.context() as patch:
        patch.setattr(qc, "MIN_COMPILED", 1 << 62)
        return bytes(codec.encode(x, seed=seed)), compiled_bytes


@pytest.mark.parametrize(
    "spec",
    [
        {"name": "uniform", "bits": 1, "block": 7},
        {"name": "uniform", "bits": 3, "block": 7},
        {"name": "dither", "bits": 8, "block": 5},
        {"name": "qsgd", "levels": 1, "block": 7},
        {"name": "qsgd", "levels": 16, "block": 5},
    ],
    ids=lambda s: f"{s['name']}-{s.get('bits', s.get('levels'))}",
)
def test_the_compiled_path_sends_the_torch_paths_bytes(
    spec: dict, kernels_as_python: list[str], monkeypatch
) -> None:
    """The same block scales, dithers and packed codes on both paths, whatever the
    block's kind (a zero block's code is the middle level, a block of norm below 1 is
    coded like any other)."""
    codec = _codec(spec)
    x = _blocks_of_every_kind(spec["block"], seed=len(spec) + spec["block"])
    torch_bytes, compiled_bytes = _torch_then_compiled(codec, x, 21, monkeypatch)
    assert compiled_bytes == torch_bytes
    # the kernels ran once per encode on the compiled path only (qsgd's norms are torch's)
    want = ["_dither_pack"] if spec["name"] == "qsgd" else ["_block_amax", "_dither_pack"]
    assert kernels_as_python == want


@pytest.mark.usefixtures("kernels_as_python")
@pytest.mark.parametrize("name", ["uniform", "qsgd"])
def test_the_compiled_path_refuses_nan_naming_the_codec(name: str) -> None:
    x = _x(20, seed=18)
    x[13] = float("nan")
    with pytest.raises(ValueError, match=f"^{name}: the update holds NaN or Inf values$"):
        make_codec(name, block=8).encode(x, seed=0)


def test_uniform_codes_of_a_half_precision_input_use_float32_scales() -> None:
    """levels / 2s is taken in float32: rounded to float16 (11 bits) it moves x inv by up
    to 2^-11 of a level, which changes some of 4096 codes at 8 bits."""
    x = (_x(4096, seed=19) * 30).to(torch.float16)
    codec = make_codec("uniform", bits=8, block=4096)
    assert bytes(codec.encode(x, seed=4).body) == bytes(codec.encode(x.float(), seed=4).body)


def test_an_unknown_inner_codec_id_is_refused_naming_the_stage_and_the_id() -> None:
    from fedcomp.codecs.base import decode_inner
    from fedcomp.codecs.wire import PayloadHeader

    assert codec_class_by_id(249) is None
    inner = Payload(PayloadHeader(codec_id=249, dtype=torch.float32, shape=(3,)), b"")
    with pytest.raises(PayloadError, match=r"^rotate: unknown inner codec id 249$"):
        decode_inner(inner, "rotate")
