"""Validating and decoding one client's reply: every check that protects the server.

A reply that fails any of them becomes a logged failure for that client, of one
:class:`fedcomp.failures.Failure` kind; the server aggregates the others. Sizes,
shapes, codec ids and every body parameter a payload claims are compared with the
global model and with the codec spec the server sent BEFORE anything is decoded or
allocated (docs/reliability.md has the field-by-field table).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import ConfigRecord, MetricRecord, RecordDict

from fedcomp.bundle import BundleError, expand_entries, is_compact, unpack_bundle
from fedcomp.codecs import Codec, TensorPolicy, parse_payload
from fedcomp.codecs.base import JOINT_ONEBIT_ID
from fedcomp.codecs.dense import RawCodec
from fedcomp.codecs.sketch import CountSketchCodec, sketch_seed
from fedcomp.codecs.wire import (
    DTYPE_CODES,
    Payload,
    PayloadHeader,
    SpecMismatch,
    check_field,
)
from fedcomp.compact import HeaderRule
from fedcomp.failures import Failure, Rejection
from fedcomp.flower.packed import PackError
from fedcomp.flower.reply_format import metrics_of, payloads_of, reply_header
from fedcomp.influence import MAX_NUM_EXAMPLES
from fedcomp.keys import (
    KEY_NUM_EXAMPLES,
    KEY_PAYLOADS,
    KEY_PROTOCOL,
    KEY_ROUND,
    KEY_STABLE_ID,
    PROTOCOL_VERSION,
    RECORD_HEADER,
)
from fedcomp.onebit.federated import joint_seed
from fedcomp.own_metrics import own_metrics_problem
from fedcomp.rng import derive_seed

_RAW = RawCodec()


class ReplyError(Rejection):
    """A reply that fails validation; it becomes a logged failure for that client."""

    default_kind = Failure.BAD_LAYOUT


def _torch_dtype(array: np.ndarray) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype


@dataclass(frozen=True)
class CheckedReply:
    """A train reply that passed :func:`check_reply`: what decoding reads from it."""

    header: ConfigRecord
    metrics: MetricRecord
    weight: float
    #: Per tensor of the model, in its order, the payload (a view into the bundle, or a
    #: compact entry's payload rebuilt).
    payloads: dict[str, memoryview]
    #: The bytes the payloads took in the message (a compact entry's, or a full
    #: payload's in a bundle that carried them so): the reply's codec bytes.
    sent_bytes: int = 0


def check_reply(
    content: RecordDict,
    stable_id: int,
    server_round: int,
    names: Sequence[str],
    *,
    max_weight: float = MAX_NUM_EXAMPLES,
    headers: HeaderRule | None = None,
) -> CheckedReply:
    """Check the header, the weight (positive, finite, at most ``max_weight``), the
    metrics (finite scalars) and the payload bundle (exactly the model's tensors
    ``names``, in order; fedcomp.bundle); return them. ``headers``: the rule that
    rebuilds a compact bundle's payload headers (:func:`uplink_headers`).

    Raises
    ------
    ReplyError
        Naming the first problem found, with its failure kind.
    """
    header = _opened_header(content)
    if header.get(KEY_PROTOCOL) != PROTOCOL_VERSION:
        raise ReplyError(
            f"protocol version {header.get(KEY_PROTOCOL)!r} != {PROTOCOL_VERSION}",
            Failure.PROTOCOL,
        )
    if header.get(KEY_STABLE_ID) != stable_id:
        raise ReplyError(
            f"header claims stable id {header.get(KEY_STABLE_ID)!r}, node is {stable_id}",
            Failure.WRONG_CLIENT,
        )
    if header.get(KEY_ROUND) != server_round:
        raise ReplyError(
            f"header is for round {header.get(KEY_ROUND)!r}, not {server_round}",
            Failure.WRONG_ROUND,
        )
    try:
        metrics = metrics_of(header)
    except (TypeError, ValueError) as exc:
        raise ReplyError(f"train metrics: {exc!s:.200}", Failure.BAD_METRICS) from None
    if KEY_NUM_EXAMPLES not in metrics:
        raise ReplyError(f"metrics lack '{KEY_NUM_EXAMPLES}'", Failure.BAD_WEIGHT)
    weight = metrics[KEY_NUM_EXAMPLES]
    if isinstance(weight, list) or not math.isfinite(weight) or not 0 < weight <= max_weight:
        raise ReplyError(
            f"invalid {KEY_NUM_EXAMPLES}={weight!r}: must be in (0, {max_weight:g}]",
            Failure.BAD_WEIGHT,
        )
    check_train_metrics(metrics, max_weight)
    blob = header.get(KEY_PAYLOADS)
    try:
        stored = unpack_bundle(blob, max_entries=len(names), names=names, expand=False)
        payloads = expand_entries(stored, headers) if is_compact(blob) else stored
    except BundleError as exc:
        raise ReplyError(f"payloads: {exc}") from exc
    sent = sum(len(entry) for entry in stored.values())  # as the message carried them
    return CheckedReply(header, metrics, float(weight), payloads, sent)


def _opened_header(content: RecordDict) -> ConfigRecord:
    """The reply's header, its packed fields opened (fedcomp.flower.packed)."""
    try:
        header = reply_header(content)
    except PackError as exc:
        raise ReplyError(f"packed header fields: {exc}") from None
    if header is None:
        raise ReplyError(
            f"no '{RECORD_HEADER}' record: add fedcomp.flower.CompressionMod to the ClientApp",
            Failure.MISSING_MOD,
        )
    return header


