"""The one-bit code (fedcomp.onebit): identities, unbiasedness, assignment, center, bounds.

Expected values are computed here from first principles (residues, inclusion
probabilities, exact means); Monte Carlo tolerances come from the measured variance.
"""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from fedcomp.codecs import make_codec
from fedcomp.codecs.wire import PayloadError
from fedcomp.onebit import OneBitCode
from fedcomp.onebit.bits import answer
from fedcomp.onebit.decode import coefficient_table, localize, safe_phases
from fedcomp.onebit.public import SlotLookup, client_slots, coordinate_draws
from fedcomp.onebit.queries import KIND_BASE, KIND_LOC, build_query_set, make_geometry


def _encode_all(code, x, *, seed, tau=1.0, indices=None, n=None):
    n = x.shape[0] if n is None else n
    indices = range(x.shape[0]) if indices is None else indices
    return [
        bytes(
            code.encode(torch.from_numpy(x[r]), client_index=i, num_clients=n, seed=seed, tau=tau)
        )
        for r, i in enumerate(indices)
    ]


def _rho(period, phase_offset, z):
    return np.mod(z - phase_offset, period)


# --------------------------------------------------------------------------- identities
@pytest.mark.parametrize("center_scale", [0.0, 3.7, -250.0, 1e4 / 3])
def test_telescoping_identity_with_deterministic_refinement(center_scale):
    """rho_0(z) - rho_0(c) + sum_j coef_j (B_j(z) - B_j(c)) = z - c exactly, for every
    z within L_J / 4 of c, using the decoder's safe phases and coefficient table."""
    geometry = make_geometry(0.0, top=8192.0, localize=False)
    qs = build_query_set(geometry, num_clients=1, bits=1)
    rng = np.random.default_rng(1)
    c = np.full(2000, center_scale) + rng.uniform(-20, 20, 2000)
    reach = geometry.top / 4
    z = c + rng.uniform(-reach, reach, c.size) * rng.choice([1e-3, 0.1, 1.0], c.size)
    phases = safe_phases(c, qs)
    table = coefficient_table(qs)
    total = np.zeros_like(z)
    for q in range(qs.num_queries):
        if qs.kind[q] == KIND_BASE:
            continue
        j = int(qs.scale_index[q])
        coef = table[q, phases[j], phases[j + 1]]
        total += coef * (
            answer(qs, np.full(z.shape, q), z, None).astype(float)
            - answer(qs, np.full(z.shape, q), c, None)
        )
    b0 = phases[0]
    l0 = geometry.base
    total += _rho(l0, b0 * l0 / 2, z) - _rho(l0, b0 * l0 / 2, c)
    np.testing.assert_allclose(total, z - c, rtol=0, atol=1e-9 * geometry.top)


def test_safe_phases_keep_the_center_a_quarter_cell_from_every_boundary():
    qs = build_query_set(make_geometry(0.0, localize=False), num_clients=4, bits=1)
    c = np.random.default_rng(2).uniform(-1e4, 1e4, 5000)
    phases = safe_phases(c, qs)
    for j in range(qs.geometry.num_scales + 1):
        lj = qs.geometry.scale(j)
        r = np.mod(c - phases[j] * lj / 2, lj)
        assert np.all(np.minimum(r, lj - r) >= lj / 4 - 1e-9)


