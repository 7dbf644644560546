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

from collections.abc import Callable, Mapping

from flwr.app import Message, RecordDict
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


def wire_and_objects(obj: Message | RecordDict) -> tuple[int, int]:
    """:func:`wire_bytes` and :func:`object_count` of ``obj`` from one walk of its
    objects (what every counted message needs)."""
    with no_object_id_recompute():
        objects = get_all_nested_objects(obj)
        return sum(len(o.deflate()) for o in objects.values()), len(objects)


def object_count(obj: Message | RecordDict) -> int:
    """How many distinct Flower objects ``obj`` is, itself included: what Flower pushes
    or pulls one call each (identical objects, e.g. equal chunks, once)."""
    with no_object_id_recompute():
        return len(get_all_nested_objects(obj))


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
    wire, objects = wire_and_objects(msg)
    traffic.add(
        kind,
        record_bytes=0 if msg.has_error() else record_bytes(msg.content),
        wire_bytes=wire,
        fp32_wire_bytes=fp32_wire_bytes,
        client=client,
        objects=objects,
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
