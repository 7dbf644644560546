"""Invariants of the tree mean that the trees mutation run found unpinned: integer
buffers, a single update, the float32 root, the report's statistics, the tree chosen
again every round, which shape each tree name builds, reduce_tree's edge cases,
tree_cost's refusals, the binade rounding model and estimate_nu's reproducibility.

Every expected value is computed here from the definition, not read from the code.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcomp.trees import (
    balanced_tree,
    blocked_tree,
    greedy_tree,
    huffman_tree,
    sequential_tree,
)
from fedcomp.trees.aggregate import (
    TreeConfig,
    TreeStats,
    needs_moments_first,
    observe,
    tree_mean,
)
from fedcomp.trees.build import select_tree
from fedcomp.trees.reduce import estimate_nu, float64_reference, reduce_tree
from fedcomp.trees.structure import (
    expected_rounding_variance,
    gram_cost,
    rounding_cost,
    tree_cost,
    validate_tree,
)


def _normal(k: int, n: int, seed: int, scales=None) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    scales = np.ones(k) if scales is None else scales
    return [{"w": (rng.standard_normal(n) * s).astype(np.float32)} for s in scales]


def _terms(updates, weights, name: str = "w") -> torch.Tensor:
    """The leaves tree_mean sums: (w_i / W) x_i in float32, one row per client."""
    f = np.asarray(weights, np.float64) / float(np.sum(weights))
    return torch.stack(
        [
            torch.from_numpy(u[name].astype(np.float32)).reshape(-1) * float(fi)
            for u, fi in zip(updates, f, strict=True)
        ]
    )


def _moments(terms: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per-leaf variance max(E[x^2] - E[x]^2, eps) and mean, in float64 (the definition)."""
    x = terms.double().numpy()
    m = x.mean(axis=1)
    return np.maximum((x * x).mean(axis=1) - m * m, 1e-30), m


# --- tree_mean --------------------------------------------------------------------------


def test_integer_buffers_take_the_weighted_mean_rounded_back() -> None:
    # A BatchNorm counter: weights 1 and 3 give (1 * 10 + 3 * 31) / 4 = 25.75 -> 26.
    updates = [{"n": np.array([10, 7], np.int64)}, {"n": np.array([31, 2], np.int64)}]
    weights = [1.0, 3.0]
    got, report = tree_mean(updates, weights, [0, 1], TreeConfig(), TreeStats(), 1)
    expected = np.rint((1 * np.array([10, 7]) + 3 * np.array([31, 2])) / 4.0)
    assert got["n"].dtype == np.int64
    assert np.array_equal(got["n"], expected.astype(np.int64))
    assert np.array_equal(got["n"], [26, 3])
    # No float coordinate was reduced: the rounding report is 0 (not a division by 0).
    assert report["mse_vs_fp64"] == 0.0 and report["chosen"] == {}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_single_update_is_its_own_mean(dtype: str) -> None:
    # The integer buffer first: the float tensor after it must still be reduced.
    update = {"n": np.array([5], np.int32), "w": np.array([1.5, -3.25, 1e-3, 7.0], np.float32)}
    config = TreeConfig(tree="balanced", dtype=dtype)
    got, _ = tree_mean([update], [2.0], [9], config, TreeStats(), 1)
    # Factor 1, no addition: only the cast to the working dtype rounds.
    expected = (
        torch.from_numpy(update["w"])
        .to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
        .float()
    )
    assert np.array_equal(got["w"], expected.numpy())
    assert np.array_equal(got["n"], [5]) and got["n"].dtype == np.int32


def test_root_fp32_does_the_last_addition_in_float32() -> None:
    updates = _normal(2, 2000, seed=3)
    weights = [1.0, 1.0]
    terms = _terms(updates, weights)
    low = terms.to(torch.bfloat16)
    with_root = (low[0].float() + low[1].float()).numpy()
    without = (low[0] + low[1]).float().numpy()
    assert not np.array_equal(with_root, without)  # the setting is observable here
    for root_fp32, expected in ((True, with_root), (False, without)):
        config = TreeConfig(tree="sequential", dtype="bf16", root_fp32=root_fp32)
        got, _ = tree_mean(updates, weights, [0, 1], config, TreeStats(), 1)
        assert np.array_equal(got["w"], expected), root_fp32


