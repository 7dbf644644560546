"""Reduction trees where their shape matters: partial sums in bf16 and fp16 on the real
client updates of a Fashion-MNIST run with 100 clients a round.

    python -m experiments.trees_regime [--clients 100] [--rounds 1 5 20] [--out FILE.md]

Capture: the leaderboard's Dirichlet 0.5 setting (``+experiment=leaderboard_fmnist``,
NIID-Bench's CNN) with ``--clients`` clients, all training every round, FedAvg in fp32,
in process (no Ray). At each listed round, every client's update (trained minus
received, float32) becomes a leaf (w_i / W) x_i, in stable-id order: what the server's
pre-aggregated mean sums.

Measured per round, working dtype and tree, over the model's flattened coordinates in
chunks of 65,536 (the server's default), each chunk's tree chosen from that chunk's
exact moments:

- ``total``: the MSE per coordinate of the tree's sum against the exact float64 sum of
  the float32 leaves: what a user gets;
- ``tree``: against the float64 sum of the leaves cast to the working dtype: the part
  the tree's shape can change (the cast is the same for every tree);
- ``predicted``: the rounding model (fedcomp.trees.rounding_cost: each addition's
  rounding variance from the leaves' means and variances), summed over chunks and
  divided by the coordinates.

Trees: sequential (a running sum in reply order), balanced, huffman (on the leaves'
variances), greedy (on their second moments), and the adaptive choice
(fedcomp.trees.select_tree with the dtype: the smallest predicted cost).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from experiments.runtime import emit
from fedcomp.trees import reduce_tree, rounding_cost, select_tree
from fedcomp.trees.build import candidate_trees

DTYPES = ("fp32", "bf16", "fp16")
TREES = ("sequential", "balanced", "huffman", "greedy")
CHUNK = 65536


def capture(clients: int, rounds: list[int], seed: int) -> dict[int, torch.Tensor]:
    """Each listed round's leaves (w_i / W) x_i as a (clients, coordinates) float32
    stack, from an in-process FedAvg run of the leaderboard's Dirichlet setting."""
    from hydra import compose, initialize_config_dir

    from clients.client_app import make_client_app
    from experiments.behaviour import node_ids
    from experiments.inprocess import InProcessGrid, Spy, set_task_identity
    from experiments.run import CONF_DIR, settings_from_cfg
    from fedcomp.flower.options import ServerOptions
    from fedcomp.flower.strategy import CompressedStrategy
    from fedcomp.models import build_model
    from strategies.inner import make_inner_strategy
    from strategies.server_app import client_task

    set_task_identity()
    overrides = ["+experiment=leaderboard_fmnist", f"num_clients={clients}", f"seed={seed}"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        settings = settings_from_cfg(compose(config_name="config", overrides=overrides))
    spy = Spy()
    grid = InProcessGrid(make_client_app(inner_mods=[spy]), clients, node_ids=node_ids(clients))
    from flwr.app import ArrayRecord

    arrays = ArrayRecord(build_model(settings.model, settings.dataset.name, seed).state_dict())
    stacks = {}
    for number in range(1, max(rounds) + 1):
        start = {k: np.asarray(v.numpy()) for k, v in arrays.items()}
        strategy = CompressedStrategy(
            make_inner_strategy({"name": "fedavg"}, clients, fraction_evaluate=0.0),
            codec={"name": "fp32"},
            run_seed=seed,
            options=ServerOptions(task=client_task(settings)),
        )
        arrays = strategy.start(grid, arrays, num_rounds=1).arrays
        if number in rounds:
            weights = np.array([spy.weight[p] for p in range(clients)])
            rows = [
                np.concatenate([(spy.local[p][k] - start[k]).reshape(-1) for k in start])
                * (weights[p] / weights.sum())
                for p in range(clients)
            ]
            stacks[number] = torch.from_numpy(np.stack(rows).astype(np.float32))
    return stacks


def measure(stack: torch.Tensor) -> list[dict]:
    """Per dtype and tree: total, tree-only and predicted MSE per coordinate."""
    rows = []
    exact = stack.double().sum(0)
    for dtype in DTYPES:
        cast = (
            stack.to(
                getattr(torch, {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype])
            )
            .double()
            .sum(0)
        )
        sums = {name: [0.0, 0.0, 0.0] for name in (*TREES, "adaptive")}
        chosen: dict[str, int] = {}
        for start in range(0, stack.shape[1], CHUNK):
            leaves = stack[:, start : start + CHUNK]
            x = leaves.double()
            mean = x.mean(1).numpy()
            var = np.maximum((x * x).mean(1).numpy() - mean**2, 1e-30)
            trees = candidate_trees(var, mean)
            name, tree, _ = select_tree(var, mean, dtype=dtype)
            chosen[name] = chosen.get(name, 0) + 1
            trees = {**{n: trees[n] for n in TREES}, "adaptive": tree}
            for label, t in trees.items():
                got = reduce_tree(t, leaves, dtype).double()
                part = slice(start, start + leaves.shape[1])
                sums[label][0] += float(((got - exact[part]) ** 2).sum())
                sums[label][1] += float(((got - cast[part]) ** 2).sum())
                sums[label][2] += rounding_cost(t, var, mean, dtype) * leaves.shape[1]
        n = stack.shape[1]
        for label, (total, tree_part, predicted) in sums.items():
            rows.append(
                {
                    "dtype": dtype,
                    "tree": label,
                    "total": total / n,
                    "tree_part": tree_part / n,
                    "predicted": predicted / n,
                    "chosen": chosen if label == "adaptive" else None,
                }
            )
    return rows


def regime(stack: torch.Tensor) -> dict[str, float]:
    """The statistics that decide whether a shape can matter: the leaves' spread of
    variances (max / median) and their common mean against their spread."""
    x = stack.double()
    var = x.var(1).numpy()
    mean = x.mean(1).numpy()
    return {
        "var_max_over_median": float(var.max() / np.median(var)),
        "mean_sq_over_var": float(np.mean(mean) ** 2 / np.mean(var)),
        "exact_power": float((x.sum(0) ** 2).mean()),
    }


def markdown(results: dict[int, tuple[list[dict], dict]], clients: int, seconds: float) -> str:
    lines = [
        "# Reduction trees on real updates, 100 clients a round",
        "",
        f"{clients} clients of the Fashion-MNIST Dirichlet 0.5 setting (NIID-Bench's CNN, "
        "44,426 parameters), all training every round, FedAvg in fp32; the leaves are "
        "the weighted terms (w_i / W) x_i. MSE per coordinate; `total` against the exact "
        "float64 sum of the float32 leaves, `tree` against the float64 sum of the leaves "
        "in the working dtype (the part a tree's shape can change), `predicted` the "
        "rounding model. `python -m experiments.trees_regime` "
        f"({seconds:.0f} s).",
        "",
    ]
    for number, (rows, stats) in results.items():
        lines += [
            f"## Round {number}",
            "",
            f"Leaves: variance max/median {stats['var_max_over_median']:.3g}, common mean^2 "
            f"over variance {stats['mean_sq_over_var']:.3g}; the exact mean's power "
            f"{stats['exact_power']:.3g} per coordinate.",
            "",
            "| dtype | tree | total MSE | tree MSE | predicted | total / exact power |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            chosen = (
                f" ({', '.join(f'{k} {v}' for k, v in r['chosen'].items())})" if r["chosen"] else ""
            )
            lines.append(
                f"| {r['dtype']} | {r['tree']}{chosen} | {r['total']:.3g} | {r['tree_part']:.3g} "
                f"| {r['predicted']:.3g} | {r['total'] / stats['exact_power']:.2e} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="reduction trees on real updates")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--rounds", type=int, nargs="+", default=[1, 5, 20])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    stacks = capture(args.clients, sorted(set(args.rounds)), args.seed)
    results = {n: (measure(s), regime(s)) for n, s in stacks.items()}
    emit(markdown(results, args.clients, time.perf_counter() - t0), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
