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

from flwr.app import Message

from fedcomp.aggregate import RunningMean
from fedcomp.failures import Failure
from fedcomp.flower.families.base import DecodedUpdate, ServerHalf
from fedcomp.flower.rejection import reject
from fedcomp.flower.round_state import Decoded, Presum, RoundState
from fedcomp.flower.validation import CheckedReply, ReplyError, check_reply, uplink_headers
from fedcomp.influence import MAX_NUM_EXAMPLES, update_norm

log = logging.getLogger("fedcomp.flower.strategy")  # one logger for the wrapper's lines


class ReplyDecoder:
    """Decodes a round's replies for CompressedStrategy.

    Parameters
    ----------
    half : ServerHalf
        The codec family's server half (fedcomp.flower.families): what one reply's
        payloads decode to.
    stable_of : callable
        Node id -> stable id (None for an unknown node).
    max_weight : float
        The largest num-examples a reply may claim (fedcomp.influence.Influence).
    run_seed : int
        The run's public seed (the compact payload headers' seeds derive from it).
    stream : bool
        Release each decoded update once its norm is known and decode it again when
        the reducer adds it: bounded server memory (not for joint codes, whose bits
        are decoded together).
    presum : bool
        Also sum the plain mean during the first decode (round_state.Presum).
    """

    def __init__(
        self,
        half: ServerHalf,
        *,
        stable_of: Callable[[int], int | None],
        max_weight: float = MAX_NUM_EXAMPLES,
        run_seed: int = 0,
        stream: bool = False,
        presum: bool = False,
    ) -> None:
        self.half = half
        self.stream = stream and not half.joint
        self.presum = presum and self.stream
        self.stable_of = stable_of
        self.max_weight = max_weight
        self.run_seed = run_seed

    # ------------------------------------------------------------------ per reply

    def check(self, msg: Message, state: RoundState, repeats: Counter) -> CheckedReply:
        """Validate one reply, once (raises a Rejection naming the failure)."""
        node_id = msg.metadata.src_node_id
        sid = self.stable_of(node_id)
        if sid is not None and repeats[sid] > 1:
            raise ReplyError(
                f"{repeats[sid]} replies from this client in one round; all dropped",
                Failure.DUPLICATE,
            )
        if sid is None or sid not in state.sent:
            raise ReplyError(
                f"reply from node {node_id}, which was not asked this round", Failure.NOT_ASKED
            )
        return check_reply(
            msg.content,
            sid,
            state.number,
            list(state.global_arrays),
            max_weight=self.max_weight,
            headers=uplink_headers(state.global_arrays, self.run_seed, state.number, sid),
        )

    def decode_reply(self, msg: Message, checked: CheckedReply, state: RoundState) -> Decoded:
        """Decode one validated reply (raises a Rejection naming the failure)."""
        sid = self.stable_of(msg.metadata.src_node_id)
        assert sid is not None  # check() refused unknown senders
        update = self.half.decode(checked.payloads, checked.header, sid, state)
        for name, codec in update.codecs.items():  # the first reply that says so
            state.tensor_codecs.setdefault(name, codec)
        return Decoded(
            sid,
            update.deltas,
            checked.weight,
            checked.metrics,
            msg,
            header=checked.header,
            payloads=checked.payloads,
            codec_bytes=checked.sent_bytes,
            joint=update.joint,
            pending=update.pending,
            sync=update.sync,
        )

    # ------------------------------------------------------------------ per round

    def decode_all(self, replies: list[Message], state: RoundState) -> list[Decoded]:
        """Validate and decode every reply; a failure of any kind is that client's only.

        Every reply is validated once, before any is decoded. Every exception a check
        or a decoder raises is counted under its failure kind (an unexpected one as a
        bug, with its traceback) and the reply is dropped. A client that replied more
        than once has all its replies dropped: keeping one would depend on the order of
        arrival. Sorted by stable id.
        """
        repeats = Counter(self.stable_of(m.metadata.src_node_id) for m in replies)
        if self.stream:  # sums in stable-id order as the replies are decoded
            replies = sorted(replies, key=self._id_order)
        checks: list[tuple[Message, CheckedReply | Exception]] = []
        for msg in replies:
            if msg.has_error():  # counted as a fault by the uplink (fedcomp.flower.uplink)
                continue
            try:
                checks.append((msg, self.check(msg, state, repeats)))
            except Exception as exc:  # every failure is this client's only (docstring)
                checks.append((msg, exc))
        if self.presum:  # the total the checked replies claim, before any is decoded
            weights = [c.weight for _, c in checks if isinstance(c, CheckedReply)]
            state.presum = Presum(RunningMean(float(sum(weights)) if weights else 1.0))
        decoded = [d for msg, checked in checks if (d := self._decode(msg, checked, state))]
        decoded.sort(key=lambda d: d.stable_id)  # reply order never matters
        return decoded

    def _decode(
        self, msg: Message, checked: CheckedReply | Exception, state: RoundState
    ) -> Decoded | None:
        """One checked reply decoded (None: it failed, counted as its sender's)."""
        try:
            if isinstance(checked, Exception):
                raise checked
            item = self.decode_reply(msg, checked, state)
            if state.presum is not None:
                state.presum.add(item.stable_id, item.deltas, item.weight)
            if self.stream:
                item.norm = update_norm(item.deltas)
                if state.consensus is not None:
                    state.consensus.add(item.stable_id, item.deltas, item.norm)
                self._release(item, state)
            return item
        except Exception as exc:  # every failure is this client's only (decode_all)
            reject(state, self.stable_of(msg.metadata.src_node_id), exc)
            return None

    def _id_order(self, msg: Message) -> tuple[bool, int]:
        """Replies by stable id, unknown senders last."""
        sid = self.stable_of(msg.metadata.src_node_id)
        return (sid is None, sid or 0)

    def _release(self, item: Decoded, state: RoundState) -> None:
        """Drop the dense update (its norm is kept) and a residual reply's pending
        mirror (it is recomputed when committed); decode it again on load."""
        item.deltas = {}
        item.deferred, item.pending = item.pending is not None, None
        item.reload = lambda: self._redecode(item, state).deltas

    def _redecode(self, item: Decoded, state: RoundState) -> DecodedUpdate:
        """The same decoders as the first time, on the same checked bytes, against the
        same mirrors (none is committed before the round's mean is taken)."""
        return self.half.decode(item.payloads, item.header, item.stable_id, state)

    def commit_deferred(self, decoded: list[Decoded], state: RoundState) -> None:
        """Move the mirrors of the accepted residual replies that were released: after
        the mean, whose loads need the mirrors the replies were encoded against. Each
        reply is decoded once more for it, so no round holds a mirror per client."""
        for item in decoded:
            if item.deferred:
                pending = self._redecode(item, state).pending
                assert pending is not None
                self.half.commit(pending)
                item.deferred = False