def test_the_report_counts_chunks_and_averages_the_squared_error_per_coordinate() -> None:
    k, weights = 5, [1.0, 2.0, 3.0, 1.0, 1.0]
    rng = np.random.default_rng(11)
    updates = [
        {
            "a": rng.standard_normal(10).astype(np.float32),
            "b": (rng.standard_normal((2, 3)) * 40).astype(np.float32),
        }
        for _ in range(k)
    ]
    config = TreeConfig(tree="balanced", dtype="bf16", chunk_size=4)
    got, report = tree_mean(updates, weights, list(range(k)), config, TreeStats(), 1)
    sq, coords = 0.0, 0
    for name in ("a", "b"):
        cast = _terms(updates, weights, name).to(torch.bfloat16).double().numpy()
        exact = cast.sum(axis=0)  # float64 sum of the leaves as the tree receives them
        sq += float(((got[name].reshape(-1).astype(np.float64) - exact) ** 2).sum())
        coords += exact.size
    assert coords == 16
    assert sq > 0  # bf16 additions round here: an all-zero error would not pass
    assert report["mse_vs_fp64"] == pytest.approx(sq / coords, rel=1e-12)
    # 10 coordinates in chunks of 4 -> 3 chunks, 6 -> 2 chunks.
    assert report["chosen"] == {"balanced": 5} and report["overflow_chunks"] == 0


def test_with_current_stats_the_tree_is_chosen_again_every_round() -> None:
    config = TreeConfig(tree="huffman", stats="current", refresh_rounds=5, chunk_size=1000)
    stats, ids, weights = TreeStats(), [0, 1, 2, 3], [1.0] * 4
    trees = []
    for rnd, scales in enumerate(([40.0, 1, 2, 3], [3.0, 2, 1, 40]), start=1):
        updates = _normal(4, 1000, seed=rnd, scales=np.array(scales))
        tree_mean(updates, weights, ids, config, stats, rnd)
        var, _ = _moments(_terms(updates, weights))
        assert stats.chosen[("w", 0)][2] == huffman_tree(var)
        trees.append(stats.chosen[("w", 0)][2])
    assert trees[0] != trees[1]  # the statistics changed enough to change the tree


K_SHAPE = 9


def _expected_tree(name: str, var: np.ndarray, mean: np.ndarray):
    return {
        "sequential": sequential_tree(K_SHAPE),
        "balanced": balanced_tree(K_SHAPE),
        "blocked": blocked_tree(K_SHAPE),
        "huffman": huffman_tree(var),
        "greedy": greedy_tree(var, mean),
    }[name]


def test_each_tree_name_sums_along_its_own_shape() -> None:
    scales = np.array([1.0, 50, 3, 0.5, 20, 2, 8, 0.1, 5])
    updates = _normal(K_SHAPE, 400, seed=5, scales=scales)
    for i, u in enumerate(updates):  # distinct means, so greedy differs from huffman
        u["w"] = u["w"] + np.float32(10 * i)
    weights = [1.0] * K_SHAPE
    terms = _terms(updates, weights)
    var, mean = _moments(terms)
    names = ("sequential", "balanced", "blocked", "huffman", "greedy")
    sums = {
        n: reduce_tree(_expected_tree(n, var, mean), terms, "bf16").float().numpy() for n in names
    }
    # Every pair of shapes gives different bf16 sums here, so a wrong shape shows.
    assert all(not np.array_equal(sums[a], sums[b]) for a in names for b in names if a < b)
    for name in names:
        config = TreeConfig(tree=name, dtype="bf16", chunk_size=400)
        got, report = tree_mean(updates, weights, list(range(K_SHAPE)), config, TreeStats(), 1)
        assert np.array_equal(got["w"], sums[name]), name
        assert report["chosen"] == {name: 1}


def test_tracked_moments_follow_their_definition() -> None:
    rng = np.random.default_rng(2)
    leaves = [torch.from_numpy(rng.standard_normal(50).astype(np.float32)) for _ in range(2)]
    ms = [float(x.double().mean()) for x in leaves]
    qs = [float((x.double() ** 2).mean()) for x in leaves]
    for stats_kind, decay in (("ema", 0.25), ("current", 0.0)):
        config = TreeConfig(tree="huffman", stats=stats_kind, ema_decay=0.25)
        stats = TreeStats()
        for leaf in leaves:
            observe(stats, config, 7, "w", 0, leaf)
        # The first observation is taken as is; later ones move by (1 - decay).
        assert stats.mean[(7, "w", 0)] == pytest.approx(decay * ms[0] + (1 - decay) * ms[1])
        assert stats.second[(7, "w", 0)] == pytest.approx(decay * qs[0] + (1 - decay) * qs[1])


