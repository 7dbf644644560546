"""The rotation stage and EDEN: the Hadamard transform against the dense matrix, the
padding rule, exact inversion, the Lloyd-Max fixed point, EDEN's normalized MSE at
1 bit (pi/2 - 1), unbiasedness by Monte Carlo with tolerances from the measured
variance, the least-squares scale's shrinkage, and bad input on both halves.

Tests taking the ``path`` fixture run twice: on the torch path and on the compiled one
(fedcomp.codecs.rotation_compiled, forced for every size)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedcomp import compiled
from fedcomp.codecs import PayloadError, TensorPolicy, decode_bytes, make_codec, rotation_compiled
from fedcomp.codecs.eden import lloyd_max_normal, normalized_mse
from fedcomp.codecs.packing import unpack_bits
from fedcomp.codecs.rotation import MIN_BLOCK, block_sizes, hadamard, rotate, unrotate
from fedcomp.codecs.wire import SpecMismatch
from fedcomp.flower.validation import decode_payloads
from fedcomp.rng import derive_seed


@pytest.fixture(params=["torch", "compiled"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test on the torch path, then on the compiled one for every size."""
    if request.param == "compiled":
        if not compiled.installed():
            pytest.skip("the compiled path needs numba")
        monkeypatch.setattr(rotation_compiled, "MIN_COMPILED", 0)
    else:
        monkeypatch.setattr(rotation_compiled, "MIN_COMPILED", 1 << 62)
    return request.param


