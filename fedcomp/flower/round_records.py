"""The per-round record of results.json, assembled from what the wrapper measured."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.app import MetricRecord

from fedcomp.controlvariates import ControlVariateServer
from fedcomp.flower.accounting import wire_and_objects
from fedcomp.flower.reference import ReplyReference
from fedcomp.flower.round_state import Decoded
from fedcomp.keys import (
    METRIC_CV_BIAS,
    METRIC_CV_BOUND,
    METRIC_CV_DELTA,
    METRIC_CV_NOISE,
    METRIC_CV_RESIDUAL,
    METRIC_ENCODE_S,
    METRIC_OUT_OF_RANGE,
    METRIC_REL_ERROR,
    METRIC_STATE_BYTES,
)
from fedcomp.own_metrics import OWN_PREFIX
from fedcomp.progress import human_bytes
from fedcomp.results_file import RoundCounts
from fedcomp.traffic import Kind, Traffic

#: Client metrics copied into each client's row (without the "fedcomp." prefix).
_COPIED = (
    METRIC_CV_BIAS,
    METRIC_CV_RESIDUAL,
    METRIC_CV_DELTA,
    METRIC_CV_NOISE,
    METRIC_CV_BOUND,
    METRIC_STATE_BYTES,
    METRIC_OUT_OF_RANGE,
)


def empty_client_row(stable_id: int) -> dict[str, Any]:
    """A client's row before anything was measured."""
    return {
        "client": stable_id,
        "uplink_codec_bytes": 0,
        "uplink_record_bytes": 0,
        "uplink_wire_bytes": 0,
        "downlink_record_bytes": 0,
        "downlink_wire_bytes": 0,
        "encode_s": 0.0,
        "num_examples": 0,
    }


def account_reply(
    row: dict[str, Any],
    item: Decoded,
    metrics: MetricRecord,
    weight: float,
    reference: ReplyReference,
) -> None:
    """Fill a decoded reply's row: measured codec bytes, the client's own metrics, and
    the fp32 reference, computed by the server (fedcomp.flower.reference): the same
    reply with the app's own content, what plain Flower would have sent (its wire
    bytes = the reply's minus its content's plus the plain content's)."""
    # the payloads as the message carried them (compact entries: fedcomp.compact)
    row["uplink_codec_bytes"] = item.codec_bytes
    row["encode_s"] = float(metrics.get(METRIC_ENCODE_S, 0.0))
    row["num_examples"] = int(weight)
    for key in _COPIED:
        if key in metrics:
            row[key.removeprefix("fedcomp.")] = float(metrics[key])
    if METRIC_REL_ERROR in metrics:
        row["codec_rel_error"] = float(metrics[METRIC_REL_ERROR])
    content_wire, content_objects = wire_and_objects(item.message.content)
    plain_wire, plain_objects = reference.content(
        MetricRecord({k: v for k, v in metrics.items() if not k.startswith(OWN_PREFIX)})
    )
    row["fp32_codec_bytes"] = reference.codec_bytes
    row["fp32_wire_bytes"] = row["uplink_wire_bytes"] - content_wire + plain_wire
    row["content_objects"], row["fp32_content_objects"] = content_objects, plain_objects


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def residual_summary(
    cv: ControlVariateServer | None, counts: RoundCounts, measured: list[dict[str, Any]]
) -> dict[str, Any]:
    """Per-round residual statistics (means, and the sums the control variate's bound is
    written in, over the decoded replies that coded a residual)."""
    if cv is None:
        return {}
    # A coded residual has compression noise; a full-precision resync has none.
    coded = [r for r in measured if r.get("cv-noise-norm2", 0) > 0]
    residual = mean([r["cv-residual-norm2"] for r in coded])
    delta = mean([r["cv-delta-norm2"] for r in coded])
    return {
        "residual_norm2_mean": residual,
        "delta_norm2_mean": delta,
        "residual_norm2_sum": sum(r["cv-residual-norm2"] for r in coded),
        "delta_norm2_sum": sum(r["cv-delta-norm2"] for r in coded),
        **_bias_summary(coded),
        "residual_over_delta": residual / delta if residual is not None and delta else None,
        "noise_norm2_mean": mean([r["cv-noise-norm2"] for r in coded]),
        # absent when the inner codec claims no omega (EDEN)
        "noise_bound_mean": mean([r["cv-noise-bound"] for r in coded if "cv-noise-bound" in r]),
        "client_state_bytes_mean": mean([r["state-bytes"] for r in measured if "state-bytes" in r]),
        "server_mirror_bytes": cv.store.nbytes(),
        "resync_requests": counts.resync_requests,
        "restarts": counts.restarts,
    }


