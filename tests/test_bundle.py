"""The payload bundle (fedcomp.bundle): its layout from the definition, every bound at
its boundary and one past it, and a fuzz over every truncation and every single-byte
change: the reader either returns views that add up to the value or raises BundleError."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from fedcomp.bundle import (
    BUNDLE_MAGIC,
    BUNDLE_VERSION,
    MAX_NAME_BYTES,
    POSITIONAL_VERSION,
    BundleError,
    is_positional,
    pack_bundle,
    unpack_bundle,
)

ITEMS = {"conv.weight": bytes(range(7)), "bias": b"", "é/ü": b"\xff" * 3}


def _by_hand(items: dict[str, bytes]) -> bytes:
    """The layout written out from the module's definition, independently."""
    out = BUNDLE_MAGIC + bytes([BUNDLE_VERSION]) + len(items).to_bytes(4, "little")
    for name, payload in items.items():
        encoded = name.encode()
        out += len(encoded).to_bytes(2, "little") + encoded + len(payload).to_bytes(4, "little")
    return out + b"".join(items.values())


def test_the_layout_is_the_definition_and_reads_back_as_views_in_order() -> None:
    blob = pack_bundle(ITEMS)
    assert blob == _by_hand(ITEMS)
    out = unpack_bundle(blob, max_entries=3, names=list(ITEMS))
    assert list(out) == list(ITEMS)
    assert {k: bytes(v) for k, v in out.items()} == ITEMS
    assert all(v.obj is blob for v in out.values())  # views, nothing copied


def test_an_empty_bundle_is_its_seven_byte_header() -> None:
    assert pack_bundle({}) == BUNDLE_MAGIC + bytes([BUNDLE_VERSION]) + b"\0\0\0\0"
    assert unpack_bundle(pack_bundle({}), max_entries=0) == {}


def test_the_entry_bound_accepts_its_value_and_refuses_one_past() -> None:
    blob = pack_bundle(ITEMS)
    assert len(unpack_bundle(blob, max_entries=3)) == 3
    with pytest.raises(BundleError, match="claims 3 payloads, at most 2"):
        unpack_bundle(blob, max_entries=2)
    with pytest.raises(BundleError, match="claims 3 payloads, exactly 2"):
        unpack_bundle(blob, max_entries=9, names=["conv.weight", "bias"])


def test_a_count_bomb_is_refused_before_the_table_is_read() -> None:
    blob = bytearray(pack_bundle(ITEMS))
    struct.pack_into("<I", blob, 3, 2**32 - 1)
    with pytest.raises(BundleError, match="claims 4294967295 payloads"):
        unpack_bundle(bytes(blob), max_entries=1 << 16)


@pytest.mark.parametrize("delta", [-1, 1])
def test_payload_lengths_must_add_up_to_exactly_what_follows(delta: int) -> None:
    blob = pack_bundle(ITEMS)
    with pytest.raises(BundleError):
        unpack_bundle(blob + b"\0" * max(delta, 0) if delta > 0 else blob[:delta], max_entries=3)
    # a payload length one larger or smaller with the same total size is also refused
    grown = bytearray(blob)
    offset = 7 + 2 + len(b"conv.weight")
    struct.pack_into("<I", grown, offset, 7 + delta)
    with pytest.raises(BundleError, match="add up to"):
        unpack_bundle(bytes(grown), max_entries=3)


def test_a_length_bomb_is_refused_without_allocating() -> None:
    blob = bytearray(pack_bundle(ITEMS))
    struct.pack_into("<I", blob, 7 + 2 + len(b"conv.weight"), 2**32 - 1)
    with pytest.raises(BundleError, match="add up to"):
        unpack_bundle(bytes(blob), max_entries=3)


def test_the_name_length_bound_at_its_value_and_one_past() -> None:
    longest = "n" * MAX_NAME_BYTES
    assert list(unpack_bundle(pack_bundle({longest: b"x"}), max_entries=1)) == [longest]
    with pytest.raises(BundleError, match="name of 1025 bytes"):
        pack_bundle({"n" * (MAX_NAME_BYTES + 1): b"x"})
    forged = _by_hand({"n" * (MAX_NAME_BYTES + 1): b"x"})
    with pytest.raises(BundleError, match="1025-byte name"):
        unpack_bundle(forged, max_entries=1)


@pytest.mark.parametrize(
    ("blob", "needle"),
    [
        (b"FB\x01\x00\x00", "truncated bundle: 5 bytes"),
        (b"XX" + pack_bundle(ITEMS)[2:], "not a payload bundle"),
        (b"FB\x04" + pack_bundle(ITEMS)[3:], "bundle format version 4, this reads 1, 2 and 3"),
        (_by_hand({"a": b"1", "b": b"2"}).replace(b"\x01\x00b", b"\x01\x00a"), "appears twice"),
        (_by_hand({"ab": b""}).replace(b"ab", b"\xff\xfe"), "not UTF-8"),
    ],
    ids=["short", "magic", "version", "duplicate", "utf8"],
)
def test_each_malformed_field_is_named(blob: bytes, needle: str) -> None:
    with pytest.raises(BundleError, match=needle):
        unpack_bundle(blob, max_entries=8)


