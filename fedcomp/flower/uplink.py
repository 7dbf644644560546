"""A round's uplink on the server: from the train replies to what the inner strategy gets.

One object, :class:`Uplink`, built once by the wrapper, takes each round's replies
through the steps of docs/reliability.md, in order: count every reply's bytes;
validate and decode each (fedcomp.flower.decoding; a bad reply is its sender's logged
failure); set aside replies whose metric names differ from the majority's
(fedcomp.flower.rejection) and outliers (fedcomp.flower.bounds); acknowledge the rest
(their residual mirrors move, their clients may commit); cap weights and clip norms;
hand the result over (fedcomp.flower.handoff); move the mirrors of released replies.
After the inner strategy it checks the aggregate (:meth:`Uplink.settle`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord

from fedcomp.codecs import TensorPolicy
from fedcomp.codecs.residual import SYNC_FULL, SYNC_RESTART
from fedcomp.flower.accounting import measure_and_record, record_bytes
from fedcomp.flower.bounds import InfluenceBounds, drop_outliers
from fedcomp.flower.budget import check_round_copies
from fedcomp.flower.decoding import ReplyDecoder
from fedcomp.flower.families import Family
from fedcomp.flower.handoff import make_handoff
from fedcomp.flower.options import ServerOptions
from fedcomp.flower.reference import ReplyReference, layout_of
from fedcomp.flower.rejection import count_error_reply, drop_metric_misfits
from fedcomp.flower.round_records import account_reply, empty_client_row
from fedcomp.flower.round_state import Decoded, RoundState
from fedcomp.injected import draw_fault
from fedcomp.traffic import Kind
from fedcomp.trees.aggregate import TreeConfig, TreeStats

log = logging.getLogger("fedcomp.flower.strategy")  # one logger for the wrapper's lines


class Uplink:
    """The server half of the uplink: decoder, bounds, hand-off and the state they keep.

    Parameters
    ----------
    family : Family
        The codec family of what the clients were asked to use
        (fedcomp.flower.families.family_of).
    options : ServerOptions
        Hand-off, trees, mirror directory, influence bounds and the policy sent.
    run_seed : int
        The run's public seed.
    stable_of : callable
        Node id -> stable id (None for an unknown node).
    policy : TensorPolicy or None
        The policy sent to the clients (None: each mod applies its own).
    """

    def __init__(
        self,
        family: Family,
        options: ServerOptions,
        run_seed: int,
        stable_of: Callable[[int], int | None],
        *,
        policy: TensorPolicy | None,
    ) -> None:
        agg, influence = options.aggregation, options.influence
        self.aggregation = agg
        #: The policy the clients apply (the fp32 reference's raw tensors).
        self.policy = policy or TensorPolicy()
        self.reference: ReplyReference | None = None
        #: Fault injection's rates, from the task the clients get (clients.faults).
        self.fault_rates = dict((options.task or {}).get("faults") or {})
        self.run_seed = run_seed
        #: The codec family's server half: what each reply decodes to, and its state.
        self.half = family.server(policy, run_seed, agg.mirror_dir)
        self.joint = self.half.joint
        #: Residual memory's mirrors (None for other families; the round record's).
        self.cv = self.half.cv
        #: The joint code's state across rounds (None for other families).
        self.joint_state = getattr(self.half, "joint_state", None)
        self.tree_stats = TreeStats()
        self.stable_of = stable_of
        self.decoder = ReplyDecoder(
            self.half,
            stable_of=stable_of,
            max_weight=influence.max_num_examples,
            run_seed=run_seed,
            # the plain mean and the trees take updates one at a time: release them
            # between passes (the one-bit path keeps its bits: decoding.py)
            stream=agg.pre_aggregated,
            presum=agg.pre_aggregated and agg.trees == TreeConfig(),
        )
        self.reject_factor = influence.reject_factor
        self.bounds = InfluenceBounds(influence, clip=not self.joint)
        self.handoff = make_handoff(
            agg.handoff, trees=agg.trees, tree_stats=self.tree_stats, reducer=self.half.reducer()
        )

    def receive(
        self, replies: list[Message], state: RoundState, accepted_round: dict[int, int]
    ) -> list[Decoded]:
        """The round's accepted replies, decoded, sorted by stable id and acknowledged
        (``accepted_round`` gets each accepted client's round)."""
        self._account(replies, state)
        if self.decoder.stream:
            state.consensus = self.bounds.start_consensus()
        decoded = self.decoder.decode_all(replies, state)
        decoded = drop_metric_misfits(decoded, state)
        decoded = drop_outliers(decoded, state, self.reject_factor)
        self._acknowledge(decoded, state, accepted_round)
        return decoded

    def hand_off(self, decoded: list[Decoded], state: RoundState) -> list[Message] | None:
        """Bound the accepted replies' influence; what the inner strategy aggregates
        (None: nothing to hand over). Released residual replies' mirrors move here,
        after the mean, whatever happens: their replies were acknowledged."""
        bounded = self.bounds.apply(decoded, state)
        try:
            return self.handoff.replies(decoded, state) if bounded else None
        finally:
            self.decoder.commit_deferred(decoded, state)

    def _account(self, replies: list[Message], state: RoundState) -> None:
        """Every reply's bytes as it arrived (wire and record), and each error reply."""
        for msg in replies:
            sid = self.stable_of(msg.metadata.src_node_id)
            row = state.per_client.setdefault(sid, empty_client_row(sid)) if sid is not None else {}
            wire = measure_and_record(state.traffic, Kind.TRAIN_REPLY, msg, client=sid)
            row["uplink_wire_bytes"] = row.get("uplink_wire_bytes", 0) + wire
            if msg.has_error():
                count_error_reply(state, sid, msg, self._expected_fault(state.number, sid))
                continue
            row["uplink_record_bytes"] = row.get("uplink_record_bytes", 0) + record_bytes(
                msg.content
            )

    def _acknowledge(
        self, decoded: list[Decoded], state: RoundState, accepted_round: dict[int, int]
    ) -> None:
        """Account the accepted replies, move their mirrors, and acknowledge them."""
        reference = self._reference(state)
        for item in decoded:
            row = state.per_client[item.stable_id]
            account_reply(row, item, item.metrics, item.weight, reference)
            state.traffic.correct_fp32(  # the reply's fp32 size, computed by the server
                Kind.TRAIN_REPLY,
                row["uplink_wire_bytes"],
                row["fp32_wire_bytes"],
                objects=(row["content_objects"], row["fp32_content_objects"]),
            )
            if item.pending is not None:
                self.half.commit(item.pending)
            self.half.accepted(item.stable_id, item.weight)
            state.record.resyncs += item.sync == SYNC_FULL
            state.record.restarts += item.sync == SYNC_RESTART
            accepted_round[item.stable_id] = state.number

    def _expected_fault(self, server_round: int, sid: int | None) -> str | None:
        """The fault the run's injection drew for this client (None: none, or no
        injection: fedcomp.injected)."""
        if sid is None or not self.fault_rates or not any(self.fault_rates.values()):
            return None
        return draw_fault(self.fault_rates, self.run_seed, server_round, sid)

    def _reference(self, state: RoundState) -> ReplyReference:
        """The fp32 reference of this round's replies (rebuilt when the model's
        layout changes; fedcomp.flower.reference)."""
        layout = layout_of(state.global_arrays)
        if self.reference is None or self.reference.layout != layout:
            self.reference = ReplyReference(state.global_arrays, self.policy)
        return self.reference

    def settle(
        self, arrays: ArrayRecord | None, metrics: MetricRecord | None, state: RoundState
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The inner strategy's aggregate in the model's dtypes; (None, None), the
        model kept, when it is not finite."""
        if arrays is None:
            return None, metrics
        arrays = cast_like(arrays, state.global_arrays)
        if not all_finite(arrays):
            log.error(
                "round %d: the aggregate is not finite; the global model is kept", state.number
            )
            state.record.aggregate_nonfinite = 1
            return None, None
        return arrays, metrics

    def prepare(self, state: RoundState, selected: list[int], policy: TensorPolicy) -> None:
        """Before the round's instructions leave: the joint code's plan (who answers
        which queries), and the refusal of a round whose dense copies cannot fit."""
        self.half.plan(state, selected, policy)
        check_round_copies(
            len(selected),
            state.global_arrays,
            per_client=not self.aggregation.pre_aggregated,
            mirrors_in_memory=self.half.mirrors_in_memory(),
        )

    def resync_requested(self, stable_id: int) -> bool:
        """Whether the client's next train instruction asks for a full resync."""
        return self.half.resync_requested(stable_id)

    def state_dict(self) -> dict[str, Any]:
        """What the uplink carries across rounds (checkpoints: fedcomp.flower.resume)."""
        return {
            "cv": None,  # the families' state under the keys checkpoints have always used
            "joint": None,
            **self.half.state_dict(),
            "tree_stats": self.tree_stats.state_dict(),
            **self.bounds.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.bounds.load_state_dict(state)
        self.half.load_state_dict(state)
        if "tree_stats" in state:
            self.tree_stats.load_state_dict(state["tree_stats"])


def cast_like(arrays: ArrayRecord, reference: Mapping[str, np.ndarray]) -> ArrayRecord:
    """The inner strategy's output in the global model's dtypes. Flower's FedOpt
    strategies return float64 arrays: every later instruction would carry twice the
    bytes, and every reply would fail the dtype check against the model."""
    if all(np.asarray(v.numpy()).dtype == reference[k].dtype for k, v in arrays.items()):
        return arrays
    return ArrayRecord(
        {
            k: Array(np.asarray(v.numpy()).astype(reference[k].dtype, copy=False))
            for k, v in arrays.items()
        }
    )


def all_finite(arrays: ArrayRecord) -> bool:
    """True when every floating-point array of the record is finite."""
    for value in arrays.values():
        array = np.asarray(value.numpy())
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            return False
    return True
