"""Property-based fuzzing of every decoder under an address-space cap (a sample here;
`make fuzz` runs 10^4 cases per decoder with a printed, replayable seed).

Random buffers and mutated valid payloads (truncated, extended, bit flips, overwritten
header and body fields, huge claimed shapes, NaN/Inf scales) must end in a decoded
tensor of the claimed shape or a PayloadError, never another exception; the server's
path (the payload checked against the codec spec the server sent, then decoded) must
end in a decoded update or a Rejection; the client's path (a mutated downlink
instruction rebuilt into the model) must end in x_hat or a ReplicaError. The cap
turns any allocation beyond ``HEADROOM`` into a test failure instead of an
out-of-memory machine: the inputs hold at most ``LIMIT`` elements (40 kB in float32),
so a decoder that needs more than 256 MiB for them trusts a field it should not.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from experiments.fuzzing import FLOATS, mutate
from experiments.memory import address_space_cap
from fedcomp import compiled
from fedcomp.bundle import BundleError, is_compact, is_positional, pack_bundle, unpack_bundle
from fedcomp.codecs import (
    PayloadError,
    TensorPolicy,
    decode_bytes,
    make_codec,
    parse_payload,
    quantize_compiled,
    rotation_compiled,
    sketch_compiled,
)
from fedcomp.codecs.wire import HEADER_FIXED_BYTES
from fedcomp.downlink import BroadcastServer, Replica, ReplicaError, checksum, parse_downlink
from fedcomp.failures import Rejection
from fedcomp.flower.evaluation import record_pre_train_metrics
from fedcomp.flower.reference import ReplyReference
from fedcomp.flower.replica import ReplicaSender, rebuild_model
from fedcomp.flower.reply_format import METRIC_PREFIX, reply_content
from fedcomp.flower.round_records import account_reply, residual_summary
from fedcomp.flower.round_state import Decoded
from fedcomp.flower.validation import check_reply, decode_payloads, uplink_headers
from fedcomp.influence import MAX_NUM_EXAMPLES
from fedcomp.keys import (
    KEY_DOWNLINK,
    KEY_DOWNLINK_CHECKSUM,
    KEY_DOWNLINK_CODEC,
    KEY_DOWNLINK_PAYLOADS,
    KEY_DOWNLINK_STEPS,
    KEY_DOWNLINK_VERSION,
    KEY_NUM_EXAMPLES,
    KEY_PAYLOADS,
    KEY_PROTOCOL,
    KEY_ROUND,
    KEY_STABLE_ID,
    METRIC_CV_BOUND,
    METRIC_PRE_TRAIN_ACCURACY,
    METRIC_PRE_TRAIN_EXAMPLES,
    METRIC_PRE_TRAIN_LOSS,
    PROTOCOL_VERSION,
    RECORD_HEADER,
)
from fedcomp.own_metrics import GROUPS, OWN_METRICS
from fedcomp.results_file import RoundCounts
from fedcomp.rng import derive_seed

EXAMPLES = int(os.environ.get("FEDCOMP_FUZZ_EXAMPLES", "100"))
HEADROOM = 256 << 20
LIMIT = 10_000  # what a server passes: the size of the matching global tensor
SPECS = [
    {"name": "raw"},
    {"name": "fp32"},
    {"name": "fp16"},
    {"name": "bf16"},
    {"name": "uniform", "bits": 3, "block": 16},
    {"name": "uniform", "bits": 8, "block": 64},
    {"name": "dither", "bits": 2, "block": 32},
    {"name": "qsgd", "levels": 5, "block": 32},
    {"name": "sign", "block": 16},
    {"name": "topk", "fraction": 0.2},
    {"name": "randk", "fraction": 0.3},
    {"name": "eden", "bits": 1, "block": 256},
    {"name": "eden", "bits": 3, "scale": "mse", "block": 512, "rotations": 1},
    {"name": "rotate", "inner": "uniform", "bits": 2, "block": 16, "rotation_block": 256},
    {"name": "rotate", "inner": "dither", "bits": 1, "block": 32, "rotations": 2},
    {"name": "uniform", "bits": 2, "block": 16, "entropy": "zstd"},
    {"name": "topk", "fraction": 0.2, "entropy": "zstd"},
    {"name": "sparseq", "fraction": 0.2, "bits": 3, "block": 16},
    {"name": "sparseq", "fraction": 0.9, "bits": 1, "block": 8, "selection": "exact"},
    {"name": "lowrank", "rank": 2},
    {"name": "sketch", "fraction": 0.5, "rows": 3},
    {"name": "sketch", "fraction": 0.3, "rows": 4, "dtype": "bf16"},
    # the compiled encoders and decoders (fedcomp.codecs.*_compiled), forced at this size
    {"name": "eden", "bits": 2, "block": 256, "path": "compiled"},
    {"name": "eden", "bits": 4, "block": 512, "rotations": 1, "path": "compiled"},
    {"name": "rotate", "inner": "qsgd", "levels": 3, "block": 8, "path": "compiled"},
    {"name": "dither", "bits": 3, "block": 16, "path": "compiled"},
    {"name": "sketch", "fraction": 0.2, "rows": 5, "path": "compiled"},
]
if not compiled.installed():
    SPECS = [spec for spec in SPECS if spec.get("path") != "compiled"]
RUN_SEED, ROUND, CLIENT, NAME = 3, 2, 5, "w"


@pytest.fixture(autouse=True, scope="module")
def _compiled_onebit_decoder():
    """Load (or compile) the one-bit decoder before any memory cap: its compiler needs
    about 1 GB of address space, and under the cap the NumPy decoder would run."""
    code, payload = _onebit()
    plan = {k: v for k, v in _PLAN.items() if k != "client_index"}
    code.decode_mean([payload], client_indices=[1], **plan)


@pytest.fixture(autouse=True, scope="module")
def _compiled_codecs():
    """The rotation and quantizer kernels compiled (or loaded from Numba's cache, with
    every argument type they are called with) before any cap, as above."""
    if compiled.installed():
        rotation_compiled._kernels()
        quantize_compiled._kernels()
        sketch_compiled.KERNELS.get()


@pytest.fixture(autouse=True)
def _memory_cap():
    with address_space_cap(HEADROOM):
        yield


def _codec(spec: dict):
    return make_codec(spec["name"], **{k: v for k, v in spec.items() if k not in ("name", "path")})


@contextlib.contextmanager
def _path(spec: dict) -> Iterator[None]:
    """The compiled encoders and decoders for every size when the spec asks for them."""
    modules = (rotation_compiled, quantize_compiled, sketch_compiled)
    saved = [module.MIN_COMPILED for module in modules]
    try:
        if spec.get("path") == "compiled":
            for module in modules:
                module.MIN_COMPILED = 0
        yield
    finally:
        for module, value in zip(modules, saved, strict=True):
            module.MIN_COMPILED = value


def _input(spec: dict) -> torch.Tensor:
    if spec["name"] == "raw":
        return torch.arange(77, dtype=torch.int64).reshape(7, 11)
    # the compiled specs: several rotation blocks and a tail of smaller ones (1,000
    # coordinates: 768 + 256 at blocks of 256; 512 + 256 + 256 at 512)
    shape = (40, 25) if spec.get("path") == "compiled" else (7, 11)
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def _valid(spec: dict) -> bytes:
    seed = derive_seed(RUN_SEED, ROUND, CLIENT, NAME)
    return bytes(_codec(spec).encode(_input(spec), seed=seed))


def _decode_or_reject(buf: bytes) -> None:
    try:
        out = decode_bytes(buf, max_numel=LIMIT)
    except PayloadError:
        return
    header = parse_payload(buf, LIMIT).header
    assert isinstance(out, torch.Tensor)
    assert tuple(out.shape) == header.shape and out.dtype == header.dtype


def _server_decode_or_reject(buf: bytes, spec: dict) -> None:
    """What the wrapper runs on a reply: spec check, then decode (policy: compress all)."""
    reference = _input(spec).numpy()
    try:
        deltas, _ = _server_decode(buf, spec)
    except Rejection:
        return
    assert deltas[NAME].shape == reference.shape and deltas[NAME].dtype == reference.dtype


mutation = st.one_of(
    st.tuples(st.just("truncate"), st.integers(0, 10_000)),
    st.tuples(st.just("extend"), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("flip"), st.integers(0, 10_000), st.integers(0, 7)),
    st.tuples(st.just("u8"), st.integers(0, 15), st.integers(0, 255)),
    st.tuples(st.just("shape"), st.integers(0, 1), st.integers(0, 2**32 - 1)),
    st.tuples(st.just("u32"), st.integers(0, 40), st.integers(0, 2**32 - 1)),
    st.tuples(
        st.just("float"),
        st.integers(0, 10_000),
        st.sampled_from(FLOATS),
    ),
)


# Regression examples. The first is the 8.6 GB block-size bomb (issue found by `make
# fuzz`): a 7x11 tensor's body starts at byte 24, so uniform/dither/qsgd read the block
# at 26 and sign at 24; 2^31 - 1 there made the decoders pad to 2^31 elements.
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "-".join(str(v) for v in s.values()))
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(mutation, min_size=1, max_size=3))
@example(ops=[("u32", 26, 2**31 - 1)])
@example(ops=[("u32", 24, 2**31 - 1)])
@example(ops=[("float", 26, 3.4e38)])
@example(ops=[("u32", 24, 2**32 - 1), ("u32", 28, 2**32 - 1)])
def test_mutated_payloads_decode_or_fail_cleanly(spec: dict, ops: list) -> None:
    """EXAMPLES cases per codec (10^4 in `make fuzz`), through the context-free
    decoder and through the server's checked path."""
    with _path(spec):
        buf = _valid(spec)
        for op in ops:
            buf = mutate(buf, op)
        _decode_or_reject(buf)
        _server_decode_or_reject(buf, spec)