# --------------------------------------------------------------------------- assignment
@pytest.mark.parametrize("n,b", [(7, 1), (50, 2), (16, 4), (100, 8)])
def test_every_client_gets_b_distinct_queries_with_the_planned_inclusion(n, b):
    qs = build_query_set(make_geometry(100.0), num_clients=n, bits=b)
    assert np.all(qs.counts <= n + 1e-9) and abs(qs.counts.sum() - n * b) < 1e-6
    count = 40_000
    offsets, shifts = coordinate_draws(123, 0, count, n)
    slots = client_slots(np.arange(n).reshape(-1, 1), shifts, n, b)  # (n, count, b)
    q = SlotLookup(qs.cuts)(slots, offsets[:, None])
    reference = np.searchsorted(qs.cuts, slots + offsets[:, None], side="right") - 1
    np.testing.assert_array_equal(q, reference)
    # b distinct queries per client per coordinate
    sorted_q = np.sort(q, axis=2)
    assert np.all(np.diff(sorted_q, axis=2) > 0)
    # every slot of every coordinate is used exactly once
    assert np.array_equal(
        np.sort(slots.reshape(n * 1, count, b).transpose(1, 0, 2).reshape(count, -1), axis=1),
        np.broadcast_to(np.arange(n * b), (count, n * b)),
    )
    # systematic sampling: per coordinate, query q has floor(t_q) or ceil(t_q) answers
    per_coord = np.zeros((count, qs.num_queries), dtype=np.int64)
    np.add.at(per_coord, (np.broadcast_to(np.arange(count)[None, :, None], q.shape), q), 1)
    assert np.all(per_coord >= np.floor(qs.counts - 1e-9))
    assert np.all(per_coord <= np.ceil(qs.counts + 1e-9))
    # inclusion: client i answers q with probability pi_q = t_q / n
    hits = np.zeros(qs.num_queries)
    np.add.at(hits, q[0].reshape(-1), 1)  # client 0
    freq = hits / count
    se = np.sqrt(qs.inclusion * (1 - qs.inclusion) / count)
    assert np.all(np.abs(freq - qs.inclusion) <= 5 * se + 1e-12)


def test_allocation_caps_at_n_and_redistributes():
    qs = build_query_set(make_geometry(0.0, localize=False, top=64.0), num_clients=3, bits=8)
    assert qs.counts.max() <= 3 + 1e-9
    assert abs(qs.counts.sum() - 24) < 1e-9
    with pytest.raises(ValueError, match="lower bits"):
        build_query_set(make_geometry(0.0, localize=False, top=16.0), num_clients=3, bits=64)


_CLIENT_SCRIPT = """
import hashlib, sys, numpy as np, torch
from fedcomp.onebit import OneBitCode
x = torch.from_numpy(np.random.default_rng(5).standard_t(3, 4096) * 2.0)
p = OneBitCode(bits=2, lam=50.0).encode(x, client_index=3, num_clients=11, seed=987654321,
                                         tau=0.5)
print(hashlib.sha256(bytes(p)).hexdigest())
"""


def test_client_and_server_processes_regenerate_the_same_assignment():
    """A client in another process produces exactly the bits the server expects: the
    payload is identical, and the server's regenerated queries give back its answers."""
    out = subprocess.run(
        [sys.executable, "-c", _CLIENT_SCRIPT], capture_output=True, text=True, check=True
    )
    x = np.random.default_rng(5).standard_t(3, 4096) * 2.0
    code = OneBitCode(bits=2, lam=50.0)
    payload = bytes(
        code.encode(torch.from_numpy(x), client_index=3, num_clients=11, seed=987654321, tau=0.5)
    )
    assert hashlib.sha256(payload).hexdigest() == out.stdout.strip()
    packed, _ = code.check(
        payload, client_index=3, num_clients=11, seed=987654321, tau=0.5, shape=(4096,)
    )
    bits = np.unpackbits(packed, bitorder="little")[: 4096 * 2].reshape(4096, 2)
    taus = code.block_taus(0.5, 4096)
    qs = code.query_set(taus, 11)
    offsets, shifts = coordinate_draws(987654321, 0, 4096, 11)
    slots = client_slots(3, shifts, 11, 2)
    q = SlotLookup(qs.cuts)(slots, offsets[:, None])
    from fedcomp.onebit.public import slot_uniforms

    u = slot_uniforms(987654321, np.broadcast_to(np.arange(4096)[:, None], q.shape), slots, 22)
    expected = answer(qs, q, (x / 0.5)[:, None], u)
    np.testing.assert_array_equal(bits, expected)


# --------------------------------------------------------------------------- unbiasedness
def _monte_carlo(code, x, *, reps, weights=None, indices=None, n=None, side=None, tau=1.0):
    estimates = []
    n = x.shape[0] if n is None else n
    indices = list(range(x.shape[0])) if indices is None else list(indices)
    for seed in range(reps):
        payloads = _encode_all(code, x, seed=1000 + seed, indices=indices, n=n, tau=tau)
        est = code.decode_mean(
            payloads,
            client_indices=indices,
            num_clients=n,
            seed=1000 + seed,
            tau=tau,
            weights=weights,
            side_center=side,
        )
        estimates.append(est.double().numpy())
    return np.stack(estimates)


