"""The one shape of ``results.json``, its validator, and its reader and writer.

Every writer (the ServerApp) and every reader (the report, the tests) goes through
:func:`validate_results`, so a file that exists is a file that has this shape::

    {"schema_version": 1,
     "config": {...resolved settings...},
     "rounds": [{"round": 1, "accuracy": ..., "loss": ..., "client_accuracy": ...,
                 "client_loss": ..., "uplink_codec_bytes": ..., "uplink_record_bytes": ...,
                 "uplink_wire_bytes": ..., "downlink_record_bytes": ...,
                 "downlink_wire_bytes": ..., "per_client": [...], "decode_s": ...,
                 "aggregate_s": ..., "round_s": ..., "selected": ..., "replied": ...,
                 "failures": ..., "resyncs": ..., "nonfinite": ..., "faults": {...},
                 "codec": {...}}, ...],
     "summary": {"final_accuracy": ..., "uplink_wire_bytes_total": ..., "wall_s": ...,
                 "total_wire_bytes": ..., "total_ratio_vs_fp32": ...,
                 "train_ratio_vs_fp32": ...,
                 "ratio_vs_fp32_codec": ..., "ratio_vs_fp32_wire": ...}}

Rounds written since the traffic accounting also hold ``traffic`` (every message kind,
both ways: messages, record, wire and fp32-reference wire bytes), ``total_wire_bytes``
and ``train_wire_bytes`` with their fp32 references; ``ratio_vs_fp32_*`` stay the train
replies' (uplink) ratios.
Rounds with a client evaluation written since ``evaluate_in_train`` existed say which
it is in ``client_eval`` ("evaluate" or "pre-train"; absent in older files: evaluate).

Byte counts are measured from real payloads and messages, never computed.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1

_NUM = (int, float)
_OPT_NUM = (int, float, type(None))

ROUND_FIELDS: dict[str, tuple[type, ...]] = {
    "round": (int,),
    "accuracy": _OPT_NUM,
    "loss": _OPT_NUM,
    "client_accuracy": _OPT_NUM,
    "client_loss": _OPT_NUM,
    "uplink_codec_bytes": (int,),
    "uplink_record_bytes": (int,),
    "uplink_wire_bytes": (int,),
    "downlink_record_bytes": (int,),
    "downlink_wire_bytes": (int,),
    "per_client": (list,),
    "decode_s": _NUM,
    "aggregate_s": _NUM,
    "round_s": _NUM,
    "selected": (int,),
    "replied": (int,),
    "failures": (int,),
    "resyncs": (int,),
    "nonfinite": (int,),
    "faults": (dict,),
    "codec": (dict,),
}

CLIENT_FIELDS: dict[str, tuple[type, ...]] = {
    "client": (int,),
    "uplink_codec_bytes": (int,),
    "uplink_record_bytes": (int,),
    "uplink_wire_bytes": (int,),
    "downlink_record_bytes": (int,),
    "downlink_wire_bytes": (int,),
    "encode_s": _NUM,
    "num_examples": (int,),
}

#: Fields added after schema 1 was first written: checked when present; a reader of
#: an older file shows them as unavailable (None).
OPTIONAL_ROUND_FIELDS: dict[str, tuple[type, ...]] = {
    "traffic": (dict,),
    "total_wire_bytes": (int,),
    "fp32_total_wire_bytes": (int,),
    "train_wire_bytes": (int,),
    "fp32_train_wire_bytes": (int,),
    # Where client_accuracy / client_loss come from (CLIENT_EVAL_KINDS); absent when
    # no client evaluation was aggregated that round.
    "client_eval": (str,),
}

#: ``client_eval``: the evaluate replies (the round's new aggregate, on the clients
#: sampled to evaluate), or the train replies' pre-train metrics (the model the
#: train-sampled clients received: the previous round's aggregate; evaluate_in_train).
CLIENT_EVAL_EVALUATE = "evaluate"
CLIENT_EVAL_PRE_TRAIN = "pre-train"
CLIENT_EVAL_KINDS = (CLIENT_EVAL_EVALUATE, CLIENT_EVAL_PRE_TRAIN)

SUMMARY_FIELDS: dict[str, tuple[type, ...]] = {
    "final_accuracy": _OPT_NUM,
    "uplink_wire_bytes_total": (int,),
    "wall_s": _NUM,
    "ratio_vs_fp32_codec": _OPT_NUM,
    "ratio_vs_fp32_wire": _OPT_NUM,
}


@dataclass
class RoundCounts:
    """What the server counts and times during one round, as typed fields (a misspelled
    counter is an AttributeError, never a silent 0). ``fedcomp.flower.round_records.round_record``
    turns it, with the byte counts, into one round of results.json."""

    selected: int = 0
    replied: int = 0
    #: Replies that were not aggregated, whatever the reason (error replies included).
    failures: int = 0
    #: Rejected replies whose decoded values were NaN or infinite.
    nonfinite: int = 0
    #: Residual memory: full-precision resyncs and h = 0 restarts accepted, and the
    #: resyncs the server asked for.
    resyncs: int = 0
    restarts: int = 0
    resync_requests: int = 0
    #: Bounded influence: weights capped, updates clipped, contributions held to the
    #: round's consensus (fedcomp.influence), and the stable ids of each.
    capped: int = 0
    clipped: int = 0
    held: int = 0
    bounded: dict[str, list[int]] = field(default_factory=dict)
    #: Clients with strikes after this round (stable id -> strikes; escalation).
    strikes: dict[int, float] = field(default_factory=dict)
    #: 1 when the round's reference norm fell back to an earlier round's (half of the
    #: updates near zero; fedcomp.influence.robust_reference).
    reference_fallback: int = 0
    #: The reference norm the round's updates were measured against, and the norm of
    #: the step the model took (None: not measured): a run whose steps stay tiny next
    #: to its clients' updates did not follow them (fedcomp.flower.outcome).
    reference_norm: float | None = None
    step_norm: float | None = None
    #: Updates loaded again for the trust region this round (a released update is
    #: decoded again: the consensus pass of a run's first round, and each contribution
    #: the norm screen could not place; fedcomp.flower.bounds).
    consensus_loads: int = 0
    #: The consensus step's norm over the reference norm (how far the clipped updates
    #: agree; None: no trust region this round).
    consensus_ratio: float | None = None
    #: 1 when the aggregate was not finite and the model was kept.
    aggregate_nonfinite: int = 0
    #: The largest update norm over the round's reference norm (the lower median), before
    #: clipping: how close the round came to ``norm_cap`` (None: fewer than two replies).
    norm_ratio: float | None = None
    #: 1 when the inner strategy raised while aggregating and the model was kept.
    inner_failed: int = 0
    #: Error replies by fault kind (injected faults, ``error_reply``), plus
    #: ``rejected_reply`` for every reply the server refused.
    faults: dict[str, int] = field(default_factory=dict)
    #: Identity exchanges (first contact) that failed before this round, by kind
    #: (fedcomp.flower.identity.IdentityFailure).
    identity_failures: dict[str, int] = field(default_factory=dict)
    #: Refused replies by failure kind (fedcomp.failures.Failure).
    rejected: dict[str, int] = field(default_factory=dict)
    decode_s: float = 0.0
    aggregate_s: float = 0.0
    client_accuracy: float | None = None
    client_loss: float | None = None
    #: Every aggregated client-evaluation metric (scalar ones).
    client_metrics: dict[str, float] = field(default_factory=dict)
    #: Which client evaluation those are (CLIENT_EVAL_KINDS; None: none this round).
    client_eval: str | None = None
    diagnostics: dict[str, float] | None = None
    tree: dict[str, Any] | None = None
    joint: dict[str, Any] | None = None
    #: Streaming plain mean: how many times each reply was decoded (1: the sum taken
    #: during the first decode was used; 2: it was discarded and summed again).
    decode_passes: int | None = None
    #: Downlink replica: the version, step bytes, ||x_hat - x_t|| / ||x_t||.
    downlink: dict[str, Any] | None = None
    #: Central accuracy of x_hat, the model the clients hold (when it differs from x_t).
    replica_accuracy: float | None = None

    def count_fault(self, kind: str) -> None:
        """One more failed reply of this fault kind."""
        self.failures += 1
        self.faults[kind] = self.faults.get(kind, 0) + 1

    def count_rejection(self, kind: str, *, fault: bool = True) -> None:
        """One more refused reply of this failure kind (``fault``: also counted as a
        ``rejected_reply`` fault; resync requests are not faults)."""
        self.failures += 1
        self.rejected[kind] = self.rejected.get(kind, 0) + 1
        if fault:
            self.faults["rejected_reply"] = self.faults.get("rejected_reply", 0) + 1


class ResultsError(ValueError):
    """A results object or file that does not have the schema's shape."""


