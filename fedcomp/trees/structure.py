"""Reduction trees as nested tuples, and the quantities their rounding error depends on.

A tree over k leaves is a leaf index (k = 1) or a pair ``(left, right)`` of trees;
e.g. ``((0, 1), (2, (3, 4)))``. Summing k values along it takes exactly k - 1 rounded
additions. A rounded addition of a value s adds noise of variance about nu u^2 s^2, so
the tree-dependent part of the error of the sum of leaf vector p is p^T K_T p, where
``K_T[i, j]`` counts the internal nodes that are ancestors of both leaves i and j.
For i.i.d. leaves with mean mu and variance tau^2, E[p^T K_T p] = tau^2 Lambda_1 +
mu^2 Lambda_2 with Lambda_1 = sum of leaf depths and Lambda_2 = sum over internal nodes
of |leaves below|^2.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import numpy as np

Tree = Union[int, tuple["Tree", "Tree"]]  # noqa: UP007  (a recursive alias needs Union)


def leaves(tree: Tree) -> list[int]:
    """Leaf indices, left to right (iteratively: a chain of 1,000 clients is deep)."""
    out: list[int] = []
    stack: list[object] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, tuple):
            stack += list(reversed(node))
        else:
            out.append(node)  # type: ignore[arg-type]
    return out


def validate_tree(tree: Tree, k: int | None = None) -> int:
    """Check that ``tree`` is a binary tree over leaves 0..k-1, each exactly once.

    Returns k. Raises ``ValueError`` naming the problem.
    """
    stack: list[object] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, tuple):
            if len(node) != 2:
                raise ValueError(f"internal nodes must have exactly 2 children, got {node!r}")
            stack += list(node)
        elif isinstance(node, bool) or not isinstance(node, int | np.integer) or node < 0:
            raise ValueError(f"leaves must be non-negative integers, got {node!r}")
    found = leaves(tree)
    count = len(found)
    if sorted(found) != list(range(count)):
        raise ValueError(f"tree leaves must be 0..{count - 1} each once, got {sorted(found)}")
    if k is not None and count != k:
        raise ValueError(f"tree has {count} leaves, expected {k}")
    return count


def postorder(tree: Tree) -> list[Tree]:
    """Every node, children before parents, left subtree before right (what a
    recursive walk visits), without recursion: a chain of 1,000 leaves is deep."""
    out: list[Tree] = []
    stack: list[Tree] = [tree]
    while stack:
        node = stack.pop()
        out.append(node)
        if isinstance(node, tuple):
            stack += [node[0], node[1]]
    out.reverse()
    return out


def internal_nodes(tree: Tree) -> int:
    """Number of additions the tree performs (k - 1)."""
    return len(leaves(tree)) - 1


def leaf_depths(tree: Tree) -> np.ndarray:
    """Depth of every leaf (root at depth 0), indexed by leaf."""
    k = validate_tree(tree)
    depths = np.zeros(k, dtype=np.int64)
    stack: list[tuple[Tree, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, tuple):
            stack += [(node[0], depth + 1), (node[1], depth + 1)]
        else:
            depths[node] = depth
    return depths


def common_ancestor_kernel(tree: Tree) -> np.ndarray:
    """K[i, j] = number of internal nodes that are ancestors of both leaves i and j."""
    k = validate_tree(tree)
    kernel = np.zeros((k, k), dtype=np.int64)
    below: dict[int, list[int]] = {}
    for node in postorder(tree):
        if isinstance(node, tuple):
            below[id(node)] = below.pop(id(node[0])) + below.pop(id(node[1]))
            kernel[np.ix_(below[id(node)], below[id(node)])] += 1
        else:
            below[id(node)] = [node]
    return kernel


def lambda1(tree: Tree) -> int:
    """Sum of leaf depths (= trace of the kernel)."""
    return int(leaf_depths(tree).sum())


def lambda2(tree: Tree) -> int:
    """Sum over internal nodes of |leaves below|^2 (= sum of all kernel entries)."""
    validate_tree(tree)
    size: dict[int, int] = {}
    total = 0
    for node in postorder(tree):
        if isinstance(node, tuple):
            n = size.pop(id(node[0])) + size.pop(id(node[1]))
            total += n * n
        else:
            n = 1
        size[id(node)] = n
    return total


def tree_cost(
    tree: Tree, sigma2: Sequence[float] | np.ndarray, mu2: float = 0.0, lam: float = 1.0
) -> float:
    """J(T) = sum_i sigma_i^2 depth_i + lam * mu^2 * Lambda_2(T).

    Raises
    ------
    ValueError
        On negative or non-finite statistics, or a length that does not match the tree.
    """
    sigma2 = np.asarray(sigma2, dtype=np.float64)
    depths = leaf_depths(tree)
    if sigma2.shape != depths.shape:
        raise ValueError(f"{sigma2.size} variances for a tree of {depths.size} leaves")
    if not np.isfinite(sigma2).all() or (sigma2 < 0).any():
        raise ValueError("variances must be finite and non-negative")
    if not np.isfinite(mu2) or mu2 < 0 or not np.isfinite(lam):
        raise ValueError(f"mu2 and lam must be finite (mu2 >= 0), got {mu2!r}, {lam!r}")
    return float(sigma2 @ depths) + lam * mu2 * lambda2(tree)


def gram_cost(tree: Tree, gram: np.ndarray) -> float:
    """The exact leading rounding cost trace(K_T G) for the chunk's Gram matrix G of
    the leaves (G[i, j] = sum over coordinates of x_i x_j): correlated leaves included."""
    kernel = common_ancestor_kernel(tree)
    if gram.shape != kernel.shape:
        raise ValueError(f"Gram matrix of shape {gram.shape} for {kernel.shape[0]} leaves")
    return float(np.sum(kernel * gram))


#: Explicit mantissa bits of the working formats (ulp of x in [2^e, 2^(e+1)) is 2^(e-p)).
MANTISSA_BITS = {"fp32": 23, "bf16": 7, "fp16": 10, "fp64": 52}


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    import torch

    return torch.special.ndtr(torch.from_numpy(np.asarray(z, dtype=np.float64))).numpy()


def expected_rounding_variance(mean: float, var: float, dtype: str) -> float:
    """E[ulp(S)^2] / 12 for S ~ N(mean, var): the variance of one round-to-nearest of S.

    The ulp is piecewise constant over binades, so a partial sum of 60 and one of 80
    round very differently in bf16 (0.25 vs 0.5) although their squares are close: the
    smooth mu^2 Lambda_2 proxy cannot see that, this model does.
    """
    if dtype not in MANTISSA_BITS:
        raise ValueError(f"dtype={dtype!r}; allowed: {', '.join(MANTISSA_BITS)}")
    p = MANTISSA_BITS[dtype]
    sd = float(np.sqrt(max(var, 0.0)))
    if sd == 0.0:
        if mean == 0.0:
            return 0.0
        return (2.0 ** (np.floor(np.log2(abs(mean))) - p)) ** 2 / 12
    top = int(np.floor(np.log2(abs(mean) + 9 * sd)))
    exps = np.arange(top - 60, top + 1)
    lo, hi = 2.0**exps, 2.0 ** (exps + 1)
    prob = (
        _normal_cdf((hi - mean) / sd)
        - _normal_cdf((lo - mean) / sd)
        + _normal_cdf((-lo - mean) / sd)
        - _normal_cdf((-hi - mean) / sd)
    )
    return float(np.sum(prob * 4.0 ** (exps - p))) / 12


def rounding_cost(
    tree: Tree,
    variances: Sequence[float] | np.ndarray,
    means: Sequence[float] | np.ndarray,
    dtype: str,
    *,
    root_fp32: bool = False,
) -> float:
    """Expected squared rounding error of the tree's sum in ``dtype``: the sum over its
    additions of the rounding variance of each partial sum (independent leaves with the
    given means and variances). With ``root_fp32`` the root addition costs nothing
    (it happens in float32)."""
    var = np.asarray(variances, dtype=np.float64)
    mean = np.asarray(means, dtype=np.float64)
    validate_tree(tree, var.size)
    total = 0.0
    moments: dict[int, tuple[float, float]] = {}
    for node in postorder(tree):
        if not isinstance(node, tuple):
            moments[id(node)] = float(mean[node]), float(var[node])
            continue
        (ml, vl), (mr, vr) = moments.pop(id(node[0])), moments.pop(id(node[1]))
        m, v = ml + mr, vl + vr
        if not (node is tree and root_fp32):
            total += expected_rounding_variance(m, v, dtype)
        moments[id(node)] = m, v
    return total