@pytest.mark.parametrize("value", [None, "FB", bytearray(pack_bundle({})), 7, [b"FB"]])
def test_anything_but_bytes_is_refused(value: object) -> None:
    with pytest.raises(BundleError, match="not bytes"):
        unpack_bundle(value, max_entries=8)


def test_names_in_another_order_are_refused() -> None:
    with pytest.raises(BundleError, match="names differ"):
        unpack_bundle(pack_bundle(ITEMS), max_entries=3, names=["bias", "conv.weight", "é/ü"])


def _neighbours(blob: bytes, seed: int) -> list[bytes]:
    """Every truncation of ``blob`` and, at every byte, 0, 255 and a random value."""
    rng = np.random.default_rng(seed)
    out = [blob[:cut] for cut in range(len(blob))]
    for i in range(len(blob)):
        for value in (0, 255, int(rng.integers(256))):
            changed = bytearray(blob)
            changed[i] = value
            out.append(bytes(changed))
    return out


def test_every_truncation_and_every_byte_flip_reads_back_or_is_refused() -> None:
    """The reader's contract over the whole neighbourhood of a valid bundle: either
    a BundleError, or views that tile the value after the table exactly."""
    blob = pack_bundle(ITEMS)
    for candidate in _neighbours(blob, seed=0):
        try:
            out = unpack_bundle(candidate, max_entries=8)
        except BundleError:
            continue
        sizes = sum(len(v) for v in out.values())
        table = 7 + sum(2 + len(n.encode()) + 4 for n in out)
        assert table + sizes == len(candidate)


# --------------------------------------------------------- positional bundles (version 2)


def _positional_by_hand(items: dict[str, bytes]) -> bytes:
    """Version 2 written out from the definition: no names, the lengths, the payloads."""
    out = BUNDLE_MAGIC + bytes([POSITIONAL_VERSION]) + len(items).to_bytes(4, "little")
    out += b"".join(len(p).to_bytes(4, "little") for p in items.values())
    return out + b"".join(items.values())


def test_a_positional_bundle_is_its_definition_and_takes_the_readers_names() -> None:
    blob = pack_bundle(ITEMS, named=False)
    assert blob == _positional_by_hand(ITEMS) and is_positional(blob)
    assert not is_positional(pack_bundle(ITEMS))
    # what the names cost in a named bundle, and nothing else
    assert len(pack_bundle(ITEMS)) - len(blob) == sum(2 + len(n.encode()) for n in ITEMS)
    out = unpack_bundle(blob, max_entries=3, names=list(ITEMS))
    assert {k: bytes(v) for k, v in out.items()} == ITEMS and list(out) == list(ITEMS)
    assert all(v.obj is blob for v in out.values())
    plain = unpack_bundle(blob, max_entries=3)  # no names given: its positions
    assert list(plain) == ["0", "1", "2"] and [bytes(v) for v in plain.values()] == list(
        ITEMS.values()
    )


def test_a_positional_bundle_must_hold_exactly_the_readers_names() -> None:
    blob = pack_bundle(ITEMS, named=False)
    for names in (["a", "b"], ["a", "b", "c", "d"]):
        with pytest.raises(BundleError, match=f"claims 3 payloads, exactly {len(names)}"):
            unpack_bundle(blob, max_entries=8, names=names)
    with pytest.raises(BundleError, match="claims 3 payloads, at most 2"):
        unpack_bundle(blob, max_entries=2)


def test_a_positional_table_that_does_not_fit_is_refused_before_it_is_read() -> None:
    forged = BUNDLE_MAGIC + bytes([POSITIONAL_VERSION]) + (5).to_bytes(4, "little") + b"\0" * 12
    with pytest.raises(BundleError, match="a table of 5 lengths does not fit"):
        unpack_bundle(forged, max_entries=8)


def test_every_truncation_and_byte_flip_of_a_positional_bundle_reads_back_or_is_refused() -> None:
    blob = pack_bundle(ITEMS, named=False)
    for candidate in _neighbours(blob, seed=1):
        for names in (None, list(ITEMS)):
            try:
                out = unpack_bundle(candidate, max_entries=8, names=names)
            except BundleError:
                continue
            if is_positional(candidate):
                table = 7 + 4 * len(out)
            else:  # a flipped version byte reads it as named
                table = 7 + sum(2 + len(n.encode()) + 4 for n in out)
            assert table + sum(len(v) for v in out.values()) == len(candidate)