def _check_fields(
    obj: Any,
    fields: Mapping[str, tuple[type, ...]],
    where: str,
    optional: Mapping[str, tuple[type, ...]] | None = None,
) -> None:
    if not isinstance(obj, Mapping):
        raise ResultsError(f"{where}: expected an object, got {type(obj).__name__}")
    missing = [k for k in fields if k not in obj]
    if missing:
        raise ResultsError(f"{where}: missing field(s) {', '.join(missing)}")
    present = {k: t for k, t in (optional or {}).items() if k in obj}
    for key, types in {**fields, **present}.items():
        value = obj[key]
        if isinstance(value, bool) or not isinstance(value, types):
            raise ResultsError(f"{where}.{key}: {value!r} is not of type {types}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ResultsError(f"{where}.{key}: non-finite value {value!r}")


#: A deployment run's ``socket`` section (experiments/deployment/socket_count.py): every
#: byte of the counted SuperNodes' connections, the per-run constants apart.
SOCKET_FIELDS: dict[str, tuple[type, ...]] = {
    "counted_nodes": (int,),
    "connections": (int,),
    "opaque_connections": (int,),
    "calls": (int,),
    "total_bytes": (int,),
    "setup_bytes": (int,),
    "setup_calls": (dict,),
    "teardown_bytes": (int,),
    "unattributed_bytes": (int,),
    "rounds": (list,),
}
SOCKET_ROUND_FIELDS: dict[str, tuple[type, ...]] = {
    "round": (int,),
    "socket_bytes": (int,),
    "idle_bytes": (int,),
    "calls": (int,),
    "kinds": (dict,),
}


#: The fp32 reference at the socket (a deployment runs only its own recipe, so the
#: reference is modelled: experiments/framing.py on the run's fp32 reference counts).
#: Optional, but both or neither.
SOCKET_REFERENCE_FIELDS: dict[str, tuple[type, ...]] = {
    "fp32_reference_socket_bytes": (int,),
    "fp32_reference_method": (str,),
}
#: How ``fp32_reference_socket_bytes`` was obtained.
SOCKET_REFERENCE_METHODS = ("model",)

#: A round's ``traffic`` entry per message kind; the object counts were added later
#: (both or neither).
TRAFFIC_FIELDS: dict[str, tuple[type, ...]] = {
    "messages": (int,),
    "record_bytes": (int,),
    "wire_bytes": (int,),
    "fp32_wire_bytes": (int,),
}
TRAFFIC_OBJECT_FIELDS: dict[str, tuple[type, ...]] = {"objects": (int,), "fp32_objects": (int,)}


def _both_or_neither(obj: Mapping[str, Any], fields: Mapping[str, Any], where: str) -> None:
    present = [k for k in fields if k in obj]
    if present and len(present) != len(fields):
        missing = [k for k in fields if k not in obj]
        raise ResultsError(f"{where}: {', '.join(present)} without {', '.join(missing)}")


def _check_traffic(traffic: Mapping[str, Any], where: str) -> None:
    for kind, counts in traffic.items():
        _check_fields(counts, TRAFFIC_FIELDS, f"{where}.{kind}", TRAFFIC_OBJECT_FIELDS)
        _both_or_neither(counts, TRAFFIC_OBJECT_FIELDS, f"{where}.{kind}")


def _check_socket(sock: Any) -> None:
    _check_fields(sock, SOCKET_FIELDS, "socket", SOCKET_REFERENCE_FIELDS)
    _both_or_neither(sock, SOCKET_REFERENCE_FIELDS, "socket")
    method = sock.get("fp32_reference_method", SOCKET_REFERENCE_METHODS[0])
    if method not in SOCKET_REFERENCE_METHODS:
        raise ResultsError(
            f"socket.fp32_reference_method: {method!r}, expected one of {SOCKET_REFERENCE_METHODS}"
        )
    for i, rnd in enumerate(sock["rounds"]):
        _check_fields(rnd, SOCKET_ROUND_FIELDS, f"socket.rounds[{i}]")
    parts = sock["setup_bytes"] + sock["teardown_bytes"] + sock["unattributed_bytes"]
    if parts + sum(r["socket_bytes"] for r in sock["rounds"]) != sock["total_bytes"]:
        raise ResultsError("socket: set-up, teardown, rounds and unattributed bytes != total")


def validate_results(obj: Any) -> dict[str, Any]:
    """Check that ``obj`` has the results shape; return it.

    Raises
    ------
    ResultsError
        Naming the first field that is missing or of the wrong type.
    """
    if not isinstance(obj, Mapping):
        raise ResultsError("results: expected an object")
    if obj.get("schema_version") != SCHEMA_VERSION:
        raise ResultsError(
            f"results.schema_version: {obj.get('schema_version')!r}, expected {SCHEMA_VERSION}"
        )
    if not isinstance(obj.get("config"), Mapping):
        raise ResultsError("results.config: expected an object")
    rounds = obj.get("rounds")
    if not isinstance(rounds, list):
        raise ResultsError("results.rounds: expected a list")
    for i, rnd in enumerate(rounds):
        _check_fields(rnd, ROUND_FIELDS, f"rounds[{i}]", OPTIONAL_ROUND_FIELDS)
        if rnd["round"] != i + 1:
            raise ResultsError(f"rounds[{i}].round: {rnd['round']}, expected {i + 1}")
        if rnd.get("client_eval", CLIENT_EVAL_EVALUATE) not in CLIENT_EVAL_KINDS:
            raise ResultsError(
                f"rounds[{i}].client_eval: {rnd['client_eval']!r}, "
                f"allowed: {', '.join(CLIENT_EVAL_KINDS)}"
            )
        for j, client in enumerate(rnd["per_client"]):
            _check_fields(client, CLIENT_FIELDS, f"rounds[{i}].per_client[{j}]")
        if "traffic" in rnd:
            _check_traffic(rnd["traffic"], f"rounds[{i}].traffic")
    _check_fields(obj.get("summary"), SUMMARY_FIELDS, "summary")
    if "socket" in obj:
        _check_socket(obj["socket"])
    if "failure" in obj:  # a run that failed: why (strategies.server_app)
        failure = obj["failure"]
        if not isinstance(failure, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in failure.items()
        ):
            raise ResultsError(f"failure: {failure!r:.120} is not an object of strings")
    if "machine" in obj:  # fedcomp.machine: every field a string
        machine = obj["machine"]
        if not isinstance(machine, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in machine.items()
        ):
            raise ResultsError(f"machine: {machine!r:.120} is not an object of strings")
    return dict(obj)


def _ratio(numerator: int, denominator: int) -> float | None:
    return numerator / denominator if denominator > 0 else None


def round_sum(rounds: Sequence[Mapping[str, Any]], key: str) -> int | None:
    """The sum of an optional round field; None when any round lacks it (a file
    written before the field existed: unavailable, never a partial sum)."""
    if not rounds or any(key not in r for r in rounds):
        return None
    return sum(int(r[key]) for r in rounds)


def _opt_ratio(numerator: int | None, denominator: int | None) -> float | None:
    if numerator is None or denominator is None:
        return None
    return _ratio(numerator, denominator)


def build_results(
    config: Mapping[str, Any], rounds: Sequence[Mapping[str, Any]], *, wall_s: float
) -> dict[str, Any]:
    """Assemble and validate a results object from per-round records.

    The compression ratios compare, over the replies that were decoded, the MEASURED
    bytes of the same updates under the fp32 codec (``codec.fp32_codec_bytes``,
    ``codec.fp32_wire_bytes``) with the bytes actually sent for them
    (``codec.decoded_codec_bytes``, ``codec.decoded_wire_bytes``).
    """
    codec_total = sum(r["uplink_codec_bytes"] for r in rounds)
    wire_total = sum(r["uplink_wire_bytes"] for r in rounds)

    def total(key: str) -> int:
        return sum(int(r["codec"].get(key, 0)) for r in rounds)

    evaluated = [r["accuracy"] for r in rounds if r["accuracy"] is not None]
    total_wire, fp32_total = (
        round_sum(rounds, "total_wire_bytes"),
        round_sum(rounds, "fp32_total_wire_bytes"),
    )
    train_wire, fp32_train = (
        round_sum(rounds, "train_wire_bytes"),
        round_sum(rounds, "fp32_train_wire_bytes"),
    )
    summary = {
        "final_accuracy": evaluated[-1] if evaluated else None,
        # The best round's test accuracy: what NIID-Bench reports (niid_bench_fmnist).
        "best_accuracy": max(evaluated) if evaluated else None,
        "uplink_wire_bytes_total": wire_total,
        "uplink_codec_bytes_total": codec_total,
        "wall_s": wall_s,
        # Every message of the run, both ways, and the same schedule under fp32.
        "total_wire_bytes": total_wire,
        "fp32_total_wire_bytes": fp32_total,
        "total_ratio_vs_fp32": _opt_ratio(fp32_total, total_wire),
        # Rounds in which no reply was accepted (the model did not change).
        "rounds_without_accepted_reply": sum(1 for r in rounds if r["replied"] == 0),
        "train_ratio_vs_fp32": _opt_ratio(fp32_train, train_wire),
        "ratio_vs_fp32_codec": _ratio(total("fp32_codec_bytes"), total("decoded_codec_bytes")),
        "ratio_vs_fp32_wire": _ratio(total("fp32_wire_bytes"), total("decoded_wire_bytes")),
    }
    return validate_results(
        {
            "schema_version": SCHEMA_VERSION,
            "config": dict(config),
            "rounds": [dict(r) for r in rounds],
            "summary": summary,
        }
    )


def write_results(
    path: str | os.PathLike[str], results: Mapping[str, Any], *, salvage: bool = False
) -> Path:
    """Validate and write atomically (a reader never sees a half-written file).

    ``salvage``: the run failed; write what it has even if it does not validate, with
    every non-finite number as null (JSON has none) and, when the shape is still
    refused, the refusal added to its ``failure``."""
    if salvage:
        results = _finite_or_none(results)
        try:
            validate_results(results)
        except ResultsError as exc:
            failure = dict(results.get("failure") or {})
            failure["results_error"] = str(exc)[:2000]
            results = {**results, "failure": failure}
    else:
        validate_results(results)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


def _finite_or_none(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by None, recursively."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite_or_none(v) for v in obj]
    return obj


def load_results(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate a results.json file."""
    try:
        obj = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{path}: not valid JSON ({exc})") from exc
    try:
        return validate_results(obj)
    except ResultsError as exc:
        raise ResultsError(f"{path}: {exc}") from exc
