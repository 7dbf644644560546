"""Error feedback: the telescoping identity, the commit-after-ack rule, and a lost
reply that desynchronizes nothing (in-process, through the real mod and wrapper)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Message, MessageType

from clients.client_app import make_client_app
from experiments.inprocess import InProcessGrid, Spy
from fedcomp.codecs import ErrorFeedback, decode_bytes, make_codec
from fedcomp.flower.memory_state import MemoryState, load_memory
from fedcomp.flower.options import ServerOptions
from fedcomp.flower.reply_format import reply_header
from fedcomp.flower.strategy import CompressedStrategy
from fedcomp.flower.validation import sent_payloads
from fedcomp.keys import KEY_STABLE_ID, RECORD_HEADER
from fedcomp.models import build_model
from fedcomp.observers import Reporting
from fedcomp.settings import settings_from_dict
from strategies.inner import make_inner_strategy
from strategies.server_app import client_task


@pytest.mark.parametrize("inner", [{"inner": "sign", "block": 16}, {"inner": "topk", "k": 5}])
def test_decoded_updates_telescope_to_the_sum_minus_the_error(inner: dict) -> None:
    ef = make_codec("ef", **inner)
    assert isinstance(ef, ErrorFeedback)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(50, generator=gen) for _ in range(20)]
    residual, decoded_sum = None, torch.zeros(50, dtype=torch.float64)
    for t, x in enumerate(xs):
        payload, residual = ef.encode(x, residual, seed=t)
        decoded_sum += decode_bytes(bytes(payload)).double()
    expected = torch.stack(xs).double().sum(0) - residual.double()
    # Each step is exact up to float32 rounding of corrected = x + e and e' = corrected - q.
    assert torch.allclose(decoded_sum, expected, atol=1e-4)
    # Without feedback, sign alone would be off by far more than that.
    plain = sum(decode_bytes(bytes(ef.inner.encode(x, seed=0))).double() for x in xs)
    assert (plain - torch.stack(xs).double().sum(0)).abs().max() > 0.1


def test_encode_does_not_touch_its_inputs_and_checks_shapes() -> None:
    ef = make_codec("ef", inner="sign")
    x, e = torch.randn(10), torch.randn(10)
    x0, e0 = x.clone(), e.clone()
    ef.encode(x, e, seed=1)
    assert torch.equal(x, x0) and torch.equal(e, e0)
    with pytest.raises(ValueError, match="residual shape"):
        ef.encode(x, torch.zeros(3), seed=1)
    with pytest.raises(ValueError, match="inner"):
        make_codec("ef")
    with pytest.raises(ValueError, match="does not take"):
        make_codec("ef", inner="sign", bits=3)


def test_pending_state_is_committed_only_when_acknowledged() -> None:
    a, b = {"w": np.ones(2)}, {"w": np.full(2, 2.0)}
    mem = MemoryState()
    assert mem.begin_round(-1, "ef-sign") == {}
    mem.stage(1, a)
    assert mem.begin_round(1, "ef-sign") is a  # ack of round 1: commit
    mem.stage(2, b)
    assert mem.begin_round(1, "ef-sign") is a  # round 2's reply was lost: drop it
    mem.stage(3, b)
    assert mem.begin_round(3, "ef-topk") == {}  # another codec: start afresh
    restored = MemoryState()
    mem.stage(4, b)
    restored.load_state_dict(mem.state_dict())
    assert restored.pending_round == 4 and np.array_equal(restored.pending["w"], b["w"])


N, LOST_CLIENT, LOST_ROUND = 3, 1, 2


def test_a_lost_reply_desynchronizes_nothing() -> None:
    settings = settings_from_dict(
        {
            "num_clients": N,
            "num_rounds": 3,
            "fraction_evaluate": 0.0,
            "codec": {"name": "ef", "inner": "sign", "block": 64},
        }
    )
    current_round = {"n": 0}

    def drop(pid: int, reply: Message, instruction: Message) -> Message | None:
        is_train = instruction.metadata.message_type == MessageType.TRAIN
        lost = is_train and pid == LOST_CLIENT and current_round["n"] == LOST_ROUND
        return None if lost else reply

    spy = Spy()
    grid = InProcessGrid(make_client_app(inner_mods=[spy]), N, tamper=drop)
    node_of = {grid.partition_of(n): n for n in grid.contexts}
    snapshots: list[dict[int, MemoryState]] = []

    def snapshot(_: dict) -> None:
        snapshots.append({p: load_memory(grid.contexts[n].state) for p, n in node_of.items()})

    strategy = CompressedStrategy(
        make_inner_strategy({"name": "fedavg"}, N, fraction_evaluate=0.0),
        codec=settings.codec,
        run_seed=0,
        reporting=Reporting(on_round=snapshot),
        options=ServerOptions(task=client_task(settings)),
    )
    original = strategy.configure_train

    def configure_train(server_round, arrays, config, grid_):
        current_round["n"] = server_round
        return original(server_round, arrays, config, grid_)

    strategy.configure_train = configure_train  # type: ignore[method-assign]
    model = build_model(settings.model, settings.dataset.name, settings.seed)
    strategy.start(grid, ArrayRecord(model.state_dict()), num_rounds=3)
    assert [r["replied"] for r in strategy.rounds] == [N, N - 1, N]

    after1, after2, after3 = snapshots
    lost, kept = after3[LOST_CLIENT], after3[0]
    # The lost client's round-2 state was never committed: it encodes round 3 against
    # the state of round 1, exactly what the server's view of it agrees with.
    assert lost.pending_round == 3 and kept.pending_round == 3
    for name, e1 in after1[LOST_CLIENT].pending.items():
        assert np.array_equal(lost.committed[name], e1)
        assert not np.array_equal(lost.committed[name], after2[LOST_CLIENT].pending[name])
    for name, e2 in after2[0].pending.items():
        assert np.array_equal(kept.committed[name], e2)

    # And the round-3 payload of the lost client is Q(x3 + e1): decode + e3 = x3 + e1,
    # with x3 = trained - received measured independently by an inner spy mod.
    sent3 = [m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN][-N:]
    instruction = next(m for m in sent3 if m.metadata.dst_node_id == node_of[LOST_CLIENT])
    received = {k: np.array(v.numpy()) for k, v in instruction.content["arrays"].items()}
    reply = [
        r
        for r in grid.replies
        if r.metadata.message_type == MessageType.TRAIN
        and r.has_content()
        and RECORD_HEADER in r.content  # not the identity replies
        and int(reply_header(r.content)[KEY_STABLE_ID]) == LOST_CLIENT
    ][-1]
    checked = 0
    for name, e3 in lost.pending.items():
        header = reply_header(reply.content)
        payloads = sent_payloads(header, spy.local[LOST_CLIENT], 0)  # the strategy's run seed
        decoded = decode_bytes(payloads[name]).numpy()
        x3 = spy.local[LOST_CLIENT][name] - received[name]
        expected = x3 + lost.committed[name]
        assert np.allclose(decoded + e3, expected, atol=1e-6)
        assert not np.allclose(decoded + e3, x3 + after2[LOST_CLIENT].pending[name], atol=1e-6)
        checked += 1
    assert checked >= 2
