"""The reply decoder: from a round's reply messages to the decoded updates to aggregate.

It validates and decodes every reply (fedcomp.flower.validation, the joint path, the
residual mirrors), counts each failure under one kind (fedcomp.failures.Failure), drops
outliers, and, for the replies that remain, moves their mirrors and acknowledges them.
Nothing a reply holds can stop the round; docs/reliability.md has the order of checks.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Callable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message

from fedcomp.aggregate import RunningMean
from fedcomp.codecs import Codec, Memory, TensorPolicy, make_codec_from_spec
from fedcomp.codecs.residual import SYNC_FULL, SYNC_RESTART
from fedcomp.controlvariates import ControlVariateServer, PendingMirror
from fedcomp.failures import Failure, failure_of, short_reason
from fedcomp.flower.accounting import count, record_bytes
from fedcomp.flower.guards import norm_of
from fedcomp.flower.handoff import client_metrics
from fedcomp.flower.joint import split_reply
from fedcomp.flower.records import account_reply, empty_client_row
from fedcomp.flower.round_state import Decoded, Presum, RoundState
from fedcomp.flower.validation import (
    ReplyError,
    check_reply,
    compressed_names,
    decode_payloads,
    majority_keys,
)
from fedcomp.influence import MAX_NUM_EXAMPLES, outliers, update_norm
from fedcomp.keys import (
    FAULT_REASON_PREFIX,
    KEY_CV_CHECKSUM,
    KEY_CV_VERSION,
    KEY_RESYNC,
    RECORD_PAYLOAD,
)
from fedcomp.onebit import OneBitCode
from fedcomp.traffic import Kind

log = logging.getLogger("fedcomp.flower.strategy")  # one logger for the wrapper's lines

_FP32 = make_codec_from_spec({"name": "fp32"})


class ReplyDecoder:
    """Decodes a round's replies for CompressedStrategy.

    Parameters
    ----------
    codec : Codec, Memory or OneBitCode
        What the server asked the clients to use.
    policy : TensorPolicy or None
        The policy sent to the clients (None: each mod applies its own).
    run_seed : int
        The run's public seed (derived seeds are checked against it).
    cv : ControlVariateServer or None
        Residual memory: the mirrors.
    stable_of : callable
        Node id -> stable id (None for an unknown node).
    reject_factor : float
        Outlier rule (0: off): see fedcomp.influence.outliers.
    max_weight : float
        The largest num-examples a reply may claim (fedcomp.influence.Influence).
    """

    def __init__(
        self,
        codec: Codec | Memory | OneBitCode,
        *,
        policy: TensorPolicy | None,
        run_seed: int,
        cv: ControlVariateServer | None,
        stable_of: Callable[[int], int | None],
        reject_factor: float,
        max_weight: float = MAX_NUM_EXAMPLES,
        stream: bool = False,
        presum: bool = False,
    ) -> None:
        self.codec = codec
        #: Release each decoded update once its norm is known and decode it again when
        #: the reducer adds it (stateless codecs, plain mean): bounded server memory.
        self.stream = stream and not isinstance(codec, OneBitCode)
        #: Also sum the plain mean during the first decode (round_state.Presum).
        self.presum = presum and self.stream
        self.joint = isinstance(codec, OneBitCode)
        #: The stateless codec clients use for compressed tensors (what every payload is
        #: checked against); None for a joint code, whose payloads check themselves.
        self.wire_codec: Codec | None = None
        if not self.joint:
            self.wire_codec = codec.inner if isinstance(codec, Memory) else codec
        self.policy = policy
        self.run_seed = run_seed
        self.cv = cv
        self.stable_of = stable_of
        self.reject_factor = reject_factor
        self.max_weight = max_weight

    def _wire_codec(self, server_round: int) -> Codec | None:
        """This round's stateless codec (a memory may change it by round: DGC's warm-up)."""
        if isinstance(self.codec, Memory):
            return self.codec.inner_for_round(server_round)
        return self.wire_codec

    # ------------------------------------------------------------------ per reply

    def decode_reply(self, msg: Message, state: RoundState) -> Decoded:
        """Validate and decode one reply (raises a Rejection naming the failure)."""
        node_id = msg.metadata.src_node_id
        sid = self.stable_of(node_id)
        if sid is None or sid not in state.sent:
            raise ReplyError(
                f"reply from node {node_id}, which was not asked this round", Failure.NOT_ASKED
            )
        header, metrics, weight, payloads = check_reply(
            msg.content, sid, state.number, max_weight=self.max_weight
        )
        if state.joint is not None:
            deltas, joint, codecs = split_reply(
                self.codec,
                state.joint,
                payloads,
                state.global_arrays,
                run_seed=self.run_seed,
                server_round=state.number,
                stable_id=sid,
            )
            _note_codecs(state, codecs)
            return Decoded(sid, deltas, weight, metrics, msg, joint=joint)
        deltas, codecs, pending, sync = self._decode_update(payloads, header, sid, state)
        _note_codecs(state, codecs)
        return Decoded(sid, deltas, weight, metrics, msg, pending=pending, sync=sync)

    def _decode_update(
        self, payloads: ArrayRecord, header: ConfigRecord, sid: int, state: RoundState
    ) -> tuple[dict[str, np.ndarray], dict[str, str], PendingMirror | None, int]:
        """The reply's update, the codec of each tensor, and under residual memory the
        mirror the reply moves its client to (not stored: the mirror moves only when
        the reply is accepted) and the reply's sync mode."""
        sync = _int_field(header, KEY_RESYNC, 0) if self.cv is not None else 0
        deltas, codecs = decode_payloads(
            payloads,
            state.global_arrays,
            # A full-precision resync sends the covered tensors in fp32.
            codec=_FP32 if sync == SYNC_FULL else self._wire_codec(state.number),
            policy=self.policy,
            run_seed=self.run_seed,
            server_round=state.number,
            stable_id=sid,
        )
        pending = None
        if self.cv is not None:
            ghat, pending = self.cv.prepare(
                sid,
                {name: deltas[name] for name in compressed_names(codecs)},
                version=_int_field(header, KEY_CV_VERSION, -1),
                checksum=str(header.get(KEY_CV_CHECKSUM, "")),
                sync=sync,
            )
            deltas.update(ghat)
        return deltas, codecs, pending, sync

    # ------------------------------------------------------------------ per round

    def decode_all(self, replies: list[Message], state: RoundState) -> list[Decoded]:
        """Validate and decode every reply; a failure of any kind is that client's only.

        Every exception a check or a decoder raises is counted under its failure kind
        (an unexpected one as a bug, with its traceback) and the reply is dropped. A
        client that replied more than once has all its replies dropped: keeping one
        would depend on the order of arrival. Sorted by stable id.
        """
        repeats = Counter(self.stable_of(m.metadata.src_node_id) for m in replies)
        decoded: list[Decoded] = []
        if self.presum:  # sum in stable-id order as the replies are decoded
            replies = sorted(replies, key=self._id_order)
            state.presum = Presum(RunningMean(self._claimed_total(replies, state, repeats)))
        for msg in replies:
            sid = self.stable_of(msg.metadata.src_node_id)
            row = state.per_client.setdefault(sid, empty_client_row(sid)) if sid is not None else {}
            wire = count(state.traffic, Kind.TRAIN_REPLY, msg, client=sid)
            row["uplink_wire_bytes"] = row.get("uplink_wire_bytes", 0) + wire
            if msg.has_error():
                _count_error_reply(state, sid, msg)
                continue
            row["uplink_record_bytes"] = row.get("uplink_record_bytes", 0) + record_bytes(
                msg.content
            )
            try:
                if sid is not None and repeats[sid] > 1:
                    raise ReplyError(
                        f"{repeats[sid]} replies from this client in one round; all dropped",
                        Failure.DUPLICATE,
                    )
                item = self.decode_reply(msg, state)
                if state.presum is not None:
                    state.presum.add(item.stable_id, item.deltas, item.weight)
                if self.stream:
                    self._release(item, state)
                decoded.append(item)
            except Exception as exc:  # every failure is this client's only (docstring)
                reject(state, sid, exc)
        decoded.sort(key=lambda d: d.stable_id)  # reply order never matters
        return decoded

    def _id_order(self, msg: Message) -> tuple[bool, int]:
        """Replies by stable id, unknown senders last."""
        sid = self.stable_of(msg.metadata.src_node_id)
        return (sid is None, sid or 0)

    def _claimed_total(self, replies: list[Message], state: RoundState, repeats: Counter) -> float:
        """The total weight the replies claim, before any payload is decoded: the sum,
        in stable-id order, over those whose header checks pass (what the plain mean's
        total is if every one of them is then accepted unchanged)."""
        weights = []
        for msg in replies:
            sid = self.stable_of(msg.metadata.src_node_id)
            if msg.has_error() or sid is None or sid not in state.sent or repeats[sid] > 1:
                continue
            try:
                weights.append(
                    check_reply(msg.content, sid, state.number, max_weight=self.max_weight)[2]
                )
            except Exception:
                continue
        return float(sum(weights)) if weights else 1.0

    def _release(self, item: Decoded, state: RoundState) -> None:
        """Keep the update's norm, drop the dense update (and a residual reply's
        pending mirror: it is recomputed when committed), decode it again on load."""
        item.norm = update_norm(item.deltas)
        item.deltas = {}
        item.deferred, item.pending = item.pending is not None, None
        item.reload = lambda: self._redecode(item.message, item.stable_id, state)[0]

    def _redecode(
        self, msg: Message, sid: int, state: RoundState
    ) -> tuple[dict[str, np.ndarray], PendingMirror | None]:
        """The same checks and decoders as the first time, on the same bytes, against
        the same mirrors (none is committed before the round's mean is taken)."""
        header, _, _, payloads = check_reply(
            msg.content, sid, state.number, max_weight=self.max_weight
        )
        deltas, _, pending, _ = self._decode_update(payloads, header, sid, state)
        return deltas, pending

    def commit_deferred(self, decoded: list[Decoded], state: RoundState) -> None:
        """Move the mirrors of the accepted residual replies that were released: after
        the mean, whose loads need the mirrors the replies were encoded against. Each
        reply is decoded once more for it, so no round holds a mirror per client."""
        for item in decoded:
            if item.deferred and self.cv is not None:
                _, pending = self._redecode(item.message, item.stable_id, state)
                assert pending is not None
                self.cv.commit(pending)
                item.deferred = False

    def drop_metric_misfits(self, decoded: list[Decoded], state: RoundState) -> list[Decoded]:
        """Set aside replies whose train metric names (fedcomp's own excepted) differ
        from those most replies carry: the inner strategy's metric aggregation needs one
        key set, and a reply with one more key made Flower end the ServerApp. The
        majority is taken over names, so the result does not depend on reply order; with
        no majority (a tie) every reply is set aside."""
        if not decoded:
            return decoded
        names = [frozenset(client_metrics(d).keys()) for d in decoded]
        keys = majority_keys(names, strict=True)
        kept = []
        for item, other in zip(decoded, names, strict=True):
            if other == keys:
                kept.append(item)
                continue
            exc = ReplyError(
                f"train metric names {sorted(other)}, "
                + (
                    "no key set is carried by most replies"
                    if keys is None
                    else f"most replies carry {sorted(keys)}"
                ),
                Failure.BAD_METRICS,
            )
            reject(state, item.stable_id, exc)
        return kept

    def drop_outliers(self, decoded: list[Decoded], state: RoundState) -> list[Decoded]:
        """Drop replies whose update norm is beyond ``reject_factor`` x the median."""
        norms = [norm_of(d) for d in decoded]
        beyond = outliers(norms, self.reject_factor)
        kept = []
        for item, norm, out in zip(decoded, norms, beyond, strict=True):
            if out:
                exc = ReplyError(
                    f"update norm {norm:.3g} is beyond {self.reject_factor:g} x the round's median",
                    Failure.OUTLIER,
                )
                reject(state, item.stable_id, exc)
            else:
                kept.append(item)
        return kept

    def accept(
        self, decoded: list[Decoded], state: RoundState, accepted_round: dict[int, int]
    ) -> None:
        """Account the accepted replies, move their mirrors, and acknowledge them."""
        for item in decoded:
            row = state.per_client[item.stable_id]
            account_reply(row, item.message.content[RECORD_PAYLOAD], item.metrics, item.weight)
            if "fp32_wire_bytes" in row:  # the reply's fp32 size, measured by the client
                state.traffic.correct_fp32(
                    Kind.TRAIN_REPLY, row["uplink_wire_bytes"], row["fp32_wire_bytes"]
                )
            if item.pending is not None and self.cv is not None:
                self.cv.commit(item.pending)
            state.record.resyncs += item.sync == SYNC_FULL
            state.record.restarts += item.sync == SYNC_RESTART
            accepted_round[item.stable_id] = state.number


