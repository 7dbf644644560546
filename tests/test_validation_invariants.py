"""The reply checks of fedcomp/flower/validation.py, one by one, from their definitions.

Each check refuses exactly what it names with its failure kind and accepts its
boundary: a header of the wrong protocol, client or round; a weight outside
(0, max_weight]; a train metric that is not one finite number; an evaluate reply with
other than one MetricRecord, a non-finite value or a non-positive weight; payload
names, shapes, dtypes, codec ids, sizes and seeds that differ from the global model and
the spec the server sent; non-finite decoded values. Built from Flower records directly
(no run), so each case takes milliseconds.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, MetricRecord, RecordDict

from fedcomp.bundle import pack_bundle
from fedcomp.codecs import TensorPolicy, make_codec
from fedcomp.codecs.dense import RawCodec
from fedcomp.codecs.wire import PayloadError, SpecMismatch
from fedcomp.failures import Failure
from fedcomp.flower.reply_format import METRIC_PREFIX, replace_metrics
from fedcomp.flower.validation import (
    ReplyError,
    allowed_codecs,
    check_evaluate_reply,
    check_reply,
    check_train_metrics,
    compressed_names,
    decode_payloads,
    majority_keys,
)
from fedcomp.keys import (
    KEY_NUM_EXAMPLES,
    KEY_PAYLOADS,
    KEY_PROTOCOL,
    KEY_ROUND,
    KEY_STABLE_ID,
    PROTOCOL_VERSION,
    RECORD_HEADER,
)
from fedcomp.rng import derive_seed

SID, ROUND, RUN_SEED = 7, 3, 11
#: The model's tensors in the replies built here, and their payloads.
PAYLOADS = {"w": b"\x01\x02\x03", "b": b"\x04"}
NAMES = list(PAYLOADS)


def _reply(weight: object = 10.0, drop: str = "", **header: object) -> RecordDict:
    """A train reply of client SID for round ROUND, with one field changed or dropped."""
    metrics = {} if drop == "metrics" else {KEY_NUM_EXAMPLES: weight, "loss": 0.5}
    fields = {
        KEY_PROTOCOL: PROTOCOL_VERSION,
        KEY_STABLE_ID: SID,
        KEY_ROUND: ROUND,
        KEY_PAYLOADS: pack_bundle(PAYLOADS),
        **{METRIC_PREFIX + k: v for k, v in metrics.items()},
        **header,
    }
    fields = {k: v for k, v in fields.items() if k != drop}
    records = {RECORD_HEADER: ConfigRecord(fields)}
    return RecordDict({k: v for k, v in records.items() if k != drop})


def _refused(kind: Failure, fn, *args, **kwargs) -> str:
    with pytest.raises(ReplyError) as info:
        fn(*args, **kwargs)
    assert info.value.kind is kind
    return str(info.value)


# ----------------------------------------------------------------------- check_reply


def test_a_well_formed_reply_returns_its_records_and_its_weight_as_a_float() -> None:
    content = _reply(weight=12)
    checked = check_reply(content, SID, ROUND, NAMES)
    assert checked.header is content.config_records[RECORD_HEADER]
    assert checked.metrics == MetricRecord({KEY_NUM_EXAMPLES: 12, "loss": 0.5})
    assert {n: bytes(p) for n, p in checked.payloads.items()} == PAYLOADS
    assert list(checked.payloads) == NAMES
    assert checked.weight == 12.0 and isinstance(checked.weight, float)


@pytest.mark.parametrize(
    "names",
    [["w"], ["b", "w"], ["w", "b", "c"], ["w", "x"]],
    ids=["fewer", "order", "more", "other"],
)
def test_a_bundle_other_than_the_models_tensors_in_order_is_a_bad_layout(names) -> None:
    message = _refused(Failure.BAD_LAYOUT, check_reply, _reply(), SID, ROUND, names)
    assert "payloads:" in message


@pytest.mark.parametrize(
    ("content", "kind", "needle"),
    [
        (_reply(drop=RECORD_HEADER), Failure.MISSING_MOD, "CompressionMod"),
        # each message names the claimed value and the expected one
        (_reply(**{KEY_PROTOCOL: 99}), Failure.PROTOCOL, f"version 99 != {PROTOCOL_VERSION}"),
        (_reply(**{KEY_STABLE_ID: 99}), Failure.WRONG_CLIENT, f"id 99, node is {SID}"),
        (_reply(**{KEY_ROUND: 99}), Failure.WRONG_ROUND, f"round 99, not {ROUND}"),
        (_reply(drop="metrics"), Failure.BAD_WEIGHT, KEY_NUM_EXAMPLES),
        (_reply(drop=KEY_PAYLOADS), Failure.BAD_LAYOUT, "NoneType, not bytes"),
        (_reply(**{KEY_PAYLOADS: b"FB"}), Failure.BAD_LAYOUT, "truncated bundle"),
    ],
    ids=["no_header", "protocol", "client", "round", "no_metrics", "no_payload", "short"],
)
def test_each_header_and_record_check_refuses_with_its_kind(content, kind, needle) -> None:
    assert needle in _refused(kind, check_reply, content, SID, ROUND, NAMES)


def test_metrics_without_the_example_count_are_a_bad_weight() -> None:
    content = _reply()
    replace_metrics(content, {"loss": 0.5})
    _refused(Failure.BAD_WEIGHT, check_reply, content, SID, ROUND, NAMES)


def test_the_weight_bound_accepts_its_ends_and_refuses_one_step_past() -> None:
    cap = 50.0
    tiny = math.ulp(0.0)  # the smallest positive float: inside (0, cap]
    assert check_reply(_reply(weight=cap), SID, ROUND, NAMES, max_weight=cap).weight == cap
    assert check_reply(_reply(weight=tiny), SID, ROUND, NAMES, max_weight=cap).weight == tiny
    past = float(np.nextafter(cap, math.inf))
    for bad in (past, 0.0, -tiny, math.inf, -math.inf, math.nan, [1.0, 2.0]):
        message = _refused(Failure.BAD_WEIGHT, check_reply, _reply(weight=bad), SID, ROUND, NAMES,
                           max_weight=cap)  # fmt: skip
        assert "(0, 50]" in message


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, [0.1, 0.2]])
def test_a_train_metric_must_be_one_finite_number(bad) -> None:
    check_train_metrics(MetricRecord({"a": 1.0, "b": -3}))
    message = _refused(Failure.BAD_METRICS, check_train_metrics, MetricRecord({"a": 1.0, "b": bad}))
    assert f"b={bad!r}" in message
    content = _reply()
    replace_metrics(content, {KEY_NUM_EXAMPLES: 4.0, "b": bad})
    _refused(Failure.BAD_METRICS, check_reply, content, SID, ROUND, NAMES)


# ----------------------------------------------------------------------- evaluate


def _evaluate(*records: dict) -> RecordDict:
    return RecordDict({f"m{i}": MetricRecord(r) for i, r in enumerate(records)})


def test_an_evaluate_reply_needs_exactly_one_metric_record() -> None:
    good = {KEY_NUM_EXAMPLES: 5, "acc": 0.5}
    metrics = check_evaluate_reply(_evaluate(good))
    assert dict(metrics) == good
    assert "got 0" in _refused(Failure.BAD_LAYOUT, check_evaluate_reply, RecordDict({}))
    assert "got 2" in _refused(Failure.BAD_LAYOUT, check_evaluate_reply, _evaluate(good, good))


@pytest.mark.parametrize("bad", [math.nan, math.inf, [0.5, math.nan], [math.inf]])
def test_every_evaluate_value_must_be_finite_lists_included(bad) -> None:
    check_evaluate_reply(_evaluate({KEY_NUM_EXAMPLES: 5, "curve": [0.1, 0.2]}))
    reply = _evaluate({KEY_NUM_EXAMPLES: 5, "x": bad})
    # the message names the metric and its value (the sender's log says what to fix)
    assert f"x={bad!r}" in _refused(Failure.NONFINITE, check_evaluate_reply, reply)


def test_the_evaluate_weight_must_be_a_positive_scalar_under_its_key() -> None:
    tiny = math.ulp(0.0)
    assert check_evaluate_reply(_evaluate({"n": tiny}), weighted_by="n")["n"] == tiny
    for bad in (0, -1.0, [3, 4]):
        message = _refused(
            Failure.BAD_WEIGHT, check_evaluate_reply, _evaluate({"n": bad}), weighted_by="n"
        )
        assert f"n={bad!r}" in message
    # present under another key only: missing
    _refused(Failure.BAD_WEIGHT, check_evaluate_reply, _evaluate({"n": 5}))


# ----------------------------------------------------------------------- majority


def test_the_majority_key_set_is_the_most_frequent_one() -> None:
    a, b, c = frozenset({"loss"}), frozenset({"acc", "loss"}), frozenset({"z"})
    assert majority_keys([b, a, b, c]) == b
    assert majority_keys([a, b, b], strict=True) == b
    assert majority_keys([c]) == c and majority_keys([c], strict=True) == c


def test_a_tie_goes_to_the_smallest_sorted_tuple_or_to_none_when_strict() -> None:
    a, b = frozenset({"b"}), frozenset({"a", "z"})  # sorted tuples ('b',) > ('a', 'z')
    for order in ([a, b], [b, a], [a, a, b, b]):
        assert majority_keys(order) == b
        assert majority_keys(order, strict=True) is None
    # a tie between the two least frequent sets does not stop a strict majority
    c = frozenset({"c"})
    assert majority_keys([c, c, a, b], strict=True) == c


# ----------------------------------------------------------------------- codecs allowed


def test_the_allowed_codecs_follow_the_policy_the_server_sent() -> None:
    codec = make_codec("uniform", bits=4)
    policy = TensorPolicy(min_numel=1000)
    big, small = np.zeros(1000, np.float32), np.zeros(999, np.float32)
    ints = np.zeros(1000, np.int64)
    names = lambda allowed: [c.name for c in allowed]  # noqa: E731
    assert names(allowed_codecs(big, codec, None)) == ["raw", "uniform"]
    assert names(allowed_codecs(big, None, policy)) == ["raw"]
    assert names(allowed_codecs(big, codec, policy)) == ["uniform"]  # numel == min_numel
    assert names(allowed_codecs(small, codec, policy)) == ["raw"]
    assert names(allowed_codecs(ints, codec, policy)) == ["raw"]
    # no size threshold: 10 elements are 40 B raw, which 4-bit codes do not beat
    assert names(allowed_codecs(np.zeros(10, np.float32), codec, TensorPolicy())) == ["raw"]
    assert names(allowed_codecs(small, codec, TensorPolicy())) == ["uniform"]


def test_compressed_names_are_those_not_sent_raw() -> None:
    assert compressed_names({"a": "raw", "b": "uniform", "c": "randk"}) == {"b", "c"}
    assert compressed_names({"a": RawCodec.name}) == set()


# ----------------------------------------------------------------------- decode_payloads


def _decode(payloads: dict, global_arrays: dict, codec=None, policy=None):
    record = {k: memoryview(bytes(v)) for k, v in payloads.items()}
    return decode_payloads(
        record, global_arrays, codec=codec, policy=policy, run_seed=RUN_SEED,
        server_round=ROUND, stable_id=SID,
    )  # fmt: skip


def _seed(name: str) -> int:
    return derive_seed(RUN_SEED, ROUND, SID, name)


def test_payloads_decode_to_their_values_with_the_codec_names() -> None:
    x = torch.linspace(-1, 1, 12).reshape(3, 4)
    randk = make_codec("randk", k=5)
    deltas, used = _decode(
        {"w": randk.encode(x, seed=_seed("w")), "b": RawCodec().encode(torch.ones(2))},
        {"w": np.zeros((3, 4), np.float32), "b": np.zeros(2, np.float32)},
        codec=randk,
    )
    assert used == {"w": "randk", "b": "raw"}
    assert np.array_equal(deltas["w"], randk.decode(randk.encode(x, seed=_seed("w"))).numpy())
    assert deltas["w"].shape == (3, 4) and deltas["w"].dtype == np.float32
    assert np.array_equal(deltas["b"], np.ones(2, np.float32))


def test_tensor_names_must_be_the_global_models_in_its_order() -> None:
    raw = RawCodec().encode(torch.ones(2))
    model = {"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)}
    for names in (["a"], ["a", "b", "c"], ["b", "a"]):
        message = _refused(Failure.BAD_LAYOUT, _decode, dict.fromkeys(names, raw), model)
        assert "names differ" in message


def test_shape_dtype_and_size_are_checked_against_the_global_tensor() -> None:
    model = {"w": np.zeros((2, 3), np.float32)}
    raw = RawCodec()
    # each message starts with the tensor's name
    assert "w: shape" in _refused(Failure.BAD_LAYOUT, _decode,
                                  {"w": raw.encode(torch.ones(3, 2))}, model)  # fmt: skip
    assert "w: dtype" in _refused(
        Failure.BAD_LAYOUT, _decode, {"w": raw.encode(torch.ones(2, 3, dtype=torch.float64))}, model
    )
    # one element more than the global tensor: refused at parsing, before decoding
    with pytest.raises(PayloadError, match="above the limit of 6"):
        _decode({"w": raw.encode(torch.ones(7))}, model)


def test_a_codec_other_than_the_one_sent_is_a_spec_mismatch_naming_the_allowed() -> None:
    model = {"w": np.zeros(300, np.float32)}
    x = torch.ones(300)
    qsgd = make_codec("qsgd")
    with pytest.raises(SpecMismatch) as info:
        _decode({"w": qsgd.encode(x, seed=1)}, model, codec=make_codec("uniform"),
                policy=TensorPolicy())  # fmt: skip
    assert info.value.expected == [make_codec("uniform").codec_id]
    assert (info.value.field, info.value.value) == ("codec id", qsgd.codec_id)
    assert str(info.value).startswith("w: codec id 5")
    # without a policy the client may also send raw: both are named
    with pytest.raises(SpecMismatch) as info:
        _decode({"w": qsgd.encode(x, seed=1)}, model, codec=make_codec("uniform"))
    assert info.value.expected == [RawCodec.codec_id, make_codec("uniform").codec_id]
    assert str(info.value).endswith("asked for raw (id 0) or uniform (id 4)")
    # the right codec with other parameters: refused by its own spec check
    with pytest.raises(SpecMismatch, match="bits"):
        _decode({"w": make_codec("uniform", bits=2).encode(x, seed=1)}, model,
                codec=make_codec("uniform", bits=4))  # fmt: skip


def test_the_seed_must_be_the_derived_one_for_seeded_codecs_and_zero_otherwise() -> None:
    model = {"w": np.zeros(50, np.float32)}
    x = torch.arange(50, dtype=torch.float32)
    randk = make_codec("randk", k=10)
    _decode({"w": randk.encode(x, seed=_seed("w"))}, model, codec=randk)
    with pytest.raises(SpecMismatch) as info:
        _decode({"w": randk.encode(x, seed=_seed("w") + 1)}, model, codec=randk)
    assert (info.value.field, info.value.value) == ("seed", _seed("w") + 1)
    assert info.value.expected == _seed("w")
    assert str(info.value).startswith("w (randk): seed is")
    # a codec drawing nothing public must carry seed 0 (its header's default)
    uniform = make_codec("uniform")
    payload = uniform.encode(x, seed=5)
    assert payload.header.seed == 0
    _decode({"w": payload}, model, codec=uniform)


def test_non_finite_decoded_values_are_refused() -> None:
    model = {"w": np.zeros(3, np.float32)}
    bad = RawCodec().encode(torch.tensor([1.0, math.nan, 2.0]))
    assert "non-finite" in _refused(Failure.NONFINITE, _decode, {"w": bad}, model)
    # integer tensors have no non-finite values to check
    ints = {"n": np.zeros(3, np.int64)}
    deltas, _ = _decode({"n": RawCodec().encode(torch.tensor([1, 2, 3]))}, ints)
    assert deltas["n"].tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    "bad", [True, "0.5", b"x", ["a"], [True]], ids=["bool", "str", "bytes", "strs", "bools"]
)
def test_a_metric_entry_that_is_not_a_number_is_a_bad_metric(bad) -> None:
    """The metrics travel as header entries (fedcomp.flower.reply_format): anything a
    MetricRecord cannot hold, or a bool, is refused as that client's bad metrics."""
    content = _reply()
    content[RECORD_HEADER][METRIC_PREFIX + "b"] = bad
    message = _refused(Failure.BAD_METRICS, check_reply, content, SID, ROUND, NAMES)
    assert "train metrics" in message
