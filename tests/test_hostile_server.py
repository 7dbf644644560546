"""A hostile server (or a network without TLS) against the client's downlink decoding.

Each test is one finding of the review: a 0.38 MB instruction of 4,000 tiny steps cost
a client 7.2 s and 1.4 GB (20,000: a MemoryError) because the record was scanned once
per step; step versions were never checked to increase; payloads nesting rotate inside
entropy inside rotate ... decoded the whole tensor once per level (7.8 s at depth 480)
until a RecursionError escaped the mod. Now every field is checked before anything is
decoded, one instruction costs at most MAX_STEPS decodes of the model, and the mod
answers anything else with an error reply, its client state untouched.
"""

from __future__ import annotations

import json
import re
import struct
import time
import tracemalloc

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode

from fedcomp import downlink
from fedcomp.bundle import pack_bundle, unpack_bundle
from fedcomp.codecs import PayloadError, TensorPolicy, decode_bytes, make_codec
from fedcomp.codecs.base import MAX_NESTING, pack_inner
from fedcomp.codecs.entropy import work_size
from fedcomp.codecs.wire import Payload, PayloadHeader, parse_payload
from fedcomp.codecs.zstdframes import compress
from fedcomp.downlink import (
    MAX_STEPS,
    BroadcastServer,
    Replica,
    ReplicaError,
    Step,
    parse_downlink,
    step_headers,
)
from fedcomp.flower import mod as mod_module
from fedcomp.flower.mod import CompressionMod
from fedcomp.flower.replica import (
    RECORD_REPLICA,
    ReplicaSender,
    rebuild_model,
    store_replica,
)
from fedcomp.flower.shared_settings import RECORD_SETTINGS, settings_digest
from fedcomp.keys import (
    DOWNLINK_STEPS,
    KEY_CODEC,
    KEY_DOWNLINK,
    KEY_DOWNLINK_CODEC,
    KEY_DOWNLINK_PAYLOADS,
    KEY_DOWNLINK_STEPS,
    KEY_DOWNLINK_VERSION,
    KEY_PROTOCOL,
    KEY_ROUND,
    KEY_RUN_SEED,
    KEY_SETTINGS,
    PROTOCOL_VERSION,
)

UNIFORM4 = {"name": "uniform", "bits": 4, "block": 256}
ROTATE_ZSTD = {
    "name": "rotate",
    "inner": "uniform",
    "bits": 2,
    "block": 256,
    "rotation_block": 256,
    "entropy": "zstd",
}
CLIENT = 3


def _model(seed: int, shape: tuple[int, ...] = (40, 30)) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.normal(size=shape).astype(np.float32),
        "b": rng.normal(size=6).astype(np.float32),  # too small for any codec to pay: raw
        "count": np.array([seed], dtype=np.int64),
    }


def _lagging(
    spec: dict, steps: int, shape: tuple[int, ...] = (40, 30)
) -> tuple[BroadcastServer, Replica]:
    """A server ``steps`` versions ahead of a client that holds version 0."""
    server = BroadcastServer(parse_downlink(spec), TensorPolicy(), 7)
    server.start(_model(0, shape))
    replica = Replica().take_full(server.x_hat, 0, server.checksum)
    server.confirmed[CLIENT] = 0
    for i in range(1, steps + 1):
        server.advance(_model(i, shape))
    return server, replica


def _instruction(server: BroadcastServer, steps: list[Step] | None = None) -> Message:
    """The train instruction the server's own sender writes (``steps``: these, as if
    the server had chosen them)."""
    content = RecordDict({"arrays": ArrayRecord(), "config": ConfigRecord({"lr": 0.1})})
    if steps is not None:
        server.steps_for = lambda client: steps  # type: ignore[method-assign]
    sender = ReplicaSender(server)
    assert sender.attach(content, CLIENT, model_free=True) == DOWNLINK_STEPS
    content["config"][KEY_DOWNLINK_CODEC] = sender.codec_json  # as the mod restores it
    return Message(content, dst_node_id=1, message_type=MessageType.TRAIN)


