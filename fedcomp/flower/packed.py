"""Packed fields: fedcomp's header fields and metrics in one bytes entry (protocol 5).

A Flower ConfigRecord entry costs its key, its value and about 7 bytes of framing: the
fedcomp header of a reply (its stable id, round, replica and control-variate versions
and checksums, and fedcomp's own metrics) was fourteen entries and 570 B, of which the
values are about 100. Here every field :data:`fedcomp.keys.PACKED_FIELDS` names travels
in ONE entry, :data:`~fedcomp.keys.KEY_PACKED`, as a tag byte, a type byte and the value::

    tag   u8   position in PACKED_FIELDS + 1
    type  u8   0 int (zigzag varint), 1 float (float64), 2 str (varint length, UTF-8),
               3 bytes (varint length), 4 bool (u8 0/1), 5 hex str (varint length, the
               bytes the lowercase hex digits stand for: a checksum in half its size)
    value

Both halves are here: :func:`pack_into` (the writers: the mod's replies, the server's
instructions as they leave) and :func:`opened` / :func:`open_instruction` (the readers:
the server's, which never change a reply it measured, and the client's mods, in place).
Fields not in the table, and values of other types (lists), stay entries of their own;
a reader takes either form. A packed entry that does not read back exactly (truncated,
an unknown tag or type, a field twice, a field also present as an entry of its own,
bytes left over) is a :class:`PackError`: for the server, that reply's failure.
Nothing is evaluated or unpickled: every value is one of five plain types.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping
from typing import Any

from flwr.app import ConfigRecord, Message

from fedcomp.keys import KEY_PACKED, PACKED_FIELDS

_TAG = {key: i + 1 for i, key in enumerate(PACKED_FIELDS)}
_KEY = {tag: key for key, tag in _TAG.items()}
_INT, _FLOAT, _STR, _BYTES, _BOOL, _HEX = range(6)
_DOUBLE = struct.Struct("<d")
_HEX_TEXT = re.compile(r"(?:[0-9a-f]{2})+")
#: The longest varint read (10 bytes hold any 64-bit value).
_MAX_VARINT = 10


class PackError(ValueError):
    """A packed entry that does not read back: truncated, unknown, repeated or leftover."""


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _zigzag(n: int) -> int:
    return (n << 1) if n >= 0 else ((-n) << 1) - 1


def _encode(value: Any) -> bytes | None:
    """A value's type byte and bytes; None for a value that stays an entry (a list, an
    int beyond 64 bits)."""
    if isinstance(value, bool):
        return bytes([_BOOL, int(value)])
    if isinstance(value, int):
        return bytes([_INT]) + _varint(_zigzag(value)) if -(1 << 63) <= value < 1 << 63 else None
    if isinstance(value, float):
        return bytes([_FLOAT]) + _DOUBLE.pack(value)
    if isinstance(value, str):
        if _HEX_TEXT.fullmatch(value):
            raw = bytes.fromhex(value)
            return bytes([_HEX]) + _varint(len(raw)) + raw
        data = value.encode("utf-8")
        return bytes([_STR]) + _varint(len(data)) + data
    if isinstance(value, bytes):
        return bytes([_BYTES]) + _varint(len(value)) + value
    return None


def pack_fields(fields: Mapping[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """The packed entry of the fields that pack, and the fields that stay entries (in
    their order)."""
    packed, rest = bytearray(), {}
    for key, value in fields.items():
        encoded = _encode(value) if key in _TAG else None
        if encoded is None:
            rest[key] = value
        else:
            packed += bytes([_TAG[key]]) + encoded
    return bytes(packed), rest


def pack_into(record: ConfigRecord) -> None:
    """Pack ``record``'s packable fields, with those it already holds packed, into its
    :data:`KEY_PACKED` entry, in place (nothing changes when none packs). The writer's
    side: an entry set since the last packing replaces the packed value of its field.

    Raises
    ------
    PackError
        The record's packed entry does not read back.
    """
    packed = unpack_fields(record[KEY_PACKED]) if KEY_PACKED in record else {}
    plain = {k: v for k, v in record.items() if k != KEY_PACKED}
    blob, rest = pack_fields({**packed, **plain})
    if not blob:
        return
    record.clear()
    record.update({KEY_PACKED: blob, **rest})


class _Reader:
    """Bounded reads from a packed entry: every length checked before it is sliced."""

    def __init__(self, blob: bytes) -> None:
        self.view, self.at = memoryview(blob), 0

    def left(self) -> int:
        return len(self.view) - self.at

    def take(self, n: int) -> bytes:
        if n > self.left():
            raise PackError(f"truncated: {n} bytes needed at offset {self.at}, {self.left()} left")
        out = bytes(self.view[self.at : self.at + n])
        self.at += n
        return out

    def varint(self) -> int:
        n, shift = 0, 0
        for _ in range(_MAX_VARINT):
            (byte,) = self.take(1)
            n |= (byte & 0x7F) << shift
            if not byte & 0x80:
                if n >> 64:
                    raise PackError(f"a varint beyond 64 bits at offset {self.at}")
                return n
            shift += 7
        raise PackError(f"a varint longer than {_MAX_VARINT} bytes at offset {self.at}")

    def value(self) -> Any:
        kind = self.take(1)[0]
        if kind == _INT:
            z = self.varint()
            return (z >> 1) ^ -(z & 1)
        if kind == _FLOAT:
            return _DOUBLE.unpack(self.take(8))[0]
        if kind == _BOOL:
            flag = self.take(1)[0]
            if flag > 1:
                raise PackError(f"a bool of value {flag}")
            return bool(flag)
        if kind in (_STR, _BYTES, _HEX):
            data = self.take(self.varint())
            if kind == _BYTES:
                return data
            if kind == _HEX:
                return data.hex()
            try:
                return data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise PackError(f"a string that is not UTF-8 ({exc.reason})") from exc
        raise PackError(f"unknown value type {kind}")


def unpack_fields(blob: object) -> dict[str, Any]:
    """The fields of a packed entry, in their order.

    Raises
    ------
    PackError
        Not bytes, truncated, an unknown tag or type, a tag twice, or bytes left over.
    """
    if not isinstance(blob, bytes):
        raise PackError(f"the '{KEY_PACKED}' entry is a {type(blob).__name__}, not bytes")
    reader, out = _Reader(blob), {}
    while reader.left():
        tag = reader.take(1)[0]
        key = _KEY.get(tag)
        if key is None:
            raise PackError(f"unknown field tag {tag}")
        if key in out:
            raise PackError(f"field {key} packed twice")
        out[key] = reader.value()
    return out


def opened(record: ConfigRecord) -> ConfigRecord:
    """``record`` with its packed fields as entries of their own (a new record; the
    record itself when nothing is packed): what the readers read.

    Raises
    ------
    PackError
        A packed entry that does not read back, or a field both packed and an entry.
    """
    if KEY_PACKED not in record:
        return record
    fields = unpack_fields(record[KEY_PACKED])
    both = sorted(set(fields) & set(record))
    if both:
        raise PackError(f"field {both[0]} is both packed and an entry of its own")
    out = ConfigRecord({k: v for k, v in record.items() if k != KEY_PACKED})
    out.update(fields)
    return out


def open_instruction(msg: Message) -> None:
    """Every config record of an instruction opened in place: what a client mod does
    before anything reads it (idempotent; fedcomp's mods call it on arrival).

    Raises
    ------
    PackError
        A packed entry that does not read back (nothing is changed then).
    """
    records = msg.content.config_records.values()
    fields = [opened(r) for r in records]  # every one checked before any changes
    for record, opened_record in zip(records, fields, strict=True):
        if opened_record is not record:
            record.clear()
            record.update(opened_record)
