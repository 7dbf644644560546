"""Every codec: round trips, real packed sizes, unbiasedness and variance bounds where
claimed (tolerances derived from the measured variance), and clear errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcomp.codecs import PayloadError, codec_names, decode_bytes, make_codec
from fedcomp.codecs.packing import (
    BitWriter,
    decode_varints,
    encode_varints,
    pack_bits,
    packed_size,
    unpack_bits,
)
from fedcomp.codecs.sparse import _threshold_subset, random_subset

SPECS = {
    "fp32": {},
    "fp16": {},
    "bf16": {},
    "uniform8": {"name": "uniform", "bits": 8, "block": 64},
    "uniform4": {"name": "uniform", "bits": 4, "block": 64},
    "uniform3": {"name": "uniform", "bits": 3, "block": 50},
    "uniform1": {"name": "uniform", "bits": 1, "block": 64},
    "dither4": {"name": "dither", "bits": 4, "block": 64},
    "dither1": {"name": "dither", "bits": 1, "block": 64},
    "qsgd16": {"name": "qsgd", "levels": 16, "block": 128},
    "qsgd1": {"name": "qsgd", "levels": 1, "block": 128},
    "sign": {"name": "sign", "block": 64},
    "topk": {"name": "topk", "fraction": 0.1},
    "sparseq": {"name": "sparseq", "fraction": 0.1, "bits": 4, "block": 64},
    "lowrank": {"name": "lowrank", "rank": 2},
    "randk": {"name": "randk", "fraction": 0.25},
    "eden1": {"name": "eden", "bits": 1, "block": 256},
    "eden3mse": {"name": "eden", "bits": 3, "scale": "mse", "block": 512, "rotations": 2},
    "rotate_uniform2": {"name": "rotate", "inner": "uniform", "bits": 2, "block": 64},
    "adaptive": {"name": "adaptive", "bits": 2.0, "block": 256},
    "sketch": {"name": "sketch", "fraction": 0.5, "rows": 3, "keep": 0.1},
    "subsample_eden1": {
        "name": "subsample",
        "inner": "eden",
        "fraction": 0.25,
        "bits": 1,
        "block": 256,
    },
}


def _codec(key: str):
    spec = dict(SPECS[key])
    return make_codec(spec.pop("name", key), **spec)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


INPUTS = {
    "matrix": lambda: torch.randn(33, 17, generator=_gen(0)),
    "scalar": lambda: torch.tensor(-1.75),
    "empty": lambda: torch.empty(0, 5),
    "all_zero": lambda: torch.zeros(40),
    "constant": lambda: torch.full((70,), 0.3),
    "huge": lambda: torch.randn(50, generator=_gen(1)) * 1e30,
    "tiny": lambda: torch.randn(50, generator=_gen(2)) * 1e-30,
    "non_contiguous": lambda: torch.randn(20, 9, generator=_gen(3)).t(),
    "fp16": lambda: torch.randn(65, generator=_gen(4)).half(),
    "bf16": lambda: torch.randn(65, generator=_gen(5)).bfloat16(),
}


def test_every_registered_codec_is_covered() -> None:
    # raw: the tensor policy's; entropy: a stage around these (tests/test_codecs_entropy.py)
    covered = {SPECS[k].get("name", k) for k in SPECS} | {"raw", "entropy"}
    assert covered == set(codec_names())


@pytest.mark.parametrize("key", sorted(SPECS))
@pytest.mark.parametrize("kind", sorted(INPUTS))
def test_roundtrip_keeps_shape_and_dtype(key: str, kind: str) -> None:
    x = INPUTS[kind]()
    codec = _codec(key)
    if key == "fp16" and kind == "huge":
        with pytest.raises(ValueError, match="overflow"):
            codec.encode(x, seed=1)
        return
    payload = codec.encode(x, seed=11)
    y = codec.decode(payload)
    z = decode_bytes(bytes(payload))
    assert y.shape == x.shape == z.shape and y.dtype == x.dtype == z.dtype
    assert torch.equal(y, z)
    assert torch.isfinite(y).all()
    if kind in ("huge", "tiny"):
        _assert_scale_equivariant(key, codec, x, y, 1e30 if kind == "huge" else 1e-30)
    if kind == "matrix":
        _assert_matrix_values(key, codec, x, y)
    if kind in ("all_zero", "empty"):
        assert torch.equal(y, torch.zeros_like(x))
    rotated = key.startswith(("eden", "rotate", "adaptive"))  # a rotated constant is not constant
    if (
        kind == "constant"
        and not rotated
        # a sketch's median gives a constant back only where its buckets hold equal counts
        and not key.startswith(
            ("qsgd", "topk", "randk", "dither", "sparseq", "subsample", "sketch")
        )
    ):
        # max|x|- and mean|x|-scaled codes put a constant block exactly on a level
        # (subtractive dither does not: its error is uniform on a step whatever x is).
        assert torch.allclose(y, x, rtol=1e-2)


def _assert_scale_equivariant(key: str, codec, x: torch.Tensor, y: torch.Tensor, c: float):
    """Every codec commutes with scaling: decoding c x (same seed) gives c times the
    decoding of x, up to float32 rounding of the scaled arithmetic (1e-4 of the largest
    value), where c x is 1e30 or 1e-30 and squares overflow or vanish in float32.
    Exceptions from the formats themselves: fp16 flushes 1e-30 to 0; bf16 rounds c x
    to 8 significant bits (relative error <= 2^-8 of each value)."""
    base = x.double() / c
    if key == "fp16":
        assert torch.equal(y, torch.zeros_like(x))  # below fp16's smallest subnormal
        return
    if key in ("fp32", "bf16"):
        rel = 0.0 if key == "fp32" else 2.0**-8
        assert torch.all((y.double() / c - base).abs() <= rel * base.abs() * (1 + 1e-6))
        return
    y1 = codec.decode(codec.encode(base.float(), seed=11)).double()
    assert float(y1.abs().max()) > 0
    assert torch.all((y.double() / c - y1).abs() <= 1e-4 * float(y1.abs().max())), key


def _assert_matrix_values(key: str, codec, x: torch.Tensor, y: torch.Tensor) -> None:
    """A matrix is coded as its flattened values (the shape travels in the header):
    the same seed decodes to the same values as the 1-d tensor, except for lowrank,
    which must decode to P P^T x with P's columns orthonormal (one power iteration:
    Q' = x^T P is what travels)."""
    if key != "lowrank":
        flat = codec.decode(codec.encode(x.reshape(-1), seed=11))
        assert torch.equal(y.reshape(-1), flat)
        assert float(y.abs().max()) > 0
        return
    rows, cols, rank = x.shape[0], x.shape[1], SPECS[key]["rank"]
    values = np.frombuffer(bytes(codec.encode(x, seed=11).body)[12:], "<f4").astype(np.float64)
    p = values[: rows * rank].reshape(rows, rank)
    q = values[rows * rank :].reshape(cols, rank)
    assert np.allclose(p.T @ p, np.eye(rank), atol=1e-5)
    assert np.allclose(q, x.double().numpy().T @ p, atol=1e-4)
    assert np.allclose(y.double().numpy(), p @ p.T @ x.double().numpy(), atol=1e-4)
    assert 0 < float(y.norm()) <= float(x.norm())