@pytest.mark.parametrize(
    ("spec", "offset", "field", "fmt", "value"),
    [
        ({"name": "uniform", "bits": 8, "block": 256}, 2, "block", "<I", 2**31 - 1),
        ({"name": "dither", "bits": 2, "block": 32}, 2, "block", "<I", 2**31 - 1),
        ({"name": "qsgd", "levels": 5, "block": 32}, 2, "block", "<I", 2**31 - 1),
        ({"name": "sign", "block": 16}, 0, "block", "<I", 2**31 - 1),
        ({"name": "uniform", "bits": 8, "block": 256}, 0, "bits", "<B", 4),
        ({"name": "qsgd", "levels": 5, "block": 32}, 0, "levels", "<B", 127),
        ({"name": "topk", "fraction": 0.2}, 0, "k", "<Q", 10),
        ({"name": "randk", "fraction": 0.3}, 0, "k", "<Q", 1),
    ],
)
def test_one_overwritten_field_is_a_spec_mismatch_naming_it(spec, offset, field, fmt, value):
    """The issue's bomb and its relatives: one body field overwritten with a value
    within its hard bound. The context-free decoder may decode it (without allocating
    beyond the tensor's size); the server, which knows what it asked for, names the
    field, the value and the expected value."""
    from fedcomp.codecs.wire import SpecMismatch

    buf = bytearray(_valid(spec))
    struct.pack_into(fmt, buf, 24 + offset, value)  # 7x11: the body starts at byte 24
    expected = _codec(spec).expected_params(77)[field]
    with pytest.raises(SpecMismatch, match=f"{field} is {value}.*asked for {expected}") as err:
        _codec(spec).check_payload(parse_payload(bytes(buf)))
    assert (err.value.field, err.value.value, err.value.expected) == (field, value, expected)
    with pytest.raises(Rejection, match=field):
        _server_decode(bytes(buf), spec)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(mutation, min_size=1, max_size=3))