def _sylvester(n: int) -> np.ndarray:
    """The orthonormal Hadamard matrix by Kronecker products, in float64."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    return h / math.sqrt(n)


@pytest.mark.parametrize("n", [1, 2, 64, 128, 1024, 4096])
def test_hadamard_equals_the_dense_matrix(n: int) -> None:
    x = torch.randn(3, n, generator=torch.Generator().manual_seed(n))
    want = x.double().numpy() @ _sylvester(n)
    got = hadamard(x).double().numpy()
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())


def test_large_hadamard_blocks_are_orthonormal_involutions() -> None:
    x = torch.randn(1, 1 << 18, generator=torch.Generator().manual_seed(0))
    y = hadamard(x)
    assert abs(float(y.norm() / x.norm()) - 1) < 1e-5
    assert float((hadamard(y) - x).abs().max()) < 1e-4
    # against the dense transform on one 2^12 sub-structure: first row of H is constant
    assert abs(float(y[0, 0]) - float(x.sum()) / math.sqrt(x.numel())) < 1e-3


@pytest.mark.parametrize("block", [256, 1024, 1 << 16])
@pytest.mark.parametrize("numel", [1, 255, 256, 257, 1000, 1024, 5000, 70_001])
def test_blocks_are_powers_of_two_with_padding_below_the_minimum_block(
    numel: int, block: int
) -> None:
    sizes = block_sizes(numel, block)
    padded = sum(sizes)
    assert numel <= padded < numel + MIN_BLOCK
    assert all(s & (s - 1) == 0 and MIN_BLOCK <= s <= block for s in sizes)
    assert sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("rotations", [1, 2])
def test_rotation_is_orthogonal_and_inverted_exactly(rotations: int, path: str) -> None:
    x = torch.randn(3001, generator=torch.Generator().manual_seed(1))
    y = rotate(x, seed=9, block=1024, rotations=rotations)
    assert y.numel() == sum(block_sizes(x.numel(), 1024))
    assert abs(float(y.norm() / x.norm()) - 1) < 1e-5
    back = unrotate(y, numel=x.numel(), seed=9, block=1024, rotations=rotations)
    assert float((back - x).abs().max()) < 1e-5
    other = rotate(x, seed=10, block=1024, rotations=rotations)
    assert not torch.allclose(y, other)  # the seed draws the signs


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_lloyd_max_centroids_are_the_conditional_means_of_their_cells(bits: int) -> None:
    centroids, thresholds = lloyd_max_normal(bits)
    assert np.allclose(centroids, -centroids[::-1])  # symmetric
    assert np.allclose(thresholds, (centroids[1:] + centroids[:-1]) / 2)
    # conditional means by numerical integration on a fine grid (independent of the code)
    t = np.linspace(-12, 12, 2_400_001)
    pdf = np.exp(-t * t / 2)
    cell = np.searchsorted(thresholds, t)
    for k, c in enumerate(centroids):
        mask = cell == k
        assert abs(np.sum(t[mask] * pdf[mask]) / np.sum(pdf[mask]) - c) < 1e-5
    if bits == 1:
        assert abs(centroids[1] - math.sqrt(2 / math.pi)) < 1e-12
        assert abs(normalized_mse(1) - (math.pi / 2 - 1)) < 1e-9  # DRIVE's constant


def test_eden_two_bits_meets_its_predicted_normalized_mse(path: str) -> None:
    """At 2 bits the prediction D / (1 - D) (D the Lloyd-Max distortion) is 0.1331."""
    x = _student_t(1 << 16, 4)
    nmse = _nmse(make_codec("eden", bits=2), x, range(3))
    assert abs(nmse.mean() / normalized_mse(2) - 1) < 0.05, nmse


def _student_t(n: int, seed: int) -> torch.Tensor:
    gen = np.random.default_rng(seed)
    return torch.from_numpy(gen.standard_t(3, size=n).astype(np.float32))


def _nmse(codec, x: torch.Tensor, seeds: range) -> np.ndarray:
    x64 = x.double()
    return np.array(
        [
            float(
                ((codec.decode(codec.encode(x, seed=s)).double() - x64) ** 2).sum()
                / x64.square().sum()
            )
            for s in seeds
        ]
    )


@pytest.mark.parametrize("rotations", [1, 2])
@pytest.mark.parametrize("kind", ["gaussian", "student_t3"])
def test_eden_one_bit_normalized_mse_is_pi_over_2_minus_1(
    kind: str, rotations: int, path: str
) -> None:
    """DRIVE/EDEN at 1 bit: vNMSE -> pi/2 - 1 for large blocks, whatever the input's
    distribution (after the rotation). Within 5%, on 2^16 coordinates."""
    n = 1 << 16
    x = (
        torch.randn(n, generator=torch.Generator().manual_seed(3))
        if kind == "gaussian"
        else _student_t(n, 3)
    )
    nmse = _nmse(make_codec("eden", bits=1, rotations=rotations), x, range(4))
    assert abs(nmse.mean() / (math.pi / 2 - 1) - 1) < 0.05, nmse


def _bias2_and_spread(codec, x: torch.Tensor, draws: int) -> tuple[float, float]:
    """||mean of the decodes - x||^2, and what the variance alone makes it on average:
    the mean squared error per draw over the number of draws."""
    total = torch.zeros(x.numel(), dtype=torch.float64)
    err = 0.0
    for s in range(draws):
        y = codec.decode(codec.encode(x, seed=10_000 + s)).double()
        total += y
        err += float(((y - x.double()) ** 2).sum())
    return float(((total / draws - x.double()) ** 2).sum()), err / draws / draws


@pytest.mark.parametrize(
    "spec",
    [
        {"name": "eden", "bits": 1, "block": 256},
        {"name": "eden", "bits": 2, "block": 256},
        {"name": "rotate", "inner": "uniform", "bits": 2, "block": 64, "rotation_block": 256},
    ],
    ids=["eden1", "eden2", "rotate_uniform2"],
)
def test_unbiased_rotated_codecs_average_to_the_input(spec: dict, path: str) -> None:
    """Without bias E||mean - x||^2 = E||Q(x) - x||^2 / draws; a bias b adds ||b||^2,
    which the 2x margin (over 600 coordinates, > 5 sigma) would expose."""
    x = _student_t(600, 5) * torch.linspace(0.05, 2, 600)
    codec = make_codec(**spec)
    draws = 400
    bias2, spread = _bias2_and_spread(codec, x, draws)
    assert bias2 <= 2.0 * spread, (bias2, spread)


def test_one_rotation_leaves_eden_measurably_biased_so_it_claims_no_unbiasedness() -> None:
    """With one Hadamard rotation the deterministic quantizer's bias does not average
    out: over 3200 draws ||mean - x||^2 stays about 5x above what the variance alone
    gives (two rotations, above, are within it)."""
    x = _student_t(600, 5) * torch.linspace(0.05, 2, 600)
    codec = make_codec("eden", bits=1, block=256, rotations=1)
    assert not codec.unbiased and make_codec("eden", bits=1).unbiased
    draws = 3200
    bias2, spread = _bias2_and_spread(codec, x, draws)
    assert bias2 > 2.0 * spread, (bias2, spread)


def test_the_least_squares_scale_shrinks_and_beats_the_unbiased_mse(path: str) -> None:
    """scale="mse" is biased towards zero (its mean projects on x with a factor < 1,
    measured far beyond the Monte Carlo spread) and has a lower error."""
    x = _student_t(4096, 7)
    unbiased, mse = make_codec("eden", bits=1), make_codec("eden", bits=1, scale="mse")
    shrink = np.array(
        [float(mse.decode(mse.encode(x, seed=s)).double() @ x.double()) for s in range(50)]
    ) / float(x.double() @ x.double())
    assert shrink.mean() + 10 * shrink.std(ddof=1) / math.sqrt(shrink.size) < 1.0
    assert _nmse(mse, x, range(10)).mean() < _nmse(unbiased, x, range(10)).mean()


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"bits": 0}, "bits"),
        ({"bits": 5}, "bits"),
        ({"scale": "median"}, "scale"),
        ({"rotations": 3}, "rotations"),
        ({"block": 300}, "power of two"),
        ({"block": 128}, "power of two"),
    ],
)
def test_bad_eden_settings_are_refused_naming_the_parameter(params: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        make_codec("eden", **params)


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"inner": "ef"}, "inner"),
        ({"inner": "rotate"}, "inner"),
        ({"inner": "onebit"}, "inner"),
        ({}, "inner"),
        ({"inner": "uniform", "rotations": 0}, "rotations"),
        ({"inner": "uniform", "rotation_block": 1000}, "power of two"),
    ],
)
def test_bad_rotation_settings_are_refused_naming_the_parameter(params: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        make_codec("rotate", **params)


def _server_decode(codec, payload: bytes, reference: np.ndarray, expected: dict):
    return decode_payloads(
        {"w": memoryview(payload)},
        {"w": reference},
        codec=expected,
        policy=TensorPolicy(),
        run_seed=1,
        server_round=2,
        stable_id=3,
    )


@pytest.mark.parametrize(
    "spec",
    [{"name": "eden", "bits": 2}, {"name": "rotate", "inner": "dither", "bits": 2}],
    ids=["eden", "rotate_dither"],
)
def test_the_server_recomputes_the_rotation_seed_and_refuses_another(spec: dict) -> None:
    reference = np.zeros(2000, dtype=np.float32)
    codec = make_codec(**spec)
    x = torch.randn(2000)
    good = bytes(codec.encode(x, seed=derive_seed(1, 2, 3, "w")))
    deltas, _ = _server_decode(codec, good, reference, codec)
    assert np.allclose(deltas["w"], codec.decode(codec.encode(x, seed=derive_seed(1, 2, 3, "w"))))
    wrong = bytes(codec.encode(x, seed=derive_seed(1, 2, 4, "w")))  # another client's seed
    with pytest.raises(SpecMismatch, match="seed"):
        _server_decode(codec, wrong, reference, codec)


def test_the_server_refuses_a_rotated_payload_whose_inner_codec_it_did_not_ask_for() -> None:
    reference = np.zeros(1000, dtype=np.float32)
    asked = make_codec("rotate", inner="uniform", bits=2)
    sent = make_codec("rotate", inner="sign")
    payload = bytes(sent.encode(torch.randn(1000), seed=derive_seed(1, 2, 3, "w")))
    with pytest.raises(SpecMismatch, match="inner codec id"):
        _server_decode(asked, payload, reference, asked)


def test_a_rotated_payload_with_a_mismatched_inner_length_is_a_payload_error() -> None:
    small = bytes(make_codec("uniform", bits=2).encode(torch.randn(512), seed=0))
    outer = bytes(make_codec("rotate", inner="uniform", bits=2).encode(torch.randn(1000), seed=5))
    # keep the outer header and rotation parameters, put the inner entry (codec id, then
    # body: fedcomp.codecs.base.pack_inner) of 512 values where 1024 are due
    head = 16 + 4 + 8
    entry = bytes([small[3]]) + small[16 + 4 :]
    with pytest.raises(PayloadError, match="uniform"):
        decode_bytes(outer[:head] + entry)


def _reference_rotation(x: np.ndarray, seed: int, block: int, rotations: int) -> np.ndarray:
    """R x in float64 from the documented definition, independently of the code's
    pieces and Kronecker factors: zero-pad, then per rotation r flip the signs where
    the Philox(key=seed + r) bit stream (MSB first) has a 1 and multiply each block by
    the dense orthonormal Hadamard matrix."""
    sizes = block_sizes(x.size, block)
    y = np.zeros(sum(sizes))
    y[: x.size] = x
    for r in range(rotations):
        gen = np.random.Generator(np.random.Philox(key=seed + r))
        bits = np.unpackbits(np.frombuffer(gen.bytes((y.size + 7) // 8), np.uint8))[: y.size]
        y = np.where(bits == 1, -y, y)
        out, start = np.empty_like(y), 0
        for size in sorted(set(sizes), reverse=True):
            count = sizes.count(size)
            rows = y[start : start + size * count].reshape(count, size)
            out[start : start + size * count] = (rows @ _sylvester(size)).reshape(-1)
            start += size * count
        y = out
    return y


@pytest.mark.parametrize(
    ("numel", "block", "rotations"),
    [((1 << 19) + 3001, 1024, 1), ((1 << 19) + 3001, 1024, 2), ((1 << 18) + 777, 8192, 1)],
)
def test_rotation_over_several_pieces_equals_the_dense_definition(
    numel: int, block: int, rotations: int, path: str
) -> None:
    """More coordinates than one cache-sized piece (2^18), with the padded tail, and a
    block above the two-factor size (4096): the rotation equals the definition computed
    densely in float64, and its inverse gives x back."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(7))
    y = rotate(x, seed=21, block=block, rotations=rotations)
    want = _reference_rotation(x.double().numpy(), 21, block, rotations)
    assert np.abs(y.double().numpy() - want).max() < 1e-4
    back = unrotate(y, numel=numel, seed=21, block=block, rotations=rotations)
    assert float((back - x).abs().max()) < 1e-4


