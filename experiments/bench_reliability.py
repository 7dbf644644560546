"""Reliability benchmark: hostile input against the server's decoders and wrapper.

Three measurements, all in this process, summarized in markdown:

1. Fuzz cases per decoder: seeded random mutations of a valid payload (experiments.
   fuzzing), each through the server's path (the payload checked against the codec
   spec the server sent, then decoded) under an address-space cap; the outcomes counted
   by failure kind. Any other exception is a bug and fails the run.
2. Peak memory per decode relative to the tensor's float32 size, per codec, on a
   2^22-element tensor (the kernel's peak RSS during the decode), and for the 8.6 GB
   block-size bomb of issue 18 on a 77-element tensor.
3. Hostile clients: one round of 10 honest and 3 hostile clients per behaviour
   (experiments.hostile): what was rejected, whether the aggregate equals the round
   in which the hostile replies were lost, and the server's peak while aggregating.

Usage: ``python -m experiments.bench_reliability --out experiments/results/reliability_bench.md``
"""

from __future__ import annotations

import argparse
import functools
import logging
import struct
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from experiments.fuzzing import mutate, random_ops
from experiments.hostile import (
    ONEBIT,
    SCENARIOS,
    UNIFORM,
    onebit_bomb,
    run_round,
    same_arrays,
)
from experiments.inprocess import set_task_identity
from experiments.memory import address_space_cap, exact_peaks, peak_rss, reset_peak_rss
from experiments.runtime import emit
from fedcomp.codecs import TensorPolicy, make_codec
from fedcomp.failures import Rejection
from fedcomp.flower.validation import decode_payloads
from fedcomp.rng import derive_seed

SPECS = [
    {"name": "raw"},
    {"name": "fp32"},
    {"name": "fp16"},
    {"name": "bf16"},
    {"name": "uniform", "bits": 4, "block": 256},
    {"name": "dither", "bits": 2, "block": 64},
    {"name": "qsgd", "levels": 16, "block": 1024},
    {"name": "sign", "block": 1024},
    {"name": "topk", "fraction": 0.01},
    {"name": "randk", "fraction": 0.01},
]
RUN_SEED, ROUND, CLIENT, NAME = 0, 1, 3, "w"


def _codec(spec):
    return make_codec(spec["name"], **{k: v for k, v in spec.items() if k != "name"})


def _tensor(spec, numel: int) -> torch.Tensor:
    if spec["name"] == "raw":
        return torch.arange(numel, dtype=torch.int64)
    return torch.randn(numel, generator=torch.Generator().manual_seed(0))


def _server_decode(spec, buf: bytes, reference: np.ndarray) -> None:
    decode_payloads(
        ArrayRecord({NAME: Array(dtype="uint8", shape=(len(buf),), stype="raw", data=buf)}),
        {NAME: reference},
        codec=_codec(spec),
        policy=TensorPolicy(min_numel=0),
        run_seed=RUN_SEED,
        server_round=ROUND,
        stable_id=CLIENT,
    )


def _valid(spec, numel: int) -> tuple[bytes, np.ndarray]:
    x = _tensor(spec, numel)
    seed = derive_seed(RUN_SEED, ROUND, CLIENT, NAME)
    return bytes(_codec(spec).encode(x, seed=seed)), x.numpy()


def fuzz(cases: int, seed: int) -> list[str]:
    """Rows: decoder, cases, decoded, rejected by kind, seconds."""
    rows = ["| decoder | cases | decoded | rejected, by kind | s |", "|---|---|---|---|---|"]
    for spec in SPECS:
        valid, reference = _valid(spec, 77)
        rng = np.random.default_rng([seed, len(rows)])
        outcomes: Counter[str] = Counter()
        t0 = time.perf_counter()
        with address_space_cap(256 << 20):
            for _ in range(cases):
                buf = valid
                for op in random_ops(rng):
                    buf = mutate(buf, op)
                try:
                    _server_decode(spec, buf, reference)
                    outcomes["decoded"] += 1
                except Rejection as exc:
                    outcomes[str(exc.kind)] += 1
        seconds = time.perf_counter() - t0
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()) if k != "decoded")
        rows.append(
            f"| {_label(spec)} | {cases} | {outcomes['decoded']} | {kinds} | {seconds:.1f} |"
        )
    return rows


