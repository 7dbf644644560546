"""Influence attacks on whole runs: some clients train honestly, then scale their update
and lie about their weight, through the real apps in one process.

    python -m experiments.attacks [--rounds 10] [--seeds 0 1 2] [--clients 10 2]
                                  [--out FILE.md] [--json FILE]

Each attack is an inner client mod (it sees the dense trained model, inside the
compression mod, so the reply is encoded honestly): the hostile client's update
``trained - received`` is multiplied by ``factor`` and its ``num-examples`` replaced by
``claim``, from round ``start`` on. The job is the default one (digits, Dirichlet 0.3,
the MLP, 5 local epochs) at 10 and at 2 clients, run with the project's ServerApp under
the influence defaults (central evaluation every round, no client evaluation). Two
baselines run beside the attacks: the honest run, and the run in which the hostile
clients' replies are lost ("silent": the best any defence can do is to ignore them).
The summary compares every round's central loss with both (docs/reliability.md,
"Bounded influence"; experiments/results/influence_attacks.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MessageType, MetricRecord

from fedcomp.failures import RunFailed
from fedcomp.keys import KEY_NUM_EXAMPLES, KEY_ROUND
from fedcomp.settings import Settings, settings_from_dict


@dataclass(frozen=True)
class Attack:
    """What the hostile clients send: ``factor`` x their honest update, claiming
    ``claim`` examples (None: their true count), from round ``start`` on; ``hostile``:
    how many of the n clients (``"half"``: ceil(n / 2)); ``silent``: their replies are
    lost instead (the baseline)."""

    name: str
    factor: float = 1.0
    claim: float | None = None
    hostile: int | str = 1
    start: int = 1
    silent: bool = False

    def hostile_ids(self, num_clients: int) -> set[int]:
        count = math.ceil(num_clients / 2) if self.hostile == "half" else int(self.hostile)
        return set(range(num_clients - count, num_clients))


#: The attacks of issue 41's findings 3 and 5, from the first round and from the third
#: (after honest rounds have given the server a reference norm to fall back on).
ATTACKS = (
    Attack("reverse x100, claims 1e9", -100.0, 1e9),
    Attack("near zero, claims 1e9", 1e-6, 1e9),
    Attack("reverse x100, honest weight", -100.0),
    Attack("half send near zero", 1e-6, hostile="half"),
    Attack("half send near zero, from round 3", 1e-6, hostile="half", start=3),
    Attack("half reverse x100, from round 3", -100.0, hostile="half", start=3),
)
SILENT = Attack("silent (hostile replies lost)", silent=True)


class AttackMod:
    """An inner train mod that turns a client's honest reply into the attack's."""

    def __init__(self, attack: Attack, hostile: set[int]) -> None:
        self.attack, self.hostile = attack, hostile

    def __call__(self, msg: Message, ctxt, call_next) -> Message:
        reply = call_next(msg, ctxt)
        if not self._acts(msg, ctxt) or reply.has_error():
            return reply
        received = next(iter(msg.content.array_records.values()))
        (key, trained), *_ = reply.content.array_records.items()
        scaled = {}
        for name, value in trained.items():
            local, start = np.asarray(value.numpy()), np.asarray(received[name].numpy())
            if local.dtype.kind == "f":
                local = (start + self.attack.factor * (local - start)).astype(local.dtype)
            scaled[name] = Array(local)
        reply.content[key] = ArrayRecord(scaled)
        if self.attack.claim is not None:
            (mkey, metrics), *_ = reply.content.metric_records.items()
            changed = MetricRecord(dict(metrics))
            changed[KEY_NUM_EXAMPLES] = self.attack.claim
            reply.content[mkey] = changed
        return reply

    def _acts(self, msg: Message, ctxt) -> bool:
        if msg.metadata.message_type != MessageType.TRAIN:
            return False
        if int(ctxt.node_config["partition-id"]) not in self.hostile:
            return False
        return round_of(msg) >= self.attack.start


def round_of(msg: Message) -> int:
    """The round of a train instruction (its fedcomp config)."""
    config = next((c for c in msg.content.config_records.values() if KEY_ROUND in c), {})
    return int(config.get(KEY_ROUND, 0))


def job(num_clients: int, seed: int, rounds: int, **aggregation: float) -> Settings:
    """The default job at ``num_clients`` clients (no client evaluation messages)."""
    return settings_from_dict(
        {
            "num_clients": num_clients,
            "num_rounds": rounds,
            "seed": seed,
            "fraction_evaluate": 0.0,
            "learning_check": False,  # an attacked run is judged here, not by the check
            "progress": "off",
            "aggregation": aggregation,
        }
    )


def run(
    settings: Settings,
    attack: Attack | None,
    *,
    client_mods: list | None = None,
    results_dir: Path | None = None,
) -> list[dict[str, Any]]:
    """The job's round records with ``attack`` (None: honest) in one process; a run
    the attack ended returns the rounds its results.json holds. ``client_mods``: more
    inner train mods; ``results_dir``: where results.json is written (default: a
    temporary directory)."""
    from clients.client_app import make_client_app
    from clients.paths import paths_of
    from experiments.inprocess import InProcessGrid, set_task_identity
    from strategies.server_app import run_server

    set_task_identity()
    mods, tamper = list(client_mods or []), None
    if attack is not None and attack.silent:
        hostile = attack.hostile_ids(settings.num_clients)

        def tamper(pid, reply, instruction):  # the hostile clients' train replies lost
            lost = pid in hostile and instruction.metadata.message_type == MessageType.TRAIN
            return None if lost else reply

    elif attack is not None:
        mods.append(AttackMod(attack, attack.hostile_ids(settings.num_clients)))
    app = make_client_app(paths=paths_of(settings), inner_mods=mods)
    ids = [10_000 + i for i in range(settings.num_clients)]
    grid = InProcessGrid(app, settings.num_clients, node_ids=ids, tamper=tamper)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(results_dir or tmp) / "results.json"
        settings = dataclasses.replace(settings, results_path=str(path))
        try:
            return run_server(grid, settings)["rounds"]
        except RunFailed as exc:  # an attack may end the run: its results are written
            print(f"  run failed: {exc}", flush=True)
            return json.loads(path.read_text())["rounds"]


def losses(rounds: list[dict[str, Any]]) -> list[float]:
    return [float(r["loss"]) if r["loss"] is not None else math.inf for r in rounds]


def summary_rows(runs: list[dict[str, Any]]) -> list[str]:
    """A markdown table: per client count and attack, over the seeds, the final loss
    and accuracy and the largest excess of any round's loss over the honest and the
    silent runs' (mean and worst seed)."""
    rows = [
        "| clients | attack | final loss | final accuracy | worst excess over honest "
        "| worst excess over silent | clients bounded |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in sorted({r["clients"] for r in runs}, reverse=True):
        base = {r["seed"]: r for r in runs if r["clients"] == n and r["attack"] == "honest"}
        silent = {r["seed"]: r for r in runs if r["clients"] == n and r["attack"] == SILENT.name}
        for name in dict.fromkeys(r["attack"] for r in runs if r["clients"] == n):
            group = [r for r in runs if r["clients"] == n and r["attack"] == name]
            over_honest = [_excess(r["loss"], base[r["seed"]]["loss"]) for r in group]
            over_silent = [_excess(r["loss"], silent[r["seed"]]["loss"]) for r in group]
            bounded = sorted({i for r in group for i in r.get("bounded", [])})
            rows.append(
                f"| {n} | {name} | {_mean([r['loss'][-1] for r in group])} "
                f"| {_mean([r['accuracy'][-1] for r in group])} | {max(over_honest):.4g} "
                f"| {max(over_silent):.4g} | {', '.join(map(str, bounded)) or '-'} |"
            )
    return rows


def _excess(loss: list[float], reference: list[float]) -> float:
    return max(max(a - b for a, b in zip(loss, reference, strict=True)), 0.0)


def _mean(values: list[float]) -> str:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if len(finite) < len(values):
        return "not finite"
    return f"{sum(finite) / len(finite):.4f}"


def one(settings: Settings, attack: Attack | None, label: str) -> dict[str, Any]:
    rounds = run(settings, attack)
    return {
        "clients": settings.num_clients,
        "seed": settings.seed,
        "attack": label,
        "loss": losses(rounds),
        "accuracy": [r["accuracy"] for r in rounds],
        "bounded": sorted(
            {i for r in rounds for ids in r.get("bounded", {}).values() for i in ids}
        ),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--set", nargs="*", default=[], help="aggregation.KEY=VALUE")
    parser.add_argument("--json", type=Path, help="write every run's losses here")
    parser.add_argument("--out", type=Path, help="write the summary table here")
    args = parser.parse_args(argv)
    aggregation = {}
    for item in args.set:
        key, value = item.split("=", 1)
        aggregation[key.removeprefix("aggregation.")] = float(value)
    out: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for n in args.clients:
        for seed in args.seeds:
            settings = job(n, seed, args.rounds, **aggregation)
            for attack in (None, SILENT, *ATTACKS):
                label = "honest" if attack is None else attack.name
                out.append(one(settings, attack, label))
                last = out[-1]
                print(
                    f"n={n} seed={seed} {label}: final loss {last['loss'][-1]:.4g} "
                    f"accuracy {last['accuracy'][-1]} ({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
    table = "\n".join(summary_rows(out))
    print(table)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