needs_numba = pytest.mark.skipif(not compiled.installed(), reason="the compiled path needs numba")


@needs_numba
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("scale", ["unbiased", "mse"])
def test_compiled_eden_codes_are_the_nearest_centroids_and_scales_their_formula(
    bits: int, scale: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled encoder's codes and scales against the definition, from the rotated
    vector computed densely in float64: every code is the nearest Lloyd-Max centroid
    of y / rms (ties within float32 rounding aside), every block's scale is
    ||y||^2 / <y, c> (unbiased) or <y, c> / ||c||^2 (mse) of its own codes, to float32
    rounding; and the torch path agrees with it but for codes within rounding of a
    threshold. A padded tail of blocks of 512 and 256 is included."""
    monkeypatch.setattr(rotation_compiled, "MIN_COMPILED", 0)
    numel, block, seed = 3 * 1024 + 700, 1024, 17
    x = _student_t(numel, 8) * torch.linspace(0.1, 3, numel)
    codec = make_codec("eden", bits=bits, scale=scale, block=block)
    body = codec.encode(x, seed=seed).body
    sizes = block_sizes(numel, block)
    scales = np.frombuffer(body, "<f4", len(sizes), 8).astype(np.float64)
    codes = unpack_bits(body[8 + 4 * len(sizes) :], sum(sizes), bits)
    y = _reference_rotation(x.double().numpy(), seed, block, 2)
    centroids, thresholds = lloyd_max_normal(bits)
    c = centroids.astype(np.float32).astype(np.float64)[codes]
    start = 0
    for k, size in enumerate(sizes):
        part = slice(start, start + size)
        start += size
        rms = math.sqrt((y[part] ** 2).mean())
        nearest = np.searchsorted(thresholds, y[part] / rms)
        # a code may differ from the float64 definition only at a threshold
        differs = codes[part] != nearest
        gap = np.abs(y[part][:, None] / rms - thresholds[None, :]).min(1)
        assert (gap[differs] < 1e-5).all() and differs.sum() <= 2, (k, differs.sum())
        dot, norm2 = float(y[part] @ c[part]), float(y[part] @ y[part])
        want = norm2 / dot if scale == "unbiased" else dot / float(c[part] @ c[part])
        assert abs(scales[k] / want - 1) < 1e-5, (k, scales[k], want)
    monkeypatch.setattr(rotation_compiled, "MIN_COMPILED", 1 << 62)
    torch_body = codec.encode(x, seed=seed).body
    torch_codes = unpack_bits(torch_body[8 + 4 * len(sizes) :], sum(sizes), bits)
    assert (torch_codes != codes).sum() <= 4


@needs_numba
@pytest.mark.parametrize("spec", [{"name": "eden", "bits": 2}, {"name": "rotate", "inner": "fp32"}])
def test_payloads_of_either_path_decode_on_the_other(
    spec: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client without Numba and a server with it, or the reverse: the same layout, so
    either decodes the other's payload, to float32 rounding of the rotation."""
    x = torch.randn(5000, generator=torch.Generator().manual_seed(2))
    codec = make_codec(**spec)
    minimum = {"torch": 1 << 62, "compiled": 0}
    payloads, decoded = {}, {}
    for path in minimum:
        monkeypatch.setattr(rotation_compiled, "MIN_COMPILED", minimum[path])
        payloads[path] = codec.encode(x, seed=4)
    for path in minimum:  # decoded[server path][client path]
        monkeypatch.setattr(rotation_compiled, "MIN_COMPILED", minimum[path])
        decoded[path] = {client: codec.decode(payloads[client]) for client in payloads}
    for got in (decoded["compiled"]["torch"], decoded["torch"]["compiled"]):
        assert float((got - decoded["torch"]["torch"]).abs().max()) < 1e-5 * float(got.abs().max())


@pytest.mark.parametrize(("value", "count"), [(math.nan, 1), (-math.inf, 1), (3e38, 1024)])
@pytest.mark.parametrize(
    "spec",
    [{"name": "eden", "bits": 2}, {"name": "eden", "bits": 1}, {"name": "rotate", "inner": "fp32"}],
)
def test_encoders_refuse_non_finite_blocks(value: float, count: int, spec: dict, path: str) -> None:
    """A NaN or Inf, or a block that overflows float32 once rotated (1,024 values of
    3e38: its first coordinate is their sum over 32), is refused on either path, not
    sent as a NaN scale or a NaN payload."""
    x = torch.randn(3000)
    x[1024 : 1024 + count] = value
    with pytest.raises(ValueError, match="NaN or Inf"):
        make_codec(**spec).encode(x, seed=1)
    with pytest.raises(ValueError, match="NaN or Inf"):
        rotate(x, seed=1, block=1024, rotations=2)


def test_without_numba_or_below_the_size_the_torch_path_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert not rotation_compiled.available(rotation_compiled.MIN_COMPILED - 1)
    monkeypatch.setitem(compiled._STATE, "numba", None)  # as without the fast extra
    assert not rotation_compiled.available(1 << 24)

    def unexpected(*args, **kwargs):
        raise AssertionError("the compiled path ran")

    for name in ("rotate", "unrotate", "eden_encode", "eden_decode"):
        monkeypatch.setattr(rotation_compiled, name, unexpected)
    codec = make_codec("eden", bits=2)
    assert codec.decode(codec.encode(torch.randn(1 << 16), seed=1)).shape == (1 << 16,)
    x = torch.randn(1 << 16)
    y = rotate(x, seed=3, block=1024, rotations=2)  # the torch path, still R x
    want = _reference_rotation(x.double().numpy(), 3, 1024, 2)
    assert np.abs(y.double().numpy() - want).max() < 1e-4


@pytest.mark.parametrize(("block", "magnitude"), [(1024, 1e37), (1 << 20, 1e35)])
def test_extreme_magnitudes_rotate_and_come_back_finite(
    block: int, magnitude: float, path: str
) -> None:
    """Values near float32's limit: both directions divide by sqrt(n) before their
    butterflies, so no intermediate exceeds sqrt(n) times the largest value (the
    compiled inverse once divided after them and decoded these to Inf). EDEN's payload
    of them decodes finite and close."""
    n = block + 3000
    x = torch.randn(n, generator=torch.Generator().manual_seed(4)) * magnitude
    y = rotate(x, seed=6, block=block, rotations=2)
    back = unrotate(y, numel=n, seed=6, block=block, rotations=2)
    assert bool(torch.isfinite(back).all())
    assert float((back.double() - x.double()).norm() / x.double().norm()) < 1e-5
    codec = make_codec("eden", bits=4, block=block)
    decoded = codec.decode(codec.encode(x, seed=6)).double()
    assert bool(torch.isfinite(decoded).all())
    assert float((decoded - x.double()).norm() / x.double().norm()) < 0.2  # 4-bit EDEN
