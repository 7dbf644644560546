"""Reduction trees evaluated as the clients' updates arrive, one dense update at a time.

The list evaluation (``fedcomp.trees.aggregate.tree_mean``) stacks every client's
update and reduces each chunk of coordinates along its tree: n dense updates alive.
Here the updates are loaded one after another in an *evaluation order*; every chunk
keeps only the partial sums of its tree whose sibling has not arrived yet, and adds
two as soon as both exist. The additions are the same rounded additions as the list
evaluation's (IEEE addition commutes exactly), so the result is bit-identical.

How many partial sums a chunk keeps depends on its tree and the order: a left chain in
leaf order keeps one, a balanced tree in leaf order about log2(n). For any tree, visiting
first the child that needs more live sums (Sethi and Ullman's order for registers) is
optimal; trees chosen per chunk from statistics (huffman, greedy, adaptive) differ from
chunk to chunk while the order is one for all, so a few candidate orders are scored
and the one with the fewest live bytes wins. The report says how many were alive.

Trees chosen from this round's statistics need every client's moments first: a first
pass loads each update once and keeps only two floats per client and chunk.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedcomp.trees.aggregate import (
    ORDER_ONLY,
    TreeConfig,
    TreeStats,
    _refresh,
    choose_tree,
    leaf_factors,
    needs_moments_first,
    observe,
)
from fedcomp.trees.build import CANDIDATES
from fedcomp.trees.reduce import DTYPES
from fedcomp.trees.structure import Tree, validate_tree

Load = Callable[[], Mapping[str, np.ndarray]]
#: The chunk index of a whole tensor evaluated at once (trees that are the same for
#: every chunk: the additions are elementwise, so the result is the chunks' bit for bit).
WHOLE = -1
#: Candidate evaluation orders scored per round (besides the stable-id order).
MAX_CANDIDATE_ORDERS = 4


@dataclass(frozen=True)
class FlatTree:
    """A tree as arrays: node ids, each node's parent and sibling, each leaf's node."""

    parent: tuple[int, ...]
    sibling: tuple[int, ...]
    leaf_node: tuple[int, ...]
    root: int


def flatten(tree: Tree) -> FlatTree:
    """Number the nodes of ``tree`` (iteratively: a chain of 1,000 leaves is deep)."""
    k = validate_tree(tree)
    parent: list[int] = [-1]
    sibling: list[int] = [-1]
    leaf_node = [0] * k
    stack: list[tuple[Tree, int]] = [(tree, 0)]
    while stack:
        node, nid = stack.pop()
        if not isinstance(node, tuple):
            leaf_node[node] = nid
            continue
        left, right = len(parent), len(parent) + 1
        parent += [nid, nid]
        sibling += [right, left]
        stack += [(node[0], left), (node[1], right)]
    return FlatTree(tuple(parent), tuple(sibling), tuple(leaf_node), 0)


def fewest_live_order(tree: Tree) -> list[int]:
    """The leaf order that keeps the fewest partial sums alive for ``tree``: at every
    node, the child needing more first (Sethi-Ullman); at most floor(log2 n) kept."""
    need: dict[int, int] = {}
    post: list[tuple[Tree, int]] = []
    stack: list[Tree] = [tree]
    while stack:  # post-order without recursion
        node = stack.pop()
        post.append((node, id(node)))
        if isinstance(node, tuple):
            stack += [node[0], node[1]]
    for node, key in reversed(post):
        if isinstance(node, tuple):
            a, b = need[id(node[0])], need[id(node[1])]
            need[key] = a + 1 if a == b else max(a, b)
        else:
            need[key] = 1
    order: list[int] = []
    visit: list[Tree] = [tree]
    while visit:
        node = visit.pop()
        if not isinstance(node, tuple):
            order.append(node)
            continue
        first, second = node
        if need[id(second)] > need[id(first)]:
            first, second = second, first
        visit += [second, first]  # the stack pops ``first`` next
    return order


def peak_live(flat: FlatTree, order: Sequence[int]) -> int:
    """The most partial sums one chunk keeps when the leaves arrive in ``order``."""
    done: set[int] = set()
    peak = 0
    for leaf in order:
        node = flat.leaf_node[leaf]
        while node != flat.root and flat.sibling[node] in done:
            done.discard(flat.sibling[node])
            node = flat.parent[node]
        if node != flat.root:
            done.add(node)
            peak = max(peak, len(done))
    return peak


@dataclass
class LiveMeter:
    """Bytes of partial sums alive over all chunks: now and at the most."""

    now: int = 0
    peak: int = 0

    def change(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ChunkSum:
    """One chunk's evaluation state: the partial sums waiting for their sibling."""

    def __init__(
        self,
        flat: FlatTree,
        dtype: torch.dtype,
        root_dtype: torch.dtype | None,
        meter: LiveMeter | None = None,
    ) -> None:
        self.flat, self.dtype, self.root_dtype = flat, dtype, root_dtype
        self.meter = meter or LiveMeter()
        self.done: dict[int, torch.Tensor] = {}
        self.peak = 0
        self.result: torch.Tensor | None = None

    def add(self, leaf: int, value: torch.Tensor, cast: torch.Tensor | None = None) -> None:
        """Add one client's chunk (float32), given or cast here to the working dtype."""
        flat = self.flat
        val = value.to(self.dtype) if cast is None else cast
        owned = val.data_ptr() != value.data_ptr()
        node = flat.leaf_node[leaf]
        while node != flat.root and flat.sibling[node] in self.done:
            other = self.done.pop(flat.sibling[node])
            self.meter.change(-_nbytes(other))
            node = flat.parent[node]
            if node == flat.root and self.root_dtype is not None:
                val, owned = val.to(self.root_dtype) + other.to(self.root_dtype), True
            elif owned:
                val.add_(other)
            else:  # partial sums kept in ``done`` are always our own
                val, owned = other.add_(val), True
        if node == flat.root:
            if self.root_dtype is not None and len(flat.parent) == 1:
                val = val.to(self.root_dtype)  # a single leaf: the root cast only
            self.result = val if owned else val.clone()
            return
        # Never keep a view: it would keep the client's whole update alive.
        self.done[node] = val if owned else val.clone()
        self.meter.change(_nbytes(val))
        self.peak = max(self.peak, len(self.done))


