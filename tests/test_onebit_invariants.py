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
import re
import warnings

import numpy as np
import pytest
import torch

from fedcomp.codecs.wire import Payload, PayloadError, PayloadHeader
from fedcomp.onebit import OneBitCode
from fedcomp.onebit import decode as joint
from fedcomp.onebit.code import _BODY, block_spreads, scale_code, scale_value
from fedcomp.onebit.decode import Received, decode_joint, localize, safe_phases
from fedcomp.onebit.decode_runs import decode_runs
from fedcomp.onebit.queries import (
    CENTERS,
    KIND_LOC,
    KIND_SREF,
    REFINES,
    build_query_set,
    make_geometry,
)

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


def test_each_level_reads_its_own_two_rows_and_leaves_the_start_alone():
    """Coordinate 0 has answers on both rows of level 0 and none on level 1's phase-1
    row: level 1 stops it, whatever the other rows hold; coordinate 1 goes on through
    both levels; coordinate 2 has no votes and keeps its start. The caller's start array
    is not written to (only some coordinates move)."""
    sums = np.array([[0.0, 0.0, 0.0], [4.0, 4.0, 0.0], [0.0, 2.0, 0.0], [0.0, 4.0, 0.0]])
    counts = np.array([[4.0, 4.0, 0.0], [4.0, 4.0, 0.0], [4.0, 4.0, 0.0], [0.0, 4.0, 0.0]])
    start = np.array([1.0, 1.0, 1.0])
    center, stopped = localize(sums, counts, start, (16.0, 4.0), min_resultant=0.3)
    assert stopped.tolist() == [True, False, True]
    assert center[0] == _snapped(1.0, 0.0, 1.0, 16.0) and center[2] == 1.0
    assert center[1] == pytest.approx(_snapped(center[0], 0.5, 1.0, 4.0), abs=1e-12)
    assert start.tolist() == [1.0, 1.0, 1.0]


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
    "inband-weighted": ("inband", "deterministic", "unequal"),
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


def test_a_lone_reply_decodes_as_the_run_sum_decoder(monkeypatch):
    """One reply of one bit per coordinate, in chunks of 8 coordinates: some chunks
    hold no answer to a query with a public U (BASE, SREF), whose sums are then absent."""
    code = OneBitCode(bits=1, lam=50.0, center="zero", block=32)
    x = np.linspace(-5, 5, 120, dtype=np.float32)[None]
    received, qs = _received(code, x, n=4, indices=[2], weights=[1.5])
    common = {"numel": 120, "seed": 5, "start": None, "localize_center": False}
    want = decode_runs(received, qs, min_resultant=0.3, **common)
    monkeypatch.setattr(joint, "DECODE_ENTRIES", 8)
    got = decode_joint(received, qs, min_resultant=0.3, **common)
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


# --------------------------------------------------------------------------- scale codes


def _code_of(spread: float) -> int:
    """The definition: round(4 log2 s) + 128 clipped to 1..255, and 0 for s = 0."""
    return 0 if spread == 0 else min(255, max(1, round(4 * math.log2(spread)) + 128))


def test_scale_codes_are_quarter_octaves_clipped_to_one_byte_at_their_ends():
    spreads = [0.0, 1.0, 3.0, 2.0**31.75, 2.0**32, 2.0**40, 2.0**-31.75, 2.0**-32, 2.0**-60]
    spreads += [5e-324, 0.7]
    codes = scale_code(np.array(spreads))
    assert codes.dtype == np.uint8
    assert codes.tolist() == [_code_of(s) for s in spreads]
    assert codes.tolist()[:8] == [0, 128, 134, 255, 255, 255, 1, 1]


def test_scale_values_invert_the_codes_and_zero_stands_for_zero():
    codes = np.array([0, 1, 2, 127, 128, 129, 255], dtype=np.uint8)
    want = [0.0] + [2.0 ** ((c - 128) / 4) for c in codes[1:].tolist()]
    np.testing.assert_array_equal(scale_value(codes), want)
    spreads = np.geomspace(2.0**-31, 2.0**31, 97)
    ratio = scale_value(scale_code(spreads)) / spreads
    assert np.all(np.abs(np.log2(ratio)) <= 1 / 8 + 1e-12)  # half a quarter octave


