"""The residual codec's bias diagnostic: the estimator against its definition, and the
round records that carry it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcomp.codecs import make_codec
from fedcomp.codecs.residual import draw_bias
from fedcomp.settings import settings_from_dict, validate


@pytest.mark.parametrize("bias_scale", [0.0, 0.3])
def test_draw_bias_is_unbiased_for_the_squared_bias(bias_scale: float) -> None:
    """Draws x_k = r + b + noise: E[estimate] = ||b||^2, whatever the noise's size
    (4,000 trials of K = 4 draws; the mean within 4 standard errors)."""
    rng = np.random.default_rng(int(bias_scale * 10))
    r = rng.normal(size=50)
    b = bias_scale * rng.normal(size=50)
    estimates = [
        draw_bias([r + b + rng.normal(scale=2.0, size=50) for _ in range(4)], r)
        for _ in range(4000)
    ]
    mean, se = float(np.mean(estimates)), float(np.std(estimates) / np.sqrt(4000))
    assert abs(mean - float(np.sum(b**2))) < 4 * se
    with pytest.raises(ValueError, match="at least 2 draws"):
        draw_bias([r], r)


def test_an_unbiased_inner_codec_shows_no_bias_on_a_residual() -> None:
    """Random-k is unbiased: over 200 seeds its estimate averages to 0 within 4
    standard errors, while one draw's squared error is omega ||r||^2 on average."""
    memory = make_codec("residual", inner="randk", fraction=0.25, bias_draws=4)
    r = torch.from_numpy(np.random.default_rng(3).standard_normal(400).astype(np.float32))
    estimates = [memory.bias_estimate(r, seed) for seed in range(200)]
    mean, se = float(np.mean(estimates)), float(np.std(estimates) / np.sqrt(200))
    assert abs(mean) < 4 * se
    norm2 = float((r.double() ** 2).sum())
    assert se < 0.1 * memory.inner.variance_factor(400) * norm2  # the test can see a bias


@pytest.mark.parametrize("draws", [1, -2, 2.5, True])
def test_a_bad_bias_draws_fails_before_the_run(draws) -> None:
    codec = {"name": "residual", "inner": "randk", "fraction": 0.25, "bias_draws": draws}
    with pytest.raises(ValueError, match=r"^invalid setting codec.*bias_draws must be 0"):
        validate(settings_from_dict({"codec": codec}))


def test_a_round_records_the_clients_bias_estimates() -> None:
    from tests.test_pipeline_inprocess import N, one_round

    codec = {"name": "residual", "inner": "randk", "fraction": 0.25, "bias_draws": 3}
    settings = settings_from_dict(
        {"num_clients": N, "num_rounds": 1, "fraction_evaluate": 0.0, "codec": codec}
    )
    _, strategy, _, _ = one_round(settings)
    record = strategy.rounds[0]
    assert record["replied"] == N and record["failures"] == 0
    rows = record["per_client"]
    assert all("cv-bias-norm2" in r for r in rows)
    summary = record["codec"]
    assert summary["bias_norm2_sum"] == pytest.approx(sum(r["cv-bias-norm2"] for r in rows))
    assert summary["bias_over_residual"] == pytest.approx(
        summary["bias_norm2_sum"] / sum(r["cv-residual-norm2"] for r in rows)
    )
