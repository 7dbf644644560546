"""Two sweeps of the same runs side by side: does a setting change what is learned?

    python -m experiments.compare_runs DIR_A DIR_B [--label-a A --label-b B] [--out FILE]

Each directory holds ``<i>/results.json`` (``experiments.presets ... --out-dir DIR``);
runs are paired by index. Per pair: the codec, the seed, every round's accuracy and
loss equal or not (bit for bit), the final accuracies, and, from the influence bounds'
round fields, the largest ``norm_ratio`` and ``consensus_ratio`` of the run and how many
weights it capped, updates it clipped and contributions it held (docs/reliability.md,
"Bounded influence").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from fedcomp.results_file import validate_results


def load_runs(directory: Path) -> dict[int, dict[str, Any]]:
    """The results of a sweep directory, by run index."""
    runs = {}
    for path in sorted(directory.glob("*/results.json")):
        runs[int(path.parent.name)] = validate_results(json.loads(path.read_text()))
    return runs


def _codec(results: dict[str, Any]) -> str:
    """The uplink codec, e.g. ``ef/sparseq fraction=0.02 bits=4``."""
    spec = dict(results["config"]["codec"])
    name = "/".join(str(spec.pop(k)) for k in ("name", "inner") if k in spec) or "?"
    shown = [f"{k}={spec[k]}" for k in ("fraction", "bits", "levels", "rank") if k in spec]
    return " ".join([name, *shown])


def _curve(results: dict[str, Any]) -> list[tuple[Any, Any]]:
    return [(r["accuracy"], r["loss"]) for r in results["rounds"]]


def _max_of(results: dict[str, Any], key: str) -> str:
    values = [r.get(key) for r in results["rounds"]]
    values = [v for v in values if v is not None]
    return f"{max(values):.2f}" if values else "n/a"


def _bound(results: dict[str, Any]) -> str:
    """Weights capped, updates clipped, contributions held, over the run."""
    return "/".join(str(sum(r.get(k, 0) for r in results["rounds"])) for k in BOUNDS)


#: The round fields counting what the influence bounds changed.
BOUNDS = ("capped", "clipped", "held")


def pair_row(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """One table row for a pair of runs of the same configuration."""
    return [
        _codec(a),
        str(a["config"]["seed"]),
        "yes" if _curve(a) == _curve(b) else "NO",
        f"{a['summary']['final_accuracy']:.4f}",
        f"{b['summary']['final_accuracy']:.4f}",
        _max_of(a, "norm_ratio"),
        _max_of(a, "consensus_ratio"),
        _bound(a),
    ]


def compare(dir_a: Path, dir_b: Path, label_a: str, label_b: str) -> str:
    """A markdown table pairing the runs of two sweep directories."""
    runs_a, runs_b = load_runs(dir_a), load_runs(dir_b)
    common = sorted(set(runs_a) & set(runs_b))
    header = [
        "codec",
        "seed",
        "every round identical",
        f"final accuracy ({label_a})",
        f"final accuracy ({label_b})",
        f"largest norm ratio ({label_a})",
        f"largest consensus ratio ({label_a})",
        f"{'/'.join(BOUNDS)} ({label_a})",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(pair_row(runs_a[i], runs_b[i])) + " |" for i in common]
    same = sum(_curve(runs_a[i]) == _curve(runs_b[i]) for i in common)
    lines.append("")
    lines.append(f"{same} of {len(common)} pairs identical in every round's accuracy and loss.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir_a", type=Path)
    parser.add_argument("dir_b", type=Path)
    parser.add_argument("--label-a", default="A")
    parser.add_argument("--label-b", default="B")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    table = compare(args.dir_a, args.dir_b, args.label_a, args.label_b)
    if args.out:
        args.out.write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
