"""The reply decoder: from a round's reply messages to decoded updates.

It validates and decodes every reply (fedcomp.flower.validation, the joint path, the
residual mirrors); any failure is set aside as that client's (fedcomp.flower.rejection).
For the streaming hand-off it releases each dense update once its norm is known and
decodes it again when the reducer needs it, and moves the released residual replies'
mirrors after the mean. Nothing a reply holds can stop the round; docs/reliability.md
has the order of checks, fedcomp.flower.uplink the order of the steps.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message

from fedcomp.aggregate import RunningMean
from fedcomp.codecs import Codec, Memory, TensorPolicy, make_codec_from_spec
from fedcomp.codecs.residual import SYNC_FULL
from fedcomp.controlvariates import ControlVariateServer, PendingMirror
from fedcomp.failures import Failure
from fedcomp.flower.joint import split_reply
from fedcomp.flower.rejection import reject
from fedcomp.flower.round_state import Decoded, Presum, RoundState
from fedcomp.flower.validation import (
    ReplyError,
    check_reply,
    compressed_names,
    decode_payloads,
)
from fedcomp.influence import MAX_NUM_EXAMPLES, update_norm
from fedcomp.keys import (
    KEY_CV_CHECKSUM,
    KEY_CV_VERSION,
    KEY_RESYNC,
)
from fedcomp.onebit import OneBitCode

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
            if msg.has_error():  # counted as a fault by the uplink (fedcomp.flower.uplink)
                continue
            sid = self.stable_of(msg.metadata.src_node_id)
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
