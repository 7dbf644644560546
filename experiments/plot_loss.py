"""Test loss per round, one line per codec, one panel per noise level (the one-bit
experiments' loss curves).

    python -m experiments.plot_loss multirun/onebit_digits <out.png>
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from fedcomp.results_file import load_results


def _name(config: dict) -> str:
    codec = config["codec"]
    return codec["name"] + (f" ({codec.get('center')})" if codec["name"] == "onebit" else "")


def plot_loss(root: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [load_results(p) for p in sorted(root.rglob("results.json"))]
    noises = sorted({r["config"]["train"]["noise_scale"] for r in runs}, reverse=True)
    fig, axes = plt.subplots(1, len(noises), figsize=(5.5 * len(noises), 4.2), sharey=True)
    for ax, noise in zip(np.atleast_1d(axes), noises, strict=True):
        groups: dict[str, list[list[float]]] = {}
        for r in runs:
            if r["config"]["train"]["noise_scale"] == noise:
                groups.setdefault(_name(r["config"]), []).append(
                    [np.nan if x["loss"] is None else x["loss"] for x in r["rounds"]]
                )
        for name in sorted(groups):
            loss = np.array(groups[name], dtype=float)
            ax.plot(
                range(1, loss.shape[1] + 1),
                np.nanmean(loss, axis=0),
                marker=".",
                label=f"{name} ({len(loss)} seeds)",
            )
        ax.set_yscale("log")
        ax.set_title(f"{runs[0]['config']['num_clients']} clients, noise s = {noise}")
        ax.set_xlabel("round")
        ax.grid(True, alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel("test loss (mean over seeds, log scale)")
    np.atleast_1d(axes)[-1].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    print(f"wrote {plot_loss(args.root, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
