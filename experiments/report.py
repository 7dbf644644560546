"""Turn a (multi)run directory into markdown tables and plots.

    python -m experiments.report multirun/2026-12-02/12-00-00 [--out table.md]
    python -m experiments.report --paired multirun/residual_femnist [--target 0.8]
    python -m experiments.report multirun/residual_femnist --out-dir report/

The plain table has one row per run: the settings that differ between runs (the
sweep), final accuracy, uplink codec and wire bytes, the compression ratio against
fp32 (wire), and wall time. ``--paired`` groups the runs of one method and setting
over their seeds: final accuracy with its 95% CI and min..max, uplink codec and wire
MB, the MB needed to reach a target accuracy, compression ratios against fp32 and wall
time, then paired residual-minus-direct differences. ``--out-dir`` writes both tables
(report.md) and PNG plots of accuracy against cumulative total wire bytes (every message
of the run, both ways) and uplink codec and wire bytes.
Every results.json is read through fedcomp's schema validator.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from experiments.framing import FP32_SOCKET_NOTE, load_model, socket_summary
from fedcomp.results_file import load_results
from fedcomp.settings import Settings, flatten, settings_to_dict

#: Settings that differ per run without being part of the sweep.
#: Per-run paths and switches that never define a method or setting.
_IGNORED = {
    "results_path",
    "diagnostics_dir",
    "resume",
    "progress",
    "client_state_dir",
    "client_state",
}


def find_results(root: Path) -> list[Path]:
    """All results.json files under ``root``, in a stable order."""
    if root.is_file():
        return [root]
    return sorted(root.rglob("results.json"))


def swept_keys(configs: Sequence[dict[str, Any]]) -> list[str]:
    """Flat setting keys whose values differ between runs, in config order.

    A setting missing from a results file (written before the setting existed) counts
    as its default, so old and new runs of the same method still group together."""
    defaults = flatten(settings_to_dict(Settings()))
    flats = [{**defaults, **flatten(c)} for c in configs]
    keys: list[str] = []
    for flat in flats:
        keys += [k for k in flat if k not in keys]
    return [k for k in keys if k not in _IGNORED and len({repr(f.get(k)) for f in flats}) > 1]


def _cell(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def table_rows(results: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """Header and raw row values (numbers, not strings) for the given results."""
    keys = swept_keys([r["config"] for r in results])
    header = [
        *keys,
        "final_accuracy",
        "best_accuracy",
        "total_wire_bytes",
        "total_ratio_vs_fp32",
        "uplink_codec_bytes",
        "uplink_wire_bytes",
        "ratio_vs_fp32_wire",
        *SOCKET_COLUMNS,
        "wall_s",
    ]
    model = load_model()
    rows = []
    for r in results:
        flat = flatten(r["config"])
        s = r["summary"]
        codec_bytes = sum(rnd["uplink_codec_bytes"] for rnd in r["rounds"])
        sock = socket_summary(r, model)
        rows.append(
            [
                *(flat.get(k) for k in keys),
                s["final_accuracy"],
                s.get("best_accuracy"),  # absent from files written before it
                s.get("total_wire_bytes"),
                s.get("total_ratio_vs_fp32"),
                codec_bytes,
                s["uplink_wire_bytes_total"],
                s["ratio_vs_fp32_wire"],
                *(sock[k] for k in SOCKET_COLUMNS.values()),
                s["wall_s"],
            ]
        )
    return header, rows


#: The socket columns of the run table (experiments/framing.py): header -> summary key.
SOCKET_COLUMNS = {
    "socket (model)": "socket_model",
    "socket (model) ratio vs fp32": "socket_model_ratio",
    "socket (measured)": "socket_measured",
    "socket (measured) ratio vs fp32": "socket_measured_ratio",
}


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def report(root: Path) -> str:
    """The markdown report for every run under ``root``."""
    header, rows = table_rows(load_all(root))
    return markdown_table(header, rows) + "\n" + FP32_SOCKET_NOTE + "\n"


def load_all(root: Path) -> list[dict[str, Any]]:
    """Every results.json under ``root``, validated."""
    paths = find_results(root)
    if not paths:
        raise FileNotFoundError(f"no results.json under {root}")
    return [load_results(p) for p in paths]


def select(runs: list[dict[str, Any]], only: Sequence[str]) -> list[dict[str, Any]]:
    """The runs whose flat settings match every ``key=value`` of ``only`` (values
    compared as text; ``codec.name=fp32,uniform`` matches either)."""
    kept = runs
    for condition in only:
        key, _, values = condition.partition("=")
        allowed = set(values.split(","))
        kept = [r for r in kept if str(flatten(r["config"]).get(key)) in allowed]
    if runs and not kept:
        raise FileNotFoundError(f"no run matches {' '.join(only)}")
    return kept


def t_half_width(values: Sequence[float], confidence: float = 0.95) -> float | None:
    """Half-width of the Student-t confidence interval of the mean (None for n < 2)."""
    if len(values) < 2:
        return None
    from scipy import stats

    n = len(values)
    return float(stats.t.ppf(0.5 + confidence / 2, n - 1) * np.std(values, ddof=1) / np.sqrt(n))


def cumulative(run: dict[str, Any], key: str) -> np.ndarray | None:
    """Cumulative per-round ``key`` bytes; None when a round lacks it (a results file
    written before that count existed)."""
    if any(key not in rnd for rnd in run["rounds"]):
        return None
    return np.cumsum([rnd[key] for rnd in run["rounds"]])


def bytes_to_reach(
    run: dict[str, Any], target: float, key: str, score: str = "server"
) -> int | None:
    """Cumulative ``key`` bytes at the first round whose accuracy reaches ``target``
    (``score``: SCORES, whose model's accuracy)."""
    total = cumulative(run, key)
    if total is None:
        return None
    for rnd, spent in zip(run["rounds"], total, strict=True):
        accuracy = scored_accuracy(rnd, score)
        if accuracy is not None and accuracy >= target:
            return int(spent)
    return None


#: Whose model a leaderboard scores each round: the server's (``accuracy``: the model
#: the run returns, what a user keeps), or the clients' replica (``replica_accuracy``:
#: the model they hold under a compressed downlink; the server's when it is the same).
SCORES = ("server", "replica")


def scored_accuracy(rnd: dict[str, Any], score: str) -> float | None:
    """A round's central accuracy of the scored model."""
    if score == "replica" and rnd.get("replica_accuracy") is not None:
        return rnd["replica_accuracy"]
    return rnd["accuracy"]


def _group_key(run: dict[str, Any], keys: Sequence[str]) -> tuple:
    flat = flatten(run["config"])
    return tuple(flat.get(k) for k in keys)


def round_metric(run: dict[str, Any], path: str) -> float | None:
    """Mean over rounds of a nested per-round value, e.g. ``codec.tree.mse_vs_fp64``."""
    values = []
    for rnd in run["rounds"]:
        node: Any = rnd
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, int | float) and not isinstance(node, bool):
            values.append(float(node))
    return float(np.mean(values)) if values else None


