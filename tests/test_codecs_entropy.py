"""The lossless stage (codec.entropy=zstd): bit-identical decoding, bytes equal to the
documented layout, the key carried through memories, rotations and specs, and every
bad body (bombs, lying sizes, corrupt, truncated or extended frames) refused before
anything beyond the claimed tensor is allocated."""

from __future__ import annotations

import struct

import pytest
import torch
import zstandard

from experiments.memory import address_space_cap
from fedcomp.codecs import PayloadError, decode_bytes, make_codec, make_codec_from_spec
from fedcomp.codecs.entropy import max_inner_size
from fedcomp.codecs.wire import SpecMismatch

SPECS = [
    {"name": "fp32"},
    {"name": "uniform", "bits": 2},
    {"name": "dither", "bits": 4, "block": 64},
    {"name": "sign"},
    {"name": "topk", "fraction": 0.05},
    {"name": "randk", "fraction": 0.1},
    {"name": "eden", "bits": 2},
    {"name": "rotate", "inner": "qsgd", "levels": 4},
]


def _x() -> torch.Tensor:
    return torch.randn(40, 75, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s["name"])
def test_decoding_is_bit_identical_to_the_inner_codec_and_bytes_follow_the_layout(spec) -> None:
    plain = make_codec_from_spec(spec)
    staged = make_codec_from_spec({**spec, "entropy": "zstd"})
    x = _x()
    inner = bytes(plain.encode(x, seed=9))
    payload = bytes(staged.encode(x, seed=9))
    assert torch.equal(decode_bytes(payload), decode_bytes(inner))
    frame = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(inner)
    assert len(payload) == 16 + 4 * x.dim() + 8 + len(frame)
    staged.check_payload(staged.encode(x, seed=9))  # the server's check accepts it
    assert staged.unbiased == plain.unbiased


def test_the_key_rides_through_memories_rotations_and_specs() -> None:
    ef = make_codec("ef", inner="sign", entropy="zstd", entropy_level=7)
    assert ef.inner.name == "entropy" and ef.inner.inner.name == "sign"
    assert make_codec_from_spec(ef.spec()).spec() == ef.spec()
    assert ef.spec()["entropy"] == "zstd" and ef.spec()["entropy_level"] == 7


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"name": "uniform", "entropy": "lzma"}, "entropy"),
        ({"name": "uniform", "entropy": "zstd", "entropy_level": 0}, "entropy_level"),
        ({"name": "onebit", "entropy": "zstd"}, "joint"),
        ({"name": "entropy"}, "codec.entropy=zstd"),
    ],
)
def test_bad_entropy_settings_are_refused_naming_the_key(spec: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        make_codec_from_spec(spec)


def _with_body(payload: bytes, body: bytes) -> bytes:
    return payload[: 16 + 4 * 2] + body


def _body(size: int, frame: bytes, method: int = 1) -> bytes:
    return struct.pack("<BBHI", method, 3, 0, size) + frame


def test_a_decompression_bomb_is_refused_before_it_is_inflated() -> None:
    """A 100 MB frame of zeros (3 kB compressed) behind a header that claims 3000
    values: the declared size is beyond what any codec makes for 3000 values."""
    good = bytes(make_codec("uniform", bits=2, entropy="zstd").encode(_x(), seed=1))
    bomb = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(100_000_000))
    with address_space_cap(64 << 20), pytest.raises(PayloadError, match="decompressed size"):
        decode_bytes(_with_body(good, _body(100_000_000, bomb)))
    # the same frame declared small: the frame's own content size contradicts it
    with address_space_cap(64 << 20), pytest.raises(PayloadError, match="declares"):
        decode_bytes(_with_body(good, _body(1000, bomb)))
    assert max_inner_size(3000, 2) < 100_000_000


def test_corrupt_truncated_and_extended_frames_are_payload_errors() -> None:
    codec = make_codec("uniform", bits=2, entropy="zstd")
    good = bytes(codec.encode(_x(), seed=1))
    for cut in range(len(good)):
        with pytest.raises(PayloadError):
            decode_bytes(good[:cut])
    with pytest.raises(PayloadError, match="exactly one zstd frame"):
        decode_bytes(good + b"\x00\x01")
    corrupt = bytearray(good)
    corrupt[-5] ^= 0xFF
    with pytest.raises(PayloadError):
        decode_bytes(bytes(corrupt))
    with pytest.raises(PayloadError, match="method"):
        decode_bytes(good[:24] + bytes([9]) + good[25:])


def test_the_server_refuses_an_inner_codec_it_did_not_ask_for() -> None:
    asked = make_codec("uniform", bits=2, entropy="zstd")
    sent = make_codec("uniform", bits=4, entropy="zstd")
    with pytest.raises(SpecMismatch, match="bits"):
        asked.check_payload(sent.encode(_x(), seed=1))
    other = make_codec("sign", entropy="zstd")
    with pytest.raises(SpecMismatch, match="uniform: codec id is 6, the server asked for 4"):
        asked.check_payload(other.encode(_x(), seed=1))