def test_a_reloaded_tree_cache_is_empty_and_usable() -> None:
    config = TreeConfig(tree="adaptive", stats="ema", refresh_rounds=3, chunk_size=500)
    stats, ids = TreeStats(), [0, 1, 2]
    tree_mean(_normal(3, 500, 0), [1.0] * 3, ids, config, stats, 1)
    restored = TreeStats()
    restored.load_state_dict(stats.state_dict())
    assert restored.chosen == {}
    tree_mean(_normal(3, 500, 1), [1.0] * 3, ids, config, restored, 2)  # a non-refresh round
    assert restored.chosen[("w", 0)][0] == tuple(ids)


# --- reduce_tree and its reference ------------------------------------------------------


def test_a_single_leaf_comes_back_in_the_root_dtype_and_owned() -> None:
    leaf = torch.tensor([[1.0 + 2.0**-12, -3.0, 0.5]], dtype=torch.float32)
    got = reduce_tree(0, leaf, dtype="bf16", root_dtype="fp32")
    assert got.dtype == torch.float32
    assert torch.equal(got, leaf[0].to(torch.bfloat16).float())
    assert got[0].item() == 1.0  # 1 + 2^-12 rounds to 1 in bf16 (8 significant bits)
    same = reduce_tree(0, leaf, dtype="fp32")
    same.add_(1.0)  # the caller's stack must not change through the result
    assert leaf[0, 1].item() == -3.0


def test_a_stack_of_scalars_is_summed() -> None:
    values = torch.tensor([3.0, -1.0, 10.0, 0.25, 6.0], dtype=torch.float64)
    got = reduce_tree(balanced_tree(5), values, dtype="fp64")
    assert got.dim() == 0 and got.item() == 18.25  # exact: small dyadic values


def test_the_reference_sums_the_leaves_as_cast_to_the_working_dtype() -> None:
    leaves = torch.tensor([[1.0 + 2.0**-10], [1.0 + 2.0**-9]], dtype=torch.float32)
    # bf16 keeps 8 significant bits: both leaves round to 1.0 before the sum.
    assert float64_reference(leaves, "bf16").tolist() == [2.0]
    assert float64_reference(leaves, "fp32").tolist() == [2.0 + 2.0**-10 + 2.0**-9]


def test_estimate_nu_is_reproducible_from_its_seed() -> None:
    a = estimate_nu("bf16", samples=4000, seed=3)
    assert a == estimate_nu("bf16", samples=4000, seed=3)
    assert a != estimate_nu("bf16", samples=4000, seed=4)


# --- the cost models --------------------------------------------------------------------


def test_tree_cost_is_its_definition_and_refuses_bad_statistics() -> None:
    tree = ((0, 1), 2)  # depths 2, 2, 1; Lambda_2 = 2^2 + 3^2 = 13
    assert (
        tree_cost(tree, [1.0, 2.0, 3.0], mu2=0.5, lam=2.0) == 1 * 2 + 2 * 2 + 3 * 1 + 2 * 0.5 * 13
    )
    for mu2, lam in ((-1.0, 1.0), (float("nan"), 1.0), (float("inf"), 1.0), (1.0, float("inf"))):
        with pytest.raises(ValueError, match="mu2 and lam must be finite"):
            tree_cost(tree, [1.0, 1.0, 1.0], mu2=mu2, lam=lam)
    with pytest.raises(ValueError, match="finite and non-negative"):
        tree_cost(tree, [1.0, -1.0, 1.0])
    with pytest.raises(ValueError, match="2 variances for a tree of 3 leaves"):
        tree_cost(tree, [1.0, 1.0])
    with pytest.raises(ValueError, match=r"Gram matrix of shape \(2, 2\) for 3 leaves"):
        gram_cost(tree, np.eye(2))