def group_runs(runs: Sequence[dict[str, Any]]) -> tuple[list[str], dict[tuple, list]]:
    """Runs grouped by every swept setting except the seed (a group = one method and
    setting, over its seeds), and the keys that define the groups."""
    keys = [k for k in swept_keys([r["config"] for r in runs]) if k != "seed"]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault(_group_key(run, keys), []).append(run)
    ordered = sorted(groups.items(), key=lambda kv: [str(v) for v in kv[0]])
    return keys, dict(ordered)


#: Setting groups that define a method (the rest define the setting it runs in).
_METHOD_PREFIXES = ("codec.", "downlink.")


def is_fp32_both_ways(run: dict[str, Any]) -> bool:
    """fp32 both ways: within one setting (strategy included), the reference every
    method's target and ratio refer to (the leaderboard, where the strategy is part of
    a recipe, also asks for FedAvg's: ``experiments.leaderboard.is_reference``)."""
    downlink = run["config"].get("downlink", {"name": "fp32"})
    return run["config"]["codec"]["name"] == "fp32" and downlink.get("name") == "fp32"


def targets_by_setting(
    runs: Sequence[dict[str, Any]],
    setting_keys: Sequence[str],
    tolerance: float,
    target: float | None = None,
) -> dict[tuple, float]:
    """The accuracy each setting must reach: ``target`` when given, else FedAvg's (the
    fp32 codec's) mean final accuracy over seeds minus ``tolerance``."""
    if target is not None:
        return {_group_key(run, setting_keys): target for run in runs}
    finals: dict[tuple, list[float]] = {}
    for run in runs:
        if is_fp32_both_ways(run):
            finals.setdefault(_group_key(run, setting_keys), []).append(
                run["summary"]["final_accuracy"]
            )
    return {k: float(np.mean(v)) - tolerance for k, v in finals.items()}