#: Codecs that draw randomness from the seed (dither, rounding, subsets, rotations):
#: the same seed must give the same bytes (reproducible runs), another seed others.
SEEDED = ["uniform4", "dither4", "qsgd16", "randk", "eden1", "rotate_uniform2", "sparseq"]


@pytest.mark.parametrize("key", SEEDED)
def test_same_seed_same_bytes(key: str) -> None:
    x = INPUTS["matrix"]()
    codec = _codec(key)
    assert bytes(codec.encode(x, seed=5)) == bytes(codec.encode(x, seed=5))
    assert bytes(codec.encode(x, seed=5)) != bytes(codec.encode(x, seed=6))


@pytest.mark.parametrize("key", ["uniform4", "dither4", "qsgd16", "randk"])
def test_different_seeds_draw_differently(key: str) -> None:
    x = INPUTS["matrix"]()
    codec = _codec(key)
    assert bytes(codec.encode(x, seed=5)) != bytes(codec.encode(x, seed=6))


def _layout_size(key: str, x: torch.Tensor) -> int:
    """The packed size from each codec's documented layout, computed independently."""
    n, header = x.numel(), 16 + 4 * x.dim()
    spec = SPECS[key]
    name = spec.get("name", key)
    if name == "fp32":
        return header + 4 * n
    if name in ("fp16", "bf16"):
        return header + 2 * n
    if name in ("uniform", "dither"):
        return header + 6 + 4 * math.ceil(n / spec["block"]) + math.ceil(n * spec["bits"] / 8)
    if name == "qsgd":
        width = math.ceil(math.log2(2 * spec["levels"] + 1))
        return header + 6 + 4 * math.ceil(n / spec["block"]) + math.ceil(n * width / 8)
    if name == "sign":
        return header + 4 + 4 * math.ceil(n / spec["block"]) + math.ceil(n / 8)
    if name == "randk":
        return header + 8 + 4 * max(1, math.ceil(spec["fraction"] * n))
    if name == "lowrank":  # 1-d and small tensors: dense; matrices: rank (rows + cols)
        rows, cols = (x.shape[0], n // x.shape[0]) if x.dim() >= 2 else (1, n)
        values = (
            rows * cols
            if spec["rank"] * (rows + cols) >= rows * cols
            else spec["rank"] * (rows + cols)
        )
        return header + 12 + 4 * values
    if name == "eden":
        padded, blocks = _rotation_blocks(n, spec["block"])
        return header + 8 + 4 * blocks + math.ceil(padded * spec["bits"] / 8)
    if name == "rotate":
        padded, _ = _rotation_blocks(n, 1024)
        # the inner payload less its header (one byte: codec id, seed flag; format 2)
        inner = 1 + 6 + 4 * math.ceil(padded / spec["block"]) + padded * spec["bits"] // 8
        return header + 8 + inner
    if name == "adaptive":  # a lone tensor: EDEN at the widest width the budget pays,
        # its payload for the flattened tensor less its header (format 2: one byte)
        padded, blocks = _rotation_blocks(n, spec["block"])
        return header + 1 + 8 + 4 * blocks + math.ceil(padded * math.floor(spec["bits"]) / 8)
    if name == "sketch":  # rows (u8), value dtype (u8), columns (u32), r c float32 values
        cols = max(1, math.ceil(spec["fraction"] * n / spec["rows"]))
        return header + 6 + 4 * spec["rows"] * cols
    if name == "subsample":  # k, then the inner codec's payload for the k kept values
        k = max(1, math.ceil(spec["fraction"] * n))
        inner = {k_: v for k_, v in spec.items() if k_ not in ("name", "inner", "fraction")}
        key_inner = next(key for key, s in SPECS.items() if s == {"name": spec["inner"], **inner})
        inner_header = 16 + 4  # a vector: the reader's, one byte in its place (format 2)
        return header + 4 + _layout_size(key_inner, torch.zeros(k)) - inner_header + 1
    raise AssertionError(name)


def _rotation_blocks(n: int, block: int) -> tuple[int, int]:
    """The padded length and block count of a rotation: full blocks of ``block``, then
    the tail padded to a multiple of 256 and cut into powers of two (its binary digits)."""
    full, rest = divmod(n, block)
    tail = math.ceil(rest / 256) * 256
    return full * block + tail, full + bin(tail).count("1")


# topk and sparseq: the index coding depends on where the kept values are
@pytest.mark.parametrize("key", [k for k in sorted(SPECS) if k not in ("topk", "sparseq")])
@pytest.mark.parametrize("shape", [(1000,), (37, 29), (3,)])
def test_codec_bytes_equal_the_packed_layout(key: str, shape: tuple[int, ...]) -> None:
    x = torch.randn(*shape, generator=_gen(7))
    assert len(bytes(_codec(key).encode(x, seed=3))) == _layout_size(key, x)


# sparseq's nominal size is an upper bound; lowrank's is for a square matrix
@pytest.mark.parametrize("key", [k for k in sorted(SPECS) if k not in ("sparseq", "lowrank")])
def test_large_tensors_are_within_two_percent_of_nominal(key: str) -> None:
    x = torch.randn(200_000, generator=_gen(8))
    codec = _codec(key)
    header = 16 + 4
    measured_bits = 8 * (len(bytes(codec.encode(x, seed=1))) - header) / x.numel()
    nominal = codec.nominal_bits(x.numel())
    # topk's nominal assumes one varint byte per gap; everything else is exact layout.
    assert abs(measured_bits - nominal) <= 0.02 * nominal + 64 / x.numel()


def test_topk_keeps_the_largest_and_codes_indices_compactly() -> None:
    x = torch.randn(10_000, generator=_gen(9))
    payload = make_codec("topk", k=100).encode(x, seed=0)
    y = decode_bytes(bytes(payload))
    expected = torch.zeros_like(x)
    top = x.abs().topk(100).indices
    expected[top] = x[top]
    assert torch.equal(y, expected)
    index_bytes = int.from_bytes(payload.body[8:16], "little")
    assert index_bytes < 2 * 100  # about one byte per gap at this density, not 8


def _assert_uniform_k_subsets(draw, n: int, k: int, trials: int) -> None:
    """``draw(seed)`` gives k distinct sorted indices in [0, n), uniform over k-subsets:
    every index with probability k/n (chi-square over indices and over blocks of 64
    against the hypergeometric variance, at about 5 sigma), every adjacent pair with
    probability k(k-1)/(n(n-1))."""
    counts = np.zeros(n)
    pairs = 0
    for seed in range(trials):
        idx = draw(seed)
        assert idx.size == k and np.all(np.diff(idx) > 0) and idx[0] >= 0 and idx[-1] < n
        counts[idx] += 1
        pairs += int(np.count_nonzero(np.diff(idx) == 1))
    assert np.array_equal(draw(17), draw(17))
    blocks = counts[: n - n % 64].reshape(-1, 64).sum(axis=1)
    q = k / n
    for size, cells in [(1, counts), (64, blocks)][: 2 if blocks.size > 1 else 1]:
        # a cell of `size` indices holds a hypergeometric count in each draw
        var = trials * size * q * (1 - q) * (n - size) / (n - 1)
        chi2 = float(((cells - trials * size * q) ** 2 / var).sum())
        dof = cells.size - 1
        assert chi2 < dof + 5 * math.sqrt(2 * dof)
    p_pair = k * (k - 1) / (n * (n - 1))
    mean = trials * (n - 1) * p_pair
    # overlapping pairs are positively correlated: three times the independent variance
    assert abs(pairs - mean) < 5 * math.sqrt(3 * mean)


def test_random_subset_is_uniform_distinct_and_reproducible() -> None:
    # numel <= 10,000: numpy's Floyd sampler
    _assert_uniform_k_subsets(lambda seed: random_subset(seed, 50, 10), 50, 10, 4000)


@pytest.mark.parametrize("n, k", [(10_240, 2_560), (10_007, 9_000), (12_000, 601)])
def test_large_share_subsets_are_uniform(n: int, k: int) -> None:
    # above numel / 20 of more than 10,000 coordinates: a level on 8-bit keys, thinned
    _assert_uniform_k_subsets(lambda seed: random_subset(seed, n, k), n, k, 300)


def test_large_share_subsets_stay_uniform_when_the_first_level_falls_short() -> None:
    # a margin of -4 standard deviations: the first level keeps fewer than k almost always,
    # so the level is raised before the surplus is dropped
    n, k = 10_240, 2_560

    def draw(seed: int) -> np.ndarray:
        return _threshold_subset(np.random.Philox(seed), n, k, margin=-4.0)

    _assert_uniform_k_subsets(draw, n, k, 300)


UNBIASED = [
    "fp32",
    "uniform8",
    "uniform4",
    "uniform3",
    "uniform1",
    "dither4",
    "dither1",
    "qsgd16",
    "qsgd1",
    "randk",
]


def _monte_carlo(
    key: str, x: torch.Tensor, draws: int, projections: list[float] | None = None
) -> tuple[torch.Tensor, float]:
    """The mean decoding over ``draws`` seeds and the mean squared error of one draw;
    ``projections`` collects each draw's <y - x, x> / ||x||^2 (its scale error)."""
    codec = _codec(key)
    total = torch.zeros_like(x, dtype=torch.float64)
    err = 0.0
    x64 = x.double()
    for seed in range(draws):
        y = codec.decode(codec.encode(x, seed=1000 + seed)).to(torch.float64)
        total += y
        err += float(((y - x64) ** 2).sum())
        if projections is not None:
            projections.append(float((y - x64) @ x64) / float(x64 @ x64))
    return total / draws, err / draws


@pytest.mark.parametrize("key", UNBIASED)
def test_unbiased_codecs_average_to_the_input(key: str) -> None:
    x = torch.randn(400, generator=_gen(10)) * torch.linspace(0.01, 3, 400)
    draws = 300
    projections: list[float] = []
    mean, per_draw_err = _monte_carlo(key, x, draws, projections)
    # Without bias E||mean - x||^2 = E||Q(x) - x||^2 / draws; chi-square concentration
    # over 400 coordinates makes 2x a > 5-sigma margin. A bias b adds ||b||^2.
    bias2 = float(((mean - x.double()) ** 2).sum())
    assert bias2 <= 2.0 * per_draw_err / draws + 1e-12
    # A scale error (E decode = (1 + a) x) hides in that sum for the noisy codecs (at
    # omega ~ 10 it admits a = 15%); its own statistic is the projection on x: the
    # draws' <y - x, x> / ||x||^2 are independent with mean a, so their mean is within
    # 5 standard errors of 0 without bias, and that band is at most 7.5% for every
    # codec (measured 0.07 for qsgd1): a 15% scale error is 10 standard errors out.
    a = np.array(projections)
    se = a.std(ddof=1) / math.sqrt(draws)
    assert abs(a.mean()) <= 5 * se + 1e-12, (a.mean(), se)
    assert 5 * se <= 0.075, se


@pytest.mark.parametrize("key", ["sign", "topk"])
def test_the_unbiasedness_check_catches_biased_codecs(key: str) -> None:
    x = torch.randn(400, generator=_gen(10)) * torch.linspace(0.01, 3, 400)
    mean, per_draw_err = _monte_carlo(key, x, 30)
    bias2 = float(((mean - x.double()) ** 2).sum())
    assert bias2 > 2.0 * per_draw_err / 30


def _blocks(x: np.ndarray, block: int) -> list[np.ndarray]:
    return [x[i : i + block] for i in range(0, x.size, block)]


def _expected_error(key: str, x: np.ndarray) -> float:
    """E||decode(encode(x)) - x||^2 evaluated on this input, from each codec's definition
    (not from its code): stochastic rounding to a grid of step d at fractional position
    f has variance d^2 f (1 - f); subtractive dither d^2 / 12; random-k keeps x_i n/k
    with probability k/n."""
    spec = SPECS[key]
    name = spec.get("name", key)
    if name == "fp32":
        return 0.0
    if name == "randk":
        k = int(np.ceil(spec["fraction"] * x.size))
        return float(np.sum(x**2) * (x.size / k - 1))
    total = 0.0
    for part in _blocks(x, spec["block"]):
        if name == "qsgd":
            norm = np.sqrt(np.sum(part**2))
            step, t = norm / spec["levels"], np.abs(part) * spec["levels"] / norm
        else:
            scale = np.abs(part).max()
            step = 2 * scale / (2 ** spec["bits"] - 1)
            t = (part + scale) / step
        if name == "dither":
            total += part.size * step**2 / 12
        else:
            f = t - np.floor(t)
            total += float(np.sum(step**2 * f * (1 - f)))
    return total


@pytest.mark.parametrize("key", UNBIASED)
def test_mean_squared_error_is_the_codecs_variance(key: str) -> None:
    """The measured error equals the variance formula on this input, within a Monte Carlo
    tolerance from the spread of the per-draw errors (not the worst case omega)."""
    x = torch.randn(512, generator=_gen(11)) * torch.linspace(0.01, 3, 512)
    x64 = x.double().numpy()
    codec = _codec(key)
    errors = np.array(
        [
            float(((codec.decode(codec.encode(x, seed=2000 + s)).double() - x.double()) ** 2).sum())
            for s in range(200)
        ]
    )
    expected = _expected_error(key, x64)
    tolerance = 5 * errors.std(ddof=1) / np.sqrt(errors.size) + 1e-6 * expected + 1e-12
    assert abs(errors.mean() - expected) <= tolerance, (errors.mean(), expected, tolerance)
    omega = codec.variance_factor(x.numel())
    assert expected <= omega * float(np.sum(x64**2)) * (1 + 1e-9)  # the bound still holds


@pytest.mark.parametrize(
    ("name", "params", "needle"),
    [
        ("uniform", {"bits": 0}, "bits"),
        ("uniform", {"bits": 9}, "bits"),
        ("uniform", {"block": 0}, "block"),
        ("qsgd", {"levels": 0}, "levels"),
        ("qsgd", {"levels": 500}, "levels"),
        ("sign", {"block": -4}, "block"),
        ("topk", {"fraction": 0.0}, "fraction"),
        ("topk", {"fraction": 1.5}, "fraction"),
        ("randk", {"k": 0}, "k must"),
        ("randk", {"k": 3, "fraction": 0.1}, "exactly one"),
    ],
)
def test_bad_parameters_are_rejected_at_construction(name: str, params: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        make_codec(name, **params)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("key", [k for k in sorted(SPECS) if k not in ("fp32", "fp16", "bf16")])
def test_nan_updates_are_refused_at_encode(key: str, bad: float) -> None:
    x = torch.randn(10)
    x[3] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        _codec(key).encode(x, seed=0)


@pytest.mark.parametrize("key", sorted(SPECS))
def test_every_truncation_and_extension_is_a_payload_error(key: str) -> None:
    buf = bytes(_codec(key).encode(torch.randn(30, generator=_gen(12)), seed=2))
    for cut in range(len(buf)):
        with pytest.raises(PayloadError):
            decode_bytes(buf[:cut])
    with pytest.raises(PayloadError):
        decode_bytes(buf + b"\x00")


@pytest.mark.parametrize("key", ["uniform8", "qsgd16", "sign"])
def test_nan_scale_in_a_payload_is_rejected(key: str) -> None:
    payload = _codec(key).encode(torch.randn(30, generator=_gen(13)), seed=2)
    body = bytearray(payload.body)
    offset = 4 if key == "sign" else 6
    body[offset : offset + 4] = np.array([np.nan], dtype="<f4").tobytes()
    buf = bytes(payload)[: len(bytes(payload)) - len(payload.body)] + bytes(body)
    with pytest.raises(PayloadError, match="scales"):
        decode_bytes(buf)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.lists(st.integers(0, 255), max_size=70))
def test_bit_packing_roundtrip(bits: int, values: list[int]) -> None:
    codes = np.array([v % (1 << bits) for v in values], dtype=np.uint8)
    buf = pack_bits(codes, bits)
    assert len(buf) == packed_size(codes.size, bits) == math.ceil(codes.size * bits / 8)
    assert np.array_equal(unpack_bits(buf, codes.size, bits), codes)
    # the documented layout: the codes' bits concatenated MSB first, zero-padded
    stream = "".join(format(int(c), f"0{bits}b") for c in codes)
    stream += "0" * (-len(stream) % 8)
    assert buf == bytes(int(stream[i : i + 8], 2) for i in range(0, len(stream), 8))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.lists(st.integers(0, 40), max_size=8), st.integers(0, 2**32))