def _bias_summary(coded: list[dict[str, Any]]) -> dict[str, Any]:
    """The codec's estimated squared bias on the real residuals, summed over the
    clients that measured it, and over their residuals' squared norms."""
    measured = [r for r in coded if "cv-bias-norm2" in r]
    if not measured:
        return {}
    bias = sum(r["cv-bias-norm2"] for r in measured)
    residual = sum(r["cv-residual-norm2"] for r in measured)
    return {"bias_norm2_sum": bias, "bias_over_residual": bias / residual if residual else None}


def round_record(
    server_round: int,
    central: Mapping[str, float],
    counts: RoundCounts,
    rows: list[dict[str, Any]],
    *,
    round_s: float,
    codec_spec: Mapping[str, Any],
    tensor_codecs: Mapping[str, str],
    cv: ControlVariateServer | None,
    traffic: Traffic,
) -> dict[str, Any]:
    """One round of results.json (fedcomp.results_file gives the shape)."""
    return {
        "round": server_round,
        "accuracy": central.get("accuracy"),
        "loss": central.get("loss"),
        "client_accuracy": counts.client_accuracy,
        "client_loss": counts.client_loss,
        "client_metrics": dict(counts.client_metrics),
        **({"client_eval": counts.client_eval} if counts.client_eval is not None else {}),
        **{key: sum(r[key] for r in rows) for key in _SUMMED},
        "per_client": rows,
        **traffic.round_fields(),
        **_outcome_fields(counts, round_s),
        "codec": _codec_section(counts, rows, codec_spec, tensor_codecs, cv),
    }


#: Byte counts of the per-client rows that the round record sums.
_SUMMED = (
    "uplink_codec_bytes",
    "uplink_record_bytes",
    "uplink_wire_bytes",
    "downlink_record_bytes",
    "downlink_wire_bytes",
)


def _outcome_fields(counts: RoundCounts, round_s: float) -> dict[str, Any]:
    """What the round took and what became of its replies (the optional fields appear
    only when something happened)."""
    return {
        "decode_s": counts.decode_s,
        "aggregate_s": counts.aggregate_s,
        "round_s": round_s,
        "selected": counts.selected,
        "replied": counts.replied,
        "failures": counts.failures,
        "resyncs": counts.resyncs,
        "nonfinite": counts.nonfinite,
        "faults": dict(counts.faults),
        # Rejected replies per failure kind (fedcomp.failures.Failure).
        "rejected": dict(counts.rejected),
        **({"aggregate_nonfinite": 1} if counts.aggregate_nonfinite else {}),
        **({"inner_failed": 1} if counts.inner_failed else {}),
        **({"identity_failures": counts.identity_failures} if counts.identity_failures else {}),
        "capped": counts.capped,
        "clipped": counts.clipped,
        "held": counts.held,
        "norm_ratio": counts.norm_ratio,
        "consensus_ratio": counts.consensus_ratio,
        "reference_norm": counts.reference_norm,
        "step_norm": counts.step_norm,
        # Which clients each bound changed (stable ids): the likely cause a failed run names.
        **(
            {"bounded": {k: v for k, v in counts.bounded.items() if v}}
            if any(counts.bounded.values())
            else {}
        ),
        **({"reference_fallback": 1} if counts.reference_fallback else {}),
        **({"strikes": {str(k): v for k, v in counts.strikes.items()}} if counts.strikes else {}),
        **({"diagnostics": counts.diagnostics} if counts.diagnostics is not None else {}),
        **({"downlink": counts.downlink} if counts.downlink is not None else {}),
        **(
            {"replica_accuracy": counts.replica_accuracy}
            if counts.replica_accuracy is not None
            else {}
        ),
    }


