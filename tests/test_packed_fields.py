"""Packed fields (fedcomp.flower.packed) from their definition: a tag byte (the field's
position in PACKED_FIELDS plus one), a type byte and the value; every packable field
reads back exactly, anything else stays an entry, and a blob that does not read back
exactly is refused by name."""

from __future__ import annotations

import math
import struct

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcomp.flower.packed import (
    PackError,
    open_instruction,
    opened,
    pack_fields,
    pack_into,
    unpack_fields,
)
from fedcomp.keys import (
    KEY_PACKED,
    KEY_PROTOCOL,
    KEY_ROUND,
    KEY_SETTINGS,
    KEY_STABLE_ID,
    PACKED_FIELDS,
)


def _varint(n: int) -> bytes:
    """LEB128, written from its definition (7 bits a byte, low first, high bit: more)."""
    out = []
    while n >= 0x80:
        out.append(n % 128 + 128)
        n //= 128
    return bytes([*out, n])


def _tag(key: str) -> int:
    return PACKED_FIELDS.index(key) + 1


@pytest.mark.parametrize(
    ("value", "body"),
    [
        (0, b"\x00\x00"),
        (300, b"\x00" + _varint(600)),  # zigzag: 2n for n >= 0
        (-3, b"\x00" + _varint(5)),  # zigzag: -2n - 1 for n < 0
        ((1 << 63) - 1, b"\x00" + _varint((1 << 64) - 2)),
        (-(1 << 63), b"\x00" + _varint((1 << 64) - 1)),
        (0.1, b"\x01" + struct.pack("<d", 0.1)),
        ("00ff10", b"\x05\x03\x00\xff\x10"),  # lowercase hex: the bytes it stands for
        ("ABCD", b"\x02\x04ABCD"),  # not lowercase hex: UTF-8
        ("abc", b"\x02\x03abc"),  # odd length: UTF-8
        ("", b"\x02\x00"),
        ("é", b"\x02\x02\xc3\xa9"),
        (b"\x00\x01", b"\x03\x02\x00\x01"),
        (True, b"\x04\x01"),
        (False, b"\x04\x00"),
    ],
    ids=repr,
)
def test_each_value_is_its_tag_type_and_bytes_and_reads_back(value, body) -> None:
    blob, rest = pack_fields({KEY_ROUND: value})
    assert rest == {} and blob == bytes([_tag(KEY_ROUND)]) + body
    back = unpack_fields(blob)[KEY_ROUND]
    assert back == value and type(back) is type(value)


def test_what_does_not_pack_stays_an_entry_in_order() -> None:
    fields = {
        "lr": 0.1,  # not fedcomp's
        KEY_ROUND: 2,
        KEY_STABLE_ID: [1, 2],  # a list
        KEY_SETTINGS: 1 << 63,  # beyond 64 bits
    }
    blob, rest = pack_fields(fields)
    assert rest == {"lr": 0.1, KEY_STABLE_ID: [1, 2], KEY_SETTINGS: 1 << 63}
    assert unpack_fields(blob) == {KEY_ROUND: 2}


_VALUES = st.one_of(
    st.integers(-(1 << 63), (1 << 63) - 1),
    st.floats(allow_nan=False),
    st.text(max_size=40),
    st.binary(max_size=40),
    st.booleans(),
    st.binary(min_size=1, max_size=16).map(bytes.hex),
)


@settings(max_examples=200, deadline=None)
@given(
    fields=st.dictionaries(st.sampled_from(PACKED_FIELDS), _VALUES, max_size=12),
    extra=st.dictionaries(st.text(min_size=1, max_size=8).map("x".__add__), _VALUES, max_size=3),
)
def test_a_record_packed_then_opened_is_the_record(fields, extra) -> None:
    record = ConfigRecord({**fields, **extra})
    before = dict(record)
    pack_into(record)
    if fields:
        assert set(record) == {KEY_PACKED, *extra}
    back = opened(record)
    assert dict(back) == before
    assert all(type(back[k]) is type(v) for k, v in before.items())


def test_nan_and_infinities_read_back_as_sent() -> None:
    for value in (math.nan, math.inf, -math.inf, -0.0):
        back = unpack_fields(pack_fields({KEY_ROUND: value})[0])[KEY_ROUND]
        assert struct.pack("<d", back) == struct.pack("<d", value)


def _valid() -> bytes:
    return pack_fields({KEY_ROUND: 7, KEY_SETTINGS: "a1b2c3d4e5f60718", KEY_STABLE_ID: 3})[0]


