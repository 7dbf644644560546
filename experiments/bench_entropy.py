"""The lossless stage (codec.entropy=zstd): its gain per codec on real updates.

    python -m experiments.bench_entropy [--clients 4] [--out FILE.md]

Real updates: round 2 of the default digits job, in process (each client's trained
model minus the global one, flattened). Each codec encodes every client's update with
and without ``entropy=zstd``; the table gives the payload bytes (summed over the
clients), the stage's gain (bytes without / bytes with) and the zstd time. Expect ~1x
for codes whose bits are close to uniformly random (stochastic rounding, dither, sign
bits) and a real gain for skewed codes (Lloyd-Max levels, top-k index gaps, floats).
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch

from experiments.bench_aggregation import real_updates
from experiments.runtime import emit
from fedcomp.codecs import make_codec_from_spec

SPECS: list[dict] = [
    {"name": "fp32"},
    {"name": "fp16"},
    {"name": "uniform", "bits": 8, "block": 256},
    {"name": "uniform", "bits": 2, "block": 256},
    {"name": "dither", "bits": 2, "block": 256},
    {"name": "qsgd", "levels": 16, "block": 1024},
    {"name": "sign", "block": 1024},
    {"name": "topk", "fraction": 0.01},
    {"name": "eden", "bits": 1},
    {"name": "eden", "bits": 4},
]


def label(spec: dict) -> str:
    return " ".join(f"{k}={v}" if k != "name" else str(v) for k, v in spec.items())


def rows(updates: torch.Tensor) -> list[str]:
    lines = [
        "| codec | bytes | with zstd | gain | zstd encode + decode s |",
        "|---|---|---|---|---|",
    ]
    for spec in SPECS:
        plain, staged = (
            make_codec_from_spec(spec),
            make_codec_from_spec({**spec, "entropy": "zstd"}),
        )
        sizes = [0, 0]
        elapsed = 0.0
        for i, x in enumerate(updates):
            sizes[0] += len(bytes(plain.encode(x, seed=i)))
            t0 = time.perf_counter()
            payload = staged.encode(x, seed=i)
            staged.decode(payload)
            elapsed += time.perf_counter() - t0
            sizes[1] += len(bytes(payload))
        lines.append(
            f"| {label(spec)} | {sizes[0]:,} | {sizes[1]:,} | {sizes[0] / sizes[1]:.3f}x | "
            f"{elapsed:.3f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    updates = real_updates(args.clients)
    lines = [
        "# The lossless stage on real updates (python -m experiments.bench_entropy)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, torch {torch.__version__}. "
        f"{updates.shape[0]} clients' round-2 updates of the default digits job, "
        f"{updates.shape[1]:,} coordinates each (one flattened tensor per client); zstd "
        "level 3; bytes are whole payloads (header included).",
        "",
        *rows(updates),
    ]
    emit("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