def check_train_metrics(metrics: MetricRecord, max_examples: float = MAX_NUM_EXAMPLES) -> None:
    """Every train metric is one finite number: Flower's metric aggregation weighs each
    by num-examples, and a list among scalars (or NaN) made it raise and end the
    ServerApp. fedcomp's own metrics and the pre-train evaluation, which the server
    reads, are also complete and in range (fedcomp.own_metrics)."""
    for key, value in metrics.items():
        if isinstance(value, list) or not math.isfinite(value):
            raise ReplyError(
                f"train metric {key:.80}={value!r:.40} is not a finite number",
                Failure.BAD_METRICS,
            )
    problem = own_metrics_problem(metrics, max_examples)
    if problem:
        raise ReplyError(f"train metrics: {problem}", Failure.BAD_METRICS)


def check_evaluate_reply(
    content: RecordDict, weighted_by: str = KEY_NUM_EXAMPLES, max_examples: float = MAX_NUM_EXAMPLES
) -> MetricRecord:
    """An evaluate reply holds exactly one MetricRecord of finite numbers, with a
    ``weighted_by`` count in (0, ``max_examples``] (what Flower's aggregation needs;
    anything else made Flower raise and end the ServerApp, and a count of 1e300 let
    one client set the aggregated metrics)."""
    if len(content.metric_records) != 1:
        raise ReplyError(
            f"an evaluate reply needs exactly one MetricRecord, got {len(content.metric_records)}"
        )
    (metrics,) = content.metric_records.values()
    for key, value in metrics.items():
        values = value if isinstance(value, list) else [value]
        if not all(math.isfinite(v) for v in values):
            raise ReplyError(
                f"evaluate metric {key:.80}={value!r:.80} is not finite", Failure.NONFINITE
            )
    weight = metrics.get(weighted_by)
    if isinstance(weight, list) or weight is None or not 0 < weight <= max_examples:
        raise ReplyError(
            f"invalid {weighted_by}={weight!r:.40}: must be in (0, {max_examples:g}]",
            Failure.BAD_WEIGHT,
        )
    return metrics


def majority_keys(key_sets: list[frozenset[str]], *, strict: bool = False) -> frozenset[str] | None:
    """The metric names most replies carry, so that replies with other names can be set
    aside without depending on reply order. On a tie: the smallest sorted tuple, or
    with ``strict`` None (no majority: a client choosing its names cannot win a tie,
    and with two clients a tie is one against one)."""
    counts: dict[frozenset[str], int] = {}
    for keys in key_sets:
        counts[keys] = counts.get(keys, 0) + 1
    ranked = sorted(counts, key=lambda keys: (-counts[keys], tuple(sorted(keys))))
    if strict and len(ranked) > 1 and counts[ranked[0]] == counts[ranked[1]]:
        return None
    return ranked[0]


def allowed_codecs(
    reference: np.ndarray, codec: Codec | None, policy: TensorPolicy | None
) -> tuple[Codec, ...]:
    """The codecs a client may have used for one tensor, given what the server sent.

    With a policy sent, exactly the one it picks (raw, or ``codec``); without one the
    mod applies its own threshold, so raw (exact, never larger than the tensor) or
    ``codec``. ``codec`` None: only raw is expected (the joint path's other tensors).
    """
    floating = reference.dtype.kind == "f"
    raw = policy is not None and policy.travels_raw(
        floating, reference.shape, codec, reference.dtype.itemsize
    )
    if codec is None or raw:
        return (_RAW,)
    return (codec,) if policy is not None else (_RAW, codec)