def test_a_constant_partial_sum_rounds_within_its_binade() -> None:
    # bf16 keeps 7 explicit bits: 3.0 lies in [2, 4), ulp 2^(1-7), variance ulp^2 / 12.
    for mean in (3.0, -3.0):
        assert expected_rounding_variance(mean, 0.0, "bf16") == (2.0**-6) ** 2 / 12
        assert expected_rounding_variance(mean, -1.0, "bf16") == (2.0**-6) ** 2 / 12
    assert expected_rounding_variance(0.0, 0.0, "fp16") == 0.0
    assert expected_rounding_variance(1.0, 0.0, "bf16") == (2.0**-7) ** 2 / 12  # [1, 2)
    with pytest.raises(ValueError, match="dtype='int8'; allowed: fp32, bf16, fp16, fp64"):
        expected_rounding_variance(1.0, 1.0, "int8")


def _integrated_rounding_variance(mean: float, var: float, bits: int) -> float:
    """E[ulp(S)^2] / 12 for S ~ N(mean, var) by quadrature on a fine grid, the ulp of s
    from frexp (s = f 2^e with f in [0.5, 1), so s lies in [2^(e-1), 2^e))."""
    sd = np.sqrt(var)
    s = np.linspace(mean - 12 * sd, mean + 12 * sd, 2_000_001)
    density = np.exp(-0.5 * ((s - mean) / sd) ** 2) / (sd * np.sqrt(2 * np.pi))
    _, e = np.frexp(s)
    ulp2 = np.where(s == 0, 0.0, 4.0 ** (e - 1 - bits))
    return float(np.sum(density * ulp2) * (s[1] - s[0])) / 12


@pytest.mark.parametrize(
    ("mean", "var", "dtype", "bits"),
    [(60.0, 100.0, "bf16", 7), (0.3, 0.04, "fp16", 10), (-5.0, 9.0, "fp32", 23)],
)
def test_the_rounding_variance_integrates_the_ulp_over_the_normal(mean, var, dtype, bits) -> None:
    # A grid step of 24 sd / 2e6 misplaces at most a step's mass at each binade edge:
    # a relative error far below 1e-3.
    expected = _integrated_rounding_variance(mean, var, bits)
    assert expected_rounding_variance(mean, var, dtype) == pytest.approx(expected, rel=1e-3)


def test_rounding_cost_sums_each_addition_and_skips_a_float32_root() -> None:
    tree, var, mean = ((0, 1), 2), [1.0, 4.0, 9.0], [60.0, 20.0, -3.0]
    inner = expected_rounding_variance(80.0, 5.0, "bf16")
    root = expected_rounding_variance(77.0, 14.0, "bf16")
    assert rounding_cost(tree, var, mean, "bf16") == pytest.approx(inner + root, rel=1e-12)
    assert rounding_cost(tree, var, mean, "bf16", root_fp32=True) == pytest.approx(inner, rel=1e-12)
    with pytest.raises(ValueError, match="tree has 3 leaves, expected 2"):
        rounding_cost(tree, [1.0, 4.0], [60.0, 20.0], "bf16")


# --- the schedule, the adaptive choice and the settings ---------------------------------


def test_ema_trees_are_chosen_again_on_each_refresh_round() -> None:
    # ema_decay 0: the tracked moments are this round's, so a refresh's tree is known.
    config = TreeConfig(tree="huffman", stats="ema", ema_decay=0.0, refresh_rounds=2)
    stats, ids, weights = TreeStats(), [0, 1, 2, 3], [1.0] * 4
    scales = ([40.0, 1, 2, 3], [3.0, 2, 1, 40], [2.0, 40, 3, 1])
    trees = []
    for rnd, sc in enumerate(scales, start=1):
        updates = _normal(4, 300, seed=rnd, scales=np.array(sc))
        tree_mean(updates, weights, ids, config, stats, rnd)
        trees.append(
            (stats.chosen[("w", 0)][2], huffman_tree(_moments(_terms(updates, weights))[0]))
        )
    assert trees[0][0] == trees[0][1]  # round 1 refreshes
    assert trees[1][0] == trees[0][0] != trees[1][1]  # round 2 keeps round 1's tree
    assert trees[2][0] == trees[2][1] != trees[0][0]  # round 3 = 1 + 2 refreshes


def test_which_rounds_need_the_moments_before_any_addition() -> None:
    ids = [0, 1, 2]
    assert not needs_moments_first(TreeConfig(tree="balanced"), TreeStats(), ids, 1)
    config = TreeConfig(tree="huffman", stats="ema", refresh_rounds=3)
    stats = TreeStats()
    assert needs_moments_first(config, stats, ids, 2)  # nothing chosen yet
    tree_mean(_normal(3, 50, 0), [1.0] * 3, ids, config, stats, 1)
    assert needs_moments_first(config, stats, ids, 4)  # a refresh round: 4 = 1 + 3
    assert not needs_moments_first(config, stats, ids, 2)  # same clients, cached tree
    assert needs_moments_first(config, stats, [0, 2, 5], 2)  # another client set