def test_block_spreads_are_the_scaled_median_absolute_deviation_per_block():
    rng = np.random.default_rng(3)
    x = rng.standard_t(3, 23)
    reference = rng.normal(size=23)
    for ref in (None, reference):
        got = block_spreads(x, 10, ref)
        want = []
        for first in (0, 10, 20):
            part = x[first : first + 10]
            r = np.median(part) if ref is None else ref[first : first + 10]
            want.append(1.4826 * np.median(np.abs(part - r)))
        np.testing.assert_allclose(got, want, rtol=1e-15)
    assert block_spreads(np.zeros(0), 4, None).shape == (0,)


# --------------------------------------------------------------------------- next tau


def _with_codes(code: OneBitCode, rows: list[list[int]], numel: int) -> list[Payload]:
    """Replies of ``numel`` zeros whose scale codes are set to ``rows`` (one per client)."""
    out = []
    for i, codes in enumerate(rows):
        p = code.encode(torch.zeros(numel), client_index=i, num_clients=len(rows), seed=2, tau=1.0)
        body = bytearray(p.body)
        body[_BODY.size : _BODY.size + len(codes)] = bytes(codes)
        out.append(Payload(p.header, bytes(body)))
    return out


def test_next_tau_is_each_blocks_median_scale_kept_within_four_times_the_previous():
    code = OneBitCode(bits=1, block=4, center="zero")
    # blocks: medians 2^-1 (below 1), 2^1, all zero, 4x the previous exactly, one code more
    # (clipped to 4x), one code under a quarter (clipped to 1/4)
    rows = [
        [124, 132, 0, 136, 137, 119],
        [120, 136, 0, 136, 137, 119],
        [126, 128, 0, 140, 150, 100],
    ]
    payloads = _with_codes(code, rows, 24)
    tau = code.next_tau(payloads, shape=(24,), previous=1.0)
    assert tau.tolist() == [0.5, 2.0, 1.0, 4.0, 4.0, 0.25]
    previous = np.array([1.0, 1.0, 3.0, 1.0, 2.0, 1.0])
    tau = code.next_tau(payloads, shape=(24,), previous=previous)
    assert tau.tolist() == [0.5, 2.0, 3.0, 4.0, 2.0**2.25, 0.25]
    # replies as bytes read the same
    assert code.next_tau([bytes(p) for p in payloads], shape=(24,), previous=1.0).tolist() == [
        0.5, 2.0, 1.0, 4.0, 4.0, 0.25
    ]  # fmt: skip


def test_next_tau_without_replies_keeps_the_previous_as_floats():
    code = OneBitCode(bits=1, block=4)
    tau = code.next_tau([], shape=(2, 5), previous=3)
    assert tau.dtype == np.float64 and tau.tolist() == [3.0, 3.0, 3.0]


def test_next_tau_refuses_a_reply_claiming_more_elements_than_the_shape():
    code = OneBitCode(bits=1, block=4)
    big = code.encode(torch.zeros(9), client_index=0, num_clients=1, seed=2, tau=1.0)
    with pytest.raises(PayloadError, match=r"^payload claims 9 elements, above the limit of 8$"):
        code.next_tau([bytes(big)], shape=(8,), previous=1.0)


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("key", "good", "bad", "allowed"),
    [
        ("bits", [1, 64], [0, 65, True, 2.0], "use an integer in 1..64"),
        ("lam", [0.0, 5], [-1e-9, math.inf, "1"], "use a finite number >= 0"),
        ("loc_votes", [0.0], [-1.0, math.nan], "use a finite number >= 0"),
        ("top", [1e-9], [0.0], "use a positive number"),
        ("a0", [1e-9], [0], "use a positive number"),
        ("min_resultant", [0.0, 2.0], [-1e-9, 2.000001], "use a number in [0, 2]"),
        ("base_share", [1e-9, 0.499], [0.0, 0.5], "use a number in (0, 0.5)"),
        ("tau_prior", [1e-30, 1e30], [0.99e-30, 1.01e30], "[1e-30, 1e30]"),
        ("decay", [-3.0, 0.0], [math.inf, math.nan], "use a finite number"),
        ("block", [1], [0, True, 2.5], "use a positive integer"),
        ("groups", [1, 7], [0, False, 1.0], "use a positive integer"),
    ],
)
def test_settings_accept_their_bounds_and_refuse_one_past_naming_key_and_value(
    key, good, bad, allowed
):
    for value in good:
        assert getattr(OneBitCode(**{key: value}), key) == value
    for value in bad:
        with pytest.raises(ValueError) as info:
            OneBitCode(**{key: value})
        message = str(info.value)
        assert message.startswith(f"onebit: {key}={value!r} is invalid; ") and allowed in message


