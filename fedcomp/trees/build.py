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
    nodes: list[tuple[float, float, int, Tree]] = [
        (float(v), float(m), i, i) for i, (v, m) in enumerate(zip(var, mean, strict=True))
    ]
    while len(nodes) > 1:
        best = None
        for a in range(len(nodes)):
            for b in range(a + 1, len(nodes)):
                va, ma, ia, _ = nodes[a]
                vb, mb, ib, _ = nodes[b]
                key = (va + vb + (ma + mb) ** 2, min(ia, ib), max(ia, ib))
                if best is None or key < best[0]:
                    best = (key, a, b)
        assert best is not None
        _, a, b = best
        va, ma, ia, ta = nodes[a]
        vb, mb, ib, tb = nodes[b]
        merged = (va + vb, ma + mb, min(ia, ib), (ta, tb) if ia < ib else (tb, ta))
        nodes = [n for i, n in enumerate(nodes) if i not in (a, b)] + [merged]
    return nodes[0][3]


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
