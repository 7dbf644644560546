"""The server's weighted mean through reduction trees, per chunk of coordinates.

Leaves are the weighted terms (w_i / W) x_i of the clients, in stable-id order; each
chunk of coordinates is summed along a tree chosen from per-client statistics of that
chunk (exact for the current round, or exponential moving estimates refreshed every
R rounds), in float32, bfloat16 or float16, optionally with a float32 root addition.
A chunk whose low-precision sum overflows is recomputed in float32 and counted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedcomp.settings import TreeOptions
from fedcomp.trees.build import (
    CANDIDATES,
    balanced_tree,
    blocked_tree,
    greedy_tree,
    huffman_tree,
    select_tree,
    sequential_tree,
)
from fedcomp.trees.reduce import DTYPES, reduce_tree
from fedcomp.trees.structure import Tree

#: Trees whose shape depends only on the number of leaves, never on statistics.
ORDER_ONLY = ("sum", "sequential", "balanced", "blocked")


# Not frozen: it extends TreeOptions, which the (mutable, Hydra-composed) run settings
# extend too; nothing changes a TreeConfig after it is built.
@dataclass
class TreeConfig(TreeOptions):
    """How the pre-aggregated mean is reduced: the ``aggregation.*`` tree options, plus
    the statistics' constants no setting exposes."""

    ema_decay: float = 0.5
    #: Variance floor: sigma^2 = max(q - m^2, eps), so a constant leaf still has a weight.
    eps: float = 1e-30

    def __post_init__(self) -> None:
        self.check_tree_options()
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"aggregation.ema_decay={self.ema_decay!r}: must be in [0, 1)")


