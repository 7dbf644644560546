"""Variance-aware reduction trees for the server's aggregation (no flwr import).

from fedcomp.trees import balanced_tree, huffman_tree, tree_cost, reduce_tree
tree = huffman_tree([16, 1, 1, 1, 1, 1, 1, 1])
tree_cost(tree, [16, 1, 1, 1, 1, 1, 1, 1])      # 43.0 (balanced: 69.0)
total = reduce_tree(tree, stack, dtype="bf16", root_dtype="fp32")
"""

from fedcomp.trees.build import (
    CANDIDATES,
    balanced_tree,
    blocked_tree,
    candidate_trees,
    greedy_tree,
    huffman_tree,
    select_tree,
    sequential_tree,
)
from fedcomp.trees.reduce import (
    estimate_nu,
    float64_reference,
    reduce_tree,
    unit_roundoff,
)
from fedcomp.trees.structure import (
    Tree,
    common_ancestor_kernel,
    expected_rounding_variance,
    gram_cost,
    internal_nodes,
    lambda1,
    lambda2,
    leaf_depths,
    leaves,
    rounding_cost,
    tree_cost,
    validate_tree,
)

__all__ = [
    "CANDIDATES",
    "Tree",
    "balanced_tree",
    "blocked_tree",
    "candidate_trees",
    "common_ancestor_kernel",
    "estimate_nu",
    "expected_rounding_variance",
    "float64_reference",
    "gram_cost",
    "greedy_tree",
    "huffman_tree",
    "internal_nodes",
    "lambda1",
    "lambda2",
    "leaf_depths",
    "leaves",
    "reduce_tree",
    "rounding_cost",
    "select_tree",
    "sequential_tree",
    "tree_cost",
    "unit_roundoff",
    "validate_tree",
]
