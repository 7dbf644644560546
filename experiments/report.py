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
    paths = find_results(root)
    if not paths:
        raise FileNotFoundError(f"no results.json under {root}")
    header, rows = table_rows([load_results(p) for p in paths])
    return markdown_table(header, rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="a run or multirun directory")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    try:
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