def _assert_unbiased(estimates, exact):
    """Per-coordinate z-scores of the Monte Carlo mean: RMS about 1, none extreme."""
    reps = estimates.shape[0]
    se = estimates.std(axis=0, ddof=1) / np.sqrt(reps)
    zscores = (estimates.mean(axis=0) - exact) / np.maximum(se, 1e-12)
    assert np.sqrt(np.mean(zscores**2)) < 1.35, np.sqrt(np.mean(zscores**2))
    assert np.max(np.abs(zscores)) < 5.5


@pytest.mark.parametrize("refine", ["deterministic", "stochastic"])
def test_unbiased_given_the_center_with_client_weights(refine):
    rng = np.random.default_rng(3)
    n, d = 40, 256
    offset = rng.uniform(-30, 30, d)
    x = (offset + rng.standard_t(4, (n, d))).astype(np.float32)
    weights = rng.integers(1, 20, n).astype(float)
    code = OneBitCode(bits=2, center="previous", refine=refine, block=64)
    est = _monte_carlo(code, x, reps=150, weights=weights, side=torch.from_numpy(offset))
    exact = (weights[:, None] * x.astype(np.float64)).sum(0) / weights.sum()
    _assert_unbiased(est, exact)


@pytest.mark.parametrize("offset", [5.0, 300.0])
def test_unbiased_when_a_third_of_the_clients_drop(offset):
    """The target is the mean of the clients that replied (all the server can know).
    offset 300 (center 0) puts the mass on the coarse scales, whose queries have about
    one answer per coordinate: a per-coordinate ratio estimator fails there (it gave
    113 for 300)."""
    rng = np.random.default_rng(4)
    n, d = 60, 256
    x = (rng.standard_t(4, (n, d)) + offset).astype(np.float32)
    kept = np.sort(rng.choice(n, 40, replace=False))
    code = OneBitCode(bits=2, center="zero", block=64)
    est = _monte_carlo(code, x[kept], reps=150, indices=kept, n=n)
    _assert_unbiased(est, x[kept].astype(np.float64).mean(0))


def test_clients_at_the_center_contribute_exactly_zero():
    rng = np.random.default_rng(6)
    n, d = 30, 512
    center = rng.uniform(-40, 40, d)
    x = np.broadcast_to(center, (n, d)).astype(np.float32)
    for mode, side in (("previous", torch.from_numpy(x[0].astype(np.float64))), ("zero", None)):
        data = x if mode == "previous" else np.zeros_like(x)
        code = OneBitCode(bits=3, center=mode, block=128)
        payloads = _encode_all(code, data, seed=77)
        est = code.decode_mean(
            payloads,
            client_indices=list(range(n)),
            num_clients=n,
            seed=77,
            tau=1.0,
            side_center=side,
        )
        np.testing.assert_array_equal(est.numpy(), data[0])


def test_per_client_variance_stays_bounded_as_the_top_scale_grows():
    """Every query answered (one client, b = number of queries, pi = 1): for df 4 the
    variance of a single client's estimate does not grow with L_J (docs/onebit.md: 11.8)."""
    rng = np.random.default_rng(7)
    d = 4000
    x = rng.standard_t(4, (1, d)).astype(np.float32)
    variances, errors = [], []
    for top in (2.0**8, 2.0**11, 2.0**14):
        geometry = make_geometry(0.0, top=top, localize=False)
        queries = 2 + 5 * geometry.num_scales
        code = OneBitCode(bits=queries, center="zero", top=top, block=d)
        errs = np.array(
            [
                code.decode_mean(
                    _encode_all(code, x, seed=s),
                    client_indices=[0],
                    num_clients=1,
                    seed=s,
                    tau=1.0,
                )
                .double()
                .numpy()
                - x[0]
                for s in range(3)
            ]
        )
        # Unbiased given x: E[err x] = 0 per coordinate, so the mean of err x over the
        # 3 x 4000 (independent) errors is within 5 standard errors of 0. An estimate
        # shrunk toward 0 fails (all zeros: err = -x, mean -E x^2 = -2, 100 sigma out).
        prod = (errs * x[0]).ravel()
        assert abs(prod.mean()) <= 5 * prod.std(ddof=1) / math.sqrt(prod.size), top
        sq = np.square(errs).ravel()
        variances.append((sq.mean(), sq.std(ddof=1) / math.sqrt(sq.size)))
        errors.append(errs)
    # The same variance at every top scale: each within 5 standard errors (of the
    # difference) of the smallest top's; a variance growing with L_J fails.
    (v0, se0), *rest = variances
    for v, se in rest:
        assert abs(v - v0) <= 5 * math.hypot(se, se0), variances
    # and 5 standard errors resolve a 20% change
    assert 5 * math.hypot(variances[-1][1], se0) < 0.2 * v0, variances