def _term(value: np.ndarray, factor: float) -> torch.Tensor:
    """(w_i / W) x_i in float32, flattened: the list evaluation's leaf, exactly."""
    return torch.from_numpy(np.asarray(value, dtype=np.float32)).reshape(-1) * factor


def _chunks(size: int, chunk_size: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk_size, size)) for s in range(0, size, chunk_size)]


@dataclass
class _Layout:
    """What the first update loaded says about every update: names, shapes, dtypes."""

    shapes: dict[str, tuple[tuple[int, ...], np.dtype]]

    @classmethod
    def of(cls, update: Mapping[str, np.ndarray]) -> _Layout:
        return cls({name: (v.shape, v.dtype) for name, v in update.items()})


def _moments_pass(
    loads: Sequence[Load],
    factors: Sequence[float],
    stable_ids: Sequence[int],
    config: TreeConfig,
    stats: TreeStats,
) -> _Layout:
    """Every client's moments per chunk; each update loaded once and released.
    Returns the layout of the updates."""
    layout = None
    for load, factor, sid in zip(loads, factors, stable_ids, strict=True):
        update = load()
        layout = layout or _Layout.of(update)
        for name, value in update.items():
            if value.dtype.kind != "f":
                continue
            term = _term(value, factor)
            for c, (lo, hi) in enumerate(_chunks(term.numel(), config.chunk_size)):
                observe(stats, config, sid, name, c, term[lo:hi])
        del update
    assert layout is not None
    return layout


def evaluation_order(trees: Sequence[tuple[Tree, int]], k: int) -> tuple[list[int], str]:
    """The evaluation order with the fewest live bytes over all chunks, among the
    stable-id order and the best order of the most common trees.

    ``trees`` holds each chunk's tree and width; the score of an order is the sum over
    chunks of its peak live partial sums times the chunk's width."""
    flats: dict[Tree, FlatTree] = {}
    counts: Counter[Tree] = Counter()
    for tree, width in trees:
        counts[tree] += width
        if tree not in flats:
            flats[tree] = flatten(tree)
    candidates = {"stable_id": list(range(k))}
    for i, (tree, _) in enumerate(counts.most_common(MAX_CANDIDATE_ORDERS)):
        candidates[f"tree_{i}"] = fewest_live_order(tree)

    label = min(candidates, key=lambda name: order_cost(flats, trees, candidates[name]))
    return candidates[label], label