def test_bit_writer_fed_in_pieces_equals_one_pack(bits: int, lengths: list[int], seed: int) -> None:
    """Pieces of any length (rests of fewer than eight codes carried to the next)."""
    rng = np.random.default_rng(seed)
    pieces = [rng.integers(0, 1 << bits, n).astype(np.uint8) for n in lengths]
    writer = BitWriter(bits)
    for piece in pieces:
        writer.add(piece)
    whole = np.concatenate([np.zeros(0, np.uint8), *pieces])
    assert writer.finish() == pack_bits(whole, bits)


def test_qsgd_over_many_chunks_stays_on_its_grid_within_one_step() -> None:
    """600,000 coordinates in blocks of 1,020: several 2^18-coordinate chunks whose code
    counts are not multiples of eight (6-bit codes carried between chunks). Every value
    decodes to a multiple of its block's norm / levels, within one such step of x."""
    levels, block, n = 16, 1020, 600_000
    x = torch.randn(n, generator=torch.Generator().manual_seed(4), dtype=torch.float64).float()
    y = decode_bytes(bytes(make_codec("qsgd", levels=levels, block=block).encode(x, seed=9)))
    pad = (-n) % block
    xb = torch.cat([x, torch.zeros(pad)]).double().view(-1, block)
    yb = torch.cat([y, torch.zeros(pad)]).double().view(-1, block)
    step = xb.norm(dim=1, keepdim=True) / levels
    k = yb / step
    assert float((k - k.round()).abs().max()) < 1e-3  # on the grid
    assert bool(((yb - xb).abs() <= step * (1 + 1e-5)).all())  # within one step


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**63 - 1), max_size=40))
def test_varint_roundtrip(values: list[int]) -> None:
    arr = np.array(values, dtype=np.uint64)
    buf = encode_varints(arr)
    assert len(buf) == sum(max(1, math.ceil(v.bit_length() / 7)) for v in values)
    assert np.array_equal(decode_varints(buf, arr.size), arr)


