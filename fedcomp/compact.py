"""Compact payload entries: a payload without the header its reader already knows.

A payload (fedcomp.codecs.wire) starts with a self-describing header of 16 bytes plus 4
per dimension: magic, format version, codec id, dtype, shape and the public seed. Inside
a message the reader knows all of it but the codec id: the tensor's shape and dtype are
the model's, and the seed is the one it derives itself (and checked the payload's
against). On the Fashion-MNIST CNN those headers were 236 B of every 3 KB message, both
ways. A compact entry keeps one byte of them::

    u8  codec id (bits 0-6) | 0x80 when the payload carries a public seed
    ... the payload's body, unchanged

Both halves are here: the writer (:func:`compact_entry`) needs no context; the reader
(:func:`expand_entry`) rebuilds the header from a :data:`HeaderRule` the protocol's
reader supplies (the uplink's in fedcomp.flower.validation, the downlink's in
fedcomp.downlink), and every check a payload's header went through before still runs on
the rebuilt one, so a hostile entry can claim nothing a full payload could not.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from fedcomp.codecs.wire import (
    HEADER_FIXED_BYTES,
    MAX_CODEC_ID,
    SEEDED,
    PayloadHeader,
    compact_bytes,
    compact_parts,
    parse_payload,
)

__all__ = ["MAX_CODEC_ID", "SEEDED", "HeaderRule", "compact_entry", "entry_size", "expand_entry"]

#: No bound on the claimed size: these functions read payloads their caller wrote or
#: already checked (parse_payload's default bound is for untrusted buffers).
_ANY_SIZE = sys.maxsize

#: The reader's side: (entry name, codec id, seeded) -> the header the payload had.
#: Raises ValueError for an entry it cannot place (an unknown name).
HeaderRule = Callable[[str, int, bool], PayloadHeader]


def compact_entry(payload: bytes | bytearray | memoryview) -> bytes:
    """One payload as a compact entry: its codec id and seed flag, then its body.

    Raises
    ------
    ValueError
        A payload that does not parse, or a codec id above :data:`MAX_CODEC_ID`.
    """
    return compact_bytes(parse_payload(payload, max_numel=_ANY_SIZE))  # the writer's own


def entry_size(payload: bytes | bytearray | memoryview) -> int:
    """The bytes a (well-formed) payload takes as a compact entry: what a message of
    protocol 4 carries for it, the figure a round's codec bytes add up."""
    header = parse_payload(payload, max_numel=_ANY_SIZE).header
    return len(payload) - HEADER_FIXED_BYTES - 4 * len(header.shape) + 1


def expand_entry(entry: bytes | memoryview, name: str, rule: HeaderRule) -> bytes:
    """The full payload a compact entry stands for: the header ``rule`` gives for its
    codec id and flag, then its body.

    Raises
    ------
    ValueError
        An empty entry, or whatever ``rule`` refuses.
    """
    try:
        codec_id, seeded, body = compact_parts(entry)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    return rule(name, codec_id, seeded).pack() + bytes(body)
