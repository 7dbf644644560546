"""The tensor policy's rule from its definition: a floating tensor is compressed
exactly when its codec carries it in fewer bytes than raw. Both sides are checked on
real payloads, for every registered codec and a range of shapes: a compressed tensor's
payload is shorter than its raw payload, and a tensor left raw would not have been
shorter by more than the policy's margin."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedcomp.codecs import codec_names, make_codec
from fedcomp.codecs.policy import JOINT_MIN_NUMEL, TensorPolicy
from fedcomp.codecs.wire import HEADER_FIXED_BYTES

SPECS = {
    "fp32": {"name": "fp32"},
    "fp16": {"name": "fp16"},
    "bf16": {"name": "bf16"},
    "uniform8": {"name": "uniform", "bits": 8, "block": 64},
    "uniform2": {"name": "uniform", "bits": 2, "block": 256},
    "dither1": {"name": "dither", "bits": 1, "block": 64},
    "qsgd1": {"name": "qsgd", "levels": 1, "block": 128},
    "sign": {"name": "sign", "block": 64},
    "topk": {"name": "topk", "fraction": 0.01},
    "randk": {"name": "randk", "fraction": 0.25},
    "sparseq": {"name": "sparseq", "fraction": 0.1, "bits": 4, "block": 64},
    "lowrank": {"name": "lowrank", "rank": 2},
    "eden1": {"name": "eden", "bits": 1, "block": 256},
    "eden4": {"name": "eden", "bits": 4, "block": 1024},
    "rotate_uniform2": {"name": "rotate", "inner": "uniform", "bits": 2, "block": 64},
    "uniform2_zstd": {"name": "uniform", "bits": 2, "block": 64, "entropy": "zstd"},
    "subsample_eden1": {"name": "subsample", "inner": "eden", "fraction": 0.25, "bits": 1},
    "adaptive": {"name": "adaptive", "bits": 1.5},
    "sketch": {"name": "sketch", "fraction": 1 / 64},
}

SHAPES = [(), (1,), (6,), (10,), (17,), (31,), (64,), (128,), (200,), (512,), (3, 5),
          (8, 8), (10, 128), (32, 1, 5, 5), (512, 64), (4097,)]  # fmt: skip


def _codec(key: str):
    spec = dict(SPECS[key])
    return make_codec(spec.pop("name"), **spec)


def _payload_len(codec, x: torch.Tensor) -> int:
    return len(bytes(codec.encode(x, seed=5)))


def test_every_registered_codec_is_weighed() -> None:
    # raw is the policy's own; entropy is a stage (uniform2_zstd); the joint code has
    # its own list (the last tests)
    weighed = {spec["name"] for spec in SPECS.values()} | {"raw", "entropy"}
    assert weighed == set(codec_names())


@pytest.mark.parametrize("key", sorted(SPECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_compressed_exactly_when_the_codec_is_shorter_than_raw(key: str, dtype) -> None:
    codec, policy, raw = _codec(key), TensorPolicy(), make_codec("raw")
    gen = torch.Generator().manual_seed(3)
    for shape in SHAPES:
        x = torch.randn(shape, generator=gen).to(dtype)
        raw_len, coded_len = _payload_len(raw, x), _payload_len(codec, x)
        assert raw_len == HEADER_FIXED_BYTES + 4 * len(shape) + x.element_size() * x.numel()
        if policy.codec_for(x, codec) is codec:
            assert coded_len < raw_len, (key, shape, coded_len, raw_len)
        else:  # raw: the codec would have saved at most the promised 64 B
            assert coded_len >= raw_len - 64, (key, shape, coded_len, raw_len)


@pytest.mark.parametrize("key", ["eden1", "uniform2", "topk", "lowrank"])
def test_the_largest_tensors_are_compressed(key: str) -> None:
    """Not a vacuous rule: every codec that compresses at all compresses big tensors."""
    codec = _codec(key)
    x = torch.zeros(512, 64)
    assert TensorPolicy().codec_for(x, codec) is codec


def test_integers_and_tensors_below_min_numel_travel_raw() -> None:
    codec = _codec("uniform8")
    big = torch.zeros(1000)
    assert TensorPolicy(min_numel=1000).codec_for(big, codec) is codec
    assert TensorPolicy(min_numel=1001).codec_for(big, codec) is not codec
    assert TensorPolicy().codec_for(torch.zeros(1000, dtype=torch.int64), codec) is not codec
    assert not TensorPolicy().travels_raw(True, (1000,))  # no codec: only the size rule


def test_low_rank_is_weighed_on_its_matrix_not_its_size() -> None:
    """A 1-d tensor is one row (dense float32: raw is shorter); a 64 x 64 matrix of the
    same size goes as rank-2 factors."""
    codec = _codec("lowrank")
    assert TensorPolicy().codec_for(torch.zeros(4096), codec) is not codec
    assert TensorPolicy().codec_for(torch.zeros(64, 64), codec) is codec
    assert codec.nominal_bytes((64, 64)) == 4 * 2 * (64 + 64)


@pytest.mark.parametrize("min_numel", [0, 100, 300, 1000])
def test_the_joint_code_compresses_its_own_list(min_numel: int) -> None:
    """The one-bit joint code keeps its floor (its queries spread a tensor's
    coordinates over the clients): floating tensors of at least max(min_numel, 256)."""
    arrays = {
        "a": np.zeros(255, np.float32),
        "b": np.zeros((16, 16), np.float32),
        "c": np.zeros(500, np.float32),
        "n": np.zeros(1000, np.int64),
    }
    floor = max(min_numel, JOINT_MIN_NUMEL)
    expected = [k for k, v in arrays.items() if v.dtype.kind == "f" and v.size >= floor]
    assert TensorPolicy(min_numel).compressed(arrays) == expected


def test_nominal_bytes_are_the_nominal_bits_of_the_size() -> None:
    codec = _codec("eden1")
    for shape in [(7,), (256,), (3, 300)]:
        n = math.prod(shape)
        assert codec.nominal_bytes(shape) == codec.nominal_bits(n) * n / 8


@pytest.mark.parametrize("saving", [63, 64, 65])
def test_the_margin_at_its_boundary(saving: int, monkeypatch) -> None:
    """A codec whose nominal bytes undercut raw by exactly MARGIN_BYTES (64) is not worth
    a payload: the tensor travels raw; by 65 it is compressed."""
    from fedcomp.codecs.policy import MARGIN_BYTES

    codec = make_codec("uniform", bits=4, block=256)
    shape = (300,)
    raw = 4 * math.prod(shape)
    monkeypatch.setattr(type(codec), "nominal_bytes", lambda self, s: raw - saving)
    assert TensorPolicy().travels_raw(True, shape, codec) == (saving <= MARGIN_BYTES)
