"""The one-bit code's decoder steps and public plan from their definitions
(fedcomp/onebit/code.py, fedcomp/onebit/decode.py), on small inputs so that each case
takes milliseconds.

- the coarse center: one level's vote snapped against the angle computed here in
  float64, at the resultant's threshold and one float past it, with one vote per query;
- the safe phases against ``min(c mod L, L - c mod L) < L / 4``, at L / 4 and one float
  either side;
- the per-answer decoder (median of means' decoder) against the run-sum decoder of
  fedcomp/onebit/decode_runs.py with equal, scaled and unequal weights, over several
  chunks, and its groups against each group decoded alone around the same center;
- the scale codes, next round's tau and the settings' bounds at their boundary values
  and one past them.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from fedcomp.onebit import OneBitCode
from fedcomp.onebit import decode as joint
from fedcomp.onebit.decode import Received, decode_joint, localize, safe_phases
from fedcomp.onebit.decode_runs import decode_runs

# --------------------------------------------------------------------------- center


def _votes(p0: float, p1: float, answers: int) -> tuple[np.ndarray, np.ndarray]:
    """One level's LOC rows (phase 0, phase 1) for one coordinate: ones and answers."""
    sums = np.array([[p0 * answers], [p1 * answers]])
    return sums, np.full((2, 1), float(answers))


def _snapped(start: float, p0: float, p1: float, period: float) -> float:
    """The definition: the vote's angle atan2(1 - 2 p0, 2 p1 - 1) as a position in
    [0, P), moved to its copy (mod P) nearest to ``start``."""
    angle = math.atan2(1 - 2 * p0, 2 * p1 - 1) % (2 * math.pi)
    y = period * angle / (2 * math.pi)
    return y + period * round((start - y) / period)


@pytest.mark.parametrize(
    ("start", "p0", "p1"),
    [(10.3, 0.5, 1.0), (-7.9, 0.25, 0.75), (100.6, 0.9, 0.2), (0.0, 0.0, 0.5)],
)
def test_one_level_snaps_the_center_to_the_copy_of_the_vote_angle_nearest_it(start, p0, p1):
    period = 4.0
    sums, counts = _votes(p0, p1, 4)
    start_arr = np.array([start])
    center, stopped = localize(sums, counts, start_arr, (period,), min_resultant=0.3)
    assert not stopped[0]
    assert center[0] == pytest.approx(_snapped(start, p0, p1, period), abs=1e-12)
    assert start_arr[0] == start  # the caller's start is not written to


def test_localization_continues_through_every_level_when_all_coordinates_agree():
    """Two coordinates, two levels, every vote informative: each level snaps in turn."""
    periods = (64.0, 16.0)
    start = np.array([3.0, -40.0])
    votes = [(0.0, 1.0), (0.5, 0.0)]  # level 0: y = P/4; level 1: y = P/2
    sums = np.array([[4 * p for _ in start] for p0p1 in votes for p in p0p1])
    counts = np.full_like(sums, 4.0)
    center, stopped = localize(sums, counts, start, periods, min_resultant=0.3)
    want = [_snapped(_snapped(s, *votes[0], periods[0]), *votes[1], periods[1]) for s in start]
    np.testing.assert_allclose(center, want, rtol=0, atol=1e-12)
    assert not stopped.any()


def test_the_resultant_threshold_keeps_its_boundary_and_stops_one_float_below():
    """A vote with resultant exactly the threshold localizes; a threshold one float
    above it stops the coordinate (and leaves the start)."""
    sums, counts = _votes(0.5, 0.75, 4)  # sin part 0, cos part 0.5: resultant 0.5
    center, stopped = localize(sums, counts, np.array([9.0]), (8.0,), min_resultant=0.5)
    assert not stopped[0] and center[0] == _snapped(9.0, 0.5, 0.75, 8.0)
    above = float(np.nextafter(0.5, 1.0))
    center, stopped = localize(sums, counts, np.array([9.0]), (8.0,), min_resultant=above)
    assert stopped[0] and center[0] == 9.0