# --------------------------------------------------------------------------- center
#: docs/onebit.md: the center is within 2 tau of the clients' position on >= 99.87% of
#: coordinates (its error is about uniform on +-2 tau: RMS 2 / sqrt(3) = 1.15).
CENTER_REACH, CENTER_SHARE = 2.0, 0.9987


def _assert_center_close(center: np.ndarray, offsets: np.ndarray) -> None:
    """The documented share within CENTER_REACH, with a binomial tolerance: at most
    m p + 5 sqrt(m p (1 - p)) of m coordinates beyond (p = 1 - CENTER_SHARE); none
    beyond a quarter of the finest localization period (2 a0 = 16 tau), where the
    vote would point the wrong way; and no offset: the mean error within 5 standard
    errors of 0."""
    err = center - offsets
    m, p = err.size, 1 - CENTER_SHARE
    beyond = int(np.sum(np.abs(err) > CENTER_REACH))
    assert beyond <= m * p + 5 * math.sqrt(m * p * (1 - p)), (beyond, m)
    assert np.max(np.abs(err)) < 4.0, np.max(np.abs(err))
    assert abs(err.mean()) <= 5 * err.std(ddof=1) / math.sqrt(m), err.mean()


def test_center_decode_on_concentrated_data_across_the_range():
    n, lam = 400, 100.0
    code = OneBitCode(bits=1, lam=lam, block=64)
    offsets = np.linspace(-lam, lam, 257)
    rng = np.random.default_rng(8)
    x = (offsets + 0.05 * rng.standard_normal((n, offsets.size))).astype(np.float32)
    _, result = code.decode(
        _encode_all(code, x, seed=9),
        client_indices=list(range(n)),
        num_clients=n,
        seed=9,
        tau=1.0,
        shape=(offsets.size,),
    )
    assert result.stopped_early == 0
    _assert_center_close(result.center, offsets)


def test_center_votes_are_one_per_client_whatever_the_weights():
    """Weights scale contributions, never votes: heavy clients do not skew the center,
    and neither does one client far away (one vote among many per level)."""
    n, lam = 200, 100.0
    code = OneBitCode(bits=1, lam=lam, block=64)
    offsets = np.linspace(-lam, lam, 129)
    rng = np.random.default_rng(21)
    x = (offsets + 0.05 * rng.standard_normal((n, offsets.size))).astype(np.float32)
    x[3] = 1e6  # an extreme client
    weights = np.ones(n)
    weights[:5] = 200.0
    _, result = code.decode(
        _encode_all(code, x, seed=4),
        client_indices=list(range(n)),
        num_clients=n,
        seed=4,
        tau=1.0,
        shape=(offsets.size,),
        weights=weights,
    )
    _assert_center_close(result.center, offsets)


def test_more_groups_than_replies_still_decode_a_finite_mean():
    rng = np.random.default_rng(22)
    x = (rng.standard_t(4, (3, 128)) + 1.0).astype(np.float32)
    code = OneBitCode(bits=2, center="zero", groups=4, block=128)
    est = code.decode_mean(
        _encode_all(code, x, seed=2, n=10),
        client_indices=[0, 1, 2],
        num_clients=10,
        seed=2,
        tau=1.0,
    )
    assert torch.isfinite(est).all()
    # ... and a value: the median of the group means (groups without a reply carry no
    # weight) is unbiased for symmetric noise, so the mean error over the 128
    # coordinates (independent public draws) is within 5 standard errors of 0 (here
    # -2.3). An all-zero estimate (error -mean: about -1, spread 0.8) is 14 sigma out.
    err = est.double().numpy() - x.astype(np.float64).mean(0)
    assert abs(err.mean()) <= 5 * err.std(ddof=1) / math.sqrt(err.size), (err.mean(), err.std())
    with pytest.raises(ValueError, match="base_share"):
        OneBitCode(base_share=0.6)


