"""The regime statistics against their definitions on draws whose answers are known."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedcomp.regime import (
    CROSSOVER,
    center_and_spread,
    crossover_constant,
    hill_tail_index,
    onebit_margin,
    spread_statistics,
)


def test_center_and_spread_are_the_median_and_the_blocks_scaled_mad() -> None:
    x = np.array([[1.0, -4.0, 0.0], [2.0, 0.0, 1.0], [10.0, 4.0, 3.0]])
    center, tau = center_and_spread(x, block=2)
    assert center.tolist() == [2.0, 0.0, 1.0]
    # block 1: deviations 1, 0, 8 and 4, 0, 4: median (1 + 4) / 2; block 2: 1, 0, 2: 1
    assert tau.tolist() == [1.4826 * 2.5, 1.4826 * 2.5, 1.4826 * 1.0]
    gauss = np.random.default_rng(0).normal(3.0, 2.0, size=(4001, 50))
    c, t = center_and_spread(gauss, block=10)
    assert np.abs(c - 3.0).max() < 0.12 and np.abs(t - 2.0).max() < 0.05


@pytest.mark.parametrize("df", [1.5, 2.5, 4.0])
def test_hill_recovers_a_student_t_tail_index(df: float) -> None:
    """A Student-t's tail is Pareto with index df: Hill on 10^6 draws, top 0.5%."""
    x = np.abs(np.random.default_rng(int(df * 10)).standard_t(df, size=1_000_000))
    assert abs(hill_tail_index(x, top=0.005) - df) < 0.15 * df


def test_the_crossover_follows_the_reference_study() -> None:
    (d0, v0), (d1, v1) = CROSSOVER
    assert crossover_constant(d0) == pytest.approx(v0) and crossover_constant(d1) == pytest.approx(
        v1
    )
    assert crossover_constant(10.0) == pytest.approx(v1) and crossover_constant(1.5) == math.inf
    mid = crossover_constant((d0 + d1) / 2)
    assert mid == pytest.approx(math.sqrt(v0 * v1))  # log-linear
    # lambda^2 / 3 > V at 1 bit: the margin crosses 1 exactly at lambda = sqrt(3 V)
    assert onebit_margin(math.sqrt(3 * v1), d1) == pytest.approx(1.0)
    assert (
        onebit_margin(math.sqrt(3 * v1) * 1.1, d1) > 1 > onebit_margin(math.sqrt(3 * v1) * 0.9, d1)
    )
    # 2 bits: lambda^2 / (3 * 9) over V / 2
    assert onebit_margin(30.0, d1, bits=2) == pytest.approx((900 / 27) / (v1 / 2))
    assert onebit_margin(1e6, 1.5) == 0.0


def test_spread_statistics_of_known_draws() -> None:
    rng = np.random.default_rng(1)
    offset = rng.normal(0, 1, size=400) * 50  # a common offset per coordinate
    gauss = offset + rng.normal(0, 1, size=(2000, 400))
    stats = spread_statistics(gauss)
    expected_offset = float(np.median(np.abs(offset)))
    assert abs(stats["offset_ratio"] - expected_offset) < 0.05 * expected_offset
    assert abs(stats["kurtosis"]) < 0.1  # Gaussian
    assert stats["range_ratio"] > np.percentile(np.abs(offset), 99) * 0.9
    heavy = rng.standard_t(2.5, size=(2000, 400))
    assert spread_statistics(heavy)["kurtosis"] > 3 and spread_statistics(heavy)["tail_index"] < 3.5
    assert spread_statistics(np.ones((5, 10))) == {} and spread_statistics(gauss[:2]) == {}


def test_the_diagnostics_record_the_statistics_of_the_exact_updates(tmp_path, monkeypatch) -> None:
    """aggregate_error adds spread_statistics of the clients' exact float updates,
    sampled at a fixed stride (integer tensors left out)."""
    import fedcomp.diagnostics as diagnostics

    monkeypatch.setattr(diagnostics, "SAMPLED", 100)
    rng = np.random.default_rng(2)
    global_arrays = {"w": np.zeros((30, 20)), "b": np.zeros(50), "n": np.zeros(1, np.int64)}
    updates = {
        sid: {
            "w": rng.standard_t(3, size=(30, 20)) + 5.0,
            "b": rng.normal(size=50),
            "n": np.ones(1),
        }
        for sid in range(6)
    }
    for sid, update in updates.items():
        diagnostics.write_update(tmp_path, 4, sid, 1.0 + sid, update)
    new = {k: v + 0.1 for k, v in global_arrays.items()}
    got = diagnostics.aggregate_error(tmp_path, 4, list(updates), global_arrays, new)
    stride = 650 // 100
    stack = np.stack(
        [np.concatenate([u["w"].reshape(-1), u["b"]])[::stride] for u in updates.values()]
    )
    want = spread_statistics(stack)
    assert want and {k: got[f"regime_{k}"] for k in want} == want
    assert got["update_power"] > 0


def test_hill_is_its_definition_on_a_small_sample() -> None:
    """k = 2 largest of [16, 8, 4, 2, 1] over the third: 1 / mean(log 4, log 2)."""
    x = np.array([1.0, 16.0, 4.0, 8.0, 2.0, 0.0])  # zeros are left out
    assert hill_tail_index(x, top=0.4) == pytest.approx(1 / (1.5 * math.log(2)))


def test_the_range_ratio_is_the_99th_percentile_of_each_coordinates_max_over_tau() -> None:
    """One coordinate far out must not set the ratio (a max would): the 99th percentile
    over 1,000 coordinates of max_i |x_i| / tau, tau from center_and_spread."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(50, 1000))
    x[0, 17] = 1e6
    _, tau = center_and_spread(x)
    expected = float(np.percentile(np.abs(x).max(axis=0) / tau, 99))
    got = spread_statistics(x)["range_ratio"]
    assert got == pytest.approx(expected) and got < 100