def _mean_of(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return float(np.mean(kept)) if kept else None


def group_summary(members: Sequence[dict[str, Any]], target: float | None) -> dict[str, Any]:
    """The numbers of one table row, from the members' results (means over seeds)."""
    finals = [m["summary"]["final_accuracy"] for m in members]

    def to_target(key: str) -> tuple[float | None, int]:
        if target is None:
            return None, 0
        reached = [b for m in members if (b := bytes_to_reach(m, target, key)) is not None]
        return (float(np.median(reached)) if reached else None), len(reached)

    total_to, total_n = to_target("total_wire_bytes")
    codec_to, codec_n = to_target("uplink_codec_bytes")
    wire_to, wire_n = to_target("uplink_wire_bytes")
    return {
        "seeds": len(members),
        "final_mean": float(np.mean(finals)),
        "final_ci": t_half_width(finals),
        "final_min": float(np.min(finals)),
        "final_max": float(np.max(finals)),
        "total_bytes": _mean_of([m["summary"].get("total_wire_bytes") for m in members]),
        "total_bytes_to_target": total_to,
        "reached_total": total_n,
        "total_ratio": _mean_of([m["summary"].get("total_ratio_vs_fp32") for m in members]),
        "codec_bytes": float(np.mean([cumulative(m, "uplink_codec_bytes")[-1] for m in members])),
        "wire_bytes": float(np.mean([m["summary"]["uplink_wire_bytes_total"] for m in members])),
        "target": target,
        "codec_bytes_to_target": codec_to,
        "wire_bytes_to_target": wire_to,
        "reached": codec_n,
        "reached_wire": wire_n,
        "ratio_codec": _mean_of([m["summary"]["ratio_vs_fp32_codec"] for m in members]),
        "ratio_wire": _mean_of([m["summary"]["ratio_vs_fp32_wire"] for m in members]),
        "wall_s": float(np.mean([m["summary"]["wall_s"] for m in members])),
    }


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1e6:.2f}"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def paired_report(
    runs: Sequence[dict[str, Any]],
    tolerance: float = 0.01,
    metrics: Sequence[str] = (),
    target: float | None = None,
) -> str:
    """One row per method and setting, over its seeds: final accuracy (mean, 95% CI,
    min..max), uplink codec and wire MB, the MB each needs to reach a target accuracy
    (median over the seeds that reach it), compression ratios against fp32 (measured
    on the same updates), wall time; then paired residual-minus-direct differences
    (same seed, bits and other settings).

    The target is ``target`` when given, else FedAvg's (fp32) mean final accuracy of
    the same setting minus ``tolerance``.
    """
    keys, groups = group_runs(runs)
    method_keys = [k for k in keys if k.startswith(_METHOD_PREFIXES)]
    setting_keys = [k for k in keys if not k.startswith(_METHOD_PREFIXES)]
    targets = targets_by_setting(runs, setting_keys, tolerance, target)
    target_text = f"{target:g}" if target is not None else f"FedAvg - {tolerance:g}"
    lines = [
        f"| {' | '.join(keys)} | seeds | final accuracy (95% CI) | min..max "
        f"| total MB | total MB to {target_text} (seeds reaching) | total ratio vs fp32 "
        f"| uplink codec MB | uplink wire MB | codec MB to {target_text} (seeds reaching) "
        f"| wire MB to {target_text} | ratio vs fp32 codec | ratio vs fp32 wire | wall s |"
        + "".join(f" {m} |" for m in metrics),
        "|" + "---|" * (len(keys) + 13 + len(metrics)),
    ]
    for key, members in groups.items():
        row = group_summary(members, targets.get(_group_key(members[0], setting_keys)))
        ci = f" +- {row['final_ci']:.4f}" if row["final_ci"] is not None else ""
        reached = (
            f"{_mb(row['codec_bytes_to_target'])} ({row['reached']}/{row['seeds']})"
            if row["target"] is not None
            else f"n/a (0/{row['seeds']})"
        )
        total_reached = (
            f"{_mb(row['total_bytes_to_target'])} ({row['reached_total']}/{row['seeds']})"
            if row["target"] is not None
            else f"n/a (0/{row['seeds']})"
        )
        extra = ""
        for metric in metrics:
            values = [v for m in members if (v := round_metric(m, metric)) is not None]
            extra += f" {np.mean(values):.3g} |" if values else " n/a |"
        lines.append(
            f"| {' | '.join(_cell(v) for v in key)} | {row['seeds']} "
            f"| {row['final_mean']:.4f}{ci} | {row['final_min']:.4f}..{row['final_max']:.4f} "
            f"| {_mb(row['total_bytes'])} | {total_reached} | {_ratio(row['total_ratio'])} "
            f"| {_mb(row['codec_bytes'])} | {_mb(row['wire_bytes'])} | {reached} "
            f"| {_mb(row['wire_bytes_to_target'])} | {_ratio(row['ratio_codec'])} "
            f"| {_ratio(row['ratio_wire'])} | {row['wall_s']:.1f} |{extra}"
        )
    lines += ["", _paired_differences(runs, setting_keys, method_keys)]
    lines += ["", _paired_downlink_differences(runs, setting_keys, targets)]
    return "\n".join(lines) + "\n"


