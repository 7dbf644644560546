"""Where every byte of one train reply and its instruction goes, measured on real messages.

    python -m experiments.bytes_breakdown [--preset leaderboard_fmnist] [--recipe eden1]
                                          [OVERRIDE ...] [--out FILE.md]

One client of the preset's setting trains two rounds through the real ClientApp (mods
included) in this process; its round-2 compressed reply (and the model-free instruction
it answers, under a compressed downlink) is taken apart: Flower's envelope (the
Message, RecordDict and ConfigRecord objects and their keys), fedcomp's header fields,
the metrics, the payload bundle's table, and per tensor the payload header, the codec's
parameters, its scales, its codes and the padding they carry (the codec's bits on the
coordinates it adds to reach its block), or the raw values of a tensor the policy sends
raw. Every figure is a measured length; the parts add up to the reply's wire bytes
(the deflated objects, what a SuperNode pushes).
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType

from fedcomp.bundle import is_compact, unpack_bundle
from fedcomp.codecs import codec_class_by_id, parse_payload
from fedcomp.codecs.wire import HEADER_FIXED_BYTES
from fedcomp.compact import MAX_CODEC_ID
from fedcomp.flower.accounting import wire_and_objects
from fedcomp.flower.packed import opened, pack_fields, unpack_fields
from fedcomp.keys import (
    KEY_DOWNLINK_PAYLOADS,
    KEY_DOWNLINK_STEPS,
    KEY_PACKED,
    KEY_PAYLOADS,
    METRIC_PREFIX,
    RECORD_HEADER,
)


def config_entry_bytes(key: str, value: Any) -> int:
    """What one ConfigRecord entry adds to the record's deflated bytes."""
    empty = wire_and_objects(ConfigRecord({}))[0]
    return wire_and_objects(ConfigRecord({key: value}))[0] - empty


def split_entry(entry: bytes, shape: tuple[int, ...], compact: bool) -> tuple[int, int, bytes]:
    """A bundle entry's codec id, header bytes and body: a compact entry's header is its
    first byte (fedcomp.compact), a full payload's its fixed part and shape."""
    if compact:
        return entry[0] & MAX_CODEC_ID, 1, entry[1:]
    parsed = parse_payload(entry)
    return parsed.header.codec_id, HEADER_FIXED_BYTES + 4 * len(shape), bytes(parsed.body)


def tensor_parts(codec_id: int, header: int, body_bytes: bytes, numel: int) -> dict[str, int]:
    """One tensor's entry, taken apart: header, then the codec's own parts."""
    body = len(body_bytes)
    codec = codec_class_by_id(codec_id)
    parts = {"payload header": header}
    if codec is not None and codec.name == "eden":
        bits, _, _, _, block = struct.unpack_from("<BBBBI", body_bytes, 0)
        padded = _eden_padded(numel, block)
        codes = math.ceil(padded * bits / 8)
        padding = (padded - numel) * bits // 8
        parts.update(
            {
                "codec parameters": 8,
                "scales": body - 8 - codes,
                "codes": codes - padding,
                "padding (codes of added coordinates)": padding,
            }
        )
    elif codec is not None and codec.name == "raw":
        parts["raw values"] = body
    else:
        parts[f"{codec.name if codec else '?'} body"] = body
    return parts


def _eden_padded(numel: int, block: int) -> int:
    """EDEN's padded length: full blocks, the tail rounded up to a power of two >= 256
    (fedcomp.codecs.rotation.padded_length)."""
    from fedcomp.codecs.rotation import padded_length

    return padded_length(numel, block)


def breakdown(msg: Message, model: Mapping[str, np.ndarray]) -> list[tuple[str, str, int]]:
    """(group, item, bytes) rows that add up to the message's wire bytes: a compressed
    train reply (its header record) or a model-free train instruction (its config);
    ``model``: the model's tensors, in order (a positional bundle carries no names, a
    compact one no shapes)."""
    wire, _ = wire_and_objects(msg)
    record, blob_key = _fedcomp_record(msg)
    rows = _field_rows(record, blob_key)
    entries = sum(size for _, _, size in rows)
    blob = record[blob_key]
    bundle_entry = config_entry_bytes(blob_key, blob)
    names = _entry_names(msg, blob_key, list(model))
    payloads = unpack_bundle(blob, max_entries=1 << 16, names=names, expand=False)
    table = len(blob) - sum(len(p) for p in payloads.values())
    rows.append(("payload bundle", "bundle table (magic, count, lengths)", table))
    rows.append(
        ("payload bundle", "its ConfigRecord entry (key, length)", bundle_entry - len(blob))
    )
    for name, payload in payloads.items():
        shape = np.shape(model[name.rpartition("/")[2]])
        numel = math.prod(shape)
        codec_id, header, body = split_entry(bytes(payload), shape, is_compact(blob))
        for part, size in tensor_parts(codec_id, header, body, numel).items():
            rows.append((f"tensor {name} ({numel})", part, size))
    envelope = wire - entries - bundle_entry
    rows.insert(0, ("Flower envelope", "Message, RecordDict, ConfigRecord objects", envelope))
    return rows


