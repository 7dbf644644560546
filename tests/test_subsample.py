"""``subsample``: a public random subset of the coordinates, coded by a stateless inner
codec, from its definition: decode(x) = (n / k) scatter_S(inner(x_S)) with S the k-subset
drawn from the payload's seed, k = ceil(p n) in [1, n]. Its error splits into the
subsampling's (n / k - 1) ||x||^2 and the inner code's (n / k) omega_inner(k) ||x||^2 (the
cross term has mean zero given S), so omega = (1 + omega_inner(k)) n / k - 1."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from fedcomp.codecs import PayloadError, decode_bytes, make_codec, make_codec_from_spec
from fedcomp.codecs.base import inner_seed, parse_inner_vector
from fedcomp.codecs.sparse import random_subset
from fedcomp.codecs.wire import HEADER_FIXED_BYTES, SpecMismatch, parse_payload
from fedcomp.codecs.wire import SEEDED as INNER_SEEDED

SIGMAS = 5.0  # Monte-Carlo band in standard errors (as tests/test_codec_factors.py)


def _sub(inner: str = "uniform", fraction: float = 0.25, **params):
    return make_codec("subsample", inner=inner, fraction=fraction, **params)


def _x(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen) * torch.linspace(0.1, 3.0, n)


def _ratios(codec, x: torch.Tensor, draws: int) -> np.ndarray:
    x64 = x.double()
    norm2 = float((x64**2).sum())
    out = []
    for seed in range(1000, 1000 + draws):
        y = codec.decode(codec.encode(x, seed=seed)).double()
        out.append(float(((y - x64) ** 2).sum()) / norm2)
    return np.array(out)


# ------------------------------------------------------------------- the definition


@pytest.mark.parametrize(("n", "fraction"), [(1, 0.5), (10, 0.01), (1000, 0.25), (777, 1.0)])
def test_decode_is_n_over_k_times_the_inner_decode_on_the_seeded_subset(n, fraction) -> None:
    codec, seed = _sub("uniform", fraction, bits=3, block=64), 77
    x = _x(n, seed=1)
    payload = codec.encode(x, seed=seed)
    k = max(1, min(n, math.ceil(fraction * n)))
    (k_read,) = struct.unpack_from("<I", payload.body, 0)
    assert k_read == k
    idx = random_subset(seed, n, k)
    # the inner payload is the inner codec's on x_S (its own seed), byte for byte, less
    # the header its reader rebuilds: one byte (inner codec id, seed flag), then its body
    kept_values = x[torch.from_numpy(idx)].contiguous()
    own = codec.inner.encode(kept_values, seed=inner_seed(seed))
    assert bytes(payload.body[4:]) == bytes([own.header.codec_id]) + bytes(own.body)
    inner = parse_inner_vector(type(codec), payload.body[4:], k, seed)
    assert bytes(inner) == bytes(own)
    expected = torch.zeros(n)
    expected[torch.from_numpy(idx)] = decode_bytes(bytes(inner)) * (n / k)
    got = decode_bytes(bytes(payload))
    assert torch.equal(got, expected)
    assert torch.count_nonzero(got) <= k


@pytest.mark.parametrize("fraction", [0.01, 0.3, 1.0])
def test_with_the_exact_inner_code_it_is_random_k_bit_for_bit(fraction: float) -> None:
    x, seed = _x(5000, seed=2), 12345
    sub, randk = _sub("fp32", fraction), make_codec("randk", fraction=fraction)
    a = decode_bytes(bytes(sub.encode(x, seed=seed)))
    b = decode_bytes(bytes(randk.encode(x, seed=seed)))
    assert torch.equal(a, b)
    assert sub.variance_factor(5000) == randk.variance_factor(5000)


def test_unbiased_the_mean_of_many_draws_converges_on_x() -> None:
    """E decode = x: the mean of M draws lies within its own Monte-Carlo error of x, a
    band tight enough that a missing n / k (a bias of factor k / n) fails by far."""
    n, draws = 400, 400
    codec = _sub("uniform", 0.25, bits=1, block=64)
    x = _x(n, seed=3).double()
    ys = np.stack([codec.decode(codec.encode(x.float(), seed=s)).double().numpy()
                   for s in range(draws)])  # fmt: skip
    mean = ys.mean(axis=0)
    se = ys.std(axis=0, ddof=1) / math.sqrt(draws)
    z = (mean - x.numpy()) / se
    assert float(np.mean(z**2)) < 1.5  # chi-square / n: 1 when unbiased
    assert float(np.abs(z).max()) < SIGMAS + 1.0


# ------------------------------------------------------------------- variance factor


@pytest.mark.parametrize(
    ("n", "fraction", "bits", "block"),
    [(1000, 0.25, 2, 4096), (1000, 0.1, 1, 64), (300, 0.5, 4, 32)],
)
def test_factor_is_one_plus_inner_factor_of_k_times_n_over_k_minus_one(
    n, fraction, bits, block
) -> None:
    codec = _sub("uniform", fraction, bits=bits, block=block)
    k = math.ceil(fraction * n)
    inner = min(block, k) / (2**bits - 1) ** 2  # uniform's omega on k values
    omega = (1 + inner) * n / k - 1
    assert codec.variance_factor(n) == pytest.approx(omega, rel=1e-12)
    # measured: at most omega, at least the subsampling's own n / k - 1
    ratios = _ratios(codec, _x(n, seed=4), draws=200)
    se = ratios.std(ddof=1) / math.sqrt(len(ratios))
    assert ratios.mean() <= omega + SIGMAS * se
    assert ratios.mean() >= n / k - 1 - SIGMAS * se


def test_biased_or_unbounded_inner_codes_give_no_factor() -> None:
    assert _sub("sign", 0.5).variance_factor(100) is None
    assert not _sub("sign", 0.5).unbiased
    assert _sub("eden", 0.5, bits=1).variance_factor(100) is None  # EDEN claims none


# ------------------------------------------------------------------------- bytes


@pytest.mark.parametrize(("n", "fraction"), [(44_426, 0.25), (1000, 0.1), (7, 0.5)])
def test_bytes_are_header_k_and_the_inner_payload_about_p_inner_bits(n, fraction) -> None:
    codec = _sub("eden", fraction, bits=1)
    x = _x(n, seed=5)
    payload = bytes(codec.encode(x, seed=9))
    k = math.ceil(fraction * n)
    inner = codec.inner.encode(x[:k].contiguous(), seed=1)  # same size on any k values
    # header (1 dim), k, the inner codec id and seed flag, the inner body
    assert len(payload) == HEADER_FIXED_BYTES + 4 + 4 + 1 + len(inner.body)
    # nominal: the inner codec's bits on k values, per coordinate of n
    nominal = codec.inner.nominal_bits(k) * k / n
    assert codec.nominal_bits(n) == pytest.approx(nominal, rel=1e-12)
    if n > 10_000:  # about p bits a coordinate for 1-bit EDEN (scales: 32 bits a block)
        assert codec.nominal_bits(n) < fraction * (1 + 32 / 256) * 1.01
        assert len(payload) * 8 / n < 0.3


def test_spec_round_trips_through_make_codec_from_spec() -> None:
    codec = _sub("eden", 0.125, bits=2, block=512)
    again = make_codec_from_spec(codec.spec())
    x = _x(3000, seed=6)
    assert bytes(again.encode(x, seed=3)) == bytes(codec.encode(x, seed=3))
    inner = {k: v for k, v in codec.inner.spec().items() if k != "name"}
    assert codec.spec() == {"name": "subsample", "inner": "eden", "fraction": 0.125, **inner}


# --------------------------------------------------------------------- bad input


@pytest.mark.parametrize("fraction", [0, -0.1, 1.5, float("nan"), True, "0.5", None])
def test_a_fraction_outside_zero_one_is_refused_naming_it(fraction) -> None:
    with pytest.raises(ValueError, match="fraction"):
        make_codec("subsample", inner="uniform", fraction=fraction, bits=2)


@pytest.mark.parametrize("inner", [None, "ef", "residual", "onebit", "subsample", 3])
def test_an_inner_that_is_not_a_stateless_codec_is_refused(inner) -> None:
    with pytest.raises(ValueError, match="inner"):
        make_codec("subsample", inner=inner, fraction=0.5)


def test_a_nan_outside_the_subset_is_refused_all_the_same() -> None:
    x = torch.zeros(1000)
    idx = set(random_subset(5, 1000, 10).tolist())
    x[next(i for i in range(1000) if i not in idx)] = float("nan")
    with pytest.raises(ValueError, match=r"finite|NaN|nan"):
        _sub("uniform", 0.01, bits=2).encode(x, seed=5)


def _with_k(payload: bytes, k: int) -> bytes:
    head = HEADER_FIXED_BYTES + 4  # one dimension
    return payload[:head] + struct.pack("<I", k) + payload[head + 4 :]


def test_a_payload_claiming_more_kept_coordinates_than_the_tensor_is_refused() -> None:
    codec = _sub("uniform", 0.5, bits=2)
    good = bytes(codec.encode(_x(100), seed=1))
    for k in (101, 2**32 - 1, 0):
        with pytest.raises(PayloadError, match="keeps"):
            decode_bytes(_with_k(good, k))


def test_an_inner_payload_of_another_shape_or_codec_is_refused() -> None:
    codec = _sub("uniform", 0.5, bits=2)
    good = bytes(codec.encode(_x(100), seed=1))
    # k says 30, the inner body holds 50 values' codes (2 bits each: 13 bytes, not 8)
    with pytest.raises(PayloadError):
        decode_bytes(_with_k(good, 30))
    # a k whose codes take the same bytes decodes without context; the server refuses
    # any k but its spec's before decoding
    with pytest.raises(SpecMismatch, match="k"):
        codec.check_payload(parse_payload(_with_k(good, 49)))
    nested = _sub("fp32", 1.0)
    inner_sub = bytes(nested.encode(_x(50), seed=2))
    # a subsample inside the subsample: its entry names the stage itself
    entry = bytes([nested.codec_id | INNER_SEEDED]) + bytes(parse_payload(inner_sub).body)
    wrapped = good[: HEADER_FIXED_BYTES + 4] + struct.pack("<I", 50) + entry
    with pytest.raises(PayloadError, match="inner codec id 16 not allowed"):
        decode_bytes(wrapped)
    with pytest.raises(PayloadError):
        decode_bytes(good[: HEADER_FIXED_BYTES + 4 + 2])  # truncated parameters


def test_the_server_refuses_another_fraction_inner_codec_or_seed() -> None:
    codec = _sub("uniform", 0.5, bits=2, block=64)
    x = _x(100)
    codec.check_payload(codec.encode(x, seed=1))  # its own: accepted
    for other in (_sub("uniform", 0.25, bits=2, block=64), _sub("dither", 0.5, bits=2),
                  _sub("uniform", 0.5, bits=3, block=64)):  # fmt: skip
        with pytest.raises((SpecMismatch, PayloadError)):
            codec.check_payload(other.encode(x, seed=1))
    # EDEN's public rotation: the inner seed is the one derived from the outer, so an
    # inner entry that says "no seed" is refused
    codec = _sub("eden", 0.5, bits=1)
    payload = codec.encode(x, seed=1)
    body = bytearray(payload.body)
    assert body[4] & INNER_SEEDED
    body[4] ^= INNER_SEEDED
    head = bytes(payload)[: len(bytes(payload)) - len(payload.body)]
    with pytest.raises(SpecMismatch, match="seed"):
        codec.check_payload(parse_payload(head + bytes(body)))


def test_an_inner_code_that_draws_gets_the_seed_derived_from_the_subsets() -> None:
    """The inner entry carries no seed, only a flag: the reader's rebuilt inner payload
    is, byte for byte, the one the inner codec made with inner_seed(seed)."""
    codec, seed, n = _sub("eden", 0.25, bits=1), 4242, 2000
    x = _x(n, seed=8)
    payload = codec.encode(x, seed=seed)
    k = math.ceil(0.25 * n)
    kept_values = x[torch.from_numpy(random_subset(seed, n, k))].contiguous()
    own = codec.inner.encode(kept_values, seed=inner_seed(seed))
    rebuilt = parse_inner_vector(type(codec), payload.body[4:], k, seed)
    assert rebuilt.header.seed == inner_seed(seed) != seed
    assert bytes(rebuilt) == bytes(own)