def _check_header(name: str, header: PayloadHeader, reference: np.ndarray) -> None:
    """The claimed shape and dtype against the global tensor, before any decoding."""
    if header.shape != reference.shape:
        raise ReplyError(f"{name}: shape {header.shape} != global {reference.shape}")
    if DTYPE_CODES[header.dtype] != DTYPE_CODES[_torch_dtype(reference)]:
        raise ReplyError(f"{name}: dtype {header.dtype} != global {reference.dtype}")


def _pick_codec(name: str, payload: Payload, allowed: tuple[Codec, ...]) -> Codec:
    """The allowed codec the payload claims to be, checked against its spec."""
    for codec in allowed:
        if payload.header.codec_id == codec.codec_id:
            codec.check_payload(payload)
            return codec
    raise SpecMismatch(
        f"{name}: codec id {payload.header.codec_id}, the server asked for "
        + " or ".join(f"{c.name} (id {c.codec_id})" for c in allowed),
        field="codec id",
        value=payload.header.codec_id,
        expected=[c.codec_id for c in allowed],
    )


def decode_payloads(
    payloads: Mapping[str, bytes | memoryview],
    global_arrays: Mapping[str, np.ndarray],
    *,
    codec: Codec | None,
    policy: TensorPolicy | None,
    run_seed: int,
    server_round: int,
    stable_id: int,
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Decode every tensor's payload after checking it against the global model and
    against the codec spec the server sent (``codec``: the stateless codec the client
    must use for compressed tensors; see :func:`allowed_codecs`).

    Every field a decoder reads is checked before it allocates anything, so decoding
    one reply costs a small multiple of the model's size whatever the payload claims.
    Returns the decoded updates and, per tensor, the name of the codec it used.
    """
    if list(payloads.keys()) != list(global_arrays):
        raise ReplyError("payload tensor names differ from the global model's")
    deltas, codecs = {}, {}
    for name, reference in global_arrays.items():
        payload = parse_payload(payloads[name], max_numel=reference.size)
        _check_header(name, payload.header, reference)
        used = _pick_codec(name, payload, allowed_codecs(reference, codec, policy))
        # Codecs that regenerate public draws carry the derived seed: it must be the
        # one the server derives itself, or decoding would use other draws.
        needs = used.needs_seed
        expected_seed = derive_seed(run_seed, server_round, stable_id, name) if needs else 0
        check_field(f"{name} ({used.name})", "seed", payload.header.seed, expected_seed)
        delta = type(used).decode_payload(payload).numpy()
        if delta.dtype.kind == "f" and not np.isfinite(delta).all():
            raise ReplyError(f"{name}: non-finite values in the update", Failure.NONFINITE)
        deltas[name] = delta
        codecs[name] = used.name
    return deltas, codecs


def uplink_headers(
    global_arrays: Mapping[str, np.ndarray], run_seed: int, server_round: int, stable_id: int
) -> HeaderRule:
    """The uplink's rule for compact payload entries (fedcomp.compact): the header a
    reply's payload had is the global tensor's shape and dtype, and, when it carries a
    public seed, the one :func:`decode_payloads` expects (the client's, the round's
    shared seed for the joint one-bit code, the run's for a count sketch)."""

    def rule(name: str, codec_id: int, seeded: bool) -> PayloadHeader:
        reference = global_arrays.get(name)
        if reference is None:
            raise ValueError(f"{name!r:.80} is not a tensor of the model")
        seed = 0
        if seeded and codec_id == JOINT_ONEBIT_ID:
            seed = joint_seed(run_seed, server_round, name)
        elif seeded and codec_id == CountSketchCodec.codec_id:
            seed = sketch_seed(run_seed, name)
        elif seeded:
            seed = derive_seed(run_seed, server_round, stable_id, name)
        return PayloadHeader(codec_id, _torch_dtype(reference), tuple(reference.shape), seed)

    return rule


def sent_payloads(
    header: ConfigRecord, global_arrays: Mapping[str, np.ndarray], run_seed: int
) -> dict[str, memoryview]:
    """A reply's payloads read as the server reads them, its stable id and round taken
    from its own header: what tools and tests that play the server use (the server
    itself checks those fields first, :func:`check_reply`).

    Raises
    ------
    fedcomp.bundle.BundleError
        A bundle that does not hold the model's tensors.
    """
    rule = uplink_headers(
        global_arrays, run_seed, int(header[KEY_ROUND]), int(header[KEY_STABLE_ID])
    )
    return payloads_of(header, list(global_arrays), rule)


def compressed_names(codecs: Mapping[str, str]) -> set[str]:
    """Tensors that did not travel raw (those a residual memory covers)."""
    return {name for name, codec in codecs.items() if codec != RawCodec.name}