def _leaves_with(mean: np.ndarray, var: np.ndarray, n: int = 64) -> list[dict[str, np.ndarray]]:
    """Updates whose weighted terms (4 equal weights: factor 1/4, exact) have the given
    per-client mean and variance: mean +- sqrt(var), alternating."""
    sign = np.where(np.arange(n) % 2 == 0, 1.0, -1.0)
    return [
        {"w": (4 * (m + np.sqrt(v) * sign)).astype(np.float32)}
        for m, v in zip(mean, var, strict=True)
    ]


def test_adaptive_scores_the_candidates_in_the_working_dtype_with_the_root() -> None:
    # Found by search: here the rounding model with a float32 root picks another tree
    # than without the root, than the smooth proxy, and than with zero means.
    updates = _leaves_with(np.array([300.0, -60, -1, 100]), np.array([1000.0, 0.01, 0.01, 1]))
    weights, ids = [1.0] * 4, [0, 1, 2, 3]
    var, mean = _moments(_terms(updates, weights))
    right = select_tree(var, mean, dtype="bf16", root_fp32=True)[0]
    wrong = {
        select_tree(var, mean, dtype="bf16", root_fp32=False)[0],
        select_tree(var, mean)[0],
        select_tree(var, np.zeros(4), dtype="bf16", root_fp32=True)[0],
    }
    assert right not in wrong
    config = TreeConfig(tree="adaptive", dtype="bf16", root_fp32=True, chunk_size=64)
    _, report = tree_mean(updates, weights, ids, config, TreeStats(), 1)
    assert report["chosen"] == {right: 1}


def test_the_plain_sum_is_the_float32_chain_in_arrival_order() -> None:
    updates = _normal(6, 300, seed=8, scales=np.array([1.0, 1e4, 1, 1e-3, 30, 1]))
    weights = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    got, report = tree_mean(updates, weights, list(range(6)), TreeConfig(), TreeStats(), 1)
    terms = _terms(updates, weights)
    chain = terms[0].clone()
    for row in terms[1:]:
        chain = chain + row  # one float32 rounding per addition, left to right
    assert np.array_equal(got["w"], chain.numpy())
    assert report["chosen"] == {}


def test_one_weight_and_one_stable_id_per_update() -> None:
    with pytest.raises(ValueError, match="one weight and one stable id per update"):
        tree_mean(_normal(2, 4, 0), [1.0, 1.0], [0, 1, 2], TreeConfig(), TreeStats(), 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"tree": "x"},
            "aggregation.tree='x'; allowed: sum, sequential, balanced, blocked, "
            "huffman, greedy, adaptive",
        ),
        ({"chunk_size": 0}, "aggregation.chunk_size=0: must be >= 1"),
        ({"stats": "x"}, "aggregation.stats='x'; allowed: current, ema"),
        ({"ema_decay": 1.0}, r"aggregation.ema_decay=1.0: must be in \[0, 1\)"),
        ({"ema_decay": -0.1}, r"aggregation.ema_decay=-0.1: must be in \[0, 1\)"),
    ],
)
def test_bad_tree_settings_name_the_value_and_what_is_allowed(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        TreeConfig(**kwargs)


def test_the_smallest_allowed_settings_are_accepted() -> None:
    config = TreeConfig(tree="balanced", chunk_size=1, ema_decay=0.0)
    got, _ = tree_mean(_normal(3, 5, 0), [1.0] * 3, [0, 1, 2], config, TreeStats(), 1)
    assert got["w"].shape == (5,)


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        (((0, 1, 2), (3, 4)), r"exactly 2 children, got \(0, 1, 2\)"),
        ((True, 0), "leaves must be non-negative integers, got True"),
        ((0, 1.0), "leaves must be non-negative integers, got 1.0"),
        ((0, -1), "leaves must be non-negative integers, got -1"),
        ((0, 0), r"tree leaves must be 0..1 each once, got \[0, 0\]"),
    ],
)
def test_validate_tree_refuses_what_is_not_a_tree_over_0_to_k(tree, message) -> None:
    with pytest.raises(ValueError, match=message):
        validate_tree(tree)
