"""Byte accounting from real messages (docs/experiments.md, "Byte accounting").

- record bytes: Flower's ``count_bytes`` summed over the message's records (array
  data and key lengths; what ``message_size_mod`` logs);
- wire bytes: the deflated objects of the message, what a SuperNode or the
  SuperLink actually pushes (about 1.3 KB of fixed overhead per message);
- objects: how many Flower objects the message is (Message, RecordDict, each record,
  Array and ArrayChunk). On a deployment each one is its own push or pull call with
  ~1 KB of HTTP framing, so this count, not only the bytes, sets a message's socket
  cost (``experiments/framing.py``).

Every message of a round, in both directions, is counted by kind into the round's
``fedcomp.traffic.Traffic`` (:func:`measure_and_record`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from flwr.app import Message, RecordDict
from flwr.common.constant import FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE
from flwr.supercore.inflatable.inflatable_object import (
    get_all_nested_objects,
    no_object_id_recompute,
)

from fedcomp.traffic import Kind, Traffic


def record_bytes(content: RecordDict) -> int:
    """Flower's record byte count of a message content."""
    return sum(record.count_bytes() for record in content.values())


def wire_bytes(obj: Message | RecordDict) -> int:
    """Sum of the deflated sizes of every object a message (or content) consists of.

    Identical objects (e.g. equal chunks) are pushed once, as Flower does. Each
    object's id is computed once (Flower's own context for pushing a message: without
    it every level of the tree deflates its children again).
    """
    with no_object_id_recompute():
        return sum(len(o.deflate()) for o in get_all_nested_objects(obj).values())


def object_count(obj: Message | RecordDict) -> int:
    """How many distinct Flower objects ``obj`` is, itself included: what Flower pushes
    or pulls one call each (identical objects, e.g. equal chunks, once)."""
    with no_object_id_recompute():
        return len(get_all_nested_objects(obj))


def array_record_objects(
    data_bytes: Sequence[int], chunk_size: int = FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE
) -> int:
    """Objects of an ArrayRecord holding one Array per entry of ``data_bytes`` (each
    Array's data length): the record, each Array, and each Array's chunks, Flower
    slicing ``Array.data`` every ``chunk_size`` bytes (``Array.slice_array``).

    Counts every chunk: an upper bound when two chunks are identical (Flower sends
    those once), which needs identical data (e.g. all-zero arrays).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size}: must be > 0 bytes")
    if any(n < 0 for n in data_bytes):
        raise ValueError(f"data_bytes={list(data_bytes)}: array sizes must be >= 0")
    return 1 + sum(1 + math.ceil(n / chunk_size) for n in data_bytes)


def packed_record_objects(
    tensors: int, total_bytes: int, chunk_size: int = FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE
) -> int:
    """Objects of an ArrayRecord of ``tensors`` raw payloads totalling ``total_bytes``
    (the fp32 reference of a reply's payload record, whose per-tensor sizes the server
    does not see), counted as if the bytes were spread evenly over the tensors: exact
    whenever ``total_bytes <= chunk_size`` (every payload is one chunk); above that at
    most one object off per ``chunk_size`` bytes (each object ~1 KB at the socket:
    under 0.03% of the bytes)."""
    if tensors < 0 or total_bytes < 0:
        raise ValueError(f"tensors={tensors}, total_bytes={total_bytes}: must be >= 0")
    share, rest = divmod(total_bytes, tensors) if tensors else (0, 0)
    return array_record_objects([share + (i < rest) for i in range(tensors)], chunk_size)


def measure_and_record(
    traffic: Traffic,
    kind: Kind,
    msg: Message,
    *,
    client: int | None,
    fp32_wire_bytes: int | None = None,
    fp32_objects: int | None = None,
) -> int:
    """Measure ``msg``, record its bytes and objects under ``kind``; return its wire bytes.

    ``fp32_wire_bytes``, ``fp32_objects``: the measured size and object count of the
    same message under fp32 both ways (None: the message is its own reference, e.g.
    an evaluate reply or an error).
    """
    wire = wire_bytes(msg)
    traffic.add(
        kind,
        record_bytes=0 if msg.has_error() else record_bytes(msg.content),
        wire_bytes=wire,
        fp32_wire_bytes=fp32_wire_bytes,
        client=client,
        objects=object_count(msg),
        fp32_objects=fp32_objects,
    )
    return wire


def count_instructions(
    traffic: Traffic | None,
    kind: Kind,
    sent: Mapping[int, Message],
    carry: Callable[[int, Message], int | None],
) -> dict[int, int]:
    """Count each instruction as it leaves; return its wire bytes per client.

    ``carry(client, msg)`` first puts in it what the downlink sends (it may replace
    the model by replica steps) and returns the fp32 instruction's wire bytes, the
    message's reference (None: it is its own). ``traffic`` None: nothing is counted
    (an instruction outside the round under way).
    """
    wire = {}
    for sid, msg in sent.items():
        # Counted before ``carry`` may replace the model: the fp32 instruction's objects.
        fp32_objects = object_count(msg) if traffic is not None else None
        fp32 = carry(sid, msg)
        if traffic is not None:
            wire[sid] = measure_and_record(
                traffic,
                kind,
                msg,
                client=sid,
                fp32_wire_bytes=fp32,
                fp32_objects=None if fp32 is None else fp32_objects,
            )
    return wire


def count_replies(
    traffic: Traffic, kind: Kind, replies: list[Message], stable_of: Callable[[int], int | None]
) -> None:
    """Count each reply under ``kind``, by its sender's stable id (None: unknown)."""
    for msg in replies:
        measure_and_record(traffic, kind, msg, client=stable_of(msg.metadata.src_node_id))