def test_localization_stops_on_balanced_and_empty_votes():
    periods = (64.0, 32.0, 16.0)
    start = np.array([5.0, 5.0, 5.0])
    # coordinate 0: balanced at level 0; 1: no votes at level 1; 2: all levels agree
    sums = np.array([[2, 0, 0], [2, 4, 4], [0, 0, 0], [0, 0, 4], [0, 0, 0], [0, 0, 4]], float)
    counts = np.array([[4, 4, 4], [4, 4, 4], [4, 0, 4], [4, 0, 4], [4, 4, 4], [4, 4, 4]], float)
    center, stopped = localize(sums, counts, start, periods, min_resultant=0.3)
    assert center[0] == 5.0 and stopped[0]
    assert stopped[1] and not stopped[2]
    # coordinate 1 used level 0 only: p0 = 0, p1 = 1 -> y = P_0 / 8
    assert center[1] == pytest.approx(periods[0] / 8)


# --------------------------------------------------------------------------- accuracy
def test_mse_at_n_1000_df_4_meets_the_reference_study():
    """docs/onebit.md: lambda = 100 tau, n = 1000, b = 1, df 4 -> MSE about 0.18 tau^2."""
    rng = np.random.default_rng(10)
    n, d = 1000, 512
    mu = rng.uniform(-100, 100, d)
    x = (mu + rng.standard_t(4, (n, d))).astype(np.float32)
    code = OneBitCode(bits=1, lam=100.0, block=512)
    est = code.decode_mean(
        _encode_all(code, x, seed=11),
        client_indices=list(range(n)),
        num_clients=n,
        seed=11,
        tau=1.0,
    )
    mse = np.mean((est.double().numpy() - x.astype(np.float64).mean(0)) ** 2)
    assert mse < 0.3, mse


@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_wrong_tau_degrades_gracefully(factor):
    rng = np.random.default_rng(12)
    n, d = 200, 512
    x = (rng.standard_t(4, (n, d)) * 3.0).astype(np.float32)
    exact = x.astype(np.float64).mean(0)

    def mse(tau):
        """(MSE, its standard error, the estimates of the 3 seeds)."""
        code = OneBitCode(bits=2, center="zero", block=512)
        est = np.array(
            [
                code.decode_mean(
                    _encode_all(code, x, seed=s, tau=tau),
                    client_indices=list(range(n)),
                    num_clients=n,
                    seed=s,
                    tau=tau,
                )
                .double()
                .numpy()
                for s in range(3)
            ]
        )
        sq = np.square(est - exact).ravel()
        return float(sq.mean()), float(sq.std(ddof=1) / math.sqrt(sq.size)), est

    # Each MSE is a mean over 3 x 512 independent squared errors: its standard error
    # from their spread. Graceful: a tau off by 2x costs at most 2x the MSE, established
    # at 5 standard errors of the ratio (measured 1.2 and 1.5); the right tau is not
    # worse than the wrong one beyond 5 standard errors of the difference.
    wrong, se_wrong, _ = mse(3.0 * factor)
    right, se_right, est = mse(3.0)
    ratio = wrong / right
    se_ratio = ratio * math.hypot(se_wrong / wrong, se_right / right)
    assert ratio + 5 * se_ratio < 2.0, (ratio, se_ratio)
    assert wrong >= right - 5 * math.hypot(se_wrong, se_right), (wrong, right)
    # Unbiased: E (est - exact)^2 = Var(est), so per coordinate the mean square error
    # over the seeds minus their sample variance has mean 0 (the squared bias
    # otherwise); within 5 standard errors over the 512 coordinates. A constant
    # estimate (all zeros) has no variance: its MSE alone, 16 sigma out.
    excess = np.mean((est - exact) ** 2, axis=0) - est.var(axis=0, ddof=1)
    assert excess.mean() <= 5 * excess.std(ddof=1) / math.sqrt(excess.size), excess.mean()


