"""Invariants of the downlink's server half that the downlink mutation run found
unpinned: the checkpoint round trip of BroadcastServer, what confirm and forget do to
the next instruction, and drift against its definition. Expected values are computed
here from the definitions (docs/downlink.md)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from fedcomp.codecs import TensorPolicy, decode_bytes
from fedcomp.codecs.entropy import max_inner_size
from fedcomp.downlink import (
    MAX_STEPS,
    BroadcastServer,
    Replica,
    ReplicaError,
    Step,
    apply_step,
    check_chain,
    check_step_bytes,
    check_step_payload,
    check_step_payloads,
    contraction_scale,
    parse_downlink,
)
from fedcomp.rng import derive_seed

UNIFORM4 = {"name": "uniform", "bits": 4, "block": 256}


def _model(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "count": np.array([seed], dtype=np.int64),  # an integer buffer first
        "w": rng.normal(size=(40, 30)).astype(np.float32),
        "b": rng.normal(size=6).astype(np.float32),  # too small for any codec to pay: raw
    }


def _server(memory: str = "error_feedback", initial: str = "sent") -> BroadcastServer:
    spec = parse_downlink({**UNIFORM4, "memory": memory, "initial": initial})
    return BroadcastServer(spec, TensorPolicy(), 7)


def _same_arrays(a: dict[str, np.ndarray] | None, b: dict[str, np.ndarray] | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a
    )


@pytest.mark.parametrize("memory", ["error_feedback", "none"])
def test_a_restored_server_continues_exactly_as_the_original(memory: str) -> None:
    server = _server(memory)
    server.start(_model(0))
    for i in (1, 2, 3):
        server.advance(_model(i))
    server.confirm(4, server.version, server.checksum)
    restored = _server(memory)
    restored.load_state_dict(server.state_dict())
    assert _same_arrays(restored.x_hat, server.x_hat)
    assert _same_arrays(restored.previous, server.previous)
    assert (memory == "none") == (server.previous is not None)
    assert (restored.version, restored.checksum) == (3, server.checksum)
    assert restored.initial_checksum == server.initial_checksum != ""
    assert restored.confirmed == {4: 3}
    fields = [(s.source, s.target, s.payloads, s.checksum, s.scales) for s in server.history]
    assert [(s.source, s.target, s.payloads, s.checksum, s.scales) for s in restored.history] == (
        fields
    )
    # Error feedback scales the compressed tensor alone (raw tensors carry their value).
    want = {"w"} if memory == "error_feedback" else set()
    assert all(set(s.scales) == want for s in server.history)
    # The next step is the same bytes from both (x_hat, and x_{t-1} for memory none).
    a, b = server.advance(_model(4)), restored.advance(_model(4))
    assert (a.payloads, a.scales, a.checksum) == (b.payloads, b.scales, b.checksum)


def test_an_unstarted_server_checkpoints_no_replica() -> None:
    state = _server("none").state_dict()
    assert state["x_hat"] is None and state["previous"] is None and state["version"] == 0
    assert state["checksum"] == state["initial_checksum"] == ""  # no version 0 to vouch for


def test_the_state_is_a_copy_the_server_does_not_change_afterwards() -> None:
    server = _server()
    server.start(_model(0))
    state = server.state_dict()
    before = state["x_hat"]["w"].copy()
    server.advance(_model(1))
    assert np.array_equal(state["x_hat"]["w"], before)


def test_forget_sends_the_model_in_full_until_the_client_confirms_again() -> None:
    server = _server(initial="seeded")
    server.start(_model(0))
    server.advance(_model(1))
    # A seeded client with no confirmation builds version 0 itself: the step from there.
    assert [s.target for s in server.steps_for(5)] == [1]
    server.forget(5)
    assert server.steps_for(5) is None  # never the seeded version 0 again: x_hat in full
    assert server.confirm(5, server.version, server.checksum)
    assert server.steps_for(5) == [] and 5 not in server.full_next


def test_a_replica_the_server_never_had_is_unknown_without_an_error() -> None:
    server = _server()
    server.start(_model(0))
    assert not server.confirm(77, 0, "0" * 16)  # never confirmed before: nothing to drop
    assert 77 not in server.confirmed and server.steps_for(77) is None


def test_drift_is_the_relative_distance_over_the_float_tensors() -> None:
    server = _server()
    assert server.drift(_model(1)) == 0.0  # not started: no replica to compare
    server.start(_model(0))
    x_t = _model(1)  # its integer buffer differs too: drift ignores it
    num = sum(
        float(np.sum((server.x_hat[k].astype(np.float64) - x_t[k].astype(np.float64)) ** 2))
        for k in ("w", "b")
    )
    den = sum(float(np.sum(x_t[k].astype(np.float64) ** 2)) for k in ("w", "b"))
    assert server.drift(x_t) == pytest.approx(np.sqrt(num / den), rel=1e-12)
    tiny = {k: v * np.float32(1e-3) if v.dtype.kind == "f" else v for k, v in x_t.items()}
    den_tiny = sum(float(np.sum(tiny[k].astype(np.float64) ** 2)) for k in ("w", "b"))
    assert 0 < den_tiny < 1  # a model of norm below 1 still has a drift
    num_tiny = sum(
        float(np.sum((server.x_hat[k].astype(np.float64) - tiny[k].astype(np.float64)) ** 2))
        for k in ("w", "b")
    )
    assert server.drift(tiny) == pytest.approx(np.sqrt(num_tiny / den_tiny), rel=1e-12)
    zeros = {k: np.zeros_like(v) for k, v in x_t.items()}
    assert server.drift(zeros) == 0.0  # no norm to divide by: defined as 0


def test_without_server_memory_the_replica_adds_each_difference_unscaled() -> None:
    server = _server("none")
    server.start(_model(0))
    client = Replica().take_full(server.x_hat, 0, server.checksum)
    steps = [server.advance(_model(i)) for i in (1, 2)]
    assert all(s.scales == {} for s in steps)  # no scale travels: each counts once
    for codec in (None, server.codec):  # decoded directly, and after the payload checks
        final = client.take_steps(steps, 2, server.checksum, codec=codec)
        assert _same_arrays(final.arrays, server.x_hat)
    # By hand: x_hat_2 = x_0 + d_1 + d_2 in float32, the decoded global updates.
    w = client.arrays["w"]
    for s in steps:
        w = w + decode_bytes(s.payloads["w"]).numpy()
    assert np.array_equal(final.arrays["w"], w)


def test_a_payload_that_does_not_fit_names_its_tensor() -> None:
    server = _server()
    server.start(_model(0))
    step = server.advance(_model(1))
    bad = Step(0, 1, {**step.payloads, "w": step.payloads["w"][:-3]}, step.checksum, step.scales)
    with pytest.raises(ReplicaError, match=r"^w: "):
        apply_step(server.state_dict()["x_hat"], bad)


def test_steps_weighing_exactly_the_model_are_read_one_byte_more_is_refused() -> None:
    arrays = {"w": np.zeros(10, np.float32)}  # a 40-byte model
    fits = [Step(0, 1, {"w": b"x" * 25}, ""), Step(1, 2, {"w": b"x" * 15}, "")]
    check_step_bytes(fits, arrays)
    over = [*fits[:1], Step(1, 2, {"w": b"x" * 16}, "")]
    with pytest.raises(ReplicaError, match="the steps weigh 41 bytes, more than the 40-byte model"):
        check_step_bytes(over, arrays)


def _step_and_model() -> tuple[BroadcastServer, Step, dict[str, np.ndarray]]:
    server = _server()
    server.start(_model(0))
    x0 = {k: v.copy() for k, v in server.x_hat.items()}
    return server, server.advance(_model(1)), x0


def test_each_payload_refusal_names_the_tensor_and_what_differs() -> None:
    server, step, x0 = _step_and_model()
    w, codec = step.payloads["w"], server.codec
    bound = max_inner_size(x0["w"].size, x0["w"].ndim)
    with pytest.raises(ReplicaError, match=f"^w: a {bound + 1}-byte payload, at most {bound} "):
        check_step_payload("w", b"\0" * (bound + 1), x0["w"], codec, raw=False)
    with pytest.raises(ReplicaError, match=r"^w: payload shape \(40, 30\) != \(30, 40\)"):
        check_step_payload("w", w, x0["w"].reshape(30, 40), codec, raw=False)
    raw_b = step.payloads["b"]  # the float32 tensor b sent raw, checked as an int64 one
    with pytest.raises(ReplicaError, match=r"^c: payload dtype torch.float32, the server sends "):
        check_step_payload("c", raw_b, np.zeros(6, np.int64), codec, raw=True)


def test_a_step_with_other_tensors_or_bad_scales_is_refused_naming_them() -> None:
    server, step, x0 = _step_and_model()
    policy = TensorPolicy()
    other = Step(0, 1, {"w": step.payloads["w"]}, step.checksum, step.scales)
    with pytest.raises(ReplicaError, match="the step to version 1 has other tensors than the"):
        check_step_payloads(other, x0, server.codec, policy)
    for scales, shown in (({"w": float("nan")}, "'w'=nan"), ({"zz": 1.0}, "'zz'=1.0")):
        bad = Step(0, 1, step.payloads, step.checksum, scales)
        with pytest.raises(ReplicaError, match=f"step to version 1: scale {shown}"):
            check_step_payloads(bad, x0, server.codec, policy)


def test_a_float64_model_takes_float32_compressed_steps() -> None:
    # The server encodes float32 differences whatever the model's dtype; only tensors
    # sent raw travel in their own dtype.
    model = {"w": np.random.default_rng(0).normal(size=(40, 30))}
    server = _server()
    server.start(model)
    client = Replica().take_full(server.x_hat, 0, server.checksum)
    step = server.advance({"w": model["w"] + 0.5})
    final = client.take_steps([step], 1, server.checksum, codec=server.codec)
    assert final.arrays["w"].dtype == np.float64 and _same_arrays(final.arrays, server.x_hat)
    # ... and the replica moves in float64: x_0 + scale * decoded, computed here.
    decoded = decode_bytes(step.payloads["w"]).numpy().astype(np.float64)
    assert np.array_equal(final.arrays["w"], model["w"] + step.scales["w"] * decoded)


def test_a_chain_longer_than_max_steps_is_refused_naming_both_counts() -> None:
    steps = [Step(i, i + 1, {}, "") for i in range(MAX_STEPS + 1)]
    check_chain(steps[:MAX_STEPS], MAX_STEPS)  # the most allowed
    with pytest.raises(ReplicaError, match=f"^{MAX_STEPS + 1} steps in one instruction, at most "):
        check_chain(steps, MAX_STEPS + 1)


def test_a_payload_is_refused_before_decoding_when_it_claims_more_than_the_tensor() -> None:
    _, step, x0 = _step_and_model()
    small = {**x0, "w": np.zeros(30, np.float32)}  # 30 elements; the payload claims 1200
    with pytest.raises(ReplicaError, match=r"^w: payload claims 1200 elements, above the limit"):
        apply_step(small, step)


def test_a_payload_of_another_shape_is_refused_naming_both_shapes() -> None:
    _, step, x0 = _step_and_model()
    turned = {**x0, "w": x0["w"].reshape(30, 40)}  # the same size, another shape
    with pytest.raises(ReplicaError, match=r"^w: payload shape \(40, 30\) != \(30, 40\)"):
        apply_step(turned, step)


def test_the_contraction_scale_is_the_least_squares_factor_clipped_at_zero() -> None:
    d, q = np.array([0.1, 0.2], np.float32), np.array([0.1, 0.1], np.float32)
    d64, q64 = d.astype(np.float64), q.astype(np.float64)
    assert contraction_scale(d, q) == pytest.approx((d64 @ q64) / (q64 @ q64), rel=1e-12)
    assert contraction_scale(d, -q) == 0.0  # a step against the difference: not taken
    assert contraction_scale(d, np.zeros(2, np.float32)) == 1.0  # nothing decoded


def test_a_step_is_the_codec_under_the_public_seed_of_its_version_and_tensor() -> None:
    # Stochastic rounding (uniform 4 bits) depends on the seed: anyone holding the run
    # seed can re-encode the step from (run seed, "downlink", version, tensor).
    server, step, x0 = _step_and_model()
    diff = torch.from_numpy(_model(1)["w"] - x0["w"])
    seed = derive_seed(7, "downlink", 1, "w")
    assert step.payloads["w"] == bytes(server.codec.encode(diff, seed=seed))
    assert step.payloads["w"] != bytes(server.codec.encode(diff, seed=seed + 1))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"name": "fp16", "memory": "x"}, "downlink.memory='x': allowed: error_feedback, none"),
        ({"name": "fp16", "initial": "x"}, "downlink.initial='x': allowed: sent, seeded"),
        ({"name": "nope"}, "downlink.name='nope': a stateless codec: bf16, dither, "),
        ({"name": "nope"}, "memories and joint codes cannot encode a broadcast"),
        (
            {"name": "uniform", "bits": 99},
            "downlink={'name': 'uniform', 'bits': 99}: uniform: bits must be an integer",
        ),
    ],
)
def test_bad_downlink_settings_name_the_key_the_value_and_what_is_allowed(spec, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_downlink(spec)


def test_a_replica_ahead_of_the_server_is_refused_naming_both_versions() -> None:
    server = _server()
    server.start(_model(0))
    client = Replica().take_full(server.x_hat, 0, server.checksum)
    steps = [server.advance(_model(i)) for i in (1, 2, 3)]
    ahead = client.take_steps(steps, 3, server.checksum)
    # Steps it has applied already, ending at version 2: nothing moves it back.
    with pytest.raises(ReplicaError, match=r"^replica at version 3, the server is at 2$"):
        ahead.take_steps(steps[:2], 2, steps[1].checksum)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_replica_rebuilt_from_the_instruction_text_is_x_hat_bit_for_bit(dtype) -> None:
    """The scales travel as text (the shortest form of their float32 value): what the
    client reads back, applied in the model's own dtype, moves its replica exactly as
    the server moved x_hat, over several lagging steps, float64 models included."""
    from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

    from fedcomp.flower.replica import ReplicaSender, rebuild_model
    from fedcomp.keys import KEY_DOWNLINK_CODEC, KEY_DOWNLINK_STEPS

    rng = np.random.default_rng(3)
    model = {"w": rng.normal(size=(40, 30)).astype(dtype), "b": rng.normal(size=300).astype(dtype)}
    server = _server()
    server.start(model)
    client = Replica().take_full(server.x_hat, 0, server.checksum)
    server.confirmed[5] = 0  # client 5 holds version 0
    for t in range(1, 4):
        server.advance({k: v + dtype(0.1 * t) * rng.normal(size=v.shape) for k, v in model.items()})
    sender = ReplicaSender(server)
    content = RecordDict({"arrays": ArrayRecord(), "config": ConfigRecord({})})
    assert sender.attach(content, 5, model_free=True) == "steps"
    content["config"][KEY_DOWNLINK_CODEC] = sender.codec_json
    text = content["config"][KEY_DOWNLINK_STEPS]
    assert len(server.history) == 3 and all(s.scales for s in server.history)
    assert all(len(str(v)) <= 12 for s in json.loads(text) for v in s[2].values())
    new = rebuild_model(Message(content, dst_node_id=1, message_type=MessageType.TRAIN), client)
    assert new.version == 3 and _same_arrays(new.arrays, server.x_hat)
    assert all(new.arrays[k].dtype == dtype for k in model)