def _label(spec) -> str:
    return " ".join(f"{v}" if k == "name" else f"{k}={v}" for k, v in spec.items())


def _peak_of(fn) -> int:
    reset_peak_rss()
    base = peak_rss()
    fn()
    return max(0, peak_rss() - base)  # the mark was reset to the RSS at ``base``


def decode_memory(numel: int) -> list[str]:
    """Rows: codec, payload bytes, peak bytes of one server-side decode / 4 numel."""
    size = f"{4 * numel / 2**20:g} MiB"
    rows = [
        f"| codec | payload bytes | decode peak (MiB) | peak / float32 tensor ({size}) |",
        "|---|---|---|---|",
    ]
    for spec in SPECS:
        buf, reference = _valid(spec, numel)
        decode = functools.partial(_server_decode, spec, buf, reference)
        peak = max(_peak_of(decode) for _ in range(2))
        rows.append(
            f"| {_label(spec)} | {len(buf)} | {peak / 2**20:.1f} | {peak / (4 * numel):.2f} |"
        )
    return rows


def bomb() -> list[str]:
    """The issue's case: 77 values, uniform 8-bit block 256, block field = 2^31 - 1."""
    spec = {"name": "uniform", "bits": 8, "block": 256}
    buf, reference = _valid(spec, 77)
    bad = bytearray(buf)
    struct.pack_into("<I", bad, 20 + 2, 2**31 - 1)  # 1-d: the body starts at byte 20
    from fedcomp.codecs import decode_bytes

    outcome: list[str] = []

    def server() -> None:
        try:
            _server_decode(spec, bytes(bad), reference)
        except Rejection as exc:
            outcome.append(f"{exc.kind}: {exc}")

    context_free = _peak_of(lambda: decode_bytes(bytes(bad), max_numel=77))
    checked = _peak_of(server)
    return [
        f"- context-free `decode_bytes` (no spec): decodes 77 values, peak "
        f"{context_free / 2**20:.2f} MiB (was an 8.6 GB allocation)",
        f"- server path: rejected as `{outcome[0]}`, peak {checked / 2**20:.2f} MiB",
    ]


def hostile() -> list[str]:
    rows = [
        "| codec | behaviour | replied | rejected | aggregate == lost round | "
        "aggregation peak (MiB) | honest-only peak (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    cases = [(UNIFORM, "per_client", b) for b, _, _ in SCENARIOS]
    cases.append((ONEBIT, "pre_aggregated", onebit_bomb))
    lost = {}
    for codec, handoff, behaviour in cases:
        key = codec["name"]
        if key not in lost:
            lost[key] = run_round(codec, None, handoff=handoff)
        _, lost_result, lost_peak = lost[key]
        strategy, result, peak = run_round(codec, behaviour, handoff=handoff)
        record = strategy.rounds[-1]
        rejected = ", ".join(f"{k} {v}" for k, v in sorted(record["rejected"].items()))
        rows.append(
            f"| {key} | {behaviour.__name__} | {record['replied']}/{record['selected']} | "
            f"{rejected} | {same_arrays(result.arrays, lost_result.arrays)} | "
            f"{peak / 2**20:.1f} | {lost_peak / 2**20:.1f} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--numel", type=int, default=1 << 22)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # thousands of rejections are the point here
    set_task_identity()
    if not exact_peaks():
        print("warning: cannot fix the malloc mmap threshold; peaks may read low")
    t0 = time.perf_counter()
    lines = [
        "# Reliability benchmark: hostile payloads and clients",
        "",
        "Reproduce: `python -m experiments.bench_reliability --out "
        f"experiments/results/reliability_bench.md` (cases {args.cases}, seed {args.seed}).",
        "",
        "## Fuzz cases per decoder (server path, 256 MiB address-space headroom)",
        "",
        *fuzz(args.cases, args.seed),
        "",
        f"## Peak memory of one server-side decode ({args.numel} elements)",
        "",
        *decode_memory(args.numel),
        "",
        "## The block-size bomb (77 values, block field 2^31 - 1)",
        "",
        *bomb(),
        "",
        "## Hostile clients (10 honest + 3 hostile, one round, in process)",
        "",
        *hostile(),
        "",
        f"Wall time {time.perf_counter() - t0:.0f} s.",
    ]
    emit("\n".join(lines) + "\n", Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