@example(ops=[("u32", 3, 2**32 - 1)])  # the count
@example(ops=[("u32", 7, 2**32 - 1)])  # the first payload's length (a positional bundle)
def test_mutated_reply_bundles_are_checked_or_refused(ops: list) -> None:
    """EXAMPLES cases (10^4 in `make fuzz`): a train reply whose payload bundle is
    mutated is refused by the reply checks (a Rejection) or yields the model's one
    tensor, which then decodes or is refused like any payload."""
    spec = SPECS[0]
    with _path(spec):
        header = {KEY_PROTOCOL: PROTOCOL_VERSION, KEY_STABLE_ID: CLIENT, KEY_ROUND: ROUND}
        content = reply_content(header, {NAME: _valid(spec)}, MetricRecord({KEY_NUM_EXAMPLES: 1}))
        blob = content[RECORD_HEADER][KEY_PAYLOADS]
        for op in ops:
            blob = mutate(blob, op)
        content[RECORD_HEADER][KEY_PAYLOADS] = blob
        model = {NAME: _input(spec).numpy()}
        rule = uplink_headers(model, RUN_SEED, ROUND, CLIENT)
        try:
            checked = check_reply(content, CLIENT, ROUND, [NAME], headers=rule)
        except Rejection:
            return
        assert list(checked.payloads) == [NAME]
        table = 7 + 4 if is_positional(blob) else 7 + 2 + len(NAME) + 4
        # a compact entry is its payload less the header the rule rebuilds, plus a byte
        header = HEADER_FIXED_BYTES + 4 * model[NAME].ndim - 1 if is_compact(blob) else 0
        assert table + len(checked.payloads[NAME]) - header == len(blob)
        _server_decode_or_reject(bytes(checked.payloads[NAME]), spec)