def _paired_differences(
    runs: Sequence[dict[str, Any]], setting_keys: Sequence[str], method_keys: Sequence[str]
) -> str:
    """Residual minus direct (same inner bits, seed and settings), final accuracy."""
    index = {}
    for run in runs:
        codec = run["config"]["codec"]
        kind = {"residual": "residual", "uniform": "direct"}.get(codec["name"])
        if kind is None:
            continue
        bits = codec.get("bits")
        index[(kind, bits, run["config"]["seed"], _group_key(run, setting_keys))] = run
    rows = []
    for (kind, bits, seed, setting), run in sorted(index.items(), key=lambda kv: str(kv[0])):
        if kind != "residual" or ("direct", bits, seed, setting) not in index:
            continue
        rows.append(
            (
                bits,
                setting,
                run["summary"]["final_accuracy"]
                - index[("direct", bits, seed, setting)]["summary"]["final_accuracy"],
            )
        )
    if not rows:
        return ""
    same = ", ".join(setting_keys) or "settings"
    lines = [
        f"Paired residual - direct final accuracy (same seed, bits, {same}):",
        "",
        "| " + " | ".join(["bits", *setting_keys, "pairs", "mean difference (95% CI)"]) + " |",
        "|---|" + "---|" * (len(setting_keys) + 2),
    ]
    by_group: dict[tuple, list[float]] = {}
    for bits, setting, diff in rows:
        by_group.setdefault((bits, setting), []).append(diff)
    for (bits, setting), diffs in sorted(by_group.items(), key=lambda kv: str(kv[0])):
        half = t_half_width(diffs)
        ci = f" +- {half:.4f}" if half is not None else ""
        cells = [str(bits), *(_cell(v) for v in setting), str(len(diffs))]
        lines.append(f"| {' | '.join(cells)} | {np.mean(diffs):+.4f}{ci} |")
    return "\n".join(lines)


