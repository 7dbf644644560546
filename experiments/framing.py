"""Socket bytes from what a run counts: a framing model of Flower's Fleet API.

On Flower 1.42's Deployment Engine a SuperNode speaks protobuf over HTTP/1.1 to the
SuperLink, one call per Flower object (``experiments/deployment/socket_count.py``):

- an instruction (or identity query) is *pulled*: a ``PullMessages`` call carrying the
  message and its object tree, one ``PullObject`` call per object, and a
  ``ConfirmMessageReceived``;
- a reply is *pushed*: a ``PushMessages`` call with its object tree, one
  ``PushObject`` call per object;
- a waiting SuperNode polls (``PullMessages`` finding nothing, every 3 s while it has
  no ClientApp running) and sends a heartbeat about every 20 s.

So a round's socket bytes are, per direction d (pull, push)::

    sum over kinds of  messages * per_message[d] + objects * per_object[d]
                       + object_bytes * per_byte[d]
    + idle_per_wait * pulled messages

``per_message`` is the message call (and the receipt of a pulled one), ``per_object``
one object call plus the object's entry in the message's tree, ``per_byte`` the
object bytes with their protobuf framing (~1). None of these depends on how fedcomp
lays out a message: the layout enters through the counts (messages, objects, object
bytes: ``results.json``'s ``traffic``), so the model holds when the format changes.

The parameters are fitted on deployment runs' socket logs, call by call
(:func:`fit`), and checked on other runs' ``results.json`` (:func:`check_run`)::

    python -m experiments.framing fit RUN_DIR... --out experiments/results/framing_model.json
    python -m experiments.framing check RUN_DIR... --model experiments/results/framing_model.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from experiments.deployment.socket_count import read_socket_log, socket_bytes

#: Where the fitted parameters live (``python -m experiments.framing fit``).
MODEL_PATH = Path(__file__).parent / "results" / "framing_model.json"
PULL, PUSH = "pull", "push"


@dataclass(frozen=True)
class Direction:
    """Socket bytes of moving one message in one direction, from its counts."""

    per_message: float
    per_object: float
    per_byte: float

    def cost(self, messages: float, objects: float, object_bytes: float) -> float:
        return (
            messages * self.per_message + objects * self.per_object + object_bytes * self.per_byte
        )


@dataclass(frozen=True)
class FramingModel:
    """Socket bytes of a round from its messages, objects, object bytes and duration."""

    pull: Direction
    push: Direction
    #: Polls and heartbeats per pulled message. A SuperNode polls (every 3 s) only
    #: while it waits for a message, not while its ClientApp runs, and each message it
    #: pulls ends one wait: a round with a separate evaluation makes each node wait
    #: twice, one with evaluation inside the train round once. The waiting time itself
    #: is not in the counts: a mean per wait of the fitted runs, not a rate per second.
    idle_per_wait: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> FramingModel:
        """The model of :meth:`to_json`'s shape; a missing or non-numeric parameter is
        a ``ValueError`` naming it."""
        try:
            pull, push = (
                Direction(**{k: float(v) for k, v in obj[d].items()}) for d in (PULL, PUSH)
            )
            return cls(pull, push, float(obj["idle_per_wait"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"framing model {dict(obj)!r}: {type(exc).__name__}: {exc}") from exc


def load_model(path: Path = MODEL_PATH) -> FramingModel:
    """The committed fitted model (``experiments/results/framing_model.json``)."""
    return FramingModel.from_json(json.loads(Path(path).read_text())["model"])


def direction_of(kind: str) -> str:
    """Which way a message kind travels at the socket: replies are pushed by the
    SuperNode, instructions and queries pulled from the SuperLink."""
    if kind.endswith("_reply"):
        return PUSH
    if kind.endswith(("_instruction", "_query")):
        return PULL
    raise ValueError(
        f"message kind {kind!r}: expected one ending in _reply, _instruction or _query"
    )


# --------------------------------------------------------------------------------
# the model applied to counts
# --------------------------------------------------------------------------------


def traffic_socket_bytes(
    model: FramingModel, traffic: Mapping[str, Mapping[str, int]], *, fp32: bool = False
) -> float | None:
    """Socket bytes of a round's messages (``results.json`` round ``traffic``), without
    the idle calls; ``fp32``: of their fp32 reference. None when the traffic has no
    object counts (a file written before they were counted)."""
    total = 0.0
    for kind, c in traffic.items():
        objects = c.get("fp32_objects" if fp32 else "objects")
        if objects is None:
            return None
        d = model.pull if direction_of(kind) == PULL else model.push
        total += d.cost(c["messages"], objects, c["fp32_wire_bytes" if fp32 else "wire_bytes"])
    return total


def pulled_messages(record: Mapping[str, Any]) -> int:
    """The messages a round's SuperNodes pulled (instructions and queries): each ended
    one wait, the polls and heartbeats before it."""
    traffic = record.get("traffic") or {}
    return sum(int(c["messages"]) for k, c in traffic.items() if direction_of(k) == PULL)


def round_socket_bytes(
    model: FramingModel, record: Mapping[str, Any], *, fp32: bool = False
) -> float | None:
    """A results.json round's modelled socket bytes: its messages plus the idle calls
    of the waits they ended (None: no object counts)."""
    moved = traffic_socket_bytes(model, record.get("traffic") or {}, fp32=fp32)
    if moved is None or not record.get("traffic"):
        return None
    return moved + model.idle_per_wait * pulled_messages(record)


def run_socket_bytes(model: FramingModel, results: Mapping[str, Any]) -> dict[str, int | None]:
    """A run's modelled socket bytes over its rounds, and its fp32 reference's (the
    model applied to the reference's objects and bytes); None when a round has no
    object counts."""
    out: dict[str, int | None] = {}
    for key, fp32 in (("socket_bytes", False), ("fp32_socket_bytes", True)):
        per_round = [round_socket_bytes(model, r, fp32=fp32) for r in results["rounds"]]
        out[key] = None if not per_round or None in per_round else round(sum(per_round))  # type: ignore[arg-type]
    return out


def fp32_reference_fields(
    results: Mapping[str, Any], model: FramingModel | None = None
) -> dict[str, Any]:
    """results.json ``socket``'s fp32 reference: the committed model applied to the
    run's fp32 reference counts, over the rounds ({}: the rounds have no object counts)."""
    fp32 = run_socket_bytes(model or load_model(), results)["fp32_socket_bytes"]
    if fp32 is None:
        return {}
    return {"fp32_reference_socket_bytes": fp32, "fp32_reference_method": "model"}


def measured_socket_bytes(results: Mapping[str, Any]) -> int | None:
    """A deployment run's measured socket bytes over its rounds (set-up apart)."""
    sock = results.get("socket")
    if not sock or sock.get("opaque_connections"):
        return None
    return sum(int(r["socket_bytes"]) for r in sock["rounds"])


#: Per-round keys :func:`with_socket_rounds` adds (what the report cumulates).
SOCKET_MODEL = "socket_model_bytes"
FP32_SOCKET_MODEL = "fp32_socket_model_bytes"
SOCKET_MEASURED = "socket_measured_bytes"


def with_socket_rounds(run: Mapping[str, Any], model: FramingModel) -> dict[str, Any]:
    """A copy of ``run`` whose rounds also hold their modelled socket bytes and their
    fp32 reference's (when the round has object counts) and, on a deployment whose
    connections were parsed, the measured ones."""
    sock = run.get("socket") or {}
    measured = {} if sock.get("opaque_connections", 1) else {r["round"]: r for r in sock["rounds"]}
    rounds = []
    for rec in run["rounds"]:
        extra: dict[str, int] = {}
        modelled = round_socket_bytes(model, rec)
        if modelled is not None:
            extra[SOCKET_MODEL] = round(modelled)
            extra[FP32_SOCKET_MODEL] = round(round_socket_bytes(model, rec, fp32=True) or 0)
        if rec["round"] in measured:
            extra[SOCKET_MEASURED] = int(measured[rec["round"]]["socket_bytes"])
        rounds.append({**rec, **extra})
    return {**run, "rounds": rounds}


def socket_summary(run: Mapping[str, Any], model: FramingModel) -> dict[str, float | None]:
    """Per run: modelled socket bytes and their ratio vs the modelled fp32 reference;
    measured socket bytes (deployments) and their ratio vs the same reference (the
    one written into results.json's socket section when there is one). None: not
    available (no object counts, or not a counted deployment)."""
    modelled = run_socket_bytes(model, run)
    measured = measured_socket_bytes(run)
    fp32 = (run.get("socket") or {}).get(
        "fp32_reference_socket_bytes", modelled["fp32_socket_bytes"]
    )

    def ratio(value: int | None) -> float | None:
        return fp32 / value if fp32 and value else None

    return {
        "socket_model": modelled["socket_bytes"],
        "socket_model_ratio": ratio(modelled["socket_bytes"]),
        "socket_measured": measured,
        "socket_measured_ratio": ratio(measured),
        "fp32_socket_model": fp32,
    }


#: What the report and the leaderboard say about the fp32 reference at the socket.
FP32_SOCKET_NOTE = (
    "socket (model): experiments/framing.py's model (experiments/results/framing_model.json) "
    "on each round's messages, objects and object bytes, and its SuperNodes' idle calls; "
    "socket (measured): the deployment's counting proxy, rounds only. fp32 socket bytes: "
    "modelled from the run's fp32 reference (its object counts and bytes)."
)


# --------------------------------------------------------------------------------
# fitting on socket logs
# --------------------------------------------------------------------------------


@dataclass
class CallSamples:
    """What a socket log says, call by call, for the fit."""

    #: (content bytes, socket bytes) of each object call, per direction.
    objects: dict[str, list[tuple[int, int]]]
    #: (tree objects, socket bytes) of each message call (its share, per message).
    messages: dict[str, list[tuple[int, float]]]
    #: Socket bytes of each receipt (ConfirmMessageReceived).
    confirms: list[int]


def call_samples(rows: Iterable[Mapping[str, Any]]) -> CallSamples:
    """Sort a socket log's calls into the model's terms (idle and set-up calls are
    left out: the idle rate comes from the rounds, :func:`idle_samples`)."""
    out = CallSamples({PULL: [], PUSH: []}, {PULL: [], PUSH: []}, [])
    for row in rows:
        rpc, cost = row.get("rpc"), socket_bytes(row)
        if rpc in ("PullObject", "PushObject"):
            out.objects[PULL if rpc == "PullObject" else PUSH].append((row["content"], cost))
        elif rpc == "ConfirmMessageReceived":
            out.confirms.append(cost)
        elif rpc in ("PullMessages", "PushMessages") and row.get("messages"):
            share = cost / len(row["messages"])
            d = PULL if rpc == "PullMessages" else PUSH
            out.messages[d].extend((len(m["objects"]), share) for m in row["messages"])
    return out


def _line(points: Sequence[tuple[float, float]], what: str) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y on x; both need at least two distinct x."""
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    if len(set(x.tolist())) < 2:
        raise ValueError(
            f"{what}: {len(points)} call(s) with x values {sorted(set(x.tolist()))}; "
            "the fit needs at least two different ones"
        )
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


def fit_calls(samples: CallSamples) -> tuple[Direction, Direction]:
    """Each direction's parameters from its calls: object call = a + b * content,
    message call = c + e * tree objects, a pulled message's receipt = its mean."""
    if not samples.confirms:
        raise ValueError("no ConfirmMessageReceived call in the logs: nothing was pulled")
    confirm = float(np.mean(samples.confirms))
    dirs = []
    for d in (PULL, PUSH):
        call, per_byte = _line(samples.objects[d], f"{d} object calls")
        msg, per_tree_object = _line(samples.messages[d], f"{d} message calls")
        dirs.append(
            Direction(
                per_message=msg + (confirm if d == PULL else 0.0),
                per_object=call + per_tree_object,
                per_byte=per_byte,
            )
        )
    return dirs[0], dirs[1]


def idle_rate(rounds: Iterable[tuple[int, int]]) -> float:
    """Idle bytes per wait over ``(idle bytes, pulled messages)`` rounds."""
    rounds = list(rounds)
    waits = sum(n for _, n in rounds)
    if waits <= 0:
        raise ValueError(f"idle rounds {rounds}: no pulled messages to divide the idle bytes by")
    return sum(b for b, _ in rounds) / waits


def _run_files(run_dir: Path) -> tuple[dict[str, Any], Path]:
    results = json.loads((run_dir / "results.json").read_text())
    if "socket" not in results:
        raise ValueError(
            f"{run_dir}: results.json has no socket section (not a counted deployment)"
        )
    return results, run_dir / "deploy" / "socket.jsonl"


def fit(run_dirs: Sequence[Path]) -> FramingModel:
    """The model fitted on deployment runs (their socket logs and results.json)."""
    rows: list[dict[str, Any]] = []
    idle: list[tuple[int, int]] = []
    for run_dir in run_dirs:
        results, log = _run_files(run_dir)
        rows += read_socket_log(log)[0]
        idle += [
            (sock["idle_bytes"], pulled_messages(rec))
            for rec, sock in zip(results["rounds"], results["socket"]["rounds"], strict=True)
        ]
    pull, push = fit_calls(call_samples(rows))
    return FramingModel(pull, push, idle_rate(idle))


# --------------------------------------------------------------------------------
# checking on runs
# --------------------------------------------------------------------------------


def check_run(model: FramingModel, results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per round of a deployment run: measured and modelled socket bytes, and the
    residual (modelled / measured - 1)."""
    out = []
    for rec, sock in zip(results["rounds"], results["socket"]["rounds"], strict=True):
        modelled = round_socket_bytes(model, rec)
        measured = int(sock["socket_bytes"])
        idle = model.idle_per_wait * pulled_messages(rec)
        moved = measured - int(sock["idle_bytes"])  # the calls that moved messages
        out.append(
            {
                "round": rec["round"],
                "measured": measured,
                "modelled": None if modelled is None else round(modelled),
                "residual": None if modelled is None else modelled / measured - 1.0,
                "messages_residual": None if modelled is None else (modelled - idle) / moved - 1,
                "idle_measured": int(sock["idle_bytes"]),
                "idle_modelled": round(idle),
            }
        )
    return out


def _fmt_model(model: FramingModel) -> list[str]:
    lines = [
        "| direction | per message (B) | per object (B) | per object byte |",
        "|---|---|---|---|",
    ]
    for name in (PULL, PUSH):
        d = getattr(model, name)
        lines.append(f"| {name} | {d.per_message:,.1f} | {d.per_object:,.1f} | {d.per_byte:.4f} |")
    lines.append(f"\nidle: {model.idle_per_wait:,.1f} B per wait (per pulled message)")
    return lines


def _recipe(config: Mapping[str, Any]) -> str:
    """The run's recipe name when the config kept it, else its codec's (with its inner
    codec, e.g. ``ef(topk)``)."""
    codec = config.get("codec", {})
    inner = f"({codec['inner']})" if "inner" in codec else ""
    return str(config.get("recipe") or f"{codec.get('name')}{inner}")


def check_table(model: FramingModel, run_dirs: Sequence[Path]) -> list[str]:
    """Markdown rows: each run's rounds, measured vs modelled, and the run's total."""
    lines = [
        "| run | codec | round | measured B | modelled B | residual | residual without "
        "idle | idle measured B | idle modelled B |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run_dir in run_dirs:
        results, _ = _run_files(run_dir)
        recipe = _recipe(results["config"])
        rows = check_run(model, results)
        for r in rows:
            res, moved = (
                "n/a" if r[k] is None else f"{r[k]:+.2%}" for k in ("residual", "messages_residual")
            )
            modelled = "n/a" if r["modelled"] is None else f"{r['modelled']:,}"
            lines.append(
                f"| {run_dir.name} | {recipe} | {r['round']} | {r['measured']:,} | {modelled} "
                f"| {res} | {moved} | {r['idle_measured']:,} | {r['idle_modelled']:,} |"
            )
        if all(r["modelled"] is not None for r in rows):
            m, p = sum(r["measured"] for r in rows), sum(r["modelled"] for r in rows)
            idle_m = sum(r["idle_measured"] for r in rows)
            idle_p = sum(r["idle_modelled"] for r in rows)
            lines.append(
                f"| {run_dir.name} | {recipe} | all | {m:,} | {p:,} | {p / m - 1:+.2%} "
                f"| {(p - idle_p) / (m - idle_m) - 1:+.2%} | {idle_m:,} | {idle_p:,} |"
            )
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.framing", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fit", help="fit the model on deployment runs' socket logs")
    f.add_argument("runs", nargs="+", type=Path)
    f.add_argument("--out", type=Path, default=MODEL_PATH)
    c = sub.add_parser("check", help="the model against deployment runs' measured socket bytes")
    c.add_argument("runs", nargs="+", type=Path)
    c.add_argument("--model", type=Path, default=MODEL_PATH)
    args = parser.parse_args(argv)
    if args.command == "fit":
        model = fit(args.runs)
        from flwr import __version__ as flwr_version

        record = {
            "model": model.to_json(),
            "flwr": flwr_version,
            "fitted_on": [p.name for p in args.runs],
            "command": "python -m experiments.framing fit " + " ".join(p.name for p in args.runs),
        }
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print("\n".join(_fmt_model(model)))
        print("\n".join(check_table(model, args.runs)))
    else:
        model = load_model(args.model)
        print("\n".join(check_table(model, args.runs)))


if __name__ == "__main__":
    main()