def test_the_unmutated_reply_bundle_is_accepted_and_decodes() -> None:
    """The property above refuses or accepts; this is what acceptance looks like, so a
    reader that refused every bundle would fail here."""
    spec = SPECS[0]
    header = {KEY_PROTOCOL: PROTOCOL_VERSION, KEY_STABLE_ID: CLIENT, KEY_ROUND: ROUND}
    content = reply_content(header, {NAME: _valid(spec)}, MetricRecord({KEY_NUM_EXAMPLES: 1}))
    assert is_compact(content[RECORD_HEADER][KEY_PAYLOADS])
    rule = uplink_headers({NAME: _input(spec).numpy()}, RUN_SEED, ROUND, CLIENT)
    checked = check_reply(content, CLIENT, ROUND, [NAME], headers=rule)
    assert bytes(checked.payloads[NAME]) == _valid(spec)


def _server_decode(buf: bytes, spec: dict):
    return decode_payloads(
        {NAME: memoryview(buf)},
        {NAME: _input(spec).numpy()},
        codec=_codec(spec),
        policy=TensorPolicy(min_numel=0),
        run_seed=RUN_SEED,
        server_round=ROUND,
        stable_id=CLIENT,
    )


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_the_fuzzed_decoders_accept_what_they_should(spec: dict) -> None:
    """A decoder that rejects everything would pass the properties above: each one
    must decode its valid payload exactly as the codec does, and still decode after a
    bit flip in its last byte (codes or values, which any bits may hold)."""
    with _path(spec):
        codec, buf = _codec(spec), _valid(spec)
        expected = codec.decode(parse_payload(buf)).numpy()
        assert np.array_equal(decode_bytes(buf, max_numel=LIMIT).numpy(), expected)
        if "entropy" in spec:
            return  # a flipped bit inside a zstd frame is corruption, not another value
        flipped = bytearray(buf)
        flipped[-1] ^= 1
        assert decode_bytes(bytes(flipped), max_numel=LIMIT).shape == expected.shape


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.binary(max_size=512))
def test_random_buffers_decode_or_fail_cleanly(buf: bytes) -> None:
    _decode_or_reject(buf)


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.binary(min_size=16, max_size=16), st.binary(max_size=256))
def test_random_bodies_behind_a_valid_magic(header: bytes, body: bytes) -> None:
    head = bytearray(header)
    head[0:2] = b"FC"
    head[2] = 1  # the current format version: the codecs' own parsers get exercised
    _decode_or_reject(bytes(head) + body)


_PLAN = {"client_index": 1, "num_clients": 3, "seed": 5, "tau": 0.5, "shape": (7, 11)}