def _config(msg: Message) -> ConfigRecord:
    return msg.content["config"]


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The payloads decoded since the test cleared it, by tensor (every decode goes
    through decode_parsed, the server's too: tests clear it after building steps)."""
    seen: list[str] = []
    real = downlink.decode_parsed

    def counting(name, parsed, current):
        seen.append(name)
        return real(name, parsed, current)

    monkeypatch.setattr(downlink, "decode_parsed", counting)
    return seen


def _peak(fn) -> tuple[int, float, object]:
    """Peak traced bytes, seconds and result (or the exception raised) of ``fn()``."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        result = fn()
    except Exception as exc:  # returned for the caller's assertions
        result = exc
    seconds = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak, seconds, result


# ------------------------------------------------------------ what an honest server sends


@pytest.mark.parametrize("spec", [UNIFORM4, ROTATE_ZSTD], ids=["uniform4", "rotate_zstd"])
def test_a_lagging_client_takes_several_steps_bit_identically(spec: dict, decodes) -> None:
    """The valid case the checks must leave alone: a client 5 versions behind rebuilds
    x_hat bit for bit, decoding each payload once, in memory a few model copies."""
    server, replica = _lagging(spec, 5, shape=(400, 30))
    msg = _instruction(server)
    assert len(json.loads(_config(msg)[KEY_DOWNLINK_STEPS])) == 5
    dense = sum(a.nbytes for a in server.x_hat.values())
    decodes.clear()
    peak, _, new = _peak(lambda: rebuild_model(msg, replica))
    assert isinstance(new, Replica), new
    assert new.version == 5 and new.checksum == server.checksum
    for name, value in server.x_hat.items():
        assert np.array_equal(new.arrays[name], value) and new.arrays[name].dtype == value.dtype
        assert np.array_equal(msg.content["arrays"][name].numpy(), value)
    assert KEY_DOWNLINK_PAYLOADS not in _config(msg)  # the app sees the model only
    assert sorted(decodes) == sorted(list(server.x_hat) * 5)
    assert peak < 8 * dense  # replica, its successor, a decoded tensor, the rebuilt record


def test_the_server_sends_the_model_rather_than_more_than_max_steps() -> None:
    """Top-k at 1%: MAX_STEPS + 4 steps weigh far less than the model, yet the client
    would pay one model decode per step; the server sends x_hat in full instead."""
    server, _ = _lagging({"name": "topk", "fraction": 0.01}, MAX_STEPS + 4, shape=(400, 30))
    history = [s for s in server.history if s.source >= 0]
    assert len(history) > MAX_STEPS
    assert sum(s.nbytes for s in history) < server.full_nbytes
    assert server.steps_for(CLIENT) is None
    server.confirmed[CLIENT] = server.version - MAX_STEPS
    assert len(server.steps_for(CLIENT)) == MAX_STEPS


# ----------------------------------------------------------------------- many tiny steps


def _tiny_steps(server: BroadcastServer, count: int) -> tuple[str, bytes]:
    """``count`` steps of a few bytes per tensor (the raw ``count`` tensor's payload
    for every tensor): the finding's 0.38 MB of 4,000 steps, as one bundle."""
    tiny = server.history[0].payloads["count"]
    steps = json.dumps([[i, i + 1, {}] for i in range(count)])
    names = list(server.x_hat)
    bundle = pack_bundle({f"{i + 1}/{name}": tiny for i in range(count) for name in names})
    return steps, bundle


@pytest.mark.parametrize("listed", [4000, MAX_STEPS], ids=["4000_listed", "16_listed"])
def test_4000_tiny_steps_are_refused_before_anything_is_decoded(listed: int, decodes) -> None:
    """4,000 steps of 3 tiny payloads (about 0.3 MB): refused by the step bound, with
    the steps listed (by their count) or only in the record (by its size), before a
    single payload is decoded and in less memory than one dense model."""
    server, replica = _lagging(UNIFORM4, 1, shape=(400, 30))
    msg = _instruction(server)
    steps, record = _tiny_steps(server, 4000)
    if listed == MAX_STEPS:  # a valid list (the server claims version 16): the record lies
        steps = json.dumps(json.loads(steps)[:MAX_STEPS])
        _config(msg)[KEY_DOWNLINK_VERSION] = MAX_STEPS
    _config(msg)[KEY_DOWNLINK_STEPS] = steps
    _config(msg)[KEY_DOWNLINK_PAYLOADS] = record
    assert 0.1e6 < len(record) < 0.5e6
    dense = sum(a.nbytes for a in server.x_hat.values())
    decodes.clear()
    peak, seconds, error = _peak(lambda: rebuild_model(msg, replica))
    assert isinstance(error, ReplicaError), error
    needle = "4000 steps|more than 16 steps" if listed == 4000 else "claims 12000 payloads"
    assert re.search(needle, str(error)), str(error)
    assert decodes == []
    assert peak < dense, (peak, dense)
    print(f"4000 tiny steps ({listed} listed) refused in {seconds * 1e3:.2f} ms, peak {peak} B")


def test_steps_weighing_more_than_the_model_are_refused(decodes) -> None:
    """Three fp16 steps weigh 1.5 models (the server sends x_hat instead): refused by
    their bytes before any decode."""
    server, replica = _lagging({"name": "fp16"}, 0)
    steps = [server.advance(_model(i)) for i in (1, 2, 3)]
    msg = _instruction(server, steps)
    decodes.clear()
    with pytest.raises(ReplicaError, match=r"weigh \d+ bytes, more than the \d+-byte model"):
        rebuild_model(msg, replica)
    assert decodes == []


# --------------------------------------------------------------------------- versions


@pytest.mark.parametrize(
    ("versions", "needle"),
    [
        ([[0, 1], [1, 1], [1, 3]], "from version 1 to 1"),
        ([[0, 2], [2, 1], [1, 3]], "from version 2 to 1"),
        ([[0, 1], [2, 3], [1, 3]], "starts at 2, the step before it ends at 1"),
        ([[0, 1], [1, 2], [2, 4]], "end at version 4, the server is at 3"),
        ([[-1, 1], [1, 2], [2, 3]], "from version -1"),
        ([[0, 1], [1, 2], [1, 2]], "step to version 2 starts at 1"),
    ],
    ids=["equal", "decreasing", "gap", "beyond", "negative", "repeated"],
)
def test_versions_that_do_not_increase_and_chain_are_refused(versions, needle, decodes) -> None:
    server, replica = _lagging(UNIFORM4, 3)
    msg = _instruction(server)
    record = _step_record(msg, server)
    steps = json.loads(_config(msg)[KEY_DOWNLINK_STEPS])
    for step, (source, target) in zip(steps, versions, strict=True):
        step[0], step[1] = source, target
    _config(msg)[KEY_DOWNLINK_PAYLOADS] = pack_bundle(  # the payloads follow their new targets
        {f"{t}/{k.partition('/')[2]}": v for k, v in record.items() for t in [_retarget(k, steps)]}
    )
    _config(msg)[KEY_DOWNLINK_STEPS] = json.dumps(steps)
    decodes.clear()
    with pytest.raises(ReplicaError, match=needle):
        rebuild_model(msg, replica)
    assert decodes == []


def _step_record(msg: Message, server: BroadcastServer) -> dict:
    """The instruction's step payloads under their names, "<target>/<tensor>" (the
    bundle is positional: the client reads it with these names)."""
    steps = json.loads(_config(msg)[KEY_DOWNLINK_STEPS])
    names = [f"{step[1]}/{name}" for step in steps for name in server.x_hat]
    blob = _config(msg)[KEY_DOWNLINK_PAYLOADS]
    rule = step_headers(server.x_hat, server.run_seed)  # the payloads in full
    return dict(unpack_bundle(blob, max_entries=len(names), names=names, headers=rule))


def _retarget(key: str, steps: list) -> int:
    """The new target of the step whose payload ``key`` was (old targets are 1, 2, 3)."""
    return steps[int(key.partition("/")[0]) - 1][1]


# ---------------------------------------------------------------------------- nesting


def _stage(kind: str, inner: bytes, numel: int) -> bytes:
    """One hand-made layer around a payload of a float32 vector of ``numel``: the
    ``entropy`` stage (a zstd frame of it) or ``rotate`` (its rotation parameters)."""
    if kind == "entropy":
        body = struct.pack("<BBHI", 1, 3, 0, len(inner)) + compress(inner, 3)
        return bytes(Payload(PayloadHeader(13, torch.float32, (numel,), 0), body))
    body = struct.pack("<BBHI", 1, 0, 0, 256) + pack_inner(parse_payload(inner))
    return bytes(Payload(PayloadHeader(12, torch.float32, (numel,), 0), body))


def _nested(levels: int, numel: int = 256, innermost: bytes | None = None) -> bytes:
    """A payload (2-bit uniform unless given) inside ``levels - 1`` alternating stages
    (rotate, entropy, rotate, ...), as no codec spec builds beyond three levels."""
    if innermost is None:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        innermost = bytes(make_codec("uniform", bits=2, block=256).encode(x, seed=1))
    buf = innermost
    for level in range(levels - 1):
        buf = _stage("entropy" if level % 2 else "rotate", buf, numel)
    return buf


def test_decode_bytes_refuses_nesting_beyond_max_nesting_with_a_payload_error() -> None:
    """The deepest spec (entropy around rotate around a quantizer) still decodes; one
    level more is a PayloadError naming the depth, and so is depth 600, where the
    unbounded decoder raised RecursionError."""
    codec = make_codec(**ROTATE_ZSTD)
    x = torch.randn(300, generator=torch.Generator().manual_seed(1))
    payload = codec.encode(x, seed=5)
    assert MAX_NESTING == 3
    assert torch.equal(decode_bytes(bytes(payload)), codec.decode(payload))
    assert decode_bytes(_nested(MAX_NESTING)).shape == (256,)
    with pytest.raises(PayloadError, match=f"nested {MAX_NESTING + 1} levels deep, at most 3"):
        decode_bytes(_nested(MAX_NESTING + 1))
    deep = _nested(600)
    with pytest.raises(PayloadError, match="nested 4 levels deep"):
        decode_bytes(deep)


def test_the_findings_10kb_payload_at_depth_480_decodes_nothing(monkeypatch) -> None:
    """A 2.36M-coordinate tensor behind 480 levels took 7.8 s (one decode per level):
    now refused at level 4, before the quantizer decodes anything."""
    from fedcomp.codecs.sparse import TopKCodec

    numel = 2_359_296  # 2304 blocks of 1024
    x = torch.randn(numel, generator=torch.Generator().manual_seed(2))
    sparse = bytes(make_codec("topk", fraction=1e-4).encode(x, seed=0))
    buf = _nested(480, numel, sparse)
    assert len(buf) < 20_000
    calls = []
    real = TopKCodec.decode_payload.__func__
    monkeypatch.setattr(
        TopKCodec, "decode_payload", classmethod(lambda c, p: calls.append(1) or real(c, p))
    )
    with pytest.raises(PayloadError, match="nested 4 levels deep"):
        decode_bytes(buf, max_numel=numel)
    assert calls == []
    assert decode_bytes(_nested(3, numel, sparse), max_numel=numel).shape == (numel,)
    assert calls == [1]  # the counter counts: three levels decode, once


@pytest.mark.parametrize(
    ("spec", "levels", "needle"),
    [
        (UNIFORM4, 2, "uniform: codec id is 12, the server asked for 4"),
        (ROTATE_ZSTD, 4, "rotate: inner codec id is 13, the server asked for 4"),
    ],
    ids=["uniform_vs_rotate", "deepest_spec_vs_one_more"],
)
def test_a_payload_nested_beyond_the_spec_is_refused_before_decoding(
    spec: dict, levels: int, needle: str, decodes
) -> None:
    """The spec in the instruction says what the server builds: a step payload with
    other (or more) stages is refused by the spec check, nothing decoded."""
    server, replica = _lagging(spec, 2, shape=(512,))
    msg = _instruction(server)
    wrong = _nested(levels, 512)
    if levels == 4:  # rotate(entropy(rotate(uniform))) under the spec's entropy stage
        wrong = _stage("entropy", wrong, 512)
    record = _step_record(msg, server)
    record["2/w"] = wrong
    _config(msg)[KEY_DOWNLINK_PAYLOADS] = pack_bundle(record)
    decodes.clear()
    with pytest.raises(ReplicaError, match=f"w: .*{needle}"):
        rebuild_model(msg, replica)
    assert decodes == []


def test_a_spec_that_no_setting_builds_is_refused() -> None:
    server, replica = _lagging(UNIFORM4, 1)
    for spec in ({"name": "ef", "inner": "sign"}, {"name": "nope"}, [1, 2]):
        msg = _instruction(server)
        _config(msg)[KEY_DOWNLINK_CODEC] = json.dumps(spec)
        with pytest.raises(ReplicaError, match="downlink codec"):
            rebuild_model(msg, replica)


# ------------------------------------------------------------------------------ the mod


def _context(replica: Replica) -> Context:
    state = RecordDict()
    store_replica(state, replica, None)
    state["app-own"] = ConfigRecord({"x": 1})
    return Context(
        run_id=1,
        node_id=11,
        node_config={"partition-id": CLIENT, "num-partitions": 8},
        state=state,
        run_config={},
    )


def _snapshot(state: RecordDict) -> dict:
    return {k: (id(v), repr(v)) for k, v in state.items()}


def _with_settings(msg: Message) -> Message:
    """The wrapper's fields, the run settings in full (the mod keeps them in
    Context.state when the instruction passes)."""
    values = {KEY_CODEC: json.dumps({"name": "fp32"})}
    fields = {KEY_PROTOCOL: PROTOCOL_VERSION, KEY_ROUND: 2, KEY_RUN_SEED: 7}
    _config(msg).update({**values, **fields, KEY_SETTINGS: settings_digest(values)})
    return msg


def _never(msg: Message, ctxt: Context) -> Message:
    raise AssertionError("the app ran on an instruction the mod could not take")


@pytest.mark.parametrize(
    "hostile",
    ["4000_steps", "deep_json_steps", "deep_json_codec", "recursion", "memory"],
)
def test_the_mod_answers_with_an_error_and_leaves_its_state_untouched(
    hostile: str, monkeypatch
) -> None:
    """Whatever fails in the mod, even RecursionError or MemoryError, the reply is a
    Flower Error (MOD_FAILED_PRECONDITION), the app never runs, and Context.state is
    what it was (the replica, and settings this very instruction sent, not kept)."""
    server, replica = _lagging(UNIFORM4, 1)
    msg = _with_settings(_instruction(server))
    if hostile == "4000_steps":
        steps, record = _tiny_steps(server, 4000)
        _config(msg)[KEY_DOWNLINK_STEPS] = steps
        _config(msg)[KEY_DOWNLINK_PAYLOADS] = record
    elif hostile.startswith("deep_json"):  # json.loads raises RecursionError on these
        key = KEY_DOWNLINK_STEPS if hostile.endswith("steps") else KEY_DOWNLINK_CODEC
        _config(msg)[key] = "[" * 1500 + "]" * 1500
    else:
        error = RecursionError if hostile == "recursion" else MemoryError

        def failing(*args, **kwargs):
            raise error("planted")

        monkeypatch.setattr(mod_module, "rebuild_model", failing)
    ctxt = _context(replica)
    before = _snapshot(ctxt.state)
    reply = CompressionMod()(msg, ctxt, _never)
    assert reply.has_error()
    assert reply.error.code == ErrorCode.MOD_FAILED_PRECONDITION
    assert reply.error.reason.startswith("CompressionMod: ")
    assert len(reply.error.reason) <= mod_module.MAX_REASON
    assert _snapshot(ctxt.state) == before
    assert RECORD_SETTINGS not in ctxt.state and RECORD_REPLICA in ctxt.state


def test_the_mod_still_takes_a_valid_instruction() -> None:
    """The same path with an honest instruction: the app sees the rebuilt model and
    Context.state keeps the new replica (the check above cannot pass by refusing all)."""
    server, replica = _lagging(UNIFORM4, 3)
    msg = _with_settings(_instruction(server))
    ctxt = _context(replica)
    seen = {}

    def app(m: Message, c: Context) -> Message:
        seen.update({k: v.numpy() for k, v in m.content["arrays"].items()})
        raise RuntimeError("the app's own failure")

    with pytest.raises(RuntimeError, match="the app's own failure"):
        CompressionMod()(msg, ctxt, app)
    assert all(np.array_equal(seen[k], v) for k, v in server.x_hat.items())
    meta = ctxt.state["fedcomp.replica-meta"]
    assert (meta["version"], meta["checksum"]) == (3, server.checksum)
    assert _config(msg)[KEY_DOWNLINK] == DOWNLINK_STEPS


# ------------------------------------------- issue 41, finding 7: what a step may cost

RANDK_ZSTD = {"name": "randk", "fraction": 0.9, "entropy": "zstd"}


def test_compressed_steps_count_their_decompressed_bytes(decodes) -> None:
    """The finding: 16 steps of zstd(random-k at fraction 1.0; 0.9 since the tensor
    policy sends 1.0 raw) on a model that did not move weigh a few hundred bytes on
    the wire and most of a model's worth each once
    decompressed (126x an honest step's client time). Each step now counts its
    decompressed size (the server's rule and the client's): the server sends the model
    instead, and the client refuses such steps before decoding any."""
    server, replica = _lagging(RANDK_ZSTD, 0, shape=(400, 30))
    still = {k: v.copy() for k, v in server.x_hat.items()}
    steps = [server.advance(still) for _ in range(MAX_STEPS)]
    wire = sum(len(p) for s in steps for p in s.payloads.values())
    dense = sum(a.nbytes for a in server.x_hat.values())
    assert wire < dense / 10 < dense < sum(s.nbytes for s in steps)
    for step in steps:  # each step's count is its payloads' decompressed sizes
        sizes = [work_size(p) for p in step.payloads.values()]
        assert step.nbytes == sum(sizes) >= sum(len(p) for p in step.payloads.values())
    server.confirmed[CLIENT] = 0
    assert server.steps_for(CLIENT) is None  # the server: the model, not the steps
    msg = _instruction(server, steps)
    decodes.clear()
    with pytest.raises(ReplicaError, match=r"weigh \d+ bytes, more than the \d+-byte model"):
        rebuild_model(msg, replica)
    assert decodes == []


def test_a_client_that_names_its_downlink_codec_refuses_any_other() -> None:
    """CompressionMod(downlink=...) fixes the codec this client decodes: an instruction
    naming another is an error reply before anything is read, its state untouched; the
    one it names is taken."""
    server, replica = _lagging(ROTATE_ZSTD, 2)
    for accepted, taken in ((UNIFORM4, False), (ROTATE_ZSTD, True)):
        msg = _with_settings(_instruction(server))
        ctxt = _context(replica)
        before = _snapshot(ctxt.state)
        seen: list[bool] = []

        def app(m: Message, c: Context, seen=seen) -> Message:
            seen.append(True)
            raise RuntimeError("the app ran")

        if taken:
            with pytest.raises(RuntimeError, match="the app ran"):
                CompressionMod(downlink=accepted)(msg, ctxt, app)
            assert seen
            continue
        reply = CompressionMod(downlink=accepted)(msg, ctxt, app)
        assert reply.has_error() and "accepts only" in reply.error.reason
        assert not seen and _snapshot(ctxt.state) == before
    with pytest.raises(ValueError, match="downlink"):
        CompressionMod(downlink={"name": "ef", "inner": "sign"})
