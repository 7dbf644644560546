"""The server at scale: n replies of a ResNet-18-sized model through the real wrapper.

    python -m experiments.bench_scale [--clients 100 1000] [--numel 11200000] [--out FILE.md]

No Ray, no training: a grid whose nodes answer each train instruction through the
real ``CompressionMod`` with a synthetic update (a shared random direction scaled per
client), so the replies are real fedcomp payloads and the server's path is the real
one (validation, decoding, outlier norms, the streaming pre-aggregated mean). The
grid keeps only the compressed replies. Measured per codec and n: the server's
``aggregate_train`` time (per client) and its peak resident memory above the start of
the aggregation, measured by the kernel (VmHWM reset), against the compressed replies'
size. Side by side at n = 100: Flower's dense ``aggregate_arrayrecords`` on the same
updates as dense arrays.

Targets (benchmark, not tests): at n = 1,000 the peak at most the compressed replies
plus 3 GB; time per client flat from 100 to 1,000; the plain mean no slower per client
than Flower's dense aggregation.
"""

from __future__ import annotations

import argparse
import gc
import platform
import time
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from experiments.inprocess import set_task_identity
from experiments.memory import peak_rss, reset_peak_rss
from experiments.runtime import emit
from fedcomp.flower import CompressedStrategy, CompressionMod
from fedcomp.flower.identity import identity_reply, is_identity_message
from fedcomp.flower.options import IdentityOptions, ServerOptions
from fedcomp.handoff_options import Aggregation
from fedcomp.trees.aggregate import TreeConfig

SIGN = {"name": "sign", "block": 1024}

#: (label, codec, aggregation settings, most clients): the streaming plain mean, trees
#: evaluated as the replies are loaded, and the one-bit joint decoder (per chunk of
#: coordinates; 100 clients only: encoding each synthetic reply takes about 1.3 s).
CASES = [
    ("sign", SIGN, {}, None),
    ("uniform 8-bit", {"name": "uniform", "bits": 8, "block": 256}, {}, None),
    (
        "sign, balanced bf16 tree",
        SIGN,
        {"tree": "balanced", "dtype": "bf16", "root_fp32": True},
        None,
    ),
    ("sign, huffman fp32 tree", SIGN, {"tree": "huffman"}, None),
    ("one-bit", {"name": "onebit"}, {}, 100),
]


class SyntheticGrid:
    """Nodes that answer through the real mod with ``global + (1 + i/n) * direction``."""

    def __init__(self, n: int, direction: np.ndarray) -> None:
        self.n, self.direction = n, direction
        self.mod = CompressionMod(measure_error=False)
        self.contexts = {
            10_000 + i: Context(
                run_id=1,
                node_id=10_000 + i,
                node_config={"partition-id": i, "num-partitions": n},
                state=RecordDict(),
                run_config={},
            )
            for i in range(n)
        }

    def get_node_ids(self):
        return list(self.contexts)

    def _train(self, msg: Message, context: Context) -> Message:
        ((_, arrays),) = msg.content.array_records.items()
        i = int(context.node_config["partition-id"])
        trained = {
            k: Array(np.asarray(v.numpy()) + (1 + i / self.n) * self.direction.reshape(v.shape))
            for k, v in arrays.items()
        }
        content = RecordDict(
            {"arrays": ArrayRecord(trained), "metrics": MetricRecord({"num-examples": 10})}
        )
        return Message(content, reply_to=msg)

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for msg in messages:
            context = self.contexts[msg.metadata.dst_node_id]
            if is_identity_message(msg):
                replies.append(identity_reply(msg, context, "train,evaluate"))
                continue
            replies.append(self.mod(msg, context, self._train))
        return replies


