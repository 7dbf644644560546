"""experiments.bytes_breakdown: every byte of a real reply and instruction is accounted
for, each part measured, the parts adding up to the message's wire bytes."""

from __future__ import annotations

import math

import pytest

from experiments.bytes_breakdown import breakdown, capture
from fedcomp.bundle import is_compact, unpack_bundle
from fedcomp.flower.accounting import wire_and_objects
from fedcomp.keys import KEY_DOWNLINK_PAYLOADS, KEY_PAYLOADS, RECORD_HEADER


@pytest.fixture(scope="module")
def messages():
    return capture("leaderboard_digits", ["recipe=eden1", "num_clients=4"])


def _payloads(msg):
    """The bundle's entries as the message carries them (compact: fedcomp.compact)."""
    if RECORD_HEADER in msg.content.config_records:
        blob = msg.content[RECORD_HEADER][KEY_PAYLOADS]
    else:
        blob = msg.content["config"][KEY_DOWNLINK_PAYLOADS]
    assert is_compact(blob)
    return unpack_bundle(blob, max_entries=64, expand=False)


def _name(msg, position: str, names: list[str]) -> str:
    """A positional entry's tensor name (reply: the model's; instruction: per step)."""
    i = int(position)
    prefix = "" if RECORD_HEADER in msg.content.config_records else "1/"
    return prefix + names[i % len(names)]


@pytest.mark.parametrize("which", [0, 1], ids=["reply", "instruction"])
def test_the_parts_add_up_to_the_wire_bytes_and_each_tensor_to_its_payload(
    messages, which
) -> None:
    msg, model = messages[which], messages[2]
    names = list(model)
    rows = breakdown(msg, model)
    assert sum(size for _, _, size in rows) == wire_and_objects(msg)[0]
    assert all(size >= 0 for _, _, size in rows)
    payloads = _payloads(msg)
    for position, payload in payloads.items():
        name = _name(msg, position, names)
        numel = model[name.rpartition("/")[2]].size
        parts = {item: size for group, item, size in rows if group == f"tensor {name} ({numel})"}
        assert sum(parts.values()) == len(payload)
        assert parts["payload header"] == 1  # the codec id and seed flag
        if "codes" in parts:  # 1-bit EDEN: one bit a coordinate, padding apart
            assert parts["codes"] == math.ceil(numel / 8) or parts["codes"] == numel // 8
    groups = {group for group, _, _ in rows}
    assert {"Flower envelope", "header fields", "payload bundle"} <= groups
