"""Every message of a round, counted by kind (docs/experiments.md, "Byte accounting").

The Flower side measures each real message (``fedcomp.flower.accounting``); this module
holds the counts and the one definition of the message kinds and of the fp32
reference: the same schedule with fp32 both ways and the full model in every
instruction, each message's reference size measured, never assumed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


class Kind(StrEnum):
    """The kinds of message a round exchanges (one name for both sides)."""

    TRAIN_INSTRUCTION = "train_instruction"
    TRAIN_REPLY = "train_reply"
    EVALUATE_INSTRUCTION = "evaluate_instruction"
    EVALUATE_REPLY = "evaluate_reply"
    #: First contact: learning a node's stable id.
    IDENTITY_QUERY = "identity_query"
    IDENTITY_REPLY = "identity_reply"


#: The kinds of the train traffic, both ways (``train_ratio_vs_fp32``).
TRAIN_KINDS = (Kind.TRAIN_INSTRUCTION, Kind.TRAIN_REPLY)


@dataclass
class KindBytes:
    """Measured bytes of one kind of message in one round."""

    messages: int = 0
    record_bytes: int = 0
    wire_bytes: int = 0
    #: What the same messages weigh under fp32 both ways (measured per message).
    fp32_wire_bytes: int = 0
    #: Flower objects the messages consist of (each one its own push or pull call on a
    #: deployment: what the socket cost of a message grows with, experiments/framing.py).
    objects: int = 0
    #: Objects of the same messages under fp32 both ways (counted per message).
    fp32_objects: int = 0


@dataclass
class Traffic:
    """One round's messages by kind, and per client (stable id) by kind."""

    by_kind: dict[str, KindBytes] = field(default_factory=dict)
    per_client: dict[int, dict[str, int]] = field(default_factory=dict)

    def add(
        self,
        kind: Kind,
        *,
        record_bytes: int,
        wire_bytes: int,
        fp32_wire_bytes: int | None = None,
        client: int | None = None,
        objects: int = 0,
        fp32_objects: int | None = None,
    ) -> None:
        """Count one message (``fp32_wire_bytes``, ``fp32_objects`` None: the same under
        fp32)."""
        counts = self.by_kind.setdefault(str(kind), KindBytes())
        counts.messages += 1
        counts.record_bytes += record_bytes
        counts.wire_bytes += wire_bytes
        counts.fp32_wire_bytes += wire_bytes if fp32_wire_bytes is None else fp32_wire_bytes
        counts.objects += objects
        counts.fp32_objects += objects if fp32_objects is None else fp32_objects
        if client is not None:
            row = self.per_client.setdefault(client, {})
            row[str(kind)] = row.get(str(kind), 0) + wire_bytes

    def correct_fp32(
        self,
        kind: Kind,
        measured: int,
        reference: int,
        objects: tuple[int, int] | None = None,
    ) -> None:
        """Replace a counted message's fp32 reference (``measured`` bytes were counted
        as their own reference) by the measured ``reference``: a train reply's fp32
        size is known only once it is decoded. ``objects``: (counted, reference)
        object counts, corrected the same way."""
        counts = self.by_kind[str(kind)]
        counts.fp32_wire_bytes += reference - measured
        if objects is not None:
            counts.fp32_objects += objects[1] - objects[0]

    def merge(self, other: Traffic) -> None:
        """Add ``other``'s counts to these."""
        for kind, counts in other.by_kind.items():
            mine = self.by_kind.setdefault(kind, KindBytes())
            for name, value in asdict(counts).items():
                setattr(mine, name, getattr(mine, name) + value)
        for client, row in other.per_client.items():
            target = self.per_client.setdefault(client, {})
            for kind, value in row.items():
                target[kind] = target.get(kind, 0) + value

    def wire(self, kinds: tuple[Kind, ...] | None = None) -> int:
        """Wire bytes of the given kinds (all kinds by default)."""
        return sum(c.wire_bytes for k, c in self.by_kind.items() if kinds is None or k in kinds)

    def fp32_wire(self, kinds: tuple[Kind, ...] | None = None) -> int:
        """The fp32 reference of the given kinds (all kinds by default)."""
        return sum(
            c.fp32_wire_bytes for k, c in self.by_kind.items() if kinds is None or k in kinds
        )

    def round_fields(self) -> dict[str, Any]:
        """The round record's traffic fields (results.json)."""
        return {
            "traffic": {k: asdict(c) for k, c in sorted(self.by_kind.items())},
            "total_wire_bytes": self.wire(),
            "fp32_total_wire_bytes": self.fp32_wire(),
            "train_wire_bytes": self.wire(TRAIN_KINDS),
            "fp32_train_wire_bytes": self.fp32_wire(TRAIN_KINDS),
        }

    def objects(self, kinds: tuple[Kind, ...] | None = None, *, fp32: bool = False) -> int:
        """Flower objects of the given kinds (``fp32``: of their fp32 reference)."""
        return sum(
            c.fp32_objects if fp32 else c.objects
            for k, c in self.by_kind.items()
            if kinds is None or k in kinds
        )
