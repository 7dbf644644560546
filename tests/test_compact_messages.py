"""Compact messages (protocol 2): a compressed reply and a model-free downlink
instruction are a fixed number of Flower objects whatever the model's tensor count,
and a message of the previous format is refused on both sides, naming both versions."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from fedcomp.codecs import TensorPolicy
from fedcomp.downlink import BroadcastServer, Replica, parse_downlink
from fedcomp.failures import Failure
from fedcomp.flower.mod import CompressionMod
from fedcomp.flower.replica import ReplicaSender, rebuild_model
from fedcomp.flower.reply_format import reply_header
from fedcomp.flower.validation import ReplyError, check_reply, sent_payloads, uplink_headers
from fedcomp.keys import (
    DOWNLINK_STEPS,
    KEY_CODEC,
    KEY_DOWNLINK_CODEC,
    KEY_DOWNLINK_PAYLOADS,
    KEY_NUM_EXAMPLES,
    KEY_PACKED,
    KEY_PAYLOADS,
    KEY_PROTOCOL,
    KEY_ROUND,
    KEY_RUN_SEED,
    KEY_STABLE_ID,
    PROTOCOL_VERSION,
    RECORD_HEADER,
)

SID, ROUND = 4, 2


def _objects(obj) -> int:
    return len(get_all_nested_objects(obj))


def _model(tensors: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"layer{i}.weight": rng.standard_normal((20, 30)).astype(np.float32)
            for i in range(tensors)}  # fmt: skip


# ------------------------------------------------------------------- object counts


@pytest.mark.parametrize("tensors", [1, 4, 16])
def test_a_train_reply_through_the_mod_is_four_objects_for_any_tensor_count(tensors) -> None:
    """Message, RecordDict and the header holding every payload and metric: the fewest
    objects a Flower message can be, whatever the model (protocol 1: a MetricRecord,
    an ArrayRecord and one Array and one chunk per tensor besides)."""
    model = _model(tensors)
    trained = {k: v + 0.01 for k, v in model.items()}
    config = ConfigRecord(
        {
            KEY_CODEC: json.dumps({"name": "uniform", "bits": 4}),
            KEY_PROTOCOL: PROTOCOL_VERSION,
            KEY_ROUND: ROUND,
            KEY_RUN_SEED: 7,
        }
    )
    instruction = Message(
        RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in model.items()}),
                    "config": config}),
        dst_node_id=1,
        message_type=MessageType.TRAIN,
    )  # fmt: skip

    def app(msg: Message, ctxt: Context) -> Message:
        arrays = ArrayRecord({k: Array(v) for k, v in trained.items()})
        metrics = MetricRecord({KEY_NUM_EXAMPLES: 10})
        return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)

    ctxt = Context(1, 11, {"partition-id": SID, "num-partitions": 8}, RecordDict(), {})
    reply = CompressionMod(TensorPolicy(min_numel=0))(instruction, ctxt, app)
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    assert _objects(reply) == 3
    # two entries: fedcomp's fields and metrics packed (fedcomp.flower.packed), the bundle
    assert set(reply.content[RECORD_HEADER]) == {KEY_PACKED, KEY_PAYLOADS}
    header = reply_header(reply.content)
    assert len(sent_payloads(header, model, 7)) == tensors
    assert KEY_CODEC not in header  # the server knows the spec it sent: not echoed back
    # and the server accepts it: the bundle is exactly the model's tensors in order
    rule = uplink_headers(model, 7, ROUND, SID)
    checked = check_reply(reply.content, SID, ROUND, list(model), headers=rule)
    assert checked.weight == 10.0 and list(checked.payloads) == list(model)
    assert checked.metrics[KEY_NUM_EXAMPLES] == 10  # the app's metric, next to fedcomp's
    assert all(k == KEY_NUM_EXAMPLES or k.startswith("fedcomp.") for k in checked.metrics)


@pytest.mark.parametrize("tensors", [1, 4, 16])
def test_a_model_free_downlink_instruction_is_three_objects(tensors) -> None:
    """Message, RecordDict and the config holding the step list and every step's
    payloads; the client rebuilds the model from them bit for bit."""
    server = BroadcastServer(parse_downlink({"name": "uniform", "bits": 4}), TensorPolicy(), 7)
    server.start(_model(tensors, 0))
    replica = Replica().take_full(server.x_hat, 0, server.checksum)
    server.confirmed[SID] = 0
    for version in (1, 2):
        server.advance(_model(tensors, version))
    content = RecordDict({"arrays": ArrayRecord(), "config": ConfigRecord({"lr": 0.1})})
    sender = ReplicaSender(server)
    assert sender.attach(content, SID, model_free=True) == DOWNLINK_STEPS
    content["config"][KEY_DOWNLINK_CODEC] = sender.codec_json  # as the mod restores it
    content["config"][KEY_RUN_SEED] = 7  # every instruction carries it (the steps' seeds)
    msg = Message(content, dst_node_id=1, message_type=MessageType.TRAIN)
    assert _objects(msg) == 3
    new = rebuild_model(msg, replica)
    assert new.version == 2 and new.checksum == server.checksum
    for name, value in server.x_hat.items():
        assert np.array_equal(msg.content["arrays"][name].numpy(), value)
    assert KEY_DOWNLINK_PAYLOADS not in msg.content["config"]  # the app sees the model


# ---------------------------------------------------------------- the previous format


def _version_1_reply() -> RecordDict:
    """A train reply as protocol 1 wrote it: one raw uint8 Array per tensor in the
    record "fedcomp.payload", the header without payloads."""
    header = ConfigRecord({KEY_PROTOCOL: 1, KEY_STABLE_ID: SID, KEY_ROUND: ROUND})
    payload = Array(dtype="uint8", shape=(3,), stype="raw", data=b"\x01\x02\x03")
    return RecordDict(
        {
            "fedcomp.payload": ArrayRecord({"w": payload}),
            RECORD_HEADER: header,
            "metrics": MetricRecord({KEY_NUM_EXAMPLES: 5}),
        }
    )


def test_a_version_1_reply_is_refused_naming_both_versions() -> None:
    with pytest.raises(ReplyError) as info:
        check_reply(_version_1_reply(), SID, ROUND, ["w"])
    assert info.value.kind is Failure.PROTOCOL
    assert f"protocol version 1 != {PROTOCOL_VERSION}" in str(info.value)


def test_a_version_1_instruction_is_refused_by_the_mod_before_training() -> None:
    config = ConfigRecord(
        {KEY_CODEC: json.dumps({"name": "fp32"}), KEY_PROTOCOL: 1, KEY_ROUND: 1, KEY_RUN_SEED: 3}
    )
    msg = Message(
        RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(3, np.float32))}),
                    "config": config}),
        dst_node_id=1,
        message_type=MessageType.TRAIN,
    )  # fmt: skip

    def never(msg: Message, ctxt: Context) -> Message:
        raise AssertionError("the app trained on an instruction of another protocol")

    ctxt = Context(1, 11, {"partition-id": SID, "num-partitions": 8}, RecordDict(), {})
    reply = CompressionMod()(msg, ctxt, never)
    assert reply.has_error()
    assert f"server protocol 1, this client speaks {PROTOCOL_VERSION}" in reply.error.reason


def test_the_settings_digest_and_handles_travel_only_in_the_reply_to_settings_in_full() -> None:
    """A client states the run settings' digest (and the kinds it handles) in its reply
    to an instruction that carried them in full, never in the reply to a digest-only
    one; the server counts a client as holding them from that statement and until an
    error reply, whatever replies without a digest come between."""
    from fedcomp.flower.shared_settings import SharedSettings
    from fedcomp.keys import KEY_HANDLES, KEY_SETTINGS

    model = _model(2)
    shared = SharedSettings({KEY_CODEC: json.dumps({"name": "uniform", "bits": 4})})

    def instruction(full: bool) -> Message:
        config = ConfigRecord({KEY_PROTOCOL: PROTOCOL_VERSION, KEY_ROUND: ROUND, KEY_RUN_SEED: 7})
        shared.fill(config, SID, restores=not full)
        assert (KEY_CODEC in config) == full
        arrays = ArrayRecord({k: Array(v) for k, v in model.items()})
        return Message(
            RecordDict({"arrays": arrays, "config": config}),
            dst_node_id=1,
            message_type=MessageType.TRAIN,
        )

    def app(msg: Message, ctxt: Context) -> Message:
        arrays = ArrayRecord({k: Array(v + 0.01) for k, v in model.items()})
        metrics = MetricRecord({KEY_NUM_EXAMPLES: 10})
        return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)

    ctxt = Context(1, 11, {"partition-id": SID, "num-partitions": 8}, RecordDict(), {})
    mod = CompressionMod(TensorPolicy(min_numel=0))
    first = reply_header(mod(instruction(True), ctxt, app).content)
    assert first[KEY_SETTINGS] == shared.digest and KEY_HANDLES in first
    shared.note_reply(SID, first)
    assert SID in shared.held
    later = reply_header(mod(instruction(False), ctxt, app).content)
    assert KEY_SETTINGS not in later and KEY_HANDLES not in later
    shared.note_reply(SID, later)  # no statement: still held
    assert SID in shared.held
    shared.note_reply(SID, ConfigRecord({KEY_SETTINGS: "0" * 16}))  # another digest
    assert SID not in shared.held