def test_median_of_means_decodes_close_to_the_mean():
    """Symmetric noise: the median of unbiased group means is unbiased too (it is biased
    for skewed tails, which is why it is off by default)."""
    rng = np.random.default_rng(13)
    n, d = 300, 256
    x = (rng.standard_t(4, (n, d)) + 2.0).astype(np.float32)
    code = OneBitCode(bits=2, center="zero", groups=3, block=256)
    est = _monte_carlo(code, x, reps=40)
    _assert_unbiased(est, x.astype(np.float64).mean(0))


def test_median_of_means_around_a_side_center_adds_the_center_back():
    """With a side center c (center="previous"), the median-of-means decoder estimates
    the mean as c + MoM(refinements): unbiased for the mean, whatever c is."""
    rng = np.random.default_rng(15)
    n, d = 300, 256
    x = (rng.standard_t(4, (n, d)) + 2.0).astype(np.float32)
    side = torch.full((d,), 2.25, dtype=torch.float64)  # near the mean, not at it
    code = OneBitCode(bits=2, center="previous", groups=3, block=256)
    est = _monte_carlo(code, x, reps=20, side=side)
    _assert_unbiased(est, x.astype(np.float64).mean(0))


# --------------------------------------------------------------------------- influence
def test_one_client_moves_the_estimate_at_most_by_the_bound():
    """With the center fixed, one client's answers move the estimate by at most
    w_i / W * sum over its b slots of max|coef_q| / pi_q (docs/onebit.md, "Influence")."""
    rng = np.random.default_rng(14)
    n, d, b = 50, 1024, 2
    x = rng.standard_t(4, (n, d)).astype(np.float32)
    weights = np.ones(n)
    weights[7] = 3.0
    code = OneBitCode(bits=b, center="zero", block=1024)
    qs = code.query_set(code.block_taus(1.0, d), n)
    levels = np.array([qs.geometry.scale(int(j)) for j in qs.scale_index])
    worth = np.where(qs.kind == KIND_BASE, qs.geometry.base, levels)
    worth = np.where(qs.kind == 3, 3 * levels, worth)  # SREF (not used here)
    worth[qs.kind == KIND_LOC] = 0.0
    bound = weights[7] / weights.sum() * b * np.max(worth / qs.inclusion)
    base = code.decode_mean(
        _encode_all(code, x, seed=5),
        client_indices=list(range(n)),
        num_clients=n,
        seed=5,
        tau=1.0,
        weights=weights,
    )
    moved = 0.0
    for extreme in (1e6, -1e6, 2000.0):
        y = x.copy()
        y[7] = extreme
        est = code.decode_mean(
            _encode_all(code, y, seed=5),
            client_indices=list(range(n)),
            num_clients=n,
            seed=5,
            tau=1.0,
            weights=weights,
        )
        change = np.abs(est.double().numpy() - base.double().numpy())
        assert np.all(change <= bound * (1 + 1e-6)), (change.max(), bound)
        moved = max(moved, float(change.max()))
    assert moved > 0  # the client did move it: the bound is not vacuous here