def _onebit():
    from fedcomp.onebit import OneBitCode

    code = OneBitCode(bits=2, lam=10.0, block=16)
    x = torch.randn(7, 11, generator=torch.Generator().manual_seed(0))
    plan = {k: v for k, v in _PLAN.items() if k != "shape"}
    return code, bytes(code.encode(x, **plan))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(mutation, min_size=1, max_size=3))
@example([("u32", 24 + 8, 2**31 - 1)])
def test_mutated_onebit_replies_are_accepted_or_rejected_cleanly(ops: list) -> None:
    """The joint code's per-reply check (the wrapper's gate before joint decoding):
    a mutated reply passes only if its header and every public parameter are still
    exactly the plan's (only answer bits, scale codes and the float dtype of the
    original tensor may differ; the wrapper compares the dtype with the model's), and
    the decoder then takes it; anything else is a PayloadError."""
    code, original = _onebit()
    buf = original
    for op in ops:
        buf = mutate(buf, op)
    try:
        code.check(buf, **_PLAN)
    except PayloadError:
        return
    from fedcomp.onebit.code import _BODY

    fixed = 24 + _BODY.size  # fixed header, 2-d shape, one-bit preamble
    assert len(buf) == len(original)
    assert buf[:4] == original[:4] and buf[5:fixed] == original[5:fixed]
    assert parse_payload(buf).header.dtype.is_floating_point
    plan = {k: v for k, v in _PLAN.items() if k != "client_index"}
    mean = code.decode_mean([buf], client_indices=[1], **plan)
    assert mean.shape == (7, 11) and torch.isfinite(mean).all()


# --- the client's side: mutated downlink instructions (a hostile server) ---------------

_DOWNLINK_SPEC = {"name": "uniform", "bits": 4, "block": 256}
#: Codec specs a mutated instruction may claim: other codecs, the deepest nesting a
#: setting builds, a memory, not JSON, not an object.
_CLAIMED_SPECS = (
    '{"name": "sign"}',
    '{"name": "uniform", "bits": 2, "block": 256}',
    '{"name": "rotate", "inner": "uniform", "bits": 4, "block": 256, "entropy": "zstd"}',
    '{"name": "ef", "inner": "sign"}',
    "[[[[]]]]",
    "{",
    '"uniform"',
)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)
instruction_mutation = st.one_of(
    st.tuples(st.just("payload"), st.integers(0, 100), mutation),
    st.tuples(
        st.just("version"),
        st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=4), st.floats()),
    ),
    st.tuples(st.just("checksum"), st.text(max_size=20)),
    st.tuples(st.just("field"), st.integers(0, 10), st.integers(0, 3), _JSON),
    st.tuples(st.just("entry"), st.integers(0, 10), _JSON),
    st.tuples(st.just("splice"), st.integers(0, 500), st.text(max_size=8)),
    st.tuples(st.just("entries"), st.integers(0, 10), st.sampled_from(["drop", "repeat"])),
    st.tuples(st.just("key"), st.integers(0, 100), st.text(max_size=10)),
    st.tuples(st.just("codec"), st.sampled_from(_CLAIMED_SPECS)),
    st.tuples(st.just("mode"), st.text(max_size=6)),
    # the bundle itself: its table and lengths (fedcomp.bundle)
    st.tuples(st.just("bundle"), mutation),
)


def _lagging_client():
    """A server 3 versions ahead of a client holding version 0 (small: under LIMIT)."""
    rng = np.random.default_rng(0)
    models = [
        {
            "w": rng.normal(size=(40, 30)).astype(np.float32),
            "b": rng.normal(size=30).astype(np.float32),
            "count": np.array([i], dtype=np.int64),
        }
        for i in range(4)
    ]
    server = BroadcastServer(parse_downlink(_DOWNLINK_SPEC), TensorPolicy(), RUN_SEED)
    server.start(models[0])
    replica = Replica().take_full(server.x_hat, 0, server.checksum)
    server.confirmed[CLIENT] = 0
    for model in models[1:]:
        server.advance(model)
    return server, replica


_LAGGING = _lagging_client()


