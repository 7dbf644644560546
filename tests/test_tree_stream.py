"""Reduction trees evaluated one update at a time: bit-identical to the list evaluation,
with the number of live partial sums each tree shape needs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fedcomp.settings import TREES
from fedcomp.trees import balanced_tree, blocked_tree, huffman_tree, sequential_tree
from fedcomp.trees.aggregate import TreeConfig, TreeStats, tree_mean
from fedcomp.trees.stream import (
    evaluation_order,
    fewest_live_order,
    flatten,
    order_cost,
    peak_live,
    streaming_tree_mean,
)


def _updates(rng: np.random.Generator, k: int) -> list[dict[str, np.ndarray]]:
    """Heavy-tailed tensors of different scales per client, a tail chunk, a counter."""
    out = []
    for _ in range(k):
        scale = rng.uniform(0.1, 5)
        out.append(
            {
                "w": (rng.standard_t(3, size=(37, 29)) * scale + rng.normal()).astype(np.float32),
                "b": (rng.normal(size=300) * scale).astype(np.float32),
                "n": np.array(rng.integers(0, 9), dtype=np.int64),
            }
        )
    return out


@pytest.mark.parametrize("stats", ["current", "ema"])
@pytest.mark.parametrize(
    ("dtype", "root_fp32"), [("fp32", False), ("bf16", True), ("bf16", False), ("fp16", False)]
)
@pytest.mark.parametrize("tree", TREES)
def test_streaming_equals_the_list_evaluation_bit_for_bit(tree, dtype, root_fp32, stats) -> None:
    """Three rounds (a refresh every second one under ema), a changing client set, and
    an fp16 round that overflows (redone in float32 by both): the means are equal to
    the bit, the trees chosen are the same, the rounding report agrees."""
    rng = np.random.default_rng(7)
    config = TreeConfig(
        tree=tree, dtype=dtype, root_fp32=root_fp32, chunk_size=200, stats=stats, refresh_rounds=2
    )
    listed, streamed = TreeStats(), TreeStats()
    client_sets = [list(range(0, 26, 2)), list(range(0, 26, 2)), [1, 2, 5, 8, 9, 30]]
    overflowed = 0
    for server_round, ids in enumerate(client_sets, start=1):
        updates = _updates(rng, len(ids))
        if dtype == "fp16" and server_round == 2:
            updates[0]["w"] *= 1e7
        weights = list(rng.uniform(1, 10, size=len(ids)))
        want, want_report = tree_mean(updates, weights, ids, config, listed, server_round)
        loads = [lambda u=u: u for u in updates]
        got, report = streaming_tree_mean(loads, weights, ids, config, streamed, server_round)
        assert list(got) == list(want)
        for name in want:
            assert got[name].dtype == want[name].dtype
            assert np.array_equal(got[name], want[name]), (server_round, name)
        assert report["chosen"] == want_report["chosen"]
        assert report["overflow_chunks"] == want_report["overflow_chunks"]
        assert report["mse_vs_fp64"] == pytest.approx(want_report["mse_vs_fp64"], rel=1e-9)
        overflowed += report["overflow_chunks"]
    assert (overflowed > 0) == (dtype == "fp16")


def _live_by_nesting(tree, order: list[int]) -> int:
    """Peak of stored subtrees computed on the nested tuples themselves (independent of
    ``flatten``): a subtree is stored once all its leaves arrived and its parent's not."""

    def leaf_set(node) -> frozenset[int]:
        return (
            frozenset([node])
            if not isinstance(node, tuple)
            else leaf_set(node[0]) | leaf_set(node[1])
        )

    subtrees, parents = [], {}

    def walk(node, parent) -> None:
        subtrees.append(node)
        parents[id(node)] = parent
        if isinstance(node, tuple):
            walk(node[0], node)
            walk(node[1], node)

    walk(tree, None)
    peak = 0
    for step in range(1, len(order) + 1):
        arrived = set(order[:step])
        stored = [
            s
            for s in subtrees
            if parents[id(s)] is not None
            and leaf_set(s) <= arrived
            and not leaf_set(parents[id(s)]) <= arrived
        ]
        peak = max(peak, len(stored))
    return peak


