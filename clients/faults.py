"""Fault injection for simulations and tests: dropped replies, crashing clients,
corrupt payloads and NaN updates, at configured rates (``faults.*`` settings).

Two mods, because faults happen at two places of a reply's life:

- :class:`FaultMod` wraps the compression mod (``mods=[FaultMod(), CompressionMod()]``):
  it crashes the client before training, or, after encoding, drops the reply or
  truncates one payload;
- :class:`NaNFaultMod` sits inside it (``inner_mods``): it turns the trained model into
  NaN, which the encoder must refuse.

Whether and how a reply is faulty is drawn from (run seed, round, stable id), so a
faulty run reproduces exactly. The settings come with the instruction (``KEY_TASK``).
"""

from __future__ import annotations

import json

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Error, Message, MessageType, RecordDict
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.constant import ErrorCode

from fedcomp.bundle import repack_like, unpack_bundle
from fedcomp.flower.identity import stable_id_of
from fedcomp.flower.packed import PackError, open_instruction
from fedcomp.flower.reply_format import MAX_TENSORS
from fedcomp.flower.shared_settings import held_task
from fedcomp.injected import KINDS, draw_fault
from fedcomp.keys import (
    FAULT_REASON_PREFIX,
    KEY_PAYLOADS,
    KEY_ROUND,
    KEY_RUN_SEED,
    RECORD_HEADER,
)

#: Error reasons contain this, then the kind (for the logs; the server counts a fault
#: by its own draw, fedcomp.injected, not by this text).
REASON_PREFIX = FAULT_REASON_PREFIX


def _fault_of(msg: Message, ctxt: Context):
    if msg.metadata.message_type != MessageType.TRAIN:
        return None, None
    # Outside the compression mod: the fields may still be packed, the task only its digest.
    try:
        open_instruction(msg)
    except PackError:
        return None, None  # the compression mod answers it with an error
    task = held_task(msg.content, ctxt.state)
    config = next((c for c in msg.content.config_records.values() if KEY_ROUND in c), None)
    if task is None or config is None:
        return None, None
    rates = json.loads(task).get("faults") or {}
    if not any(rates.values()):
        return None, None
    fault = draw_fault(rates, int(config[KEY_RUN_SEED]), int(config[KEY_ROUND]), stable_id_of(ctxt))
    return fault, config


def _truncated(reply: Message, msg: Message, seed: int) -> Message:
    """The reply with one payload cut short (detectable: sizes no longer match), as
    its bundle stores it (a compact entry, fedcomp.compact, or a full payload)."""
    header = reply.content[RECORD_HEADER]
    blob = header[KEY_PAYLOADS]
    entries = {
        n: bytes(e) for n, e in unpack_bundle(blob, max_entries=MAX_TENSORS, expand=False).items()
    }
    names = list(entries)
    rng = np.random.default_rng(seed)
    name = names[int(rng.integers(len(names)))]
    data = entries[name]
    entries[name] = data[: int(rng.integers(len(data)))] if data else b""
    header[KEY_PAYLOADS] = repack_like(blob, entries, stored=True)
    return Message(reply.content, reply_to=msg)


class FaultMod:
    """Outer fault mod: crash before training; drop or corrupt after encoding."""

    def __call__(self, msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
        fault, config = _fault_of(msg, ctxt)
        if fault == "crash_client":
            raise RuntimeError(REASON_PREFIX + "crash_client")
        try:
            reply = call_next(msg, ctxt)
        except Exception as exc:  # the encoder refuses the NaNs: name the injected fault
            if fault == "nan_update":
                raise RuntimeError(f"{REASON_PREFIX}nan_update: {exc!r}") from exc
            raise
        if fault == "nan_update" and reply.has_error():
            reason = f"{REASON_PREFIX}nan_update: {reply.error.reason}"
            return Message(Error(code=reply.error.code, reason=reason), reply_to=msg)
        if fault is None or reply.has_error():
            return reply
        if fault == "drop_reply":
            return Message(
                Error(code=ErrorCode.UNKNOWN, reason=REASON_PREFIX + "drop_reply"),
                reply_to=msg,
            )
        header = reply.content.config_records.get(RECORD_HEADER)
        if fault == "corrupt_payload" and header is not None and KEY_PAYLOADS in header:
            seed = int(config[KEY_RUN_SEED]) * 7919 + int(config[KEY_ROUND])
            return _truncated(reply, msg, seed)
        return reply


class NaNFaultMod:
    """Inner fault mod: the trained model becomes NaN (before the encoder sees it)."""

    def __call__(self, msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
        fault, _ = _fault_of(msg, ctxt)
        reply = call_next(msg, ctxt)
        if fault != "nan_update" or reply.has_error():
            return reply
        content = RecordDict()
        for key, record in reply.content.items():
            if isinstance(record, ArrayRecord):
                record = ArrayRecord(
                    {
                        n: Array(np.full_like(np.asarray(a.numpy()), np.nan))
                        if np.asarray(a.numpy()).dtype.kind == "f"
                        else a
                        for n, a in record.items()
                    }
                )
            content[key] = record
        return Message(content, reply_to=msg)


__all__ = ["KINDS", "REASON_PREFIX", "FaultMod", "NaNFaultMod", "draw_fault"]