def _downlink_instruction():
    """A fresh copy of the server's own instruction to the lagging client (3 steps)."""
    content = RecordDict({"arrays": ArrayRecord(), "config": ConfigRecord({})})
    sender = ReplicaSender(_LAGGING[0])
    sender.attach(content, CLIENT, model_free=True)
    content["config"][KEY_DOWNLINK_CODEC] = sender.codec_json  # as the mod restores it
    return Message(content, dst_node_id=1, message_type=MessageType.TRAIN)


def _mutate_steps(text: str, op: tuple) -> str:
    """The step list JSON with one field or entry replaced, text spliced in, or an
    entry dropped or repeated."""
    if op[0] == "splice":
        at = op[1] % (len(text) + 1)
        return text[:at] + op[2] + text[at:]
    steps = json.loads(text)
    i = op[1] % len(steps)
    if op[0] == "field":
        steps[i][op[2]] = op[3]
    elif op[0] == "entry":
        steps[i] = op[2]
    elif op[2] == "drop":
        del steps[i]
    else:
        steps.insert(i, list(steps[i]))
    return json.dumps(steps)


def _mutate_instruction(msg, op: tuple) -> None:
    config = msg.content["config"]
    blob = config.get(KEY_DOWNLINK_PAYLOADS)
    try:  # an earlier mutation may have left no bundle to edit entry by entry
        record = {k: bytes(v) for k, v in unpack_bundle(blob, max_entries=1 << 16).items()}
    except BundleError:
        record = None
    kind = op[0]
    if kind in ("payload", "key") and record:
        keys = list(record)
        key = keys[op[1] % len(keys)]
        data = record.pop(key)
        if kind == "payload":
            record[key] = mutate(data, op[2])
        else:
            record[op[2]] = data
        config[KEY_DOWNLINK_PAYLOADS] = pack_bundle(record, named=not is_positional(blob))
    elif kind == "bundle" and isinstance(blob, bytes):
        config[KEY_DOWNLINK_PAYLOADS] = mutate(blob, op[1])
    elif kind == "version":
        config[KEY_DOWNLINK_VERSION] = op[1]
    elif kind == "checksum":
        config[KEY_DOWNLINK_CHECKSUM] = op[1]
    elif kind == "codec":
        config[KEY_DOWNLINK_CODEC] = op[1]
    elif kind == "mode":
        config[KEY_DOWNLINK] = op[1]
    else:
        try:
            config[KEY_DOWNLINK_STEPS] = _mutate_steps(str(config[KEY_DOWNLINK_STEPS]), op)
        except (ValueError, TypeError, LookupError, ZeroDivisionError, RecursionError):
            pass  # an earlier mutation left no list of lists to edit: that is the case


def _rebuild_or_refuse(msg) -> None:
    """The client's rebuild path ends in x_hat's checksum or a ReplicaError."""
    server, replica = _LAGGING
    try:
        new = rebuild_model(msg, replica)
    except ReplicaError:
        return
    assert new.checksum == checksum(new.arrays) == msg.content["config"][KEY_DOWNLINK_CHECKSUM]
    assert {k: (v.shape, v.dtype) for k, v in new.arrays.items()} == {
        k: (v.shape, v.dtype) for k, v in server.x_hat.items()
    }


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(instruction_mutation, min_size=1, max_size=3))
@example(ops=[("field", 1, 1, 1)])  # two steps to version 1
@example(ops=[("splice", 0, "[" * 1200)])  # json's own recursion
@example(ops=[("codec", _CLAIMED_SPECS[2])])  # a deeper spec than the payloads
def test_mutated_downlink_instructions_rebuild_or_fail_cleanly(ops: list) -> None:
    """EXAMPLES cases (10^4 in `make fuzz`): a mutated instruction (step list, versions,
    checksum, codec spec, record keys, payload bytes) rebuilds x_hat or is a
    ReplicaError, under the memory cap."""
    msg = _downlink_instruction()
    for op in ops:
        _mutate_instruction(msg, op)
    _rebuild_or_refuse(msg)


def test_the_fuzzed_instruction_rebuilds_unmutated() -> None:
    """The target above must be able to succeed: the unmutated instruction rebuilds
    x_hat bit for bit."""
    server, replica = _LAGGING
    new = rebuild_model(_downlink_instruction(), replica)
    assert new.version == 3
    assert all(np.array_equal(new.arrays[k], v) for k, v in server.x_hat.items())


