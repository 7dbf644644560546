"""How decoded updates reach the inner Flower strategy: one object per mode, chosen once
when the wrapper is built (``make_handoff``), never re-decided per round.

- ``PerClient``: one dense reply per client (global + decoded update), in stable-id
  order; any inner strategy works.
- ``PreAggregated``: one synthetic reply, global + the mean update, with a reducer:
  ``PlainMean`` (float32 running sum in stable-id order), ``TreeMean`` (variance-aware
  reduction trees, fedcomp.trees) or a codec family's own (the one-bit code's joint
  decoder, fedcomp.flower.families.joint.JointMean).
"""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from fedcomp.aggregate import weighted_mean
from fedcomp.flower.round_state import Decoded, RoundState
from fedcomp.keys import KEY_NUM_EXAMPLES, RECORD_METRICS

# Client metric names with this prefix are fedcomp's own: aggregated by the wrapper,
# not handed to the inner strategy.
from fedcomp.own_metrics import OWN_PREFIX
from fedcomp.trees.aggregate import TreeConfig, TreeStats
from fedcomp.trees.stream import streaming_tree_mean

log = logging.getLogger("fedcomp.flower.strategy")

_ARRAYS = "arrays"


def client_metrics(item: Decoded) -> MetricRecord:
    """A reply's metrics without fedcomp's own."""
    return MetricRecord({k: v for k, v in item.metrics.items() if not k.startswith(OWN_PREFIX)})


class Handoff(Protocol):
    def replies(self, decoded: list[Decoded], state: RoundState) -> list[Message] | None:
        """The messages to hand the inner strategy (None: keep the model)."""


class PerClient:
    """One dense reply per client, sorted by stable id."""

    def replies(self, decoded: list[Decoded], state: RoundState) -> list[Message] | None:
        return [
            Message(
                RecordDict(
                    {
                        _ARRAYS: ArrayRecord(
                            {
                                name: Array(np.asarray(state.global_arrays[name] + delta))
                                for name, delta in d.deltas.items()
                            }
                        ),
                        RECORD_METRICS: client_metrics(d),
                    }
                ),
                reply_to=state.sent[d.stable_id],
            )
            for d in decoded
        ]


class Reducer(Protocol):
    def mean(self, decoded: list[Decoded], state: RoundState) -> dict[str, np.ndarray] | None:
        """The weighted mean update of the decoded replies (None: keep the model)."""


class PlainMean:
    """float32 running sum in stable-id order (fedcomp.aggregate.weighted_mean); each
    update is loaded when it is added, so released ones are decoded one at a time.
    When the sum taken during the first decode is the mean of exactly the accepted
    replies (round_state.Presum), it is used as is and nothing is decoded again."""

    def mean(self, decoded: list[Decoded], state: RoundState) -> dict[str, np.ndarray] | None:
        presum, state.presum = state.presum, None  # freed before any second pass
        if presum is not None:
            state.record.decode_passes = 1 if presum.matches(decoded) else 2
            if state.record.decode_passes == 1:
                return presum.running.result()
            del presum
        return weighted_mean([d.load for d in decoded], [d.weight for d in decoded])


class TreeMean:
    """Variance-aware reduction trees, possibly in bf16/fp16 (fedcomp.trees), evaluated
    as the updates are loaded: a bounded number of partial sums alive."""

    def __init__(self, config: TreeConfig, stats: TreeStats) -> None:
        self.config, self.stats = config, stats

    def mean(self, decoded: list[Decoded], state: RoundState) -> dict[str, np.ndarray] | None:
        mean, report = streaming_tree_mean(
            [d.load for d in decoded],
            [d.weight for d in decoded],
            [d.stable_id for d in decoded],
            self.config,
            self.stats,
            state.number,
        )
        state.record.tree = report
        return mean


class PreAggregated:
    """One synthetic reply: global + the reducer's mean, weights summed, the clients'
    metrics aggregated."""

    def __init__(self, reducer: Reducer) -> None:
        self.reducer = reducer

    def replies(self, decoded: list[Decoded], state: RoundState) -> list[Message] | None:
        mean = self.reducer.mean(decoded, state)
        if mean is None:
            return None
        metrics = aggregate_metricrecords(
            [RecordDict({RECORD_METRICS: client_metrics(d)}) for d in decoded], KEY_NUM_EXAMPLES
        )
        metrics[KEY_NUM_EXAMPLES] = sum(d.weight for d in decoded)
        arrays = ArrayRecord(
            {
                name: Array(np.asarray(state.global_arrays[name] + mean[name]))
                for name in state.global_arrays
            }
        )
        content = RecordDict({_ARRAYS: arrays, RECORD_METRICS: metrics})
        return [Message(content, reply_to=state.sent[decoded[0].stable_id])]


def make_handoff(
    handoff: str, *, trees: TreeConfig, tree_stats: TreeStats, reducer: Reducer | None = None
) -> Handoff:
    """The hand-off for the wrapper's settings (already checked by fedcomp.rules);
    ``reducer``: the codec family's own mean (the joint code's), which the
    pre-aggregated hand-off then uses."""
    if handoff == "per_client":
        return PerClient()
    if reducer is not None:
        return PreAggregated(reducer)
    if trees == TreeConfig():
        return PreAggregated(PlainMean())
    return PreAggregated(TreeMean(trees, tree_stats))