@pytest.mark.parametrize(
    ("numel", "extra"), [(0, 8.0), (1, 8.0), (10, 0.8), (64, 0.125), (65, 0.125)]
)
def test_nominal_bits_add_one_scale_code_per_block(numel: int, extra: float) -> None:
    code = OneBitCode(bits=3, block=64)
    assert code.nominal_bits(numel) == 3 + extra
    assert code.num_blocks(numel) == -(-numel // 64)


def test_block_taus_broadcast_a_scalar_and_refuse_a_wrong_count_or_value():
    code = OneBitCode(block=4)
    assert code.block_taus(2.0, 9).tolist() == [2.0, 2.0, 2.0]
    assert code.block_taus(torch.tensor([1.0, 2.0, 3.0]), 9).tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match=r"\(3 blocks of 4\), got shape \(2,\)$"):
        code.block_taus([1.0, 2.0], 9)
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"^onebit: tau must be finite and positive"):
            code.block_taus([1.0, bad, 1.0], 9)


# --------------------------------------------------------------------------- decode_mean


def _three_replies(code: OneBitCode) -> tuple[list[Payload], dict]:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4) - 5
    plan = {"num_clients": 3, "seed": 8, "tau": 1.0}
    payloads = [code.encode(x, client_index=i, **plan) for i in range(3)]
    return payloads, {"client_indices": [0, 1, 2], **plan}


def test_decode_mean_reads_the_shape_from_the_first_reply_as_object_or_bytes():
    code = OneBitCode(bits=2, center="zero", block=8)
    payloads, plan = _three_replies(code)
    as_objects = code.decode_mean(payloads, **plan)
    assert as_objects.shape == (3, 4)
    assert torch.equal(code.decode_mean([bytes(p) for p in payloads], **plan), as_objects)
    assert torch.equal(code.decode_mean(payloads, shape=(3, 4), **plan), as_objects)


def test_decode_mean_refuses_a_shape_that_is_not_the_replies_and_no_replies():
    code = OneBitCode(bits=2, center="zero", block=8)
    payloads, plan = _three_replies(code)
    with pytest.raises(PayloadError, match=r"^onebit: shape is \(3, 4\), the server asked"):
        code.decode_mean(payloads, shape=(12,), **plan)
    with pytest.raises(ValueError, match=r"^onebit: no payloads to decode$"):
        code.decode_mean([], **{**plan, "client_indices": []})


def test_median_of_means_of_a_single_coordinate_is_the_groups_median():
    est = np.array([[1.0], [10.0], [6.0]])  # three groups, one coordinate (a ragged chunk)
    got = joint._median_of_means(est, np.array([1.0, 2.0, 3.0]))
    assert got.tolist() == [float(np.median([1.0, 5.0, 2.0]))]


def test_a_reply_of_weight_zero_says_nothing_when_no_center_is_voted():
    """Zero-weight replies add nothing to the weighted sums nor to the total weight: with
    the center not localized from votes (one per client, whatever the weight) the mean
    is that of the weighted replies alone."""
    code = OneBitCode(bits=2, center="zero", block=8)
    rng = np.random.default_rng(4)
    x = torch.from_numpy(rng.normal(3.0, 2.0, (3, 20)).astype(np.float32))
    plan = {"num_clients": 5, "seed": 9, "tau": 1.0}
    payloads = [code.encode(x[r], client_index=i, **plan) for r, i in enumerate([0, 2, 4])]
    got = code.decode_mean(payloads, client_indices=[0, 2, 4], weights=[0.0, 1.0, 0.0], **plan)
    alone = code.decode_mean(payloads[1:2], client_indices=[2], **plan)
    torch.testing.assert_close(got, alone, rtol=0, atol=1e-6)
    assert not torch.allclose(got, code.decode_mean(payloads, client_indices=[0, 2, 4], **plan))


