"""Tree constructors and the selector that scores them."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence

import numpy as np

from fedcomp.trees.structure import Tree, rounding_cost, tree_cost


def _check_k(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"a reduction tree needs k >= 1 leaves, got {k!r}")
    return k


def sequential_tree(k: int) -> Tree:
    """A left chain in leaf order: (((0, 1), 2), 3), what arrival-order summation does."""
    tree: Tree = 0
    for i in range(1, _check_k(k)):
        tree = (tree, i)
    return tree


def _balanced(lo: int, hi: int) -> Tree:
    if hi - lo == 1:
        return lo
    mid = (lo + hi + 1) // 2
    return (_balanced(lo, mid), _balanced(mid, hi))


def balanced_tree(k: int) -> Tree:
    """Pairwise summation: halves, recursively (depth ceil(log2 k))."""
    return _balanced(0, _check_k(k))


def blocked_tree(k: int, groups: int | None = None) -> Tree:
    """Two stages: a chain inside each of ``groups`` contiguous blocks (default
    round(sqrt(k))), then a chain over the block sums."""
    _check_k(k)
    groups = groups if groups is not None else max(1, round(math.sqrt(k)))
    if isinstance(groups, bool) or not isinstance(groups, int) or not 1 <= groups <= k:
        raise ValueError(f"groups must be in 1..{k}, got {groups!r}")
    bounds = np.linspace(0, k, groups + 1).round().astype(int)
    tree: Tree | None = None
    for lo, hi in itertools.pairwise(bounds):
        block: Tree = int(lo)
        for i in range(lo + 1, hi):
            block = (block, int(i))
        tree = block if tree is None else (tree, block)
    assert tree is not None
    return tree


def _check_stats(values: Sequence[float] | np.ndarray, what: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    if arr.size == 0:
        raise ValueError(f"{what}: need at least one leaf")
    if not np.isfinite(arr).all():
        raise ValueError(f"{what}: statistics must be finite, got {arr.tolist()}")
    return arr


def huffman_tree(weights: Sequence[float] | np.ndarray) -> Tree:
    """The Huffman tree on leaf weights (e.g. variances): minimizes sum_i w_i depth_i.

    Ties are broken by the smallest leaf index below each node, so the tree depends
    only on the weights, never on reply order.
    """
    w = _check_stats(weights, "huffman_tree")
    if (w < 0).any():
        raise ValueError(f"huffman_tree: weights must be non-negative, got {w.tolist()}")
    heap: list[tuple[float, int, Tree]] = [(float(wi), i, i) for i, wi in enumerate(w)]
    heapq.heapify(heap)
    while len(heap) > 1:
        wa, ia, a = heapq.heappop(heap)
        wb, ib, b = heapq.heappop(heap)
        heapq.heappush(heap, (wa + wb, min(ia, ib), (a, b)))
    return heap[0][2]


def greedy_tree(
    variances: Sequence[float] | np.ndarray, means: Sequence[float] | np.ndarray
) -> Tree:
    """Greedy merge on second moments: repeatedly add the two partial sums whose sum
    has the smallest expected square (variance + mean^2), the expected size of that
    addition's rounding error. With zero means it is Huffman on the variances."""
    var = _check_stats(variances, "greedy_tree")
    mean = _check_stats(means, "greedy_tree")
    if var.shape != mean.shape or (var < 0).any():
        raise ValueError("greedy_tree: one non-negative variance and one mean per leaf")
    return _greedy_merge(var, mean)


def _pair_keys(v: np.ndarray, m: np.ndarray, i: int, others: np.ndarray) -> np.ndarray:
    """The merge key of node ``i`` with each of ``others``: the expected square of
    their sum (IEEE addition commutes, so the operand order does not matter)."""
    return v[i] + v[others] + (m[i] + m[others]) ** 2