def reject(state: RoundState, sid: int | None, exc: Exception) -> None:
    """Count and log one rejected reply under its failure kind."""
    kind = failure_of(exc)
    state.record.count_rejection(str(kind), fault=kind is not Failure.RESYNC)
    if kind is Failure.NONFINITE:
        state.record.nonfinite += 1
    if kind is Failure.RESYNC:
        state.record.resync_requests += 1
        log.warning("round %d: client %s: %s", state.number, sid, exc)
        return
    if kind is Failure.UNEXPECTED:  # a decoder bug, not the client's fault alone
        log.error(
            "round %d: reply of client %s could not be decoded (%s: %s)",
            state.number,
            sid,
            type(exc).__name__,
            exc,
            exc_info=exc,
        )
    else:
        log.warning("round %d: rejected reply of client %s [%s]: %s", state.number, sid, kind, exc)


def _count_error_reply(state: RoundState, sid: int | None, msg: Message) -> None:
    injected = re.search(FAULT_REASON_PREFIX + r"(\w+)", str(msg.error.reason))
    state.record.count_fault(injected.group(1) if injected else "error_reply")
    log.warning(
        "round %d: client %s replied with an error: %s",
        state.number,
        sid,
        short_reason(msg.error.reason),
    )


def _int_field(header: ConfigRecord, key: str, default: int) -> int:
    """An integer header field; anything else is a malformed reply, not a crash."""
    value = header.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ReplyError(f"header field {key}={value!r} is not an integer", Failure.MALFORMED)
    return value


def _note_codecs(state: RoundState, codecs: dict[str, str]) -> None:
    """Record which codec each tensor travelled with (the first reply that says so)."""
    for name, codec in codecs.items():
        state.tensor_codecs.setdefault(name, codec)