# --------------------------------------------------------------------------- payloads
def test_payload_bytes_and_validation():
    code = make_codec("onebit", bits=1, lam=10.0, block=100)
    assert isinstance(code, OneBitCode)
    x = torch.randn(3, 333)
    p = code.encode(x, client_index=2, num_clients=5, seed=42, tau=1.0)
    buf = bytes(p)
    assert len(buf) == len(p)
    # header 16 + 8 (2 dims) + body 20 + one scale code per block + ceil(999 / 8)
    assert len(buf) == 16 + 8 + 20 + 10 + 125
    ok = {"client_index": 2, "num_clients": 5, "seed": 42, "tau": 1.0, "shape": (3, 333)}
    code.check(buf, **ok)
    for change, message in [
        ({"client_index": 1}, "client index"),
        ({"num_clients": 6}, "digest|client count"),
        ({"seed": 43}, "seed"),
        ({"tau": 2.0}, "digest"),
        ({"shape": (999,)}, "shape"),
    ]:
        with pytest.raises(PayloadError, match=message):
            code.check(buf, **{**ok, **change})
    with pytest.raises(PayloadError, match="body"):
        code.check(buf[:-1], **ok)
    with pytest.raises(PayloadError):
        code.check(buf + b"\0", **ok)
    with pytest.raises(PayloadError, match="bits"):
        OneBitCode(bits=2, lam=10.0, block=100).check(buf, **ok)
    with pytest.raises(ValueError, match="NaN"):
        code.encode(
            torch.tensor([1.0, float("nan")]), client_index=0, num_clients=1, seed=1, tau=1.0
        )
    with pytest.raises(ValueError, match="tau"):
        code.encode(x, client_index=0, num_clients=1, seed=1, tau=0.0)
    with pytest.raises(ValueError, match="center"):
        OneBitCode(center="median")


def test_next_tau_is_the_median_of_the_clients_scale_codes():
    rng = np.random.default_rng(15)
    code = OneBitCode(bits=1, block=1000, center="zero")
    scales = np.array([0.5, 1.0, 2.0, 4.0, 8.0])
    payloads = [
        code.encode(
            torch.from_numpy(s * rng.standard_normal(3000)),
            client_index=i,
            num_clients=5,
            seed=1,
            tau=1.0,
        )
        for i, s in enumerate(scales)
    ]
    tau = code.next_tau(payloads, shape=(3000,), previous=1.0)
    assert tau.shape == (3,)
    # the median client has sigma 2; codes are quarter-octave steps of a MAD estimate
    assert np.all(np.abs(np.log2(tau / 2.0)) < 0.25)


def test_prefer_onebit_follows_the_crossover_rule():
    from fedcomp.onebit.choice import prefer_onebit, tail_variance

    assert tail_variance(4.0) < tail_variance(3.0) < tail_variance(2.5) < tail_variance(1.5)
    # wide range, 1 bit, many clients: one-bit; a tight range or many bits: dithered uniform
    assert prefer_onebit(100.0, 1, 1000, 4.0)
    assert not prefer_onebit(1.0, 1, 1000, 4.0)
    assert not prefer_onebit(100.0, 8, 1000, 4.0)
    # the in-band center needs n b >= 240 answers; side information does not
    assert not prefer_onebit(1e4, 1, 16, 4.0)
    assert prefer_onebit(1e4, 1, 16, 4.0, center="previous")


def test_the_crossover_rule_takes_eden_into_account():
    """lambda = 30 tau, 1 bit, df 4: dither's variance lambda^2 / 3 = 300 exceeds
    one-bit's V / b = 230, but EDEN's (pi/2 - 1)(lambda^2 / 3 + df / (df - 2)) = 172 does
    not: the rule now picks the baseline. With df <= 2 EDEN's norm is unbounded."""
    from fedcomp.onebit.choice import eden_variance, prefer_onebit, tail_variance

    lam, df = 30.0, 4.0
    dither = lam**2 / 3
    eden = (math.pi / 2 - 1) * (lam**2 / 3 + df / (df - 2))
    assert eden < tail_variance(df) < dither
    assert abs(eden_variance(lam, 1, df) - eden) < 1e-9 * eden
    assert not prefer_onebit(lam, 1, 1000, df)
    assert prefer_onebit(100.0, 1, 1000, df)  # EDEN's error grows with lambda^2 too
    assert eden_variance(lam, 1, 2.0) == math.inf


def test_median_of_means_step_leaves_out_weightless_groups() -> None:
    from fedcomp.onebit.decode import _median_of_means

    est = np.array([[2.0, 4.0], [6.0, 9.0], [100.0, 100.0], [1.0, 1.0]])
    weights = np.array([2.0, 3.0, 0.0, 1.0])  # group 2 has no weight: it says nothing
    got = _median_of_means(est, weights)
    expected = np.median(np.stack([est[0] / 2, est[1] / 3, est[3] / 1]), axis=0)
    assert np.array_equal(got, expected)
    assert np.array_equal(_median_of_means(est[:1], weights[:1]), est[0] / 2)