def _paired_downlink_differences(
    runs: Sequence[dict[str, Any]], setting_keys: Sequence[str], targets: dict[tuple, float]
) -> str:
    """Downlink with server error feedback minus the same downlink codec without server
    memory (same uplink, seed and settings): final accuracy and total MB to target."""
    index = {}
    for run in runs:
        downlink = dict(run["config"].get("downlink", {"name": "fp32"}))
        memory = downlink.pop("memory", "error_feedback")
        if downlink.get("name") == "fp32":
            continue
        codec = json.dumps(run["config"]["codec"], sort_keys=True)
        key = (json.dumps(downlink, sort_keys=True), codec, _group_key(run, setting_keys))
        index[(memory, key, run["config"]["seed"])] = run
    by_group: dict[tuple, list[tuple[float, float | None]]] = {}
    for (memory, key, seed), run in index.items():
        direct = index.get(("none", key, seed))
        if memory != "error_feedback" or direct is None:
            continue
        target = targets.get(key[2])
        spent = [
            bytes_to_reach(r, target, "total_wire_bytes") if target is not None else None
            for r in (run, direct)
        ]
        mb = (spent[0] - spent[1]) / 1e6 if None not in spent else None
        by_group.setdefault(key, []).append(
            (run["summary"]["final_accuracy"] - direct["summary"]["final_accuracy"], mb)
        )
    if not by_group:
        return ""
    same = ", ".join(setting_keys) or "settings"
    lines = [
        f"Paired downlink error feedback - direct (same downlink codec, uplink, seed, {same}):",
        "",
        "| downlink | uplink | "
        + " | ".join(setting_keys)
        + (" | " if setting_keys else "")
        + "pairs | final accuracy difference (95% CI) | total MB to target difference |",
        "|---|---|" + "---|" * (len(setting_keys) + 3),
    ]
    for (downlink, codec, setting), diffs in sorted(by_group.items(), key=lambda kv: str(kv[0])):
        acc = [a for a, _ in diffs]
        mbs = [m for _, m in diffs if m is not None]
        half = t_half_width(acc)
        ci = f" +- {half:.4f}" if half is not None else ""
        mb = f"{np.mean(mbs):+.2f} ({len(mbs)} pairs reaching)" if mbs else "n/a"
        cells = [downlink, codec, *(_cell(v) for v in setting), str(len(diffs))]
        lines.append(f"| {' | '.join(cells)} | {np.mean(acc):+.4f}{ci} | {mb} |")
    return "\n".join(lines)


def _label(keys: Sequence[str], group: tuple, informative: set[str] | None = None) -> str:
    both = any(k.startswith("downlink.") for k in keys)  # say which direction

    def name(key: str) -> str:
        prefix = {"codec": "up ", "downlink": "down "}.get(key.split(".")[0], "") if both else ""
        return prefix + key.split(".")[-1]

    return ", ".join(
        f"{name(k)}={_cell(v)}"
        for k, v in zip(keys, group, strict=True)
        if v is not None and (informative is None or k in informative)
    )


def _informative(keys: Sequence[str], groups: Sequence[tuple]) -> set[str]:
    """Keys worth a legend entry: the codec's name, and any key with two or more
    values besides n/a (a parameter only one codec has, at one value, says nothing)."""
    keep = {"codec.name", "downlink.name"}
    for i, key in enumerate(keys):
        if len({repr(g[i]) for g in groups if g[i] is not None}) > 1:
            keep.add(key)
    return keep


