"""The bytes-to-accuracy leaderboard: recipes ranked by the TOTAL bytes they need.

    python -m experiments.report --leaderboard multirun/leaderboard_digits [--plot P.png]

A recipe is one uplink codec, one downlink and the server strategy (the swept
``codec.*``, ``downlink.*`` and ``strategy.*`` settings: FedProx in fp32 is a recipe);
FedAvg, the reference, is fp32 both ways with the FedAvg strategy. Each recipe's target
is FedAvg's mean final accuracy over seeds (with ``window`` > 1: the mean of its last
``window`` rounds, its converged accuracy) minus ``tolerance`` (one point), reached by
the ``score``'s model (the server's, or the clients' replica); for every
seed, the bytes spent until the first round whose central accuracy reaches it are
cumulated from the measured per-round counts: ``total_wire_bytes`` (every message of the
round, both directions, evaluation included) and ``uplink_wire_bytes`` (train replies).
A recipe is ranked by how many seeds reach the target, then by its median total bytes
over them; its ratio is FedAvg's median bytes to the same target divided by its own. The
same for the socket bytes (``experiments/framing.py``): modelled for every run from its
messages, objects and object bytes, measured for deployment runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from experiments.framing import (
    FP32_SOCKET_NOTE,
    SOCKET_MEASURED,
    SOCKET_MODEL,
    load_model,
    with_socket_rounds,
)
from experiments.report import (
    accuracy_plot,
    bytes_to_reach,
    group_runs,
    is_fp32_both_ways,
    t_half_width,
)

TOTAL, UPLINK = "total_wire_bytes", "uplink_wire_bytes"
#: Every per-round count a recipe is ranked or compared by.
KEYS = (TOTAL, UPLINK, SOCKET_MODEL, SOCKET_MEASURED)


#: Downlink keys left out of a recipe's name when they have their usual values.
_USUAL = {"memory": "error_feedback", "initial": "seeded"}


def spec_label(spec: dict[str, Any], usual: dict[str, Any] | None = None) -> str:
    """``name(key=value, ...)`` of a codec or downlink spec, usual values left out."""
    params = [f"{k}={v}" for k, v in spec.items() if k != "name" and (usual or {}).get(k) != v]
    return f"{spec['name']}({', '.join(params)})" if params else str(spec["name"])


#: The settings a recipe is made of; every other swept setting must be the same in all runs.
RECIPE_PREFIXES = ("codec.", "downlink.", "strategy.")


def _strategy(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("strategy") or {"name": "fedavg"}


def recipe_label(config: dict[str, Any]) -> str:
    """``up <codec> / down <downlink>`` from a run's settings, then the strategy when it
    is not FedAvg (``, strategy fedprox(proximal_mu=0.01)``)."""
    downlink = config.get("downlink", {"name": "fp32"})
    label = f"up {spec_label(config['codec'])} / down {spec_label(downlink, _USUAL)}"
    strategy = _strategy(config)
    return label if strategy["name"] == "fedavg" else f"{label}, strategy {spec_label(strategy)}"


def is_reference(run: dict[str, Any]) -> bool:
    """FedAvg: fp32 both ways under the FedAvg strategy (FedProx in fp32 is not it)."""
    return is_fp32_both_ways(run) and _strategy(run["config"])["name"] == "fedavg"


def _median(values: Sequence[int]) -> float | None:
    return float(np.median(values)) if values else None


def converged_accuracy(run: dict[str, Any], window: int) -> float:
    """The mean central accuracy of a run's last ``window`` rounds that evaluated."""
    evaluated = [r["accuracy"] for r in run["rounds"] if r["accuracy"] is not None]
    if not evaluated:
        raise ValueError("a FedAvg run without central accuracy cannot set the target")
    return float(np.mean(evaluated[-window:]))


def rank_recipes(
    runs: Sequence[dict[str, Any]],
    tolerance: float = 0.01,
    *,
    window: int = 1,
    score: str = "server",
) -> list[dict[str, Any]]:
    """One entry per recipe, best first (see the module docstring).

    Raises
    ------
    ValueError
        Without FedAvg runs (the reference) or with settings other than the recipe
        that differ between runs (one leaderboard compares recipes in one setting).
    """
    model = load_model()
    runs = [with_socket_rounds(r, model) for r in runs]
    keys, groups = group_runs(runs)
    others = [k for k in keys if not k.startswith(RECIPE_PREFIXES)]
    if others:
        raise ValueError(f"the runs differ in {', '.join(others)}: select one setting (--only)")
    fedavg = [r for r in runs if is_reference(r)]
    if not fedavg:
        raise ValueError("no FedAvg run (fp32 both ways): the leaderboard needs the reference")
    target = float(np.mean([converged_accuracy(r, window) for r in fedavg])) - tolerance
    reference = {
        key: _median(
            [b for r in fedavg if (b := bytes_to_reach(r, target, key, score)) is not None]
        )
        for key in KEYS
    }
    entries = []
    for members in groups.values():
        spent = {
            key: [b for m in members if (b := bytes_to_reach(m, target, key, score)) is not None]
            for key in KEYS
        }
        finals = [m["summary"]["final_accuracy"] for m in members]
        total = _median(spent[TOTAL])
        uplink = _median(spent[UPLINK])
        entries.append(
            {
                "recipe": recipe_label(members[0]["config"]),
                "fedavg": all(is_reference(m) for m in members),
                "compressed": not all(is_fp32_both_ways(m) for m in members),
                "seeds": len(members),
                "reached": len(spent[TOTAL]),
                "total_to_target": total,
                "uplink_to_target": uplink,
                "total_ratio": reference[TOTAL] / total if total and reference[TOTAL] else None,
                "uplink_ratio": reference[UPLINK] / uplink
                if uplink and reference[UPLINK]
                else None,
                **_socket_entry(spent, reference),
                "final_mean": float(np.mean(finals)),
                "final_ci": t_half_width(finals),
                "wall_s": float(np.mean([m["summary"]["wall_s"] for m in members])),
                "members": members,
                "target": target,
            }
        )
    entries.sort(key=lambda e: (-e["reached"] / e["seeds"], e["total_to_target"] or math.inf))
    return entries