def order_cost(
    flats: Mapping[Tree, FlatTree], trees: Sequence[tuple[Tree, int]], order: Sequence[int]
) -> int:
    """Sum over chunks of the chunk's peak live partial sums times its width."""
    peaks = {tree: peak_live(flat, order) for tree, flat in flats.items()}
    return sum(peaks[tree] * width for tree, width in trees)


def streaming_tree_mean(
    loads: Sequence[Load],
    weights: Sequence[float],
    stable_ids: Sequence[int],
    config: TreeConfig,
    stats: TreeStats,
    server_round: int,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``tree_mean`` with each update loaded by a function when its turn comes.

    Bit-identical to ``tree_mean`` on the same updates (its rounding report to about
    1e-16 relative: the float64 reference is a running sum here). The report adds
    ``live_partial_sums`` (the most kept by one chunk), ``live_partial_sum_bytes``
    (the most kept at once over all chunks), ``order`` and ``passes`` (loads per
    update: 1, 2 when trees need this round's moments first, +1 if a low-precision
    chunk overflowed and is redone in float32).
    """
    factors = leaf_factors(loads, weights, stable_ids)
    k = len(loads)
    run = _StreamRun(loads, factors, stable_ids, config, stats, server_round)
    passes = 1
    if needs_moments_first(config, stats, stable_ids, server_round):
        run.layout = _moments_pass(loads, factors, stable_ids, config, stats)
        run.observed = True
        run.choose_all()
        passes += 1
    run.main_pass()
    mean = run.finish()
    passes += bool(run.overflow)
    return mean, {**run.report(), "passes": passes, "k": k}


class _StreamRun:
    """One round's streaming evaluation (the state between the passes)."""

    def __init__(
        self,
        loads: Sequence[Load],
        factors: Sequence[float],
        stable_ids: Sequence[int],
        config: TreeConfig,
        stats: TreeStats,
        server_round: int,
    ) -> None:
        self.loads, self.factors, self.ids = loads, factors, stable_ids
        self.config, self.stats = config, stats
        #: Whether this round's moments were taken by a first pass.
        self.observed = False
        self.refresh = _refresh(config, server_round)
        self.work = DTYPES[config.dtype]
        self.root = torch.float32 if config.root_fp32 else None
        self.layout: _Layout | None = None
        self.trees: dict[tuple[str, int], Tree] = {}
        self.chosen = dict.fromkeys(CANDIDATES, 0)
        self.sums: dict[tuple[str, int], ChunkSum] = {}
        self.reference: dict[str, torch.Tensor] = {}
        self.ints: dict[str, list[np.ndarray | None]] = {}
        self.order: list[int] = list(range(len(loads)))
        self.order_label = "stable_id"
        self.meter = LiveMeter()
        self.overflow: list[tuple[str, int]] = []

    # ---------------------------------------------------------------- trees and order

    def choose_all(self) -> None:
        """Every chunk's tree, then the evaluation order (the moments are known)."""
        assert self.layout is not None
        widths = []
        for name, (shape, dtype) in self.layout.shapes.items():
            if dtype.kind != "f":
                continue
            for c, (lo, hi) in enumerate(_chunks(int(np.prod(shape)), self.config.chunk_size)):
                tree, picked = choose_tree(name, c, self.ids, self.config, self.stats, self.refresh)
                if picked is not None:
                    self.chosen[picked] += 1
                self.trees[(name, c)] = tree
                widths.append((tree, hi - lo))
        if self.config.tree not in ORDER_ONLY:
            self.order, self.order_label = evaluation_order(widths, len(self.ids))

    # ---------------------------------------------------------------- passes

    def main_pass(self) -> None:
        """Load every update once, in the evaluation order, adding it to every chunk."""
        for i in self.order:
            update = self.loads[i]()
            if self.layout is None:
                self.layout = _Layout.of(update)
            self._add(i, update)
            del update

    def _add(self, i: int, update: Mapping[str, np.ndarray]) -> None:
        assert self.layout is not None
        whole = self.config.tree in ORDER_ONLY  # one tree for every chunk
        for name, (_, dtype) in self.layout.shapes.items():
            value = update[name]
            if dtype.kind != "f":
                self.ints.setdefault(name, [None] * len(self.ids))[i] = np.array(value)
                continue
            term = _term(value, self.factors[i])
            cast = term.to(self.work)
            if name not in self.reference:  # (not setdefault: that would allocate each time)
                self.reference[name] = torch.zeros(term.numel(), dtype=torch.float64)
            ref = self.reference[name]
            ref.add_(cast)  # promoted to float64 element by element: no double copy
            if whole:  # elementwise the same additions as chunk by chunk, in one pass
                chunks = len(_chunks(term.numel(), self.config.chunk_size))
                self._chunk(name, WHOLE, chunks).add(i, term, cast)
                continue
            for c, (lo, hi) in enumerate(_chunks(term.numel(), self.config.chunk_size)):
                if not self.observed:
                    observe(self.stats, self.config, self.ids[i], name, c, term[lo:hi])
                self._chunk(name, c).add(i, term[lo:hi], cast[lo:hi])

    def _chunk(self, name: str, c: int, chunks: int = 1) -> ChunkSum:
        """The evaluation state of chunk ``c`` (``WHOLE``: all ``chunks`` of the tensor)."""
        key = (name, c)
        if key not in self.sums:
            if key not in self.trees:  # order-only trees, or trees from the cache
                tree, picked = choose_tree(name, c, self.ids, self.config, self.stats, self.refresh)
                if picked is not None:
                    self.chosen[picked] += chunks
                self.trees[key] = tree
            self.sums[key] = ChunkSum(flatten(self.trees[key]), self.work, self.root, self.meter)
        return self.sums[key]

    def _results(self) -> dict[tuple[str, int], torch.Tensor]:
        """Each chunk's sum (views into a whole tensor's)."""
        out = {}
        for (name, c), chunk in self.sums.items():
            assert chunk.result is not None
            if c != WHOLE:
                out[(name, c)] = chunk.result
                continue
            for cc, (lo, hi) in enumerate(_chunks(chunk.result.numel(), self.config.chunk_size)):
                out[(name, cc)] = chunk.result[lo:hi]
        return out

    def _redo_in_float32(self, results: dict[tuple[str, int], torch.Tensor]) -> None:
        """Chunks whose low-precision sum overflowed, summed again in float32 (one more
        pass over the updates, for those chunks only)."""
        redo = {
            (name, c): ChunkSum(
                flatten(self.trees.get((name, c), self.trees.get((name, WHOLE)))),
                torch.float32,
                None,
            )
            for name, c in self.overflow
        }
        for i in self.order:
            update = self.loads[i]()
            terms = {name: _term(update[name], self.factors[i]) for name, _ in redo}
            for (name, c), chunk in redo.items():
                lo, hi = _chunks(terms[name].numel(), self.config.chunk_size)[c]
                chunk.add(i, terms[name][lo:hi])
            del update, terms
        for key, chunk in redo.items():
            assert chunk.result is not None
            results[key] = chunk.result

    # ---------------------------------------------------------------- results

    def finish(self) -> dict[str, np.ndarray]:
        assert self.layout is not None
        results = self._results()
        self.overflow = [k for k, r in results.items() if not torch.isfinite(r.float()).all()]
        if self.overflow:  # e.g. fp16 beyond 65504
            self._redo_in_float32(results)
        mean: dict[str, np.ndarray] = {}
        self.sq_error, self.coords = 0.0, 0
        for name, (shape, dtype) in self.layout.shapes.items():
            if dtype.kind != "f":  # a float64 mean in stable-id order, rounded back
                acc = sum(
                    f * v.astype(np.float64)
                    for f, v in zip(self.factors, self.ints[name], strict=True)
                )
                mean[name] = np.rint(acc).astype(dtype)
                continue
            out = torch.empty(int(np.prod(shape)), dtype=torch.float32)
            for c, (lo, hi) in enumerate(_chunks(out.numel(), self.config.chunk_size)):
                out[lo:hi] = results[(name, c)].float()
            diff = out.double() - self.reference[name]
            self.sq_error += float((diff**2).sum())
            self.coords += out.numel()
            mean[name] = out.reshape(shape).numpy()
        return mean

    def report(self) -> dict[str, Any]:
        peaks = [s.peak for s in self.sums.values()]
        return {
            "chosen": {k: v for k, v in self.chosen.items() if v},
            "overflow_chunks": len(self.overflow),
            "mse_vs_fp64": self.sq_error / self.coords if self.coords else 0.0,
            "live_partial_sums": max(peaks, default=0),
            "live_partial_sum_bytes": self.meter.peak,
            "order": self.order_label,
        }