@dataclass
class TreeStats:
    """Per-client, per-chunk first and second moments (the one state object of trees)."""

    mean: dict[tuple[int, str, int], float] = field(default_factory=dict)
    second: dict[tuple[int, str, int], float] = field(default_factory=dict)
    #: Trees chosen at the last refresh, per (tensor, chunk), keyed by the client set.
    chosen: dict[tuple[str, int], tuple[tuple[int, ...], str, Any]] = field(default_factory=dict)

    def update(self, key: tuple[int, str, int], m: float, q: float, decay: float) -> None:
        if key in self.mean and decay > 0:
            self.mean[key] = decay * self.mean[key] + (1 - decay) * m
            self.second[key] = decay * self.second[key] + (1 - decay) * q
        else:
            self.mean[key], self.second[key] = m, q

    def state_dict(self) -> dict[str, Any]:
        return {
            "mean": [[*k, v] for k, v in self.mean.items()],
            "second": [[*k, v] for k, v in self.second.items()],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.mean = {(int(a), str(b), int(c)): float(v) for a, b, c, v in state["mean"]}
        self.second = {(int(a), str(b), int(c)): float(v) for a, b, c, v in state["second"]}
        self.chosen = {}


def _fixed_tree(name: str, var: np.ndarray, mean: np.ndarray) -> Tree:
    k = len(var)
    if name == "sequential":
        return sequential_tree(k)
    if name == "balanced":
        return balanced_tree(k)
    if name == "blocked":
        return blocked_tree(k)
    if name == "huffman":
        return huffman_tree(var)
    return greedy_tree(var, mean)


def tree_mean(
    updates: Sequence[Mapping[str, np.ndarray]],
    weights: Sequence[float],
    stable_ids: Sequence[int],
    config: TreeConfig,
    stats: TreeStats,
    server_round: int,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The weighted mean of ``updates`` (sorted by stable id) through trees.

    Returns the mean per tensor (float32 for float tensors) and a report: how often each
    candidate was chosen, and how many chunks overflowed and were redone in float32.
    """
    factors = leaf_factors(updates, weights, stable_ids)
    refresh = _refresh(config, server_round)
    chosen_counts = dict.fromkeys(CANDIDATES, 0)
    overflow = 0
    sq_error, coords = 0.0, 0
    work = DTYPES[config.dtype]
    mean: dict[str, np.ndarray] = {}
    for name, first in updates[0].items():
        if first.dtype.kind != "f":  # integer buffers: a float64 mean, rounded back
            acc = sum(f * u[name].astype(np.float64) for f, u in zip(factors, updates, strict=True))
            mean[name] = np.rint(acc).astype(first.dtype)
            continue
        terms = torch.stack(
            [
                torch.from_numpy(np.asarray(u[name], dtype=np.float32)).reshape(-1) * f
                for u, f in zip(updates, factors, strict=True)
            ]
        )
        out = torch.empty(terms.shape[1], dtype=torch.float32)
        for c, start in enumerate(range(0, terms.shape[1], config.chunk_size)):
            leaves = terms[:, start : start + config.chunk_size]
            tree, picked = _tree_for(name, c, leaves, stable_ids, config, stats, refresh)
            if picked is not None:
                chosen_counts[picked] += 1
            root = "fp32" if config.root_fp32 else None
            total_chunk = reduce_tree(tree, leaves, dtype=work, root_dtype=root).float()
            if not torch.isfinite(total_chunk).all():
                overflow += 1  # e.g. fp16 beyond 65504: redo this chunk in float32
                total_chunk = reduce_tree(tree, leaves, dtype=torch.float32)
            out[start : start + leaves.shape[1]] = total_chunk
            # The tree's own rounding: against the float64 sum of the same leaves, as
            # cast to the working dtype.
            reference = leaves.to(work).double().sum(0)
            sq_error += float(((total_chunk.double() - reference) ** 2).sum())
            coords += leaves.shape[1]
        mean[name] = out.reshape(first.shape).numpy()
    report = {
        "chosen": {k: v for k, v in chosen_counts.items() if v},
        "overflow_chunks": overflow,
        "mse_vs_fp64": sq_error / coords if coords else 0.0,
    }
    return mean, report


def leaf_factors(
    updates: Sequence[object], weights: Sequence[float], stable_ids: Sequence[int]
) -> list[float]:
    """Each leaf's factor w_i / W, after checking one weight and one stable id per update
    (k >= 1) and weights positive and finite."""
    if not updates or len(updates) != len(weights) or len(weights) != len(stable_ids):
        raise ValueError("tree_mean needs one weight and one stable id per update (k >= 1)")
    if any(not np.isfinite(w) or w <= 0 for w in weights):
        raise ValueError(f"weights must be positive and finite, got {list(weights)!r}")
    total = float(sum(weights))
    return [w / total for w in weights]


def leaf_moments(leaf: torch.Tensor) -> tuple[float, float]:
    """The first and second moment of one client's chunk, in float64.

    One leaf at a time (not a row of a stacked matrix, whose reduction torch may
    vectorise across rows and round differently), so the list and the streaming
    evaluation see the same statistics bit for bit."""
    x = leaf.double()
    return float(x.mean()), float((x * x).mean())


def observe(
    stats: TreeStats, config: TreeConfig, sid: int, name: str, chunk: int, leaf: torch.Tensor
) -> None:
    """Track one client's moments of one chunk (exact, or a moving average)."""
    decay = config.ema_decay if config.stats == "ema" else 0.0
    m, q = leaf_moments(leaf)
    stats.update((sid, name, chunk), m, q, decay)


def needs_moments_first(
    config: TreeConfig, stats: TreeStats, stable_ids: Sequence[int], server_round: int
) -> bool:
    """Whether a tree must be chosen from this round's moments before any addition:
    the trees that depend on statistics, on a refresh round or for a new client set."""
    if config.tree in ORDER_ONLY:
        return False
    if _refresh(config, server_round) or not stats.chosen:
        return True
    return any(ids != tuple(stable_ids) for ids, _, _ in stats.chosen.values())


def _refresh(config: TreeConfig, server_round: int) -> bool:
    return config.stats == "current" or (server_round - 1) % config.refresh_rounds == 0


def choose_tree(
    name: str,
    chunk: int,
    stable_ids: Sequence[int],
    config: TreeConfig,
    stats: TreeStats,
    refresh: bool,
) -> tuple[Tree, str | None]:
    """The tree of one chunk from the tracked moments (which include this round's).

    The tree is chosen again only on refresh rounds or when the set of clients changed.
    """
    k = len(stable_ids)
    if config.tree == "sum":
        return sequential_tree(k), None
    if config.tree in ORDER_ONLY:
        return _fixed_tree(config.tree, np.zeros(k), np.zeros(k)), config.tree
    key_ids = tuple(stable_ids)
    cached = stats.chosen.get((name, chunk))
    if not refresh and cached is not None and cached[0] == key_ids:
        return cached[2], cached[1]
    m = np.array([stats.mean[(sid, name, chunk)] for sid in stable_ids])
    q = np.array([stats.second[(sid, name, chunk)] for sid in stable_ids])
    var = np.maximum(q - m * m, config.eps)
    if config.tree == "adaptive":
        picked, tree, _ = select_tree(var, m, dtype=config.dtype, root_fp32=config.root_fp32)
    else:
        picked, tree = config.tree, _fixed_tree(config.tree, var, m)
    stats.chosen[(name, chunk)] = (key_ids, picked, tree)
    return tree, picked


def _tree_for(
    name: str,
    chunk: int,
    leaves: torch.Tensor,
    stable_ids: Sequence[int],
    config: TreeConfig,
    stats: TreeStats,
    refresh: bool,
) -> tuple[Tree, str | None]:
    if config.tree != "sum":  # moments are tracked every round
        for i, sid in enumerate(stable_ids):
            observe(stats, config, sid, name, chunk, leaves[i])
    return choose_tree(name, chunk, stable_ids, config, stats, refresh)
