"""Behaviour unchanged? A fixed list of runs, recorded round by round, compared with a record.

    python -m experiments.behaviour record OUT.json [--only NAME ...]
    python -m experiments.behaviour compare BEFORE.json AFTER.json

Each run drives the real ClientApp and ServerApp in one process (experiments.inprocess,
no Ray: the same updates as a simulation, deterministic on one machine) and records,
per round, the centralized and client accuracy and loss and every message kind's
count and bytes. ``compare`` fails (exit 1) if any accuracy or loss differs by a
single bit; byte counts may differ, and each difference is listed with its round and
message kind, so a refactoring that changes a message's size says so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from experiments.runtime import PROJECT_ROOT
from fedcomp.failures import RunFailed

#: name -> Hydra overrides of the main job (conf/config.yaml), or None for the
#: quickstart example (examples/quickstart_fedcomp), driven in process too.
RUNS: dict[str, list[str] | None] = {
    "default": [],
    "residual4_eden1_fedavgm_half": [
        "codec=residual4",
        "downlink=eden1",
        "strategy=fedavgm",
        "fraction_train=0.5",
        "num_rounds=6",
    ],
    "ef_sparseq2_16": ["recipe=ef_sparseq2", "num_clients=16", "num_rounds=6"],
    "bf16_adaptive_fedadam": [
        "codec=bf16",
        "aggregation=bf16_adaptive",
        "strategy=fedadam",
        "num_rounds=6",
    ],
    "onebit_120_pre_aggregated": [
        "codec=onebit",
        "aggregation=pre_aggregated",
        "num_clients=120",
        "partition=iid",  # Dirichlet draws fail with 120 clients of 1,797 digits
        "num_rounds=3",
        "train.local_epochs=1",
        # 3 short rounds do not learn (accuracy 0.07): compared bit for bit all the same
        "learning_check=false",
    ],
    "quickstart": None,
}

#: Round fields that must be identical, bit for bit.
EXACT = ("accuracy", "loss", "client_accuracy", "client_loss", "selected", "replied", "failures")


def node_ids(n: int) -> list[int]:
    """Distinct Flower-like node ids, unrelated to the partition ids."""
    return [1_000_003 + 7_919 * i * i for i in range(n)]


def _round_row(record: dict[str, Any]) -> dict[str, Any]:
    row = {k: record.get(k) for k in EXACT}
    row["traffic"] = {
        kind: [v["messages"], v["wire_bytes"]] for kind, v in record.get("traffic", {}).items()
    }
    return row


def run_job(overrides: list[str]) -> list[dict[str, Any]]:
    """One job of the main experiment, in process; its rounds."""
    from hydra import compose, initialize_config_dir

    from clients.client_app import make_client_app
    from experiments.inprocess import InProcessGrid
    from experiments.run import CONF_DIR, settings_from_cfg
    from strategies.server_app import run_server

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    settings = settings_from_cfg(cfg)
    grid = InProcessGrid(
        make_client_app(), settings.num_clients, node_ids=node_ids(settings.num_clients)
    )
    results = run_server(grid, settings)
    return [_round_row(r) for r in results["rounds"]]


def run_quickstart(num_rounds: int = 3, num_nodes: int = 4) -> list[dict[str, Any]]:
    """The README's two-line drop-in (examples/quickstart_fedcomp): its ServerApp's
    strategy and its ClientApp, with the example's run config."""
    example = PROJECT_ROOT / "examples" / "quickstart_fedcomp"
    sys.path.insert(0, str(example))
    try:
        from flwr.app import ArrayRecord, ConfigRecord
        from flwr.serverapp.strategy import FedAvg
        from quickstart_fedcomp.client_app import app
        from quickstart_fedcomp.task import Net

        from experiments.inprocess import InProcessGrid
        from fedcomp.flower import CompressedStrategy
        from fedcomp.observers import Reporting
    finally:
        sys.path.remove(str(example))
    run_config = {"local-epochs": 1, "lr": 0.1, "fraction-evaluate": 0.5}
    grid = InProcessGrid(app, num_nodes, node_ids=node_ids(num_nodes))
    for context in grid.contexts.values():
        context.run_config.update(run_config)
    records: list[dict[str, Any]] = []
    torch.manual_seed(0)
    strategy = CompressedStrategy(  # as examples/quickstart_fedcomp/.../server_app.py
        FedAvg(fraction_evaluate=run_config["fraction-evaluate"]),
        codec={"name": "uniform", "bits": 2},
        downlink={"name": "uniform", "bits": 4},
        reporting=Reporting(on_round=records.append),  # to record the rounds
    )
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(Net().state_dict()),
        train_config=ConfigRecord({"lr": run_config["lr"]}),
        num_rounds=num_rounds,
    )
    return [_round_row(r) for r in records]


def record(out: Path, only: list[str]) -> None:
    from experiments.inprocess import set_task_identity

    set_task_identity()  # Flower's run identity, which its runtimes set
    runs: dict[str, Any] = {}
    for name, overrides in RUNS.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        try:
            rounds = run_quickstart() if overrides is None else run_job(overrides)
            runs[name] = {"overrides": overrides, "rounds": rounds}
        except RunFailed as exc:  # how a run fails is behaviour too: compared as well
            runs[name] = {"overrides": overrides, "rounds": [], "failed": str(exc)}
        took = time.perf_counter() - t0
        print(f"{name}: {len(runs[name]['rounds'])} rounds in {took:.1f} s", flush=True)
        out.write_text(json.dumps(runs, indent=1) + "\n")  # after each run


def compare(before: dict[str, Any], after: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(differences in what was learned, differences in bytes), one line each."""
    learned, bytes_ = [], []
    for name, old in before.items():
        new = after.get(name)
        if new is None:
            learned.append(f"{name}: not in the new record")
            continue
        if old.get("failed") != new.get("failed"):
            learned.append(f"{name}: failed {old.get('failed')!r} -> {new.get('failed')!r}")
        if len(old["rounds"]) != len(new["rounds"]):
            learned.append(f"{name}: {len(old['rounds'])} rounds before, {len(new['rounds'])} now")
            continue
        for i, (a, b) in enumerate(zip(old["rounds"], new["rounds"], strict=True), start=1):
            for key in EXACT:
                if a[key] != b[key]:
                    learned.append(f"{name} round {i}: {key} {a[key]!r} -> {b[key]!r}")
            for kind in sorted(set(a["traffic"]) | set(b["traffic"])):
                x, y = a["traffic"].get(kind), b["traffic"].get(kind)
                if x != y:
                    bytes_.append(f"{name} round {i}: {kind} [messages, bytes] {x} -> {y}")
    return learned, bytes_


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("out", type=Path)
    rec.add_argument("--only", nargs="*", default=[], choices=list(RUNS))
    cmp_ = sub.add_parser("compare")
    cmp_.add_argument("before", type=Path)
    cmp_.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    if args.command == "record":
        record(args.out, args.only)
        return 0
    load: Callable[[Path], dict] = lambda p: json.loads(p.read_text())  # noqa: E731
    learned, bytes_ = compare(load(args.before), load(args.after))
    for line in bytes_:
        print("bytes:", line)
    for line in learned:
        print("LEARNED DIFFERENTLY:", line)
    print(f"{len(learned)} difference(s) in what was learned, {len(bytes_)} in bytes")
    return 1 if learned else 0


if __name__ == "__main__":
    sys.exit(main())