def _codec_section(
    counts: RoundCounts,
    rows: list[dict[str, Any]],
    codec_spec: Mapping[str, Any],
    tensor_codecs: Mapping[str, str],
    cv: ControlVariateServer | None,
) -> dict[str, Any]:
    """The codec's bytes against fp32 over the decoded replies, its error, and the
    residual, tree and joint statistics of the round."""
    measured = [r for r in rows if "fp32_codec_bytes" in r]  # decoded replies only
    fp32_codec = sum(r["fp32_codec_bytes"] for r in measured)
    fp32_wire = sum(r["fp32_wire_bytes"] for r in measured)
    sent_codec = sum(r["uplink_codec_bytes"] for r in measured)
    sent_wire = sum(r["uplink_wire_bytes"] for r in measured)
    return {
        "spec": dict(codec_spec),
        "fp32_codec_bytes": fp32_codec,
        "fp32_wire_bytes": fp32_wire,
        "decoded_codec_bytes": sent_codec,
        "decoded_wire_bytes": sent_wire,
        "ratio_vs_fp32_codec": fp32_codec / sent_codec if sent_codec else None,
        "ratio_vs_fp32_wire": fp32_wire / sent_wire if sent_wire else None,
        "per_tensor": dict(tensor_codecs),
        "client_rel_error_mean": mean(
            [r["codec_rel_error"] for r in measured if "codec_rel_error" in r]
        ),
        **residual_summary(cv, counts, measured),
        **({"tree": counts.tree} if counts.tree is not None else {}),
        **({"joint": counts.joint} if counts.joint is not None else {}),
        **({"decode_passes": counts.decode_passes} if counts.decode_passes is not None else {}),
        **({"consensus_loads": counts.consensus_loads} if counts.consensus_loads else {}),
    }


def client_rows(per_client: dict[int, dict[str, Any]], traffic: Traffic) -> list[dict[str, Any]]:
    """The round's per-client rows in stable-id order, each with its wire bytes by
    message kind (clients that only evaluated get a row too)."""
    for sid, by_kind in traffic.per_client.items():
        row = per_client.setdefault(sid, empty_client_row(sid))
        row["wire_bytes_by_kind"] = dict(sorted(by_kind.items()))
    return [per_client[sid] for sid in sorted(per_client)]


def fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def log_line(record: Mapping[str, Any], num_rounds: int) -> str:
    """The one line printed per round."""
    total, fp32 = record["total_wire_bytes"], record["fp32_total_wire_bytes"]
    evaluate = sum(
        record["traffic"].get(str(k), {}).get("wire_bytes", 0)
        for k in (Kind.EVALUATE_INSTRUCTION, Kind.EVALUATE_REPLY)
    )
    # pre-train client evaluation measures the model the clients received (last round's)
    pre = " (pre-train)" if record.get("client_eval") == "pre-train" else ""
    return (
        f"round {record['round']}/{num_rounds} | accuracy {fmt(record['accuracy'])} "
        f"loss {fmt(record['loss'])} | client acc{pre} {fmt(record['client_accuracy'])} "
        f"| total wire {human_bytes(total, 3)} (fp32/total {fmt(fp32 / total if total else None)}) "
        f"| up codec {human_bytes(record['uplink_codec_bytes'], 3)} "
        f"record {human_bytes(record['uplink_record_bytes'], 3)} "
        f"wire {human_bytes(record['uplink_wire_bytes'], 3)} "
        f"| down wire {human_bytes(record['downlink_wire_bytes'], 3)} "
        f"| evaluate wire {human_bytes(evaluate, 3)} "
        f"| {record['replied']}/{record['selected']} replied | {record['round_s']:.2f} s"
    )


def bare_record(
    server_round: int, central: Mapping[str, float], counts: RoundCounts, error: Exception
) -> dict[str, Any]:
    """A round's record when the full one could not be built (a bug in the
    bookkeeping): the evaluation and the reply counts, zero bytes, and the error."""
    return {
        "round": server_round,
        "accuracy": central.get("accuracy"),
        "loss": central.get("loss"),
        "client_accuracy": None,
        "client_loss": None,
        **dict.fromkeys(_SUMMED, 0),
        "per_client": [],
        "traffic": {},
        "total_wire_bytes": 0,
        "fp32_total_wire_bytes": 0,
        **_outcome_fields(counts, 0.0),
        "codec": {},
        "record_error": f"{type(error).__name__}: {error}"[:500],
    }