@pytest.mark.parametrize(
    ("blob", "needle"),
    [
        (bytes([0, 0, 0]), "unknown field tag 0"),
        (bytes([len(PACKED_FIELDS) + 1, 0, 0]), f"unknown field tag {len(PACKED_FIELDS) + 1}"),
        (bytes([_tag(KEY_ROUND), 6, 0]), "unknown value type 6"),
        (bytes([_tag(KEY_ROUND), 0, 1, _tag(KEY_ROUND), 0, 2]), "packed twice"),
        (bytes([_tag(KEY_ROUND), 4, 2]), "a bool of value 2"),
        (bytes([_tag(KEY_ROUND), 2, 2, 0xFF, 0xFE]), "not UTF-8"),
        (bytes([_tag(KEY_ROUND), 0]) + b"\xff" * 11, "longer than 10 bytes"),
        (bytes([_tag(KEY_ROUND), 0]) + b"\xff" * 9 + b"\x02", "beyond 64 bits"),
        (bytes([_tag(KEY_ROUND), 3, 5, 1, 2]), "truncated"),
        (bytes([_tag(KEY_ROUND), 1, 0, 0]), "truncated"),
    ],
)
def test_a_blob_that_does_not_read_back_exactly_is_refused_by_name(blob, needle) -> None:
    with pytest.raises(PackError, match=needle):
        unpack_fields(blob)


def test_every_cut_inside_a_field_is_refused() -> None:
    blob = _valid()
    boundaries = {0}
    for n in range(1, len(blob) + 1):
        try:
            unpack_fields(blob[:n])
            boundaries.add(n)
        except PackError:
            pass
    # exactly the ends of the three fields read (as fewer fields); every other cut fails
    ends = {len(pack_fields(dict(list(unpack_fields(blob).items())[:i]))[0]) for i in range(4)}
    assert boundaries == ends


def test_a_field_both_packed_and_an_entry_is_refused_and_non_bytes_too() -> None:
    record = ConfigRecord({KEY_PACKED: _valid(), KEY_ROUND: 8})
    with pytest.raises(PackError, match="both packed and an entry"):
        opened(record)
    with pytest.raises(PackError, match="not bytes"):
        opened(ConfigRecord({KEY_PACKED: "text"}))
    # the writer packing again merges what is packed with the new entries, which win
    record = ConfigRecord({KEY_PACKED: _valid(), "lr": 0.5})
    record[KEY_PROTOCOL], record[KEY_ROUND] = 5, 9
    pack_into(record)
    assert set(record) == {KEY_PACKED, "lr"}
    expected = {**unpack_fields(_valid()), KEY_PROTOCOL: 5, KEY_ROUND: 9}
    assert unpack_fields(record[KEY_PACKED]) == expected


def test_an_instruction_is_opened_whole_or_not_at_all() -> None:
    good = ConfigRecord({KEY_PACKED: _valid(), "lr": 0.5})
    bad = ConfigRecord({KEY_PACKED: _valid()[:-1]})
    msg = Message(
        RecordDict({"arrays": ArrayRecord(), "a": good, "b": bad}),
        dst_node_id=1,
        message_type=MessageType.TRAIN,
    )
    with pytest.raises(PackError):
        open_instruction(msg)
    assert KEY_PACKED in msg.content["a"]  # nothing changed
    msg.content["b"] = ConfigRecord({"lr": 1.0})
    open_instruction(msg)
    assert dict(msg.content["a"]) == {"lr": 0.5, **unpack_fields(_valid())}
    open_instruction(msg)  # idempotent
    assert msg.content["a"][KEY_ROUND] == 7


@settings(max_examples=300, deadline=None)
@given(blob=st.binary(max_size=64))
def test_any_bytes_read_as_known_fields_or_are_refused(blob) -> None:
    try:
        fields = unpack_fields(blob)
    except PackError:
        return
    assert set(fields) <= set(PACKED_FIELDS)
    # plain values only (nothing evaluated), each of which packs again
    assert all(type(v) in (int, float, str, bytes, bool) for v in fields.values())
    assert unpack_fields(pack_fields(fields)[0]).keys() == fields.keys()


def test_the_mod_answers_an_instruction_it_cannot_open_with_a_clear_error() -> None:
    from flwr.app import Context
    from flwr.common.constant import ErrorCode

    from fedcomp.flower.mod import CompressionMod

    msg = Message(
        RecordDict({"arrays": ArrayRecord(), "config": ConfigRecord({KEY_PACKED: b"\x01"})}),
        dst_node_id=1,
        message_type=MessageType.TRAIN,
    )
    called = []
    ctxt = Context(1, 11, {"partition-id": 0, "num-partitions": 2}, RecordDict(), {})
    reply = CompressionMod()(msg, ctxt, lambda m, c: called.append(m))
    assert reply.has_error() and not called
    assert reply.error.code == ErrorCode.MOD_FAILED_PRECONDITION
    assert "packed fields: truncated" in reply.error.reason
