"""Byte accounting from real messages (docs/experiments.md, "Byte accounting").

- record bytes: Flower's ``count_bytes`` summed over the message's records (array
  data and key lengths; what ``message_size_mod`` logs);
- wire bytes: the deflated objects of the message, what a SuperNode or the
  SuperLink actually pushes (about 1.3 KB of fixed overhead per message).
"""

from __future__ import annotations

from flwr.app import Message, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects


def record_bytes(content: RecordDict) -> int:
    """Flower's record byte count of a message content."""
    return sum(record.count_bytes() for record in content.values())


def wire_bytes(obj: Message | RecordDict) -> int:
    """Sum of the deflated sizes of every object a message (or content) consists of.

    Identical objects (e.g. equal chunks) are pushed once, as Flower does.
    """
    return sum(len(o.deflate()) for o in get_all_nested_objects(obj).values())
