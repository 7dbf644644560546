"""The bounded-influence rules (fedcomp.influence) where real rounds put them: norms
and caps below 1, a zero reference norm, weights near 1, the weight cap, and an update
whose squares partly underflow float32. Every expected value is computed here from the
rule's definition (the reference norm is ``sorted(norms)[(n - 1) // 2]``)."""

from __future__ import annotations

import numpy as np
import pytest

from fedcomp.influence import (
    MAX_STRIKES,
    MAX_STRIKES_A_ROUND,
    NORM_ROW,
    STRIKE_DECAY,
    TrustRegion,
    cap_weights,
    clip_scales,
    consensus_coefficients,
    next_strikes,
    outliers,
    robust_reference,
    room_of,
    total_weight_is_finite,
    update_norm,
    weight_cap,
)

#: Real updates' norms: a learning rate times a gradient is well below 1.
SMALL_NORMS = [0.031, 0.0042, 0.58, 0.012, 0.0097, 0.21, 0.0063]


def _lower_median(values: list[float]) -> float:
    return sorted(values)[(len(values) - 1) // 2]


@pytest.mark.parametrize("factor", [0.5, 1.0, 3.0])
def test_clipping_binds_when_the_cap_is_below_one(factor: float) -> None:
    """Norms of 0.004 to 0.6 (reference 0.012): caps of 0.006, 0.012 and 0.036, each
    below 1, still bring every larger update down to the cap and no further."""
    cap = factor * _lower_median(SMALL_NORMS)
    assert cap < 1
    scales = clip_scales(SMALL_NORMS, factor, _lower_median(SMALL_NORMS))
    beyond = [norm > cap for norm in SMALL_NORMS]
    assert any(beyond) and not all(beyond)  # the case really clips some and not others
    for norm, scale, over in zip(SMALL_NORMS, scales, beyond, strict=True):
        if over:
            assert norm * scale == pytest.approx(cap, rel=1e-12, abs=0)
        else:
            assert scale == 1.0


def test_a_zero_reference_norm_never_switches_clipping_off() -> None:
    """Issue 41, finding 5: a reference of exactly 0 (half the updates zero, nothing to
    fall back on) used to disable clipping (``norm > cap > 0``), letting the other
    half through at any norm. The cap is then 0: every nonzero update is scaled to 0
    (the round makes no step, logged), zero updates stay as they are."""
    norms = [0.0, 0.4, 0.0, 1e30]
    assert _lower_median(norms) == 0.0
    assert clip_scales(norms, 10.0, 0.0) == [1.0, 0.0, 1.0, 0.0]
    assert clip_scales([0.7], 10.0, 0.0) == [0.0]
    assert clip_scales(norms, 10.0, None) == [1.0] * 4  # no reference at all: nothing to cap
    assert clip_scales(norms, 0.0, 0.0) == [1.0] * 4  # off


@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
def test_outliers_are_beyond_factor_times_the_reference_at_any_factor(factor: float) -> None:
    """The bound is factor x the rejection reference (the upper median), also for
    factors up to 1 and references far below 1, where factor / reference would be a
    different number."""
    bound = factor * sorted(SMALL_NORMS)[len(SMALL_NORMS) // 2]
    expected = [norm > bound for norm in SMALL_NORMS]
    assert any(expected) and not all(expected)
    assert outliers(SMALL_NORMS, factor) == expected


def test_the_weight_cap_is_the_factor_times_the_lower_median_weight() -> None:
    """Issue 41, finding 3: the cap is relative to the round's claims and one client of
    two cannot raise it: the LOWER median (the plain median of two is their mean, which
    a client claiming 1e9 sets near 5e8)."""
    weights = [120.0, 7.0, 3000.0, 55.0, 9.0, 64.0]
    lower = sorted(weights)[(len(weights) - 1) // 2]  # 55, not (55 + 64) / 2
    for factor in (0.5, 1.0, 3.0):
        assert weight_cap(weights, factor) == factor * lower
        capped = cap_weights(weights, factor)
        assert capped == [min(w, factor * lower) for w in weights]
    assert weight_cap([1e9, 300.0], 4.0) == 1200.0  # one of two: 4 x the honest claim
    assert cap_weights([1e9, 300.0], 4.0) == [1200.0, 300.0]
    assert weight_cap(weights, 0.0) is None and cap_weights(weights, 0.0) == weights  # off
    assert weight_cap([], 3.0) is None  # no replies: nothing to cap


def test_a_clients_room_scales_its_weight_cap_norm_cap_and_trust_region() -> None:
    """Escalation: a client with room f is held to f times each bound (its weight cap
    included: a client that lost its room loses its weight with it)."""
    weights, room = [100.0, 100.0, 900.0], [1.0, 1.0, 0.25]
    assert cap_weights(weights, 4.0, room) == [100.0, 100.0, 100.0]  # 4 x 0.25 x 100
    assert cap_weights(weights, 4.0, [1.0, 1.0, 0.5]) == [100.0, 100.0, 200.0]
    norms = [1.0, 1.2, 30.0]
    assert clip_scales(norms, 10.0, 1.0, room) == [1.0, 1.0, 2.5 / 30.0]
    region = TrustRegion(0.5, 2.0, 3.0)
    # A contribution of 1 x (3, 4) against a unit consensus along x (C = 1): 3 along is
    # beyond 2 x 0.5 = 1, 4 across beyond 3 x 0.5 = 1.5.
    (lam, mu), *_ = consensus_coefficients([1.0], [3.0], [5.0], 1.0, region, [0.5])
    assert lam == 1.5 / 4.0 and lam * 3.0 + mu == 1.0


@pytest.mark.parametrize("strikes", [0.0, 0.5, 1.0, 3.0, 8.0])
def test_room_halves_with_each_strike(strikes: float) -> None:
    assert room_of(strikes) == 2.0**-strikes
    assert room_of(0.0) == 1.0  # an honest client, never cut, keeps all of its room


def test_strikes_are_the_log2_of_what_a_bound_cut_beyond_half_and_decay_when_none_did():
    assert next_strikes(0.0, 0.5) == 0.0  # the first halving is free
    assert next_strikes(0.0, 0.7) == 0.0
    assert next_strikes(2.0, 0.7) == 2.0  # cut, but not beyond half: no decay either
    assert next_strikes(0.0, 0.25) == 1.0
    assert next_strikes(1.0, 0.125) == 3.0
    assert next_strikes(0.0, 0.1) == pytest.approx(np.log2(10) - 1, rel=1e-12)
    assert next_strikes(0.0, 1e-9) == MAX_STRIKES_A_ROUND  # at most 4 a round
    assert next_strikes(0.0, 0.0) == MAX_STRIKES_A_ROUND
    assert next_strikes(MAX_STRIKES - 1.0, 1e-9) == MAX_STRIKES  # never beyond the cap
    assert next_strikes(3.0, 1.0) == 3.0 - STRIKE_DECAY  # a round no bound cut
    assert next_strikes(0.2, 1.0) == 0.0  # never below 0


def test_the_reference_falls_back_when_the_lower_median_collapses() -> None:
    """Issue 41, finding 5: half of the updates near zero pull the lower median to ~0.
    With an earlier clean round the reference is that round's; without one, the lower
    median stands (nothing is let through unclipped); a round with one update uses the
    earlier reference, as before."""
    honest = [1.0, 1.3, 0.8, 1.1, 0.9]
    tiny = [1e-7] * 5
    assert robust_reference(honest, None, 10.0) == (_lower_median(honest), False)
    assert robust_reference(honest + tiny, 0.95, 10.0) == (0.95, True)
    assert robust_reference(honest + tiny, None, 10.0) == (1e-7, True)
    # Exactly at the ratio is not a collapse; just past it is.
    assert robust_reference([1.0, 10.0], 3.0, 10.0) == (1.0, False)
    assert robust_reference([1.0, 10.000001], 3.0, 10.0) == (3.0, True)
    assert robust_reference([4.0], 3.0, 10.0) == (3.0, True)
    assert robust_reference([4.0], None, 10.0) == (None, False)
    assert robust_reference(honest + tiny, 0.95, 0.0) == (1e-7, False)  # the rule off


@pytest.mark.parametrize("weights", [[1.0], [0.25], [0.5, 0.25]])
def test_a_total_weight_of_one_or_less_is_finite_and_positive(weights: list[float]) -> None:
    assert total_weight_is_finite(weights)


def test_an_update_whose_squares_partly_underflow_gets_its_true_norm() -> None:
    """Most coordinates' float32 squares (2^-151) round to 0, and two normal ones carry
    a float32 sum just above size x tiny / 2^12: summing in float32 would lose about
    4e-5 of the norm. The norm must be as accurate as for a normal-range update
    (1e-6: tests/test_influence.py's measured accuracy)."""
    size = 2 * NORM_ROW
    tiny = float(np.finfo(np.float32).tiny)
    update = np.full(size, 2.0**-75.5, dtype=np.float32)
    assert np.square(update[:1])[0] == 0.0  # the float32 square underflows
    update[0] = update[NORM_ROW] = np.sqrt(0.75 * size * tiny / 2**12)
    exact = float(np.sqrt(np.sum(np.square(update, dtype=np.float64))))
    lost = (size - 2) * 2.0**-151  # what the underflowed squares hold
    assert lost / exact**2 > 5e-5  # the float32 sum would be off by that share
    assert update_norm({"w": update}) == pytest.approx(exact, rel=1e-6, abs=0)
