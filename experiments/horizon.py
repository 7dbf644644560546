"""The converged horizon of a FedAvg run: its accuracy curve, the trailing mean, and the
round from which it gains less than a set amount over the next rounds (issue 42).

    python -m experiments.horizon RUN_DIR [RUN_DIR ...] [--plot FILE.png]

Each RUN_DIR holds a results.json of FedAvg run long enough to plateau. The rule, per
run: the 20-round trailing mean accuracy at round t, m(t); the run has plateaued from
the first round t at which m(t + 50) - m(t) < 0.005 (half a point over 50 rounds). The
converged accuracy is the mean of the last 50 rounds; the target one point below it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedcomp.results_file import load_results

TRAIL, AHEAD, GAIN, LAST = 20, 50, 0.005, 50


def trailing_mean(accuracy: Sequence[float], width: int = TRAIL) -> np.ndarray:
    """m(t): the mean of rounds max(1, t - width + 1) .. t."""
    acc = np.asarray(accuracy, dtype=np.float64)
    sums = np.concatenate([[0.0], np.cumsum(acc)])
    starts = np.maximum(np.arange(len(acc)) - width + 1, 0)
    return (sums[1:] - sums[starts]) / (np.arange(len(acc)) - starts + 1)


def plateau_round(accuracy: Sequence[float]) -> int | None:
    """The first round t (1-based) with m(t + AHEAD) - m(t) < GAIN, or None."""
    m = trailing_mean(accuracy)
    for t in range(TRAIL - 1, len(m) - AHEAD):
        if m[t + AHEAD] - m[t] < GAIN:
            return t + 1
    return None


def describe(path: Path) -> dict[str, float | int | None]:
    results = load_results(path / "results.json")
    accuracy = [r["accuracy"] for r in results["rounds"]]
    converged = float(np.mean(accuracy[-LAST:]))
    first = next((i + 1 for i, a in enumerate(accuracy) if a >= converged - 0.01), None)
    return {
        "rounds": len(accuracy),
        "plateau": plateau_round(accuracy),
        "converged": converged,
        "target_first_reached": first,
        "best": float(max(accuracy)),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args(argv)
    print(
        "| run | rounds | plateau from round | converged (last 50) "
        "| its own target first at | best |"
    )
    print("|---|---|---|---|---|---|")
    for run in args.runs:
        d = describe(run)
        print(
            f"| {run} | {d['rounds']} | {d['plateau']} | {d['converged']:.4f} "
            f"| {d['target_first_reached']} | {d['best']:.4f} |"
        )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        for run in args.runs:
            acc = [r["accuracy"] for r in load_results(run / "results.json")["rounds"]]
            rounds = np.arange(1, len(acc) + 1)
            line = ax.plot(rounds, acc, alpha=0.35, lw=0.8)[0]
            ax.plot(rounds, trailing_mean(acc), color=line.get_color(), lw=1.6, label=str(run))
            if (t := plateau_round(acc)) is not None:
                ax.axvline(t, color=line.get_color(), ls=":", lw=1)
        ax.set_xlabel("round")
        ax.set_ylabel("central accuracy (thin) and 20-round trailing mean")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
