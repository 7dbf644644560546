"""Every codec's variance factor omega, against its closed form and against the error
measured on that codec's worst-case input.

``Codec.variance_factor(numel)`` claims ``E||decode(encode(x)) - x||^2 <= omega ||x||^2``
for every x; the residual protocol derives its step ``1 / (1 + omega)`` from it, so a
factor that is too large (a slower, still "correct" run) must fail a test as surely as
one that is too small. Each test computes omega from the definition, then measures the
normalized error on an input where the bound is (nearly) attained: measured >= c omega
for a c derived here, and <= omega + k sigma with sigma the Monte-Carlo standard error
computed from the error's own variance.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedcomp.codecs import codec_names, make_codec
from fedcomp.codecs.rotation import padded_length, unrotate

#: Monte-Carlo tolerance in standard errors (a two-sided 5-sigma band: a false failure
#: about once in 1.7 million runs; the tests below are deterministic in any case).
SIGMAS = 5.0
#: float32 arithmetic in encode/decode: relative error of one ratio of sums of squares.
FLOAT_RTOL = 1e-5


def _ratios(codec, x: torch.Tensor, draws: int, first_seed: int = 100) -> np.ndarray:
    """||decode(encode(x)) - x||^2 / ||x||^2 for ``draws`` seeds (float64)."""
    x64 = x.double()
    norm2 = float((x64**2).sum())
    out = []
    for seed in range(first_seed, first_seed + draws):
        y = codec.decode(codec.encode(x, seed=seed)).double()
        out.append(float(((y - x64) ** 2).sum()) / norm2)
    return np.array(out)


def _signs(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).choice([-1.0, 1.0], n)).float()


# ----------------------------------------------------------------------- every codec


#: Registered codecs whose variance_factor is None, and why (a claim, tested below).
NO_FACTOR = {
    "sign": "biased: a deterministic 1-bit code",
    "topk": "biased: keeps the largest magnitudes",
    "sparseq": "biased: top-k selection",
    "lowrank": "biased: a rank-r projection",
    "fp16": "biased: round to nearest",
    "bf16": "biased: round to nearest",
    "eden": "no bound is claimed for the Hadamard rotation (measured instead)",
    "adaptive": "EDEN's codes: no bound is claimed for the Hadamard rotation",
    "sketch": "biased: the median of the rows (each row is unbiased: tests/test_sketch.py)",
}
#: Registered codecs with a factor, tested in this file (the stages delegate).
#: (subsample: tests/test_subsample.py)
WITH_FACTOR = {"raw", "fp32", "uniform", "dither", "qsgd", "randk", "rotate", "entropy",
               "subsample"}  # fmt: skip


def test_every_registered_codec_is_classified() -> None:
    """A new codec must say here whether it has a variance factor."""
    assert set(NO_FACTOR) | WITH_FACTOR == set(codec_names())
    assert not set(NO_FACTOR) & WITH_FACTOR


@pytest.mark.parametrize(
    "spec",
    [
        {"name": "sign", "block": 64},
        {"name": "topk", "fraction": 0.5},
        {"name": "sparseq", "fraction": 0.5},
        {"name": "lowrank", "rank": 2},
        {"name": "fp16"},
        {"name": "bf16"},
        # every EDEN variant, the unbiased one (2 rotations) included
        {"name": "eden", "bits": 1, "rotations": 2, "scale": "unbiased"},
        {"name": "eden", "bits": 4, "rotations": 1, "scale": "mse"},
        # stages around a codec without a factor have none either
        {"name": "rotate", "inner": "sign"},
        {"name": "topk", "fraction": 0.5, "entropy": "zstd"},
    ],
    ids=lambda s: "-".join(str(v) for v in s.values()),
)
def test_codecs_without_a_bound_return_none_deliberately(spec: dict) -> None:
    params = dict(spec)
    codec = make_codec(params.pop("name"), **params)
    for numel in (1, 256, 10_000):
        assert codec.variance_factor(numel) is None


@pytest.mark.parametrize("name", ["raw", "fp32"])
def test_exact_codecs_have_factor_zero_and_zero_error(name: str) -> None:
    codec = make_codec(name)
    x = torch.randn(300, generator=torch.Generator().manual_seed(1))
    assert codec.variance_factor(300) == 0.0
    assert torch.equal(codec.decode(codec.encode(x, seed=1)), x)


# ----------------------------------------------------------------------- uniform


def _uniform_worst(n: int, block: int, seed: int) -> torch.Tensor:
    """Per block one entry at max|x| = s (on a level) and the others at 0.

    The 2^b levels on [-s, s] are -s + j step, step = 2s / (2^b - 1): 2^b - 1 is odd,
    so 0 is exactly half-way between two levels and stochastic rounding sends it to
    +-step/2 with probability 1/2 each. Every zero entry then contributes exactly
    step^2 / 4 = s^2 / (2^b - 1)^2 per draw (no randomness in the squared error), and
    ||x_block||^2 = s^2: the ratio is (block - 1) / (2^b - 1)^2, i.e. omega (block - 1)
    / block, the supremum over inputs up to that factor.
    """
    x = torch.zeros(n)
    rng = np.random.default_rng(seed)
    for start in range(0, n, block):
        size = min(block, n - start)
        x[start + int(rng.integers(size))] = float(rng.uniform(0.5, 4.0)) * (
            1 if rng.random() < 0.5 else -1
        )
    return x


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize(("n", "block"), [(1024, 256), (100, 256), (96, 32)])
def test_uniform_factor_is_block_over_levels_squared_and_attained(
    bits: int, n: int, block: int
) -> None:
    codec = make_codec("uniform", bits=bits, block=block)
    levels = 2**bits - 1
    d = min(block, n)
    omega = d / levels**2
    assert codec.variance_factor(n) == pytest.approx(omega, rel=1e-15)
    # Every block is full (or the tensor is one short block), each with one entry at s.
    x = _uniform_worst(n, block, seed=bits)
    ratios = _ratios(codec, x, draws=4)
    # Deterministic per draw (|error| = step/2 exactly at every zero entry): the same
    # value every draw, equal to the definition up to float32 rounding.
    s2 = sum(float(x[i : i + block].abs().max()) ** 2 for i in range(0, n, block))
    expected = (
        sum(
            (min(block, n - i) - 1) * float(x[i : i + block].abs().max()) ** 2 / levels**2
            for i in range(0, n, block)
        )
        / s2
    )
    assert np.allclose(ratios, expected, rtol=FLOAT_RTOL, atol=0), (ratios, expected)
    # attained: c = (d - 1) / d of omega, and never above it
    c = (d - 1) / d
    assert ratios.min() >= c * omega * (1 - FLOAT_RTOL)
    assert ratios.max() <= omega * (1 + FLOAT_RTOL)


def test_uniform_typical_input_stays_below_the_factor() -> None:
    """On Gaussian data the bound is loose but holds: mean ratio <= omega + 5 sigma."""
    codec = make_codec("uniform", bits=2, block=256)
    x = torch.randn(2048, generator=torch.Generator().manual_seed(3))
    ratios = _ratios(codec, x, draws=20)
    se = ratios.std(ddof=1) / math.sqrt(ratios.size)
    assert ratios.mean() <= codec.variance_factor(2048) + SIGMAS * se
    assert ratios.mean() > 0


# ----------------------------------------------------------------------- dither


@pytest.mark.parametrize("bits", [1, 3, 8])
def test_dither_factor_is_a_third_of_uniform_and_attained(bits: int) -> None:
    """Subtractive dither: the error is uniform on one step whatever x is, variance
    step^2 / 12 per coordinate, step = 2s / (2^b - 1); with one entry at s and the rest
    0 per block, ||x_block||^2 = s^2 and the ratio's mean is exactly omega =
    block / (3 (2^b - 1)^2)."""
    n, block, draws = 1024, 256, 20
    codec = make_codec("dither", bits=bits, block=block)
    levels = 2**bits - 1
    omega = block / (3 * levels**2)
    assert codec.variance_factor(n) == pytest.approx(omega, rel=1e-15)
    x = _uniform_worst(n, block, seed=10 + bits)
    ratios = _ratios(codec, x, draws=draws)
    # Per coordinate e = step u, u ~ U(-1/2, 1/2): E e^2 = step^2 / 12 and
    # Var e^2 = step^4 (1/80 - 1/144) = step^4 / 180. The ratio of a draw is
    # sum_blocks sum_i e_i^2 / sum_blocks s_b^2 (steps differ per block).
    s2 = np.array([float(x[i : i + block].abs().max()) ** 2 for i in range(0, n, block)])
    step4 = (2 / levels) ** 4 * s2**2
    var_draw = float((block * step4 / 180).sum()) / float(s2.sum()) ** 2
    se = math.sqrt(var_draw / draws)
    assert abs(ratios.mean() - omega) <= SIGMAS * se + FLOAT_RTOL * omega, (
        ratios.mean(),
        omega,
        se,
    )
    assert SIGMAS * se < 0.05 * omega  # the band is narrow: a factor off by 10% fails


# ----------------------------------------------------------------------- QSGD


def _qsgd_exact(x: torch.Tensor, levels: int, block: int) -> tuple[float, float]:
    """E ratio and Var ratio of one draw, from the definition: u_i = s |x_i| / ||x_b||
    rounded up with probability f_i = frac(u_i); the error of coordinate i is
    (||x_b|| / s)(B_i - f_i): mean square f(1 - f), variance f(1 - f)(1 - 2f)^2 (times
    (||x_b|| / s)^2 and ^4)."""
    x64 = x.double().numpy()
    mean = var = 0.0
    for i in range(0, x64.size, block):
        b = x64[i : i + block]
        norm = float(np.linalg.norm(b))
        if norm == 0:
            continue
        u = levels * np.abs(b) / norm
        f = u - np.floor(u)
        mean += (norm / levels) ** 2 * float((f * (1 - f)).sum())
        var += (norm / levels) ** 4 * float((f * (1 - f) * (1 - 2 * f) ** 2).sum())
    total = float((x64**2).sum())
    return mean / total, var / total**2


@pytest.mark.parametrize(("levels", "block"), [(1, 1024), (4, 1024), (8, 256)])
def test_qsgd_factor_sqrt_branch_attained_by_the_flat_vector(levels: int, block: int) -> None:
    """sqrt(d) / s < d / s^2 (s < sqrt(d)): omega = sqrt(d) / s. The error's mean is
    (1 / s^2) sum f_i (1 - f_i) = (1 / s^2) (sum u_i - s^2) when every u_i <= 1, and
    sum u_i <= s sqrt(d) (Cauchy-Schwarz, equality for |x_i| all equal): the flat
    vector attains the supremum sqrt(d) / s - 1, a fraction c = 1 - s / sqrt(d) of
    omega."""
    d, draws = block, 40
    codec = make_codec("qsgd", levels=levels, block=block)
    omega = min(d / levels**2, math.sqrt(d) / levels)
    assert omega == math.sqrt(d) / levels
    assert codec.variance_factor(4 * block) == pytest.approx(omega, rel=1e-15)
    x = _signs(4 * block, seed=levels)  # four blocks, |x_i| = 1
    mean, var = _qsgd_exact(x, levels, block)
    assert mean == pytest.approx(math.sqrt(d) / levels - 1, rel=1e-12)
    ratios = _ratios(codec, x, draws=draws)
    se = math.sqrt(var / draws)
    assert abs(ratios.mean() - mean) <= SIGMAS * se + 1e-4 * mean, (ratios.mean(), mean, se)
    c = 1 - levels / math.sqrt(d)
    assert ratios.mean() >= c * omega - SIGMAS * se
    assert ratios.mean() <= omega + SIGMAS * se


def test_qsgd_factor_d_branch_is_the_papers_bound_four_times_the_supremum() -> None:
    """d < s^2: omega = d / s^2 (Alistarh et al.'s bound). Since f (1 - f) <= 1/4 the
    supremum is d / (4 s^2), attained when every u_i is a half-integer: d = 8, s = 4,
    u = (5, 3, 3, 3, 3, 1, 1, 1) / 2 has sum u^2 = 16 = s^2, so the ratio is exactly
    (1 / s^2) 8 / 4 = 1/8 = omega / 4 on every draw (f = 1/2: no variance)."""
    levels, block = 4, 8
    codec = make_codec("qsgd", levels=levels, block=block)
    omega = min(block / levels**2, math.sqrt(block) / levels)
    assert omega == block / levels**2 == 0.5
    assert codec.variance_factor(64) == pytest.approx(omega, rel=1e-15)
    u = torch.tensor([5.0, 3, 3, 3, 3, 1, 1, 1]) / 2
    assert float((u**2).sum()) == levels**2
    x = (u.repeat(8) * _signs(64, seed=5)) * 0.37  # eight blocks, any scale
    mean, var = _qsgd_exact(x, levels, block)
    assert mean == pytest.approx(block / (4 * levels**2), rel=1e-6)
    ratios = _ratios(codec, x, draws=3)
    assert np.allclose(ratios, omega / 4, rtol=1e-3), ratios
    assert var == pytest.approx(0.0, abs=1e-12)


# ----------------------------------------------------------------------- random-k


@pytest.mark.parametrize(("n", "k"), [(1000, 10), (1000, 250), (64, 63)])
def test_randk_factor_is_n_over_k_minus_one_with_equality(n: int, k: int) -> None:
    """E err_i^2 = (k/n)(n/k - 1)^2 x_i^2 + (1 - k/n) x_i^2 = (n/k - 1) x_i^2: the bound
    holds with equality for every x. For |x_i| all equal the squared error is the same
    every draw (k kept at n/k, the rest at 0): n^2/k - n, ratio n/k - 1 exactly."""
    codec = make_codec("randk", k=k)
    omega = n / k - 1
    assert codec.variance_factor(n) == pytest.approx(omega, rel=1e-15)
    ratios = _ratios(codec, _signs(n, seed=k), draws=3)
    assert np.allclose(ratios, omega, rtol=FLOAT_RTOL), ratios


def test_randk_factor_holds_with_equality_on_any_input() -> None:
    n, k, draws = 512, 64, 200
    codec = make_codec("randk", k=k)
    omega = n / k - 1
    x = torch.randn(n, generator=torch.Generator().manual_seed(4)) * torch.linspace(0.1, 5, n)
    ratios = _ratios(codec, x, draws=draws)
    se = ratios.std(ddof=1) / math.sqrt(draws)
    assert abs(ratios.mean() - omega) <= SIGMAS * se, (ratios.mean(), omega, se)
    assert SIGMAS * se < 0.2 * omega  # tight enough that omega +- 20% fails


# ----------------------------------------------------------------------- the stages


@pytest.mark.parametrize(("n", "block"), [(1024, 64), (700, 64), (700, 4096)])
def test_rotate_factor_is_the_inner_factor_on_the_padded_length(n: int, block: int) -> None:
    """R is orthogonal, so ||R^T Q(R x) - x|| = ||Q(y) - y|| with y = R x: the inner
    codec's factor on the padded length (the inner codec encodes all of it: with an
    inner block above it, omega counts the padded coordinates), attained when y is the
    inner worst case (x = R^T y)."""
    rb, bits = 256, 2
    codec = make_codec("rotate", inner="uniform", bits=bits, block=block, rotation_block=rb)
    padded = padded_length(n, rb)
    assert padded == math.ceil(n / rb) * rb
    omega = min(block, padded) / (2**bits - 1) ** 2
    assert codec.variance_factor(n) == pytest.approx(omega, rel=1e-15)
    if padded != n:
        return  # a cropped tail is not the inner worst case
    seed = 41
    y = _uniform_worst(padded, block, seed=7)
    x = unrotate(y, numel=n, seed=seed, block=rb, rotations=1)
    ratios = _ratios(codec, x, draws=1, first_seed=seed)
    # the rotated zeros are zeros up to float32 rounding (1e-7 s): still midpoints
    assert ratios[0] == pytest.approx((block - 1) / block * omega, rel=1e-4)


def test_entropy_stage_keeps_the_inner_factor_and_error() -> None:
    inner = make_codec("uniform", bits=3, block=128)
    codec = make_codec("uniform", bits=3, block=128, entropy="zstd")
    assert codec.variance_factor(1000) == inner.variance_factor(1000) == 128 / 49
    x = _uniform_worst(1024, 128, seed=2)
    assert np.array_equal(_ratios(codec, x, draws=2), _ratios(inner, x, draws=2))
    assert _ratios(codec, x, draws=1)[0] == pytest.approx(127 / 49, rel=FLOAT_RTOL)
