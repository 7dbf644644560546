"""Trees inside the server's pre-aggregated mean: accuracy bounds, overflow handling,
statistics refresh, order independence through the real wrapper, and bad settings."""

from __future__ import annotations

import numpy as np
import pytest

from fedcomp.settings import settings_from_dict, validate
from fedcomp.trees import balanced_tree, leaf_depths
from fedcomp.trees.aggregate import TreeConfig, TreeStats, tree_mean
from tests.test_pipeline_inprocess import SETTINGS, N, _initial, one_round

U32 = 2.0**-24


def _updates(k: int, n: int, seed: int = 0, scales=None) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    scales = scales if scales is not None else np.ones(k)
    return [{"w": (rng.standard_normal(n) * s).astype(np.float32)} for s in scales]


def test_fp32_balanced_tree_mean_is_within_its_rounding_bound() -> None:
    k, n = 12, 5000
    updates = _updates(k, n)
    weights = [float(i + 1) for i in range(k)]
    got, report = tree_mean(
        updates, weights, list(range(k)), TreeConfig(tree="balanced"), TreeStats(), 1
    )
    f = np.array(weights) / sum(weights)
    stack = np.stack([u["w"].astype(np.float64) for u in updates])
    ref = f @ stack
    depth = leaf_depths(balanced_tree(k)).max()
    bound = (depth + 2) * U32 * (f @ np.abs(stack))  # weighting + depth additions per path
    assert (np.abs(got["w"] - ref) <= bound + 1e-30).all()
    assert report["chosen"] == {"balanced": 1} and report["overflow_chunks"] == 0
    assert report["mse_vs_fp64"] == pytest.approx(float(np.mean((got["w"] - ref) ** 2)), rel=1e-6)


def test_fp16_overflow_is_recomputed_in_fp32_and_counted() -> None:
    # Weighted terms are +-60000 (representable in fp16, max 65504); the balanced tree's
    # partial sums (0 + 1) and (2 + 3) reach +-120000 and overflow, the mean is 0.
    updates = [{"w": np.full(10, s * 240000.0, np.float32)} for s in (1, 1, -1, -1)]
    config = TreeConfig(tree="balanced", dtype="fp16", chunk_size=5)
    got, report = tree_mean(updates, [1.0] * 4, [0, 1, 2, 3], config, TreeStats(), 1)
    assert report["overflow_chunks"] == 2  # both chunks, each redone in float32
    assert np.array_equal(got["w"], np.zeros(10, np.float32))


def test_trees_are_reused_between_refreshes_and_follow_client_changes() -> None:
    config = TreeConfig(tree="adaptive", refresh_rounds=3, stats="ema", chunk_size=1000)
    stats = TreeStats()
    ids = [0, 1, 2, 3]
    scales = [30.0, 1.0, 1.0, 1.0]
    tree_mean(_updates(4, 1000, 0, scales), [1.0] * 4, ids, config, stats, 1)
    first = stats.chosen[("w", 0)]
    # Round 2: different data, no refresh: the same tree object is reused.
    tree_mean(_updates(4, 1000, 1, [1.0, 1.0, 1.0, 30.0]), [1.0] * 4, ids, config, stats, 2)
    assert stats.chosen[("w", 0)] is first
    # A different set of clients forces a new choice even between refreshes.
    tree_mean(_updates(3, 1000, 2), [1.0] * 3, [0, 1, 3], config, stats, 3)
    assert stats.chosen[("w", 0)][0] == (0, 1, 3)
    restored = TreeStats()
    restored.load_state_dict(stats.state_dict())
    assert restored.mean == stats.mean and restored.second == stats.second


@pytest.mark.parametrize("tree", ["adaptive", "huffman", "sequential"])
def test_bf16_trees_through_the_wrapper_are_independent_of_reply_order(tree: str) -> None:
    settings = settings_from_dict(
        {
            "num_clients": N,
            "num_rounds": 1,
            "fraction_evaluate": 0.0,
            "aggregation": {
                "handoff": "pre_aggregated",
                "tree": tree,
                "dtype": "bf16",
                "root_fp32": True,
            },
        }
    )
    trees = TreeConfig(tree=tree, dtype="bf16", root_fp32=True)
    first, strategy, _, spy = one_round(settings, handoff="pre_aggregated", trees=trees)
    reversed_, *_ = one_round(
        settings, handoff="pre_aggregated", trees=trees, order=lambda r: r[::-1]
    )
    exact, *_ = one_round(SETTINGS, handoff="pre_aggregated")
    assert strategy.rounds[0]["codec"]["tree"]["overflow_chunks"] == 0
    initial = {k: np.asarray(v.numpy()) for k, v in _initial(settings).items()}
    weights = np.array([spy.weight[i] for i in range(N)])
    # Per coordinate, a bf16 tree's error is at most (depth + 2) bf16 roundings
    # (u = 2^-8) of the weighted mean of |update|: one to cast each leaf, one per level
    # of additions (depth <= N - 1 for any tree); the fp32 root and the final
    # global + mean add float32 roundings of the result.
    for name in first:
        assert np.array_equal(first[name], reversed_[name])
        updates = np.stack(
            [spy.local[i][name].astype(np.float64) - initial[name] for i in range(N)]
        )
        scale = np.tensordot(weights / weights.sum(), np.abs(updates), axes=1)
        float32_ulps = 4 * np.spacing(np.abs(exact[name]).astype(np.float32)).astype(np.float64)
        bound = (N + 1) * 2.0**-8 * scale + float32_ulps
        err = np.abs(first[name].astype(np.float64) - exact[name].astype(np.float64))
        assert np.all(err <= bound), (name, float(np.max(err - bound)))
        # and the bf16 error is visible, or the test says nothing about bf16 rounding
        assert np.any(err > float32_ulps), name


def test_bad_tree_settings_fail_with_the_key() -> None:
    with pytest.raises(ValueError, match=r"aggregation\.tree"):
        TreeConfig(tree="oak")
    with pytest.raises(ValueError, match=r"aggregation\.dtype"):
        TreeConfig(dtype="fp8")
    with pytest.raises(ValueError, match="pre_aggregated"):
        validate(settings_from_dict({"aggregation": {"tree": "huffman"}}))
    with pytest.raises(ValueError, match="refresh_rounds"):
        TreeConfig(refresh_rounds=0)
    with pytest.raises(ValueError, match="weights"):
        tree_mean(_updates(2, 3), [1.0, 0.0], [0, 1], TreeConfig(tree="balanced"), TreeStats(), 1)
    with pytest.raises(ValueError, match="k >= 1"):
        tree_mean([], [], [], TreeConfig(tree="balanced"), TreeStats(), 1)
