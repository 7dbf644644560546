"""The float32 weighted mean the wrapper hands over in pre-aggregated mode."""

from __future__ import annotations

import numpy as np
import pytest

from fedcomp.aggregate import weighted_mean


def test_single_update_is_returned_exactly() -> None:
    x = {"w": np.random.default_rng(0).standard_normal(1000).astype(np.float32)}
    out = weighted_mean([x], [37.0])
    assert out["w"].dtype == np.float32 and np.array_equal(out["w"], x["w"])


def test_matches_a_float64_weighted_mean_within_float32_rounding() -> None:
    rng = np.random.default_rng(1)
    xs = [{"w": rng.standard_normal(500).astype(np.float32)} for _ in range(6)]
    ws = [3.0, 1.0, 7.0, 2.0, 5.0, 4.0]
    out = weighted_mean(xs, ws)["w"]
    f = np.array(ws) / sum(ws)
    stack = np.stack([x["w"].astype(np.float64) for x in xs])
    ref = f @ stack
    bound = (len(xs) + 1) * 2.0**-24 * (f @ np.abs(stack))
    assert (np.abs(out - ref) <= bound).all()


def test_integer_buffers_are_averaged_and_keep_their_dtype() -> None:
    xs = [{"steps": np.array(10, dtype=np.int64)}, {"steps": np.array(20, dtype=np.int64)}]
    out = weighted_mean(xs, [1.0, 3.0])["steps"]
    assert out.dtype == np.int64 and int(out) == 18  # rint(0.25 * 10 + 0.75 * 20 = 17.5)


@pytest.mark.parametrize("weights", [[], [1.0, 0.0], [1.0, -1.0], [1.0, float("nan")]])
def test_bad_weights_are_rejected(weights: list[float]) -> None:
    xs = [{"w": np.zeros(2, np.float32)}] * max(len(weights), 1)
    with pytest.raises(ValueError):
        weighted_mean(xs if weights else [], weights)