@pytest.mark.parametrize("tau", [2.0, 0.25])
def test_clients_at_the_side_center_decode_to_it_whatever_tau(tau: float) -> None:
    """The side center is divided by tau like the clients' values: clients sitting on
    it contribute exactly zero and the mean is the side center."""
    code = OneBitCode(bits=2, center="previous", block=8)
    side = torch.linspace(-30, 30, 24)
    plan = {"num_clients": 4, "seed": 3, "tau": tau}
    payloads = [code.encode(side, client_index=i, **plan) for i in range(4)]
    got = code.decode_mean(payloads, client_indices=[0, 1, 2, 3], side_center=side, **plan)
    assert torch.equal(got, side)
    with pytest.raises(ValueError, match=r'^onebit: center="previous" needs side_center$'):
        code.decode_mean(payloads, client_indices=[0, 1, 2, 3], **plan)


def test_without_the_compiled_decoder_one_group_decodes_with_the_run_sums(monkeypatch):
    """Numba absent, or scales that are not powers of two: the run-sum decoder, whose
    estimate is the per-answer decoder's to the bit (equal weights)."""
    from fedcomp.onebit import code as onebit_code

    code = OneBitCode(bits=2, lam=50.0, block=16)
    rng = np.random.default_rng(8)
    x = torch.from_numpy((10 + 3 * rng.standard_t(3, (12, 40))).astype(np.float32))
    plan = {"num_clients": 12, "seed": 4, "tau": 1.0}
    payloads = [code.encode(x[i], client_index=i, **plan) for i in range(12)]
    kwargs = {"client_indices": list(range(12)), **plan}
    monkeypatch.setattr(onebit_code, "compiled_available", lambda qs: False)
    fallback = code.decode_mean(payloads, **kwargs)
    monkeypatch.setattr(onebit_code, "decode_one_group", decode_joint)
    assert torch.equal(fallback, code.decode_mean(payloads, **kwargs))


def test_used_queries_are_every_nonzero_coefficient_of_each_scale_and_pattern():
    """Per scale j = 0..J and phase pattern p: the rows' (query, coefficient) pairs are
    exactly the non-LOC queries of scale j with a non-zero coefficient for p."""
    codes = (OneBitCode(bits=2, lam=300.0), OneBitCode(bits=1, refine="stochastic", a0=1.0))
    for code in codes:
        qs = code.query_set(np.ones(1), 20)
        table = joint.coefficient_table(qs)
        rows = joint.used_queries(qs, table)
        num = qs.geometry.num_scales
        assert {row.scale for row in rows} <= set(range(num + 1))  # the top scale may have none
        for scale in range(num + 1):
            for p in range(4):
                want = sorted(
                    (q, table[q].reshape(-1)[p])
                    for q in range(qs.num_queries)
                    if qs.kind[q] != KIND_LOC
                    and int(qs.scale_index[q]) == scale
                    and table[q].reshape(-1)[p] != 0
                )
                got = sorted(
                    (int(r.query[p]), r.coef[p]) for r in rows if r.scale == scale and r.coef[p]
                )
                assert got == want, (scale, p)
        needs_u = qs.needs_uniform()
        assert all(bool(needs_u[r.query[r.coef != 0]].all()) == r.drawn for r in rows)


def _plan(code: OneBitCode, x: torch.Tensor, n: int) -> tuple[list[Payload], dict]:
    plan = {"num_clients": n, "seed": 6, "tau": 1.0}
    payloads = [code.encode(x[i], client_index=i, **plan) for i in range(len(x))]
    return payloads, {"client_indices": list(range(len(x))), **plan}