def _swap_orders(tree) -> list[list[int]]:
    """Every leaf order reachable by swapping children (the orders that keep each
    subtree's leaves together)."""
    if not isinstance(tree, tuple):
        return [[tree]]
    out = []
    for a, b in itertools.product(_swap_orders(tree[0]), _swap_orders(tree[1])):
        out += [a + b, b + a]
    return out


def _random_tree(rng: np.random.Generator, k: int):
    nodes: list = list(range(k))
    while len(nodes) > 1:
        i, j = sorted(rng.choice(len(nodes), size=2, replace=False))
        right, left = nodes.pop(j), nodes.pop(i)
        nodes.append((left, right))
    return nodes[0]


def test_live_partial_sums_of_each_shape_as_computed() -> None:
    """A left chain keeps 1, a balanced tree of 2^m leaves m, blocked trees one per
    finished block plus the running one, in stable-id order; for random trees the
    chosen order reaches the minimum over every child-swapping order, which is at
    most floor(log2 k) (Sethi-Ullman)."""
    for k in (2, 5, 64, 200):
        ids = list(range(k))
        assert peak_live(flatten(sequential_tree(k)), ids) == 1
        assert peak_live(flatten(balanced_tree(k)), ids) == _live_by_nesting(balanced_tree(k), ids)
    for m in range(1, 8):
        assert peak_live(flatten(balanced_tree(2**m)), list(range(2**m))) == m
    blocked = blocked_tree(49, groups=7)
    assert (
        peak_live(flatten(blocked), list(range(49)))
        == _live_by_nesting(blocked, list(range(49)))
        == 2
    )
    rng = np.random.default_rng(3)
    for _ in range(40):
        k = int(rng.integers(2, 8))
        tree = _random_tree(rng, k)
        best = min(_live_by_nesting(tree, o) for o in _swap_orders(tree))
        order = fewest_live_order(tree)
        assert sorted(order) == list(range(k))
        assert peak_live(flatten(tree), order) == _live_by_nesting(tree, order) == best
        assert best <= int(np.floor(np.log2(k)))
    # A chain of 1,000 leaves is flattened without recursion.
    assert peak_live(flatten(sequential_tree(1000)), fewest_live_order(sequential_tree(1000))) == 1


def test_the_report_gives_the_live_sums_and_passes_of_a_huffman_round() -> None:
    """Huffman trees need this round's moments first (two loads per update); the order
    chosen costs no more live bytes than the stable-id order, and the report's live
    count is what that order gives on the chosen trees."""
    rng = np.random.default_rng(11)
    updates = _updates(rng, 16)
    loads_seen = [0]

    def loader(u):
        def load():
            loads_seen[0] += 1
            return u

        return load

    config = TreeConfig(tree="huffman", chunk_size=256)
    stats = TreeStats()
    ids = list(range(16))
    loads = [loader(u) for u in updates]
    _, report = streaming_tree_mean(loads, [1.0] * 16, ids, config, stats, 1)
    assert report["passes"] == 2 and loads_seen[0] == 32
    widths = {"w": [256, 256, 256, 256, 49], "b": [256, 44]}
    chunks = [(stats.chosen[(n, c)][2], w) for n, ws in widths.items() for c, w in enumerate(ws)]
    assert len(stats.chosen) == len(chunks)
    order, label = evaluation_order(chunks, 16)
    assert label == report["order"]
    flats = {tree: flatten(tree) for tree, _ in chunks}
    assert order_cost(flats, chunks, order) <= order_cost(flats, chunks, ids)
    assert report["live_partial_sums"] == max(peak_live(flats[t], order) for t, _ in chunks)
    # One chunk's Huffman tree in its own best order keeps at most log2(16).
    tree = huffman_tree(rng.uniform(0.1, 9, size=16))
    assert peak_live(flatten(tree), fewest_live_order(tree)) <= 4