def _varied(n: int = 4099, seed: int = 3) -> torch.Tensor:
    """Values over many magnitudes (per-block scales differ), including ties for the
    16-bit formats: exact halfway points between representable values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(4 * torch.randn(n, generator=g))
    x[:16] = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8] * 4)
    return x


def test_fp16_rounds_to_nearest_even_like_ieee() -> None:
    x = _varied().clamp(-6e4, 6e4)
    y = make_codec("fp16").decode(make_codec("fp16").encode(x, seed=0))
    expected = x.numpy().astype(np.float16).astype(np.float32)  # numpy's own IEEE cast
    assert np.array_equal(y.numpy(), expected)


def test_bf16_rounds_to_nearest_even_not_truncation() -> None:
    x = _varied()
    y = make_codec("bf16").decode(make_codec("bf16").encode(x, seed=0)).numpy()
    u = x.numpy().view(np.uint32).astype(np.uint64)
    bias = 0x7FFF + ((u >> 16) & 1)  # round half to even on the upper 16 bits
    expected = ((u + bias) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    truncated = (u & 0xFFFF0000).astype(np.uint32).view(np.float32)
    assert np.array_equal(y, expected)
    assert not np.array_equal(expected, truncated)  # the input tells the two apart


@pytest.mark.parametrize("block", [1, 7, 256, 5000])
def test_sign_sends_each_blocks_mean_magnitude(block: int) -> None:
    x = _varied().numpy()
    y = (
        make_codec("sign", block=block)
        .decode(make_codec("sign", block=block).encode(torch.from_numpy(x), seed=0))
        .numpy()
    )
    for start in range(0, x.size, block):
        part = x[start : start + block]
        scale = np.float32(np.abs(part).sum(dtype=np.float32) / np.float32(part.size))
        want = np.where(np.signbit(part), -scale, scale)
        np.testing.assert_allclose(y[start : start + block], want, rtol=1e-5)


@pytest.mark.parametrize("bits", [1, 4])
def test_subtractive_dither_error_is_uniform_on_one_step_whatever_the_input(bits) -> None:
    """docs/codecs.md: dither's error is uniform on one step, independent of x. Each
    coordinate's error divided by its block's step (2 max|x| / (2^b - 1)) lies in
    [-1/2, 1/2] (up to the dither's 2^-16 resolution: it is k / 2^16) and is uniform
    there (Kolmogorov-Smirnov against U(-1/2, 1/2)), for an
    input sitting on the grid and one halfway between grid points, where stochastic
    rounding's error would be two-valued."""
    from scipy import stats

    codec = make_codec("dither", bits=bits, block=64)
    levels = 2**bits - 1
    grid = torch.arange(64, dtype=torch.float64) % (levels + 1) * 2 / levels - 1
    for shift in (0.0, 0.5):  # on the grid; halfway (max|x| stays 1 per block)
        x = (grid + shift * 2 / levels).clamp(-1, 1).repeat(400).float()
        x[::64] = 1.0  # every block's scale is exactly 1
        step = 2.0 / levels
        err = np.concatenate(
            [
                (codec.decode(codec.encode(x, seed=s)).double() - x.double()).numpy()
                for s in range(5)
            ]
        )
        u = err / step
        assert np.abs(u).max() <= 0.5 + 2.0**-16
        assert stats.kstest(u, stats.uniform(loc=-0.5, scale=1.0).cdf).pvalue > 1e-3
    # The same test rejects stochastic rounding's error at the halfway input.
    rounding = make_codec("uniform", bits=bits, block=64)
    err = (rounding.decode(rounding.encode(x, seed=1)).double() - x.double()).numpy()
    assert stats.kstest(err / step, stats.uniform(loc=-0.5, scale=1.0).cdf).pvalue < 1e-6