def _socket_entry(
    spent: dict[str, list[int]], reference: dict[str, float | None]
) -> dict[str, float | None]:
    """Median socket bytes to target, modelled and measured, and FedAvg's over them."""
    out: dict[str, float | None] = {}
    for key, name in ((SOCKET_MODEL, "socket_model"), (SOCKET_MEASURED, "socket_measured")):
        mine, ref = _median(spent[key]), reference[key]
        out[f"{name}_to_target"] = mine
        out[f"{name}_ratio"] = ref / mine if mine and ref else None
    return out


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1e6:.3f}"


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}x"


def leaderboard(
    runs: Sequence[dict[str, Any]],
    tolerance: float = 0.01,
    *,
    window: int = 1,
    score: str = "server",
) -> str:
    """The ranked table and the headline numbers, as markdown."""
    entries = rank_recipes(runs, tolerance, window=window, score=score)
    target = entries[0]["target"]
    which = "final accuracy" if window == 1 else f"accuracy over its last {window} rounds"
    lines = [
        f"Target: FedAvg's mean {which} minus {tolerance:g} = {target:.4f}, reached by "
        f"the {score}'s model. "
        "Bytes are medians over the seeds that reach it, cumulated from the measured "
        "per-round counts; ratios are FedAvg's bytes to the same target over the "
        "recipe's.",
        "",
        "| rank | recipe | seeds reaching | total MB to target | x fewer total bytes than "
        "FedAvg | uplink MB to target | x fewer uplink bytes | socket (model) MB to target "
        "| x fewer socket (model) | socket (measured) MB to target | x fewer socket "
        "(measured) | final accuracy (95% CI) | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rank, e in enumerate(entries, 1):
        ci = f" +- {e['final_ci']:.4f}" if e["final_ci"] is not None else ""
        name = e["recipe"] + (" (FedAvg)" if e["fedavg"] else "")
        lines.append(
            f"| {rank} | {name} | {e['reached']}/{e['seeds']} | {_mb(e['total_to_target'])} "
            f"| {_x(e['total_ratio'])} | {_mb(e['uplink_to_target'])} | {_x(e['uplink_ratio'])} "
            f"| {_mb(e['socket_model_to_target'])} | {_x(e['socket_model_ratio'])} "
            f"| {_mb(e['socket_measured_to_target'])} | {_x(e['socket_measured_ratio'])} "
            f"| {e['final_mean']:.4f}{ci} | {e['wall_s']:.1f} |"
        )
    every_seed = [e for e in entries if e["reached"] == e["seeds"] and e["compressed"]]
    if every_seed:
        best = every_seed[0]
        best_up = max(every_seed, key=lambda e: e["uplink_ratio"] or 0.0)
        lines += [
            "",
            f"Best recipe reaching the target in every seed: {best['recipe']}, "
            f"{_x(best['total_ratio'])} fewer total bytes than FedAvg.",
            f"Best uplink-only ratio at matched accuracy: {best_up['recipe']}, "
            f"{_x(best_up['uplink_ratio'])}.",
        ]
    else:
        lines += ["", "No compressed recipe reached the target in every seed."]
    lines += ["", FP32_SOCKET_NOTE]
    return "\n".join(lines) + "\n"


def leaderboard_plot(
    runs: Sequence[dict[str, Any]],
    path: Path,
    top: int = 6,
    tolerance: float = 0.01,
    *,
    window: int = 1,
    score: str = "server",
) -> Path:
    """Accuracy against cumulative total bytes for FedAvg and the ``top`` recipes."""
    entries = rank_recipes(runs, tolerance, window=window, score=score)
    chosen = [e for e in entries if e["fedavg"]] + [e for e in entries if not e["fedavg"]][:top]
    runs_shown = [m for e in chosen for m in e["members"]]
    return accuracy_plot(runs_shown, path, TOTAL, label_of=lambda run: recipe_label(run["config"]))