# --- fedcomp's own metrics and the pre-train evaluation (issue 41, findings 1 and 2) ---

_BAD_VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e301, -1e-300, -1.0, 2.5, 1e10, math.nan, math.inf]),
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.lists(st.floats(allow_nan=True), max_size=3),
    st.text(max_size=8),
)
_PLAUSIBLE = st.one_of(
    st.floats(0.0, 1.0), st.sampled_from([0.0, 1.0, 1e9, 1e300]), st.integers(1, 10**9)
)


@st.composite
def _reply_metrics(draw) -> dict:
    """A reply's metrics, mostly plausible (so that many are accepted and reach the
    bookkeeping), each group whole, partly or not at all, now and then a bad value
    or an unknown fedcomp name."""
    names = [[n] for n in OWN_METRICS if not any(n in g for g in GROUPS)]
    names += [list(g) for g in GROUPS] + [["train_loss"], ["fedcomp.unknown"]]
    bad_weight = draw(st.integers(0, 9)) == 0
    metrics = {KEY_NUM_EXAMPLES: draw(_BAD_VALUES if bad_weight else st.integers(1, 10**9))}
    for group in names:
        kept = draw(st.sampled_from(["none", "none", "all", "all", "all", "some"]))
        if kept == "none" or (group == ["fedcomp.unknown"] and draw(st.integers(0, 3))):
            continue
        chosen = group if kept == "all" else draw(st.lists(st.sampled_from(group), unique=True))
        for name in chosen:
            bad = draw(st.integers(0, 19)) == 0
            metrics[name] = draw(_BAD_VALUES if bad else _PLAUSIBLE)
    return metrics


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(metrics=_reply_metrics())
@example(metrics={METRIC_CV_BOUND: 1.0, KEY_NUM_EXAMPLES: 5})  # finding 1
@example(  # finding 2
    metrics={
        KEY_NUM_EXAMPLES: 5,
        METRIC_PRE_TRAIN_ACCURACY: 0.5,
        METRIC_PRE_TRAIN_LOSS: 1e300,
        METRIC_PRE_TRAIN_EXAMPLES: 1e9,
    }
)
def test_fuzzed_reply_metrics_are_refused_or_recorded_finite(metrics: dict) -> None:
    """EXAMPLES cases (10^4 in `make fuzz`): a train reply's metrics of any names and
    values are refused by the reply checks (a Rejection), or the round's bookkeeping
    reads them without raising into a record whose every number is finite."""
    header = ConfigRecord(
        {
            KEY_PROTOCOL: PROTOCOL_VERSION,
            KEY_STABLE_ID: CLIENT,
            KEY_ROUND: ROUND,
            KEY_PAYLOADS: pack_bundle({NAME: _valid(SPECS[0])}),
        }
    )
    for name, value in metrics.items():
        header[METRIC_PREFIX + name] = value
    content = RecordDict({RECORD_HEADER: header})
    try:
        checked = check_reply(content, CLIENT, ROUND, [NAME])
    except Rejection:
        event("refused")
        return
    event("accepted")
    counts = RoundCounts()
    record_pre_train_metrics(counts, [(CLIENT, checked.metrics)], MAX_NUM_EXAMPLES, 4.0)
    row = {"client": CLIENT, "uplink_wire_bytes": 1000}
    arrays = {NAME: _input(SPECS[0]).numpy()}
    item = Decoded(
        CLIENT,
        {},
        checked.weight,
        checked.metrics,
        Message(content, dst_node_id=1, message_type=MessageType.TRAIN),
        payloads=checked.payloads,
    )
    account_reply(
        row, item, checked.metrics, checked.weight, ReplyReference(arrays, TensorPolicy())
    )
    summary = residual_summary(_CvStub(), counts, [row])
    numbers = [counts.client_accuracy, counts.client_loss, *row.values(), *summary.values()]
    assert all(math.isfinite(v) for v in numbers if isinstance(v, int | float))


class _CvStub:
    """A residual server's mirrors as residual_summary reads them."""

    class store:
        @staticmethod
        def nbytes() -> int:
            return 0
