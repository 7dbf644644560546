"""Compact payload entries (fedcomp.compact) and the compact bundle (fedcomp.bundle
version 3), from their definitions: an entry is the payload less the header its reader
knows, one byte in its place; the reader's rules rebuild exactly the header the
payload had, and nothing a full payload could not claim."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from fedcomp.bundle import (
    BundleError,
    is_compact,
    is_positional,
    pack_bundle,
    repack_like,
    unpack_bundle,
)
from fedcomp.codecs import make_codec
from fedcomp.codecs.base import JOINT_ONEBIT_ID
from fedcomp.codecs.dense import RawCodec
from fedcomp.codecs.wire import HEADER_FIXED_BYTES, PayloadHeader, parse_payload
from fedcomp.compact import (
    MAX_CODEC_ID,
    SEEDED,
    compact_entry,
    entry_size,
    expand_entry,
)
from fedcomp.downlink import SEED_PURPOSE, step_headers
from fedcomp.flower.validation import uplink_headers
from fedcomp.onebit.federated import joint_seed
from fedcomp.rng import derive_seed

SPECS = [
    {"name": "raw"},
    {"name": "fp16"},
    {"name": "uniform", "bits": 2, "block": 16},
    {"name": "sign", "block": 16},
    {"name": "topk", "fraction": 0.2},
    {"name": "randk", "fraction": 0.3},
    {"name": "eden", "bits": 1, "block": 256},
    {"name": "subsample", "inner": "eden", "fraction": 0.25, "bits": 1, "block": 256},
    {"name": "sparseq", "fraction": 0.2, "bits": 3, "block": 16},
    {"name": "lowrank", "rank": 2},
    {"name": "uniform", "bits": 2, "block": 16, "entropy": "zstd"},
]
SHAPES = [(7,), (6, 5), (2, 3, 4), (3, 1, 5, 5)]


def _payload(spec: dict, shape: tuple[int, ...], seed: int) -> bytes:
    params = {k: v for k, v in spec.items() if k != "name"}
    x = torch.from_numpy(np.random.default_rng(len(shape)).standard_normal(shape).astype("f4"))
    return bytes(make_codec(spec["name"], **params).encode(x, seed=seed))


def _own_rule(full: bytes):
    """The rule a reader that knows this payload's shape, dtype and seed applies."""
    header = parse_payload(full).header

    def rule(name: str, codec_id: int, seeded: bool) -> PayloadHeader:
        return PayloadHeader(codec_id, header.dtype, header.shape, header.seed if seeded else 0)

    return rule


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "-".join(map(str, s.values())))
def test_an_entry_is_the_payload_less_its_header_and_expands_back_bit_for_bit(spec, shape):
    if spec["name"] == "lowrank" and len(shape) == 1:
        pytest.skip("low rank needs a matrix")
    full = _payload(spec, shape, seed=derive_seed(9, 1, 2, "w"))
    header = parse_payload(full).header
    entry = compact_entry(full)
    # the definition: one byte (codec id, seed flag), then the body, unchanged
    assert entry[0] & MAX_CODEC_ID == header.codec_id
    assert bool(entry[0] & SEEDED) == (header.seed != 0)
    assert entry[1:] == full[HEADER_FIXED_BYTES + 4 * len(shape) :]
    assert len(entry) == entry_size(full) == len(full) - HEADER_FIXED_BYTES - 4 * len(shape) + 1
    assert expand_entry(entry, "w", _own_rule(full)) == full


def test_a_codec_id_the_flag_bit_would_take_is_refused():
    full = bytearray(_payload({"name": "raw"}, (4,), 0))
    full[3] = MAX_CODEC_ID + 1
    with pytest.raises(ValueError, match="does not fit a compact entry"):
        compact_entry(bytes(full))


def test_an_empty_entry_is_refused_by_name():
    with pytest.raises(ValueError, match="w: an empty compact entry"):
        expand_entry(b"", "w", _own_rule(_payload({"name": "raw"}, (4,), 0)))


MODEL = {"a.weight": np.zeros((6, 5), np.float32), "a.bias": np.zeros(5, np.float32)}


def _replies(seed_of) -> dict[str, bytes]:
    specs = {"a.weight": {"name": "eden", "bits": 1, "block": 256}, "a.bias": {"name": "raw"}}
    return {n: _payload(specs[n], MODEL[n].shape, seed_of(n)) for n in MODEL}