def _greedy_merge(var: np.ndarray, mean: np.ndarray) -> Tree:
    """The greedy merge in O(k^2) memory and about O(k^2) time (k = 1,000 in well under
    a second where scanning every pair per merge took minutes).

    A live node sits in the slot of its smallest leaf index; ``key[i, j]`` (i < j) is
    the key of merging slots i and j, so the first minimum of the upper triangle in
    row-major order is the smallest (key, i, j): the same tie-break as comparing
    (key, min leaf, max leaf) over every pair. Each row keeps its minimum."""
    k = var.size
    v, m = var.astype(np.float64).copy(), mean.astype(np.float64).copy()
    trees: list[Tree] = list(range(k))
    key = np.full((k, k), np.inf)
    for i in range(k - 1):
        key[i, i + 1 :] = _pair_keys(v, m, i, np.arange(i + 1, k))
    row_min, row_arg = key.min(axis=1), key.argmin(axis=1)
    alive = np.ones(k, dtype=bool)
    for _ in range(k - 1):
        i = int(np.argmin(row_min))
        j = int(row_arg[i])
        v[i], m[i] = v[i] + v[j], m[i] + m[j]
        trees[i] = (trees[i], trees[j])
        alive[j] = False
        key[j, :] = np.inf
        key[:, j] = np.inf
        after, before = np.flatnonzero(alive[i + 1 :]) + i + 1, np.flatnonzero(alive[:i])
        key[i, after] = _pair_keys(v, m, i, after)
        key[before, i] = _pair_keys(v, m, i, before)
        # Rows whose minimum was a pair with i or j: recompute; the others may only
        # have gained the new entry in column i.
        stale = np.flatnonzero((row_arg == i) | (row_arg == j))
        stale = np.union1d(stale, [i, j])
        row_min[stale], row_arg[stale] = key[stale].min(axis=1), key[stale].argmin(axis=1)
        col = key[before, i]
        better = (col < row_min[before]) | ((col == row_min[before]) & (i < row_arg[before]))
        row_min[before[better]], row_arg[before[better]] = col[better], i
    return trees[0]


CANDIDATES = ("sequential", "balanced", "blocked", "huffman", "greedy")


def candidate_trees(variances: np.ndarray, means: np.ndarray) -> dict[str, Tree]:
    """Every candidate tree for these leaf statistics."""
    k = len(variances)
    return {
        "sequential": sequential_tree(k),
        "balanced": balanced_tree(k),
        "blocked": blocked_tree(k),
        "huffman": huffman_tree(variances),
        "greedy": greedy_tree(variances, means),
    }


def select_tree(
    variances: Sequence[float] | np.ndarray,
    means: Sequence[float] | np.ndarray | None = None,
    *,
    lam: float = 1.0,
    dtype: str | None = None,
    root_fp32: bool = False,
) -> tuple[str, Tree, dict[str, float]]:
    """Score every candidate and return (name, tree, all scores).

    Without ``dtype`` the score is the proxy J(T) with mu^2 = (mean of the leaf
    means)^2 (lam = 1 is what the expectation gives). With ``dtype`` it is the expected
    rounding error in that format (``rounding_cost``: binade-exact ulps, and the root
    left out when it runs in float32), which the benchmark measured to rank the
    candidates correctly where the smooth proxy does not (large means in bf16).
    Ties go to the earlier candidate in CANDIDATES, so the choice is deterministic.
    """
    var = _check_stats(variances, "select_tree")
    mean = np.zeros_like(var) if means is None else _check_stats(means, "select_tree")
    if (var < 0).any():
        raise ValueError("select_tree: variances must be non-negative")
    mu2 = float(np.mean(mean)) ** 2
    trees = candidate_trees(var, mean)
    if dtype is None:
        scores = {name: tree_cost(tree, var, mu2=mu2, lam=lam) for name, tree in trees.items()}
    else:
        scores = {
            name: rounding_cost(tree, var, mean, dtype, root_fp32=root_fp32)
            for name, tree in trees.items()
        }
    name = min(CANDIDATES, key=lambda n: (scores[n], CANDIDATES.index(n)))
    return name, trees[name], scores
