"""The wire format and the dense codecs (raw, fp32): exact round trips, real sizes,
and clear errors on malformed buffers."""

from __future__ import annotations

import struct

import pytest
import torch

from fedcomp.codecs import PayloadError, decode_bytes, make_codec, make_codec_from_spec
from fedcomp.codecs.wire import HEADER_FIXED_BYTES


def _expected_size(x: torch.Tensor, itemsize: int) -> int:
    """16-byte fixed header + 4 bytes per dimension + the packed values."""
    return 16 + 4 * x.dim() + itemsize * x.numel()


TENSORS = {
    "matrix": torch.randn(7, 5, generator=torch.Generator().manual_seed(0)),
    "scalar": torch.tensor(3.25),
    "empty": torch.empty(0, 4),
    "non_contiguous": torch.randn(6, 4, generator=torch.Generator().manual_seed(1)).t(),
    "fp16": torch.randn(9, generator=torch.Generator().manual_seed(2)).half(),
    "bf16": torch.randn(9, generator=torch.Generator().manual_seed(3)).bfloat16(),
    "huge": torch.tensor([3.0e38, -3.0e38, 1e-45, 0.0]),
    "all_zero": torch.zeros(3, 3),
}


@pytest.mark.parametrize("name", sorted(TENSORS))
def test_fp32_roundtrip_is_exact_with_real_size(name: str) -> None:
    x = TENSORS[name]
    codec = make_codec("fp32")
    payload = codec.encode(x, seed=0)
    buf = bytes(payload)
    assert len(buf) == len(payload) == _expected_size(x, 4)
    for y in (codec.decode(payload), decode_bytes(buf)):
        assert y.dtype == x.dtype and y.shape == x.shape
        assert torch.equal(y, x)


@pytest.mark.parametrize(
    "x",
    [
        torch.arange(10),
        torch.tensor([True, False]),
        torch.tensor(5, dtype=torch.int32),
        torch.randn(3).double(),
    ],
)
def test_raw_roundtrip_keeps_dtype_and_bytes(x: torch.Tensor) -> None:
    buf = bytes(make_codec("raw").encode(x, seed=0))
    assert len(buf) == _expected_size(x, x.element_size())
    y = decode_bytes(buf)
    assert y.dtype == x.dtype and torch.equal(y, x)


def test_fp32_bytes_are_the_little_endian_values_whatever_the_seed() -> None:
    """The fp32 body is the tensor's values as little-endian float32 (computed here
    with numpy), independent of the seed: nothing random enters a dense payload."""
    x = TENSORS["matrix"]
    buf = bytes(make_codec("fp32").encode(x, seed=1))
    body = buf[16 + 4 * x.dim() :]
    assert body == x.numpy().astype("<f4").tobytes()
    assert buf == bytes(make_codec("fp32").encode(x, seed=99))


def test_every_truncation_and_extension_is_rejected() -> None:
    buf = bytes(make_codec("fp32").encode(torch.randn(3, 2), seed=0))
    for cut in range(len(buf)):
        with pytest.raises(PayloadError):
            decode_bytes(buf[:cut])
    with pytest.raises(PayloadError):
        decode_bytes(buf + b"\x00")


def _with_header(buf: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(buf)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


@pytest.mark.parametrize(
    ("offset", "fmt", "value", "needle"),
    [
        (0, "<H", 0x5858, "magic"),
        (2, "<B", 9, "version"),
        (3, "<B", 200, "unknown codec id"),
        (4, "<B", 77, "dtype code"),
        (5, "<B", 40, "dimensions"),
    ],
)
def test_bad_header_fields_are_named(offset: int, fmt: str, value: int, needle: str) -> None:
    buf = bytes(make_codec("fp32").encode(torch.randn(4), seed=0))
    with pytest.raises(PayloadError, match=needle):
        decode_bytes(_with_header(buf, offset, fmt, value))


def test_enormous_claimed_shape_is_rejected_before_allocating() -> None:
    buf = bytes(make_codec("fp32").encode(torch.randn(2, 2), seed=0))
    # Claim 2^32-1 x 2^32-1 elements: decoding must compare sizes, not allocate.
    bad = _with_header(
        _with_header(buf, HEADER_FIXED_BYTES, "<I", 2**32 - 1),
        HEADER_FIXED_BYTES + 4,
        "<I",
        2**32 - 1,
    )
    with pytest.raises(PayloadError, match="above the limit"):
        decode_bytes(bad)
    with pytest.raises(PayloadError, match="needs"):  # within the limit: sizes compared
        decode_bytes(bad, max_numel=2**64)


def test_factory_rejects_unknown_names_and_params() -> None:
    with pytest.raises(ValueError, match=r"unknown codec 'gzip'.*fp32"):
        make_codec("gzip")
    with pytest.raises(ValueError, match=r"does not take parameter.*bits"):
        make_codec("fp32", bits=4)
    with pytest.raises(ValueError, match="needs a 'name'"):
        make_codec_from_spec({"bits": 4})
    with pytest.raises(ValueError, match="floating-point"):
        make_codec("fp32").encode(torch.arange(3), seed=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_all_finite_agrees_with_isfinite_for_every_kind_of_non_finite(dtype) -> None:
    """The one-reduction check (min and max) against the elementwise definition: a
    NaN, +Inf or -Inf anywhere (first, middle, last element) is found."""
    from fedcomp.codecs.blocks import all_finite

    gen = torch.Generator().manual_seed(4)
    base = torch.randn(1001, generator=gen).to(dtype)
    assert all_finite(base) and all_finite(base[:0]) and all_finite(torch.arange(5))
    for bad in (float("nan"), float("inf"), -float("inf")):
        for where in (0, 500, 1000):
            x = base.clone()
            x[where] = bad
            assert all_finite(x) == bool(torch.isfinite(x).all()) is False


@pytest.mark.parametrize("op", ["abssum", "sumsq"])
def test_block_sums_a_few_blocks_at_a_time_equal_the_whole_matrix_bit_for_bit(op) -> None:
    """block_reduce sums a few blocks per pass (cache-sized temporaries); each block's
    sum must be exactly the one torch gives on the whole (blocks, block) matrix, which
    is what the payloads were computed with before (torch reduces long rows differently
    when several are stacked: the speed-up is kept below that length)."""
    from fedcomp.codecs.blocks import block_reduce

    x = torch.randn(3_000_001, generator=torch.Generator().manual_seed(1)) * 5
    for block in (1, 7, 64, 1000, 1024, 4096, 32768, 65536, 1 << 17):
        full = x.numel() - x.numel() % block
        parts = [x[:full].view(-1, block)] + ([x[full:].view(1, -1)] if full < x.numel() else [])
        want = torch.cat(
            [
                p.abs().sum(dim=1) if op == "abssum" else p.double().square().sum(dim=1)
                for p in parts
            ]
        )
        assert torch.equal(block_reduce(x, block, op), want), block
