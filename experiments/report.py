"""Turn a (multi)run directory into a markdown table, one row per run.

    python -m experiments.report multirun/2026-12-02/12-00-00 [--out table.md]

Columns: the settings that differ between runs (the sweep), final accuracy, uplink
codec and wire bytes, the compression ratio against fp32 (wire), and wall time.
Every results.json is read through fedcomp's schema validator.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedcomp.results import load_results
from fedcomp.settings import flatten

#: Settings that differ per run without being part of the sweep.
_IGNORED = {"results_path"}


def find_results(root: Path) -> list[Path]:
    """All results.json files under ``root``, in a stable order."""
    if root.is_file():
        return [root]
    return sorted(root.rglob("results.json"))


def swept_keys(configs: Sequence[dict[str, Any]]) -> list[str]:
    """Flat setting keys whose values differ between runs, in config order."""
    flats = [flatten(c) for c in configs]
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
        "uplink_codec_bytes",
        "uplink_wire_bytes",
        "ratio_vs_fp32_wire",
        "wall_s",
    ]
    rows = []
    for r in results:
        flat = flatten(r["config"])
        s = r["summary"]
        codec_bytes = sum(rnd["uplink_codec_bytes"] for rnd in r["rounds"])
        rows.append(
            [
                *(flat.get(k) for k in keys),
                s["final_accuracy"],
                codec_bytes,
                s["uplink_wire_bytes_total"],
                s["ratio_vs_fp32_wire"],
                s["wall_s"],
            ]
        )
    return header, rows


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def report(root: Path) -> str:
    """The markdown report for every run under ``root``."""
    header, rows = table_rows(load_all(root))
    return markdown_table(header, rows)


def load_all(root: Path) -> list[dict[str, Any]]:
    """Every results.json under ``root``, validated."""
    paths = find_results(root)
    if not paths:
        raise FileNotFoundError(f"no results.json under {root}")
    return [load_results(p) for p in paths]


def t_half_width(values: Sequence[float], confidence: float = 0.95) -> float | None:
    """Half-width of the Student-t confidence interval of the mean (None for n < 2)."""
    if len(values) < 2:
        return None
    from scipy import stats

    n = len(values)
    return float(stats.t.ppf(0.5 + confidence / 2, n - 1) * np.std(values, ddof=1) / np.sqrt(n))


def cumulative(run: dict[str, Any], key: str) -> np.ndarray:
    return np.cumsum([rnd[key] for rnd in run["rounds"]])


def bytes_to_reach(run: dict[str, Any], target: float, key: str) -> int | None:
    """Cumulative ``key`` bytes at the first round whose accuracy reaches ``target``."""
    total = cumulative(run, key)
    for rnd, spent in zip(run["rounds"], total, strict=True):
        if rnd["accuracy"] is not None and rnd["accuracy"] >= target:
            return int(spent)
    return None


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


def paired_report(
    runs: Sequence[dict[str, Any]], tolerance: float = 0.01, metrics: Sequence[str] = ()
) -> str:
    """Mean over seeds with 95% CIs, bytes to reach FedAvg's accuracy, and paired
    residual-minus-direct differences (same seed, bits and other settings)."""
    keys = [k for k in swept_keys([r["config"] for r in runs]) if k != "seed"]
    method_keys = [k for k in keys if k.startswith("codec.")]
    setting_keys = [k for k in keys if not k.startswith("codec.")]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault(_group_key(run, keys), []).append(run)
    # Target per setting: FedAvg (fp32 codec) mean final accuracy minus the tolerance.
    targets = {}
    for run in runs:
        if run["config"]["codec"]["name"] == "fp32":
            targets.setdefault(_group_key(run, setting_keys), []).append(
                run["summary"]["final_accuracy"]
            )
    targets = {k: float(np.mean(v)) - tolerance for k, v in targets.items()}
    lines = [
        f"| {' | '.join(keys)} | seeds | final accuracy (95% CI) | uplink codec MB "
        f"| uplink wire MB | codec MB to reach FedAvg - {tolerance:g} (seeds reaching) |"
        + "".join(f" {m} |" for m in metrics),
        "|" + "---|" * (len(keys) + 5 + len(metrics)),
    ]
    for key, members in sorted(groups.items(), key=lambda kv: [str(v) for v in kv[0]]):
        finals = [m["summary"]["final_accuracy"] for m in members]
        half = t_half_width(finals)
        codec_mb = np.mean([cumulative(m, "uplink_codec_bytes")[-1] for m in members]) / 1e6
        wire_mb = np.mean([m["summary"]["uplink_wire_bytes_total"] for m in members]) / 1e6
        target = targets.get(_group_key(members[0], setting_keys))
        reached = [
            b
            for m in members
            if target is not None
            and (b := bytes_to_reach(m, target, "uplink_codec_bytes")) is not None
        ]
        to_target = (
            f"{np.median(reached) / 1e6:.2f} ({len(reached)}/{len(members)})"
            if target is not None and reached
            else f"n/a (0/{len(members)})"
        )
        ci = f" +- {half:.4f}" if half is not None else ""
        extra = ""
        for metric in metrics:
            values = [v for m in members if (v := round_metric(m, metric)) is not None]
            extra += f" {np.mean(values):.3g} |" if values else " n/a |"
        lines.append(
            f"| {' | '.join(_cell(v) for v in key)} | {len(members)} | {np.mean(finals):.4f}{ci} "
            f"| {codec_mb:.2f} | {wire_mb:.2f} | {to_target} |{extra}"
        )
    lines += ["", _paired_differences(runs, setting_keys, method_keys)]
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
        f"| bits | {' | '.join(setting_keys)} | pairs | mean difference (95% CI) |",
        "|---|" + "---|" * (len(setting_keys) + 2),
    ]
    by_group: dict[tuple, list[float]] = {}
    for bits, setting, diff in rows:
        by_group.setdefault((bits, setting), []).append(diff)
    for (bits, setting), diffs in sorted(by_group.items(), key=lambda kv: str(kv[0])):
        half = t_half_width(diffs)
        ci = f" +- {half:.4f}" if half is not None else ""
        lines.append(
            f"| {bits} | {' | '.join(_cell(v) for v in setting)} | {len(diffs)} "
            f"| {np.mean(diffs):+.4f}{ci} |"
        )
    return "\n".join(lines)


def accuracy_plot(
    runs: Sequence[dict[str, Any]], path: Path, key: str = "uplink_codec_bytes"
) -> Path:
    """Mean accuracy against mean cumulative uplink bytes, one line per group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in swept_keys([r["config"] for r in runs]) if k != "seed"]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault(_group_key(run, keys), []).append(run)
    fig, ax = plt.subplots(figsize=(8, 5))
    for group, members in sorted(groups.items(), key=lambda kv: [str(v) for v in kv[0]]):
        spent = np.mean([cumulative(m, key) for m in members], axis=0)
        acc = np.mean([[r["accuracy"] for r in m["rounds"]] for m in members], axis=0)
        label = ", ".join(
            f"{k.split('.')[-1]}={_cell(v)}"
            for k, v in zip(keys, group, strict=True)
            if v is not None
        )
        style = "--" if "residual" in label else "-"
        ax.plot(
            spent / 1e6, acc, style, marker=".", label=label, color=plt.cm.tab20(len(ax.lines) % 20)
        )
    ax.set_xscale("log")
    ax.set_xlabel(f"cumulative {key.replace('_', ' ')} (MB, log scale)")
    ax.set_ylabel("test accuracy (mean over seeds)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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
    parser.add_argument("--plot", type=Path, help="write accuracy vs uplink bytes (PNG)")
    parser.add_argument(
        "--metric",
        action="append",
        default=[],
        help="with --paired: a per-round value to average, e.g. "
        "codec.tree.mse_vs_fp64 (repeatable)",
    )
    args = parser.parse_args(argv)
    try:
        if args.paired or args.plot:
            runs = load_all(args.root)
            text = (
                paired_report(runs, args.tolerance, args.metric)
                if args.paired
                else report(args.root)
            )
            if args.plot:
                accuracy_plot(runs, args.plot)
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