def test_the_compact_bundle_saves_each_header_and_reads_back_the_same_payloads():
    payloads = _replies(lambda n: derive_seed(4, 3, 8, n) if n == "a.weight" else 0)
    full, compact = (
        pack_bundle(payloads, named=False),
        pack_bundle(payloads, named=False, compact=True),
    )
    assert is_compact(compact) and is_positional(compact) and not is_compact(full)
    saved = sum(HEADER_FIXED_BYTES + 4 * MODEL[n].ndim - 1 for n in MODEL)
    assert len(full) - len(compact) == saved
    rule = uplink_headers(MODEL, 4, 3, 8)
    read = unpack_bundle(compact, max_entries=2, names=list(MODEL), headers=rule)
    assert {n: bytes(p) for n, p in read.items()} == payloads
    # the same reader takes protocol 3's full payloads too
    assert unpack_bundle(full, max_entries=2, names=list(MODEL), headers=rule).keys() == read.keys()
    with pytest.raises(BundleError, match="without the rule"):
        unpack_bundle(compact, max_entries=2, names=list(MODEL))
    stored = unpack_bundle(compact, max_entries=2, names=list(MODEL), expand=False)
    assert [bytes(e) for e in stored.values()] == [compact_entry(p) for p in payloads.values()]
    assert repack_like(compact, stored, stored=True) == compact
    assert repack_like(compact, payloads) == compact and repack_like(full, payloads) == full


def test_the_uplink_rule_gives_the_seed_the_server_checks():
    rule = uplink_headers(MODEL, 4, 3, 8)
    header = rule("a.weight", 7, True)
    assert (header.shape, header.dtype) == ((6, 5), torch.float32)
    assert header.seed == derive_seed(4, 3, 8, "a.weight")
    assert rule("a.weight", 7, False).seed == 0
    assert rule("a.weight", JOINT_ONEBIT_ID, True).seed == joint_seed(4, 3, "a.weight")
    with pytest.raises(ValueError, match="not a tensor of the model"):
        rule("evil", 7, True)


def test_the_downlink_rule_follows_encode_step():
    held = {"w": np.zeros((3, 4), np.float16), "b": np.zeros(2, np.int64)}
    rule = step_headers(held, 11)
    coded = rule("5/w", 4, True)
    assert (coded.shape, coded.dtype, coded.seed) == (
        (3, 4),
        torch.float32,  # differences travel as float32
        derive_seed(11, SEED_PURPOSE, 5, "w"),
    )
    raw = rule("5/b", RawCodec.codec_id, False)
    assert (raw.shape, raw.dtype, raw.seed) == ((2,), torch.int64, 0)  # the value itself
    for bad in ("x/w", "5/evil", "w"):
        with pytest.raises(ValueError, match="is not '<target>/<tensor>'"):
            rule(bad, 4, True)


def test_a_rule_that_refuses_is_a_bundle_error():
    payloads = _replies(lambda n: 0)
    compact = pack_bundle(payloads, named=False, compact=True)
    with pytest.raises(BundleError, match="not a tensor of the model"):
        unpack_bundle(
            compact,
            max_entries=2,
            names=["a.weight", "other"],
            headers=uplink_headers(MODEL, 0, 1, 2),
        )
    entries = compact[7 + 8 :]  # after the head and the two lengths
    emptied = struct.pack("<2sBI", b"FB", 3, 2) + struct.pack("<II", 0, len(entries)) + entries
    with pytest.raises(BundleError, match="empty compact entry"):
        unpack_bundle(
            emptied, max_entries=2, names=list(MODEL), headers=uplink_headers(MODEL, 0, 1, 2)
        )


def test_a_replys_codec_bytes_are_what_its_bundle_carried_in_either_form() -> None:
    from flwr.app import MetricRecord

    from fedcomp.flower.reply_format import reply_content
    from fedcomp.flower.validation import check_reply
    from fedcomp.keys import (
        KEY_NUM_EXAMPLES,
        KEY_PAYLOADS,
        KEY_PROTOCOL,
        KEY_ROUND,
        KEY_STABLE_ID,
        PROTOCOL_VERSION,
        RECORD_HEADER,
    )

    payloads = _replies(lambda n: derive_seed(4, 3, 8, n) if n == "a.weight" else 0)
    header = {KEY_PROTOCOL: PROTOCOL_VERSION, KEY_STABLE_ID: 8, KEY_ROUND: 3}
    content = reply_content(header, payloads, MetricRecord({KEY_NUM_EXAMPLES: 5}))
    rule = uplink_headers(MODEL, 4, 3, 8)
    compact = check_reply(content, 8, 3, list(MODEL), headers=rule)
    assert compact.sent_bytes == sum(len(compact_entry(p)) for p in payloads.values())
    content[RECORD_HEADER][KEY_PAYLOADS] = pack_bundle(payloads, named=False)  # in full
    full = check_reply(content, 8, 3, list(MODEL), headers=rule)
    assert full.sent_bytes == sum(len(p) for p in payloads.values()) > compact.sent_bytes
    assert {n: bytes(p) for n, p in full.payloads.items()} == payloads


def test_a_tensor_beyond_the_untrusted_size_bound_still_packs() -> None:
    """The writer's own payload of a huge tensor (an embedding of 2^28 + 1 values):
    compacting it must not apply the bound meant for untrusted buffers."""
    header = PayloadHeader(RawCodec.codec_id, torch.float32, ((1 << 28) + 1,), 0)
    full = header.pack() + b"\x00" * 8  # the header is what is read; no body is needed
    assert compact_entry(full) == b"\x00" + b"\x00" * 8
    assert entry_size(full) == 9
