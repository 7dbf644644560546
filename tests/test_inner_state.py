"""Checkpoints hold the inner strategy's state explicitly: for every stateful supported
class, a strategy restored from ``inner_state_dict`` aggregates the next round exactly
as the uninterrupted one does; unknown classes are refused by name."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import (
    DifferentialPrivacyServerSideFixedClipping,
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedYogi,
)

from fedcomp.flower.inner_state import (
    UnsupportedStrategy,
    inner_state_dict,
    load_inner_state_dict,
)

NODES = [11, 22, 33]


class _Grid:
    def get_node_ids(self):
        return list(NODES)


def _round(strategy, rnd: int, arrays: ArrayRecord) -> ArrayRecord:
    """One real configure/aggregate round with seeded client models."""
    messages = list(strategy.configure_train(rnd, arrays, ConfigRecord(), _Grid()))
    rng = np.random.default_rng(rnd)
    replies = []
    for i, msg in enumerate(messages):
        local = {
            k: (v.numpy() + rng.normal(size=v.numpy().shape)).astype(np.float32)
            for k, v in arrays.items()
        }
        content = RecordDict(
            {
                "arrays": ArrayRecord({k: Array(v) for k, v in local.items()}),
                "metrics": MetricRecord({"num-examples": 10 + i}),
            }
        )
        replies.append(Message(content, reply_to=msg))
    out, _ = strategy.aggregate_train(rnd, replies)
    return out


def _make(cls):
    common = {"fraction_evaluate": 0.0, "min_available_nodes": 3, "min_train_nodes": 3}
    if cls is FedAvgM:
        return FedAvgM(server_momentum=0.9, **common)
    if cls is DifferentialPrivacyServerSideFixedClipping:
        return cls(FedAvg(**common), noise_multiplier=0.0, clipping_norm=5.0, num_sampled_clients=3)
    return cls(**common)


@pytest.mark.parametrize(
    "cls", [FedAvgM, FedAdam, FedYogi, FedAdagrad, DifferentialPrivacyServerSideFixedClipping]
)
def test_a_restored_strategy_continues_bit_for_bit(cls) -> None:
    arrays = ArrayRecord(
        {"w": Array(np.ones((4, 3), np.float32)), "b": Array(np.zeros(3, np.float32))}
    )
    original = _make(cls)
    for rnd in (1, 2):
        arrays = _round(original, rnd, arrays)
    # Through pickle, as the checkpoint file stores it: plain data only.
    state = pickle.loads(pickle.dumps(inner_state_dict(original)))
    restored = _make(cls)
    load_inner_state_dict(restored, state)
    a, b = _round(original, 3, arrays), _round(restored, 3, arrays)
    for name in a.keys():
        assert np.array_equal(a[name].numpy(), b[name].numpy()), name
    fresh = _round(_make(cls), 3, arrays)  # the state matters: without it, another model
    if cls is not DifferentialPrivacyServerSideFixedClipping:
        assert not all(np.array_equal(a[k].numpy(), fresh[k].numpy()) for k in a.keys())


def test_unknown_strategies_and_mismatched_states_are_refused_by_name() -> None:
    class MyFedAvg(FedAvg):
        pass

    with pytest.raises(UnsupportedStrategy, match=r"MyFedAvg.*supported: .*FedAdam"):
        inner_state_dict(MyFedAvg())
    with pytest.raises(UnsupportedStrategy, match="holds the state of FedAdam"):
        load_inner_state_dict(FedYogi(), inner_state_dict(FedAdam()))