def test_one_answer_per_loc_query_is_a_vote():
    """One client's bits are a full vote: one answer on each phase row localizes."""
    sums, counts = _votes(1.0, 1.0, 1)  # sin part -1, cos part 1: y = 7P/8
    center, stopped = localize(sums, counts, np.array([0.0]), (8.0,), min_resultant=0.3)
    assert not stopped[0] and center[0] == pytest.approx(_snapped(0.0, 1.0, 1.0, 8.0))


def test_each_level_reads_its_own_two_rows():
    """Level 0 has answers on both rows, level 1 none on its phase-1 row: level 1 stops,
    whatever the other rows hold."""
    sums = np.array([[0.0], [4.0], [0.0], [0.0]])
    counts = np.array([[4.0], [4.0], [4.0], [0.0]])
    center, stopped = localize(sums, counts, np.array([1.0]), (16.0, 4.0), min_resultant=0.3)
    assert stopped[0] and center[0] == _snapped(1.0, 0.0, 1.0, 16.0)


def test_empty_and_balanced_votes_stop_every_coordinate_silently():
    """No answers (0 / 0) is no vote, not a warning; when every coordinate stopped the
    start comes back unchanged."""
    sums = np.zeros((4, 3))
    counts = np.array([[0.0, 4.0, 4.0], [0.0, 4.0, 0.0], [1, 1, 1], [1, 1, 1]])
    sums[:2, 1] = 2.0  # coordinate 1: balanced (p0 = p1 = 1/2)
    start = np.array([1.5, -2.0, 7.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        center, stopped = localize(sums, counts, start, (16.0, 4.0), min_resultant=0.3)
    assert stopped.all()
    np.testing.assert_array_equal(center, start)


# --------------------------------------------------------------------------- safe phases


def _geometry_scales(code: OneBitCode, n: int) -> tuple:
    qs = code.query_set(np.ones(1), n)
    return qs, [qs.geometry.scale(j) for j in range(qs.geometry.num_scales + 1)]


def test_safe_phases_are_the_definition_at_a_quarter_cell_and_one_float_either_side():
    qs, scales = _geometry_scales(OneBitCode(bits=2, block=8), 10)
    lj = scales[2]
    quarter = lj / 4
    centers = np.array(
        [quarter, np.nextafter(quarter, 0), np.nextafter(quarter, lj), -quarter, 0.3 * lj, 5 * lj]
    )
    phases = safe_phases(centers, qs)
    assert phases.shape == (len(scales) + 1, centers.size)
    for j, l_j in enumerate(scales):
        r = np.mod(centers, l_j)
        np.testing.assert_array_equal(phases[j], (np.minimum(r, l_j - r) < l_j / 4).astype(int))
    assert phases[2].tolist()[:3] == [0, 1, 0]  # strict: a quarter cell away is safe
    assert not phases[-1].any()


# --------------------------------------------------------------------------- decoder


def _received(code, x, *, n, indices, weights, seed=5):
    """The replies of clients ``indices`` (rows of x) as the server checks them, and the
    query set of the plan (tau 1)."""
    taus = code.block_taus(1.0, x.shape[1])
    packed = []
    for row, i in zip(x, indices, strict=True):
        payload = code.encode(
            torch.from_numpy(row), client_index=i, num_clients=n, seed=seed, tau=1.0
        )
        packed.append(
            code.check(
                payload, client_index=i, num_clients=n, seed=seed, tau=1.0, shape=(x.shape[1],)
            )[0]
        )
    w = np.ones(len(indices)) if weights is None else np.asarray(weights, float)
    received = Received(np.stack(packed), np.asarray(indices, np.int64), w)
    return received, code.query_set(taus, n)


CASES = {
    "inband-equal": ("inband", "deterministic", None),
    "inband-scaled": ("inband", "deterministic", 2.5),
    "previous-weighted": ("previous", "deterministic", "unequal"),
    "zero-stochastic-weighted": ("zero", "stochastic", "unequal"),
    "inband-stochastic-scaled": ("inband", "stochastic", 0.25),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_per_answer_decoder_is_the_run_sum_decoder_over_several_chunks(case, monkeypatch):
    """decode_joint (one group) and decode_runs compute the same estimate; chunks of 16
    coordinates (a ragged last one) cover the chunk offsets of the per-answer decoder."""
    center, refine, weighting = CASES[case]
    rng = np.random.default_rng(len(case))
    n, d = 30, 70
    indices = sorted(rng.choice(n, 24, replace=False).tolist())
    x = (20 + 3 * rng.standard_t(3, (len(indices), d))).astype(np.float32)
    if weighting == "unequal":
        weights = rng.uniform(0.5, 3.0, len(indices))
    else:
        weights = None if weighting is None else np.full(len(indices), weighting)
    code = OneBitCode(bits=2, lam=50.0, center=center, refine=refine, block=32)
    received, qs = _received(code, x, n=n, indices=indices, weights=weights)
    common = {
        "numel": d,
        "seed": 5,
        "start": np.full(d, 18.5) if center == "previous" else None,
        "localize_center": center == "inband",
        "min_resultant": code.min_resultant,
    }
    reference = decode_runs(received, qs, **common)
    monkeypatch.setattr(joint, "DECODE_ENTRIES", 16 * len(indices) * 2)
    got = decode_joint(received, qs, **common)
    # equal weights: the same integer counts, the same bits; unequal: float64 sums in
    # another order (values of about 20 from terms of about 100: 1e-10 apart)
    exact = weighting != "unequal"
    np.testing.assert_allclose(got.mean, reference.mean, rtol=0, atol=0 if exact else 1e-8)
    np.testing.assert_array_equal(got.center, reference.center)
    assert got.stopped_early == reference.stopped_early
    # not a vacuous agreement: the errors average out around the weighted mean (an
    # all-zero estimate is off by -20 with a spread of about 3 / sqrt(24))
    w = np.ones(len(indices)) if weights is None else weights
    err = got.mean - np.average(x, axis=0, weights=w)
    assert abs(err.mean()) <= 5 * err.std() / math.sqrt(d)


def test_a_lone_reply_decodes_as_the_run_sum_decoder():
    code = OneBitCode(bits=3, lam=50.0, center="zero", block=32)
    x = np.linspace(-5, 5, 40, dtype=np.float32)[None]
    received, qs = _received(code, x, n=4, indices=[2], weights=[1.5])
    common = {"numel": 40, "seed": 5, "start": None, "localize_center": False}
    got = decode_joint(received, qs, min_resultant=0.3, **common)
    want = decode_runs(received, qs, min_resultant=0.3, **common)
    np.testing.assert_allclose(got.mean, want.mean, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("groups", "weighted"), [(2, False), (3, True)])
def test_median_of_means_is_the_median_of_each_group_decoded_alone(groups, weighted):
    """Replies go to groups in turn (reply r to group r mod groups); each group decoded
    alone around the joint center gives that group's mean, and the joint estimate is the
    center plus the median of those."""
    rng = np.random.default_rng(groups)
    n, d = 12, 48
    indices = [0, 1, 2, 4, 5, 7, 8, 9, 11]
    x = (3 * rng.standard_t(3, (len(indices), d)) - 10).astype(np.float32)
    weights = rng.uniform(0.5, 2.0, len(indices)) if weighted else None
    code = OneBitCode(bits=2, lam=50.0, block=16, groups=groups)
    received, qs = _received(code, x, n=n, indices=indices, weights=weights)
    common = {"numel": d, "seed": 5, "min_resultant": code.min_resultant}
    got = decode_joint(received, qs, start=None, localize_center=True, groups=groups, **common)
    means = []
    for g in range(groups):
        rows = np.arange(len(indices)) % groups == g
        alone = Received(received.packed[rows], received.client_indices[rows],
                         received.weights[rows])  # fmt: skip
        one = decode_joint(alone, qs, start=got.center, localize_center=False, **common)
        means.append(one.mean - got.center)
    want = got.center + np.median(np.stack(means), axis=0)
    np.testing.assert_allclose(got.mean, want, rtol=1e-12, atol=1e-12)
    assert not np.allclose(means[0], means[1])  # the groups differ: the median is not moot
