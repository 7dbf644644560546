"""The bounded-influence rules (fedcomp.influence) where real rounds put them: norms
and caps below 1, a zero reference norm, weights near 1, the weight cap, and an update
whose squares partly underflow float32. Every expected value is computed here from the
rule's definition (the reference norm is ``sorted(norms)[(n - 1) // 2]``)."""

from __future__ import annotations

import numpy as np
import pytest

from fedcomp.influence import (
    NORM_ROW,
    clip_scales,
    outliers,
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
    scales = clip_scales(SMALL_NORMS, factor)
    beyond = [norm > cap for norm in SMALL_NORMS]
    assert any(beyond) and not all(beyond)  # the case really clips some and not others
    for norm, scale, over in zip(SMALL_NORMS, scales, beyond, strict=True):
        if over:
            assert norm * scale == pytest.approx(cap, rel=1e-12, abs=0)
        else:
            assert scale == 1.0


def test_a_zero_reference_norm_scales_nothing_to_zero() -> None:
    """Half the updates zero (lower median 0): the cap is 0, and scaling the others by
    0 / norm would erase every nonzero update; the round is left unclipped instead."""
    norms = [0.0, 0.4, 0.0, 0.9]
    assert _lower_median(norms) == 0.0
    assert clip_scales(norms, 10.0) == [1.0] * 4
    # A single update against a zero fallback reference: the same.
    assert clip_scales([0.7], 10.0, fallback=0.0) == [1.0]


@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
def test_outliers_are_beyond_factor_times_the_reference_at_any_factor(factor: float) -> None:
    """The bound is factor x the rejection reference (the upper median), also for
    factors up to 1 and references far below 1, where factor / reference would be a
    different number."""
    bound = factor * sorted(SMALL_NORMS)[len(SMALL_NORMS) // 2]
    expected = [norm > bound for norm in SMALL_NORMS]
    assert any(expected) and not all(expected)
    assert outliers(SMALL_NORMS, factor) == expected


def test_the_weight_cap_is_the_factor_times_the_median_weight() -> None:
    weights = [120.0, 7.0, 3000.0, 55.0, 9.0, 64.0]
    median = (sorted(weights)[2] + sorted(weights)[3]) / 2  # an even count: the mean of two
    for factor in (0.5, 1.0, 3.0):
        assert weight_cap(weights, factor) == pytest.approx(factor * median, rel=1e-15, abs=0)
    assert weight_cap(weights, 0.0) is None  # off
    assert weight_cap([], 3.0) is None  # no replies: nothing to cap


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
