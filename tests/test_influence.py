"""The norm behind the median-based rules: fast, and within its stated error bound."""

from __future__ import annotations

import numpy as np
import pytest

from fedcomp.influence import NORM_ROW, update_norm


def _exact(update):
    return float(np.sqrt(sum(np.sum(np.square(v, dtype=np.float64)) for v in update.values())))


@pytest.mark.parametrize("size", [1, NORM_ROW - 1, NORM_ROW, 3 * NORM_ROW + 17, 1_000_003])
def test_update_norm_is_within_its_bound_of_the_float64_norm(size):
    rng = np.random.default_rng(size)
    update = {
        "w": (rng.standard_t(2, size) * 1e-3).astype(np.float32),
        "h": rng.standard_normal((3, 5)).astype(np.float16),
        "n": np.arange(4, dtype=np.int64),  # not a float: not counted
    }
    exact = float(
        np.sqrt(
            np.sum(np.square(update["w"], dtype=np.float64))
            + np.sum(np.square(update["h"].astype(np.float64)))
        )
    )
    # Stated bound on the sum of squares: NORM_ROW * 2^-24 relative; half on the norm.
    assert abs(update_norm(update) - exact) <= 0.5 * NORM_ROW * 2.0**-24 * exact
    # In practice (random signs of rounding) far tighter.
    assert abs(update_norm(update) - exact) <= 1e-6 * exact


def test_a_huge_finite_update_gets_its_true_finite_norm():
    update = {"w": np.full(10_000, 3e30, dtype=np.float32)}  # squares overflow float32
    norm = update_norm(update)
    assert np.isfinite(norm)
    assert norm == pytest.approx(_exact(update), rel=1e-12)


def test_float64_tensors_are_summed_in_float64():
    rng = np.random.default_rng(0)
    update = {"w": rng.standard_normal(50_000)}
    assert update_norm(update) == pytest.approx(_exact(update), rel=1e-14)


@pytest.mark.parametrize("value", [1e-22, 1e-24, 1e-40])
def test_a_tiny_update_gets_its_true_nonzero_norm(value):
    """float32 squares of these underflow (to subnormals or 0); the median-based rules
    would then see a zero median norm."""
    update = {"w": np.full(10_000, value, dtype=np.float32)}
    assert update_norm(update) == pytest.approx(_exact(update), rel=1e-12, abs=0)
    assert update_norm(update) > 0