def _field_rows(record: ConfigRecord, blob_key: str) -> list[tuple[str, str, int]]:
    """A row per header field and metric: an entry's own bytes, or a packed field's
    share of the packed entry (its tag, type and value: fedcomp.flower.packed), with
    the packed entry's key and length a row of their own."""
    rows = []
    for key, value in record.items():
        if key == blob_key:
            continue
        if key != KEY_PACKED:
            rows.append(
                (_group(key), key.removeprefix(METRIC_PREFIX), config_entry_bytes(key, value))
            )
            continue
        fields = unpack_fields(value)
        for field, field_value in fields.items():
            size = len(pack_fields({field: field_value})[0])
            rows.append((_group(field), field.removeprefix(METRIC_PREFIX) + " (packed)", size))
        framing = config_entry_bytes(key, value) - len(value)
        rows.append(("header fields", "the packed entry's key and length", framing))
    return rows


def _group(key: str) -> str:
    return "metrics" if key.startswith(METRIC_PREFIX) else "header fields"


def _entry_names(msg: Message, blob_key: str, names: Sequence[str]) -> list[str]:
    """The bundle's entry names: the model's, per step in an instruction."""
    if blob_key == KEY_PAYLOADS:
        return list(names)
    steps = json.loads(opened(msg.content["config"])[KEY_DOWNLINK_STEPS])
    return [f"{target}/{name}" for _, target, _ in steps for name in names]


def _fedcomp_record(msg: Message) -> tuple[ConfigRecord, str]:
    """The record holding fedcomp's fields and payload bundle, and the bundle's key."""
    if RECORD_HEADER in msg.content.config_records:
        return msg.content.config_records[RECORD_HEADER], KEY_PAYLOADS
    record = next(c for c in msg.content.config_records.values() if KEY_DOWNLINK_PAYLOADS in c)
    return record, KEY_DOWNLINK_PAYLOADS


def capture(preset: str, overrides: Sequence[str]) -> tuple[Message, Message, list[str]]:
    """One client's compressed train reply of round 2 of the preset's first run, the
    train instruction it answers (the run settings already held: what every later round
    sends; model-free under a compressed downlink) and the model's tensors."""
    from clients.client_app import make_client_app
    from clients.paths import paths_of
    from experiments.inprocess import InProcessGrid, set_task_identity
    from experiments.presets import preset_settings
    from fedcomp.models import build_model
    from strategies.server_app import run_server

    settings = preset_settings(preset, "seed=0", *overrides)[0]
    settings.num_rounds, settings.progress, settings.learning_check = 2, "off", False
    set_task_identity()
    grid = InProcessGrid(make_client_app(paths=paths_of(settings)), settings.num_clients)
    run_server(grid, settings)
    reply = [r for r in grid.replies if _is_train(r)][-1]
    node = reply.metadata.src_node_id  # the last train instruction to that node
    sent = [
        m
        for m in grid.sent
        if m.metadata.dst_node_id == node and m.metadata.message_type == MessageType.TRAIN
    ]
    model = build_model(settings.model, settings.dataset.name, settings.seed).state_dict()
    return reply, sent[-1], {k: v.numpy() for k, v in model.items()}


def _is_train(msg: Message) -> bool:
    return (
        not msg.has_error()
        and msg.metadata.message_type == MessageType.TRAIN
        and RECORD_HEADER in msg.content.config_records
        and KEY_PAYLOADS in msg.content.config_records[RECORD_HEADER]
    )


def table(rows: list[tuple[str, str, int]], total: int, what: str = "reply") -> str:
    lines = ["| part | item | bytes | share |", "|---|---|---|---|"]
    groups: dict[str, int] = {}
    for group, item, size in rows:
        groups[group] = groups.get(group, 0) + size
        lines.append(f"| {group} | {item} | {size:,} | {size / total:.1%} |")
    lines.append(f"| **total** | wire bytes of the {what} | **{total:,}** | 100% |")
    summary = ["", "| part | bytes | share |", "|---|---|---|"]
    summary += [f"| {g} | {b:,} | {b / total:.1%} |" for g, b in groups.items()]
    return "\n".join(lines + summary)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--preset", default="leaderboard_fmnist")
    parser.add_argument("--recipe", default="eden1")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    reply, instruction, model = capture(args.preset, [f"recipe={args.recipe}", *args.overrides])
    parts = []
    for title, msg in (("train reply", reply), ("train instruction", instruction)):
        total = wire_and_objects(msg)[0]
        if title == "train instruction" and KEY_DOWNLINK_PAYLOADS not in msg.content.get(
            "config", {}
        ):
            parts.append(f"## {title}\n\n{total:,} wire bytes: the full model (no downlink codec)")
            continue
        rows = breakdown(msg, model)
        assert sum(r[2] for r in rows) == total
        parts.append(f"## {title}\n\n" + table(rows, total, title.split()[-1]))
    text = "\n\n".join(parts)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