def test_several_groups_decode_by_median_of_means_and_one_group_or_reply_plainly():
    rng = np.random.default_rng(12)
    x = torch.from_numpy((5 + 3 * rng.standard_t(3, (7, 30))).astype(np.float32))
    for groups in (2, 3):
        code = OneBitCode(bits=2, lam=50.0, block=16, groups=groups)
        payloads, plan = _plan(code, x, 7)
        got = code.decode_mean(payloads, **plan)
        received, qs = _received(code, x.numpy(), n=7, indices=list(range(7)), weights=None,
                                 seed=6)  # fmt: skip
        common = {"numel": 30, "seed": 6, "start": None, "localize_center": True}
        want = decode_joint(received, qs, min_resultant=code.min_resultant, groups=groups,
                            **common)  # fmt: skip
        assert torch.equal(got, torch.from_numpy(want.mean).float())
        plain = decode_joint(received, qs, min_resultant=code.min_resultant, **common)
        assert not np.allclose(want.mean, plain.mean)


def test_an_empty_tensor_decodes_to_an_empty_float32_mean():
    code = OneBitCode(bits=2, block=8)
    payloads, plan = _plan(code, torch.zeros(3, 2, 0), 3)
    got = code.decode_mean(payloads, **plan)
    assert got.shape == (2, 0) and got.dtype == torch.float32


def test_decode_refuses_mismatched_indices_and_weights_naming_the_rule():
    code = OneBitCode(bits=2, center="zero", block=8)
    # weights of 1e308 overflow the sums of these replies (their answers differ from
    # the center's, seed 0): inf - inf
    x = np.random.default_rng(0).normal(0, 10, (3, 5)).astype(np.float32)
    payloads, plan = _plan(code, torch.from_numpy(x), 3)
    assert code.decode_mean(payloads, **plan).dtype == torch.float32
    accepted = code.decode_mean(payloads, weights=[0.0, 0.0, 1e-300], **plan)
    assert torch.isfinite(accepted).all()  # zero weights are allowed, a positive sum needed
    refusals = [
        ({"client_indices": [0, 1]}, "one client index per payload"),
        ({"client_indices": [0, 1, 1]}, "duplicate client indices"),
        ({"weights": [1.0, 1.0]}, "weights must be one finite number per payload"),
        ({"weights": [1.0, math.nan, 1.0]}, "weights must be one finite number per payload"),
        ({"weights": [1.0, -1e-300, 1.0]}, "weights must be >= 0 with a positive sum"),
        ({"weights": [0.0, 0.0, 0.0]}, "weights must be >= 0 with a positive sum"),
        ({"weights": [1e308, 1e308, 1e308]}, "the decoded mean is not finite (check the weights)"),
    ]
    for change, message in refusals:
        with (
            np.errstate(over="ignore"),
            pytest.raises(ValueError, match=f"^onebit: {re.escape(message)}$"),
        ):
            code.decode_mean(payloads, **{**plan, **change})
    with pytest.raises(ValueError, match=r"^onebit: no payloads to decode$"):
        code.decode([], **{**plan, "client_indices": []}, shape=(5,))


# --------------------------------------------------------------------------- check


def _one_reply(seed: int = 5) -> tuple[OneBitCode, torch.Tensor, Payload, dict]:
    code = OneBitCode(bits=2, center="zero", block=8)
    x = torch.linspace(-3, 3, 18).reshape(2, 9)
    plan = {"client_index": 1, "num_clients": 3, "seed": seed, "tau": 1.0}
    return code, x, code.encode(x, **plan), {**plan, "shape": (2, 9)}