def accuracy_plot(
    runs: Sequence[dict[str, Any]],
    path: Path,
    key: str = "total_wire_bytes",
    label_of: Callable[[dict[str, Any]], str] | None = None,
) -> Path:
    """Accuracy (mean over seeds, shaded min..max) against mean cumulative bytes
    (``key``: total_wire_bytes, every message both ways, or uplink_codec_bytes or
    uplink_wire_bytes), one line per method and setting (runs whose files lack ``key``
    are left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys, groups = group_runs(runs)
    informative = _informative(keys, list(groups))
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (group, members) in enumerate(groups.items()):
        members = [m for m in members if cumulative(m, key) is not None]
        if not members:
            continue
        spent = np.mean([cumulative(m, key) for m in members], axis=0) / 1e6
        acc = np.array(
            [
                [np.nan if r["accuracy"] is None else r["accuracy"] for r in m["rounds"]]
                for m in members
            ]
        )
        label = label_of(members[0]) if label_of else _label(keys, group, informative)
        color = plt.cm.tab20(i % 20)
        style = "--" if "residual" in label else "-"
        ax.plot(spent, np.nanmean(acc, axis=0), style, marker=".", label=label, color=color)
        if len(members) > 1:
            ax.fill_between(
                spent, np.nanmin(acc, axis=0), np.nanmax(acc, axis=0), color=color, alpha=0.15
            )
    ax.set_xscale("log")
    ax.set_xlabel(f"cumulative {key.replace('_', ' ')} (MB, log scale)")
    ax.set_ylabel("test accuracy (mean over seeds; band: min..max)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


PLOT_KEYS = ("total_wire_bytes", "uplink_codec_bytes", "uplink_wire_bytes")


def write_report(
    runs: Sequence[dict[str, Any]],
    out_dir: Path,
    *,
    tolerance: float = 0.01,
    metrics: Sequence[str] = (),
    target: float | None = None,
) -> list[Path]:
    """``report.md`` (the per-method table over seeds, then one row per run) and one
    PNG of accuracy against cumulative uplink bytes per byte count, in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    header, rows = table_rows(runs)
    text = (
        "# Summary over seeds\n\n"
        + paired_report(runs, tolerance, metrics, target)
        + "\n# Runs\n\n"
        + markdown_table(header, rows)
    )
    report_md = out_dir / "report.md"
    report_md.write_text(text)
    plots = [accuracy_plot(runs, out_dir / f"accuracy_vs_{k}.png", k) for k in PLOT_KEYS]
    return [report_md, *plots]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="a run or multirun directory")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    parser.add_argument(
        "--paired",
        action="store_true",
        help="aggregate over seeds: means, 95%% CIs, bytes to target",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.01,
        help="target = FedAvg's mean final accuracy minus this",
    )
    parser.add_argument(
        "--target",
        type=float,
        help="with --paired/--out-dir: the target accuracy (default: FedAvg's minus --tolerance)",
    )
    parser.add_argument(
        "--leaderboard",
        action="store_true",
        help="rank recipes by total bytes to FedAvg's accuracy minus --tolerance "
        "(experiments.leaderboard); with --plot, accuracy vs total bytes of the top ones",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=1,
        help="with --leaderboard: FedAvg's accuracy is the mean of its last WINDOW rounds "
        "(its converged accuracy; default 1: the final round)",
    )
    parser.add_argument(
        "--score",
        choices=SCORES,
        default="server",
        help="with --leaderboard: whose model reaches the target: the server's (the model "
        "a user keeps) or the clients' replica",
    )
    parser.add_argument("--plot", type=Path, help="write accuracy vs uplink bytes (PNG)")
    parser.add_argument(
        "--out-dir",
        type=Path,
        help="write report.md and accuracy_vs_{total_wire,uplink_codec,uplink_wire}_bytes.png here",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        help="with --paired/--plot/--out-dir: keep the runs whose setting key=value "
        "(a,b for either; repeatable), e.g. --only fraction_train=0.25",
    )
    parser.add_argument(
        "--metric",
        action="append",
        default=[],
        help="with --paired: a per-round value to average, e.g. "
        "codec.tree.mse_vs_fp64 (repeatable)",
    )
    args = parser.parse_args(argv)
    try:
        if args.leaderboard:
            from experiments.leaderboard import leaderboard, leaderboard_plot

            runs = select(load_all(args.root), args.only)
            text = leaderboard(runs, args.tolerance, window=args.window, score=args.score)
            if args.plot:
                leaderboard_plot(
                    runs, args.plot, tolerance=args.tolerance, window=args.window, score=args.score
                )
        elif args.paired or args.plot or args.out_dir:
            runs = select(load_all(args.root), args.only)
            text = (
                paired_report(runs, args.tolerance, args.metric, args.target)
                if args.paired
                else report(args.root)
            )
            if args.plot:
                accuracy_plot(runs, args.plot)
            if args.out_dir:
                for path in write_report(
                    runs,
                    args.out_dir,
                    tolerance=args.tolerance,
                    metrics=args.metric,
                    target=args.target,
                ):
                    print(f"wrote {path}", file=sys.stderr)
        else:
            text = report(args.root)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