def fixed_mmap_threshold(limit: int = 128 << 10) -> bool:
    """Make glibc serve every allocation above ``limit`` with its own mapping and give
    it back when freed. By default glibc raises that threshold after the first large
    free (up to 32 MB), and then keeps freed model-sized buffers in its heap: measured
    here, a process that encodes and decodes many models grows by about one model's
    worth of bytes per client in RSS without holding any of them (malloc_trim returns
    it). Returns False where glibc's mallopt is not available."""
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, limit))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def run(codec: dict, n: int, numel: int, trees: dict | None = None) -> dict:
    direction = np.random.default_rng(0).standard_normal(numel).astype(np.float32) * 1e-3
    grid = SyntheticGrid(n, direction)
    strategy = CompressedStrategy(
        FedAvg(fraction_evaluate=0.0, min_available_nodes=n),
        codec=codec,
        options=ServerOptions(
            aggregation=Aggregation(handoff="pre_aggregated", trees=TreeConfig(**(trees or {}))),
            identity=IdentityOptions(timeout=30),
        ),
    )
    measured: dict = {}
    aggregate = strategy.aggregate_train

    def timed(server_round, replies):
        replies = list(replies)
        measured["compressed"] = sum(
            len(a.data)
            for r in replies
            for rec in r.content.array_records.values()
            for a in rec.values()
        )
        # The previous case's objects, freed only when the cyclic collector runs, would
        # otherwise be freed during this aggregation and hide part of its peak.
        gc.collect()
        reset_peak_rss()
        base = peak_rss()
        t0 = time.perf_counter()
        out = aggregate(server_round, replies)
        measured["seconds"] = time.perf_counter() - t0
        measured["peak"] = max(0, peak_rss() - base)
        return out

    strategy.aggregate_train = timed  # type: ignore[method-assign]
    initial = ArrayRecord({"w": Array(np.zeros(numel, dtype=np.float32))})
    strategy.start(grid, initial, num_rounds=1)
    record = strategy.rounds[0]
    assert record["replied"] == n, record
    measured["tree"] = record["codec"].get("tree", {})
    return measured


def flower_dense(n: int, numel: int) -> float:
    """Flower's own FedAvg aggregation of n dense float32 updates (time in seconds)."""
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    direction = np.random.default_rng(0).standard_normal(numel).astype(np.float32)
    records = [
        RecordDict(
            {
                "arrays": ArrayRecord({"w": Array((1 + i / n) * direction)}),
                "metrics": MetricRecord({"num-examples": 10}),
                "config": ConfigRecord({}),
            }
        )
        for i in range(n)
    ]
    t0 = time.perf_counter()
    aggregate_arrayrecords(records, "num-examples")
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--numel", type=int, default=11_200_000)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--cases", nargs="*", help="labels of CASES to run (default: all)")
    args = parser.parse_args(argv)
    set_task_identity()
    fixed_mmap_threshold()
    lines = [
        "# The server at scale (python -m experiments.bench_scale)",
        "",
        f"Machine: {platform.processor() or platform.machine()}; one tensor of "
        f"{args.numel:,} float32 coordinates (ResNet-18 has 11.2M), pre-aggregated "
        "hand-off, FedAvg.",
        "",
        "| case | clients | compressed replies MB | aggregate s | ms per client "
        "| peak above start MB | peak <= replies + 3 GB | live partial sums (MB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, codec, trees, most in CASES:
        if args.cases and label not in args.cases:
            continue
        for n in args.clients:
            if most is not None and n > most:
                continue
            m = run(codec, n, args.numel, trees)
            ok = m["peak"] <= m["compressed"] + (3 << 30)
            tree = m["tree"]
            live = (
                f"{tree['live_partial_sums']} ({tree['live_partial_sum_bytes'] / 1e6:.0f})"
                if "live_partial_sums" in tree
                else "-"
            )
            lines.append(
                f"| {label} | {n} | {m['compressed'] / 1e6:.0f} | {m['seconds']:.1f} "
                f"| {1e3 * m['seconds'] / n:.1f} | {m['peak'] / 1e6:.0f} | "
                f"{'met' if ok else 'MISSED'} | {live} |"
            )
            print(lines[-1], flush=True)
    n0 = min(args.clients)
    dense = flower_dense(n0, args.numel)
    lines += [
        "",
        f"Flower's dense aggregate_arrayrecords of {n0} float32 updates of the same size: "
        f"{dense:.1f} s ({1e3 * dense / n0:.1f} ms per client; the dense updates alone "
        f"take {4 * n0 * args.numel / 1e9:.1f} GB).",
    ]
    emit("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