def test_check_returns_the_packed_bits_and_the_scale_codes_of_each_block():
    code, x, payload, plan = _one_reply()
    packed, codes = code.check(payload, **plan)
    want = scale_code(block_spreads(x.reshape(-1).double().numpy(), 8, None))
    assert codes.tolist() == want.tolist() and len(codes) == 3
    assert bytes(packed) == bytes(payload.body)[_BODY.size + 3 :]
    assert len(packed) == -(-18 * 2 // 8)
    # a seed beyond 64 bits travels as its low 64 bits, on both sides
    code, _, payload, plan = _one_reply(seed=-1)
    assert payload.header.seed == 2**64 - 1
    code.check(payload, **plan)


def test_check_names_each_mismatched_field_with_both_values():
    code, _, payload, plan = _one_reply()
    h = payload.header
    digest = code.digest(code.block_taus(2.0, 18), 3)
    sent = code.digest(code.block_taus(1.0, 18), 3)
    body = bytes(payload.body)
    cases = [
        (code, Payload(PayloadHeader(0, h.dtype, h.shape, h.seed), body), {},
         f"codec id is 0, the server asked for {h.codec_id}"),
        (code, payload, {"shape": (18,)}, "shape is (2, 9), the server asked for (18,)"),
        (code, payload, {"seed": 6}, "public seed is 5, the server asked for 6"),
        (code, Payload(h, bytes([2]) + body[1:]), {}, "format is 2, the server asked for 1"),
        (OneBitCode(bits=3, center="zero", block=8), payload, {},
         "bits is 2, the server asked for 3"),
        (OneBitCode(bits=2, center="previous", block=8), payload, {},
         "center is 2, the server asked for 1"),
        (OneBitCode(bits=2, center="zero", refine="stochastic", block=8), payload, {},
         "refine is 0, the server asked for 1"),
        (code, payload, {"client_index": 0}, "client index is 1, the server asked for 0"),
        (code, payload, {"num_clients": 4}, "client count is 3, the server asked for 4"),
        (OneBitCode(bits=2, center="zero", block=9), payload, {},
         "block is 8, the server asked for 9"),
        (code, payload, {"tau": 2.0},
         f"public parameter digest is {sent}, the server asked for {digest}"),
    ]  # fmt: skip
    for checker, reply, change, message in cases:
        with pytest.raises(PayloadError, match=f"^onebit: {re.escape(message)}$"):
            checker.check(reply, **{**plan, **change})
    ints = Payload(PayloadHeader(h.codec_id, torch.int32, h.shape, h.seed), body)
    with pytest.raises(PayloadError, match=r"^onebit payload declares a non-float dtype"):
        code.check(ints, **plan)


def test_check_bounds_the_body_at_its_fixed_part_and_its_exact_length():
    code, _, payload, plan = _one_reply()
    h, body = payload.header, bytes(payload.body)
    expected = _BODY.size + 3 + 5
    assert len(body) == expected
    with pytest.raises(
        PayloadError, match=rf"^onebit payload body is 20 bytes, expected {expected}$"
    ):
        code.check(Payload(h, body[: _BODY.size]), **plan)
    with pytest.raises(PayloadError, match=r"^truncated onebit payload: 19 body bytes$"):
        code.check(Payload(h, body[: _BODY.size - 1]), **plan)
    with pytest.raises(PayloadError, match=r"^payload claims 18 elements, above the limit of 9$"):
        code.check(bytes(payload), **{**plan, "shape": (9,)})


# --------------------------------------------------------------------------- encode


def test_encode_codes_spreads_around_the_given_reference_and_scales_by_tau():
    code = OneBitCode(bits=1, center="zero", block=5)
    rng = np.random.default_rng(9)
    x, reference = rng.normal(size=12), rng.normal(size=12)
    plan = {"client_index": 0, "num_clients": 2, "seed": 1, "tau": [2.0, 0.5, 4.0]}
    for ref in (None, reference):
        payload = code.encode(torch.from_numpy(x), reference=ref, **plan)
        codes = np.frombuffer(bytes(payload.body), np.uint8, 3, _BODY.size)
        assert codes.tolist() == scale_code(block_spreads(x, 5, ref)).tolist()
    assert payload.header.dtype == torch.float64  # a tensor's own dtype
    as_array = code.encode(x.astype(np.float32), **plan)
    assert as_array.header.dtype == torch.float32 and as_array.header.shape == (12,)
    assert bytes(as_array.body) == bytes(code.encode(torch.from_numpy(x).float(), **plan).body)


def test_encode_refuses_a_client_index_outside_the_plan_and_non_finite_values():
    code = OneBitCode(bits=1, block=4)
    plan = {"num_clients": 3, "seed": 1, "tau": 1.0}
    code.encode(torch.ones(4), client_index=2, **plan)
    for bad in (3, -1):
        with pytest.raises(ValueError, match=rf"^onebit: client_index {bad} not in \[0, 3\)$"):
            code.encode(torch.ones(4), client_index=bad, **plan)
    message = "onebit: the tensor has NaN or infinite values; refusing to encode"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        code.encode(torch.tensor([1.0, math.inf]), client_index=0, **plan)


def test_the_digest_covers_every_setting_the_client_count_and_tau():
    from fedcomp.codecs import make_codec_from_spec

    base = OneBitCode(bits=2, block=8)
    assert make_codec_from_spec(base.spec()) == base
    taus = base.block_taus(1.0, 16)
    digest = base.digest(taus, 5)
    others = [
        OneBitCode(bits=2, block=8, min_resultant=0.4).digest(taus, 5),  # same cuts
        OneBitCode(bits=2, block=8, groups=3).digest(taus, 5),
        base.digest(taus, 6),
        base.digest(base.block_taus([1.0, 1.5], 16), 5),
    ]
    assert digest not in others and len(set(others)) == len(others)


@pytest.mark.parametrize(("key", "names"), [("center", CENTERS), ("refine", REFINES)])
def test_an_unknown_center_or_refinement_is_refused_listing_the_allowed(key, names) -> None:
    for name in names:
        assert getattr(OneBitCode(**{key: name}), key) == name
    allowed = f"use one of {', '.join(names)}"
    with pytest.raises(ValueError, match=f"^onebit: {key}='median' is invalid; {allowed}$"):
        OneBitCode(**{key: "median"})


def test_the_query_set_is_built_from_every_setting_and_the_smallest_tau():
    code = OneBitCode(bits=3, lam=60.0, center="inband", refine="stochastic", top=512.0,
                      a0=2.0, decay=1.5, loc_votes=7.0, base_share=0.3)  # fmt: skip
    got = code.query_set(np.array([4.0, 2.5, 8.0]), 60)
    geometry = make_geometry(60.0 / 2.5, top=512.0, a0=2.0, localize=True)
    want = build_query_set(geometry, num_clients=60, bits=3, refine="stochastic", decay=1.5,
                           loc_votes=7.0, base_share=0.3)  # fmt: skip
    assert got.geometry == geometry and len(geometry.periods) > 1  # lambda / tau sets them
    np.testing.assert_array_equal(got.cuts, want.cuts)
    np.testing.assert_array_equal(got.kind, want.kind)
    np.testing.assert_array_equal(got.inclusion, want.inclusion)


def test_a_stochastic_refinements_coefficient_is_three_scales_at_its_phases_only():
    """SREF(j, b, b') is worth 3 L_j when the safe phases are (b, b'), 0 otherwise."""
    qs = OneBitCode(bits=2, refine="stochastic").query_set(np.ones(1), 10)
    table = joint.coefficient_table(qs)
    sref = np.flatnonzero(qs.kind == KIND_SREF)
    assert sref.size
    for q in sref:
        want = np.zeros((2, 2))
        want[qs.phase[q], qs.phase2[q]] = 3 * qs.geometry.scale(int(qs.scale_index[q]))
        np.testing.assert_array_equal(table[q], want)


def test_an_integer_tensor_is_refused_and_an_array_of_any_shape_is_flattened():
    code = OneBitCode(bits=1, block=4)
    plan = {"client_index": 0, "num_clients": 2, "seed": 1, "tau": 1.0}
    with pytest.raises(
        ValueError, match=r"^onebit needs a floating-point tensor, got torch.int64$"
    ):
        code.encode(torch.arange(6), **plan)
    x = np.linspace(-2, 2, 6).reshape(2, 3)
    assert code.encode(x, **plan).header.shape == (2, 3)
    assert bytes(code.encode(x, **plan).body) == bytes(
        code.encode(torch.from_numpy(x), **plan).body
    )
