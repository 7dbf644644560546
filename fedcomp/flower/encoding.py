"""A train reply's update as packed payloads, and the reply's own measurements.

The mod (fedcomp.flower.mod) reads the instruction and adapts records and
Context.state; this is what it calls between the two: the update (trained minus
received model), its encoding by the codec family's client half
(fedcomp.flower.families), and the reply's measurements (codec bytes, relative error,
fp32 reference bytes). fedcomp.flower.reply_format lays the reply out.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, MetricRecord

from fedcomp.codecs import Codec, decode_bytes
from fedcomp.flower.families import family_of
from fedcomp.flower.families.base import Encoded, Instruction
from fedcomp.flower.memory_state import MemoryState
from fedcomp.keys import (
    KEY_NUM_EXAMPLES,
    METRIC_ENCODE_S,
    METRIC_REL_ERROR,
    METRIC_STATE_BYTES,
)


def only_record(records: dict, kind: str, where: str) -> tuple[str, object]:
    """The one record of ``kind`` a message part must hold."""
    if len(records) != 1:
        raise ValueError(f"{where} must hold exactly one {kind}, found {len(records)}")
    return next(iter(records.items()))


def relative_error(payloads: dict[str, bytes], inputs: dict[str, torch.Tensor]) -> float:
    """sum ||decode(payload) - x||^2 / sum ||x||^2, in float64 (0 for an all-zero input)."""
    num = den = 0.0
    for name, x in inputs.items():
        reference = x.to(torch.float64)
        num += float(((decode_bytes(payloads[name]).to(torch.float64) - reference) ** 2).sum())
        den += float((reference**2).sum())
    return num / den if den > 0 else 0.0


def trained_update(
    reply: Message, global_record: ArrayRecord
) -> tuple[dict[str, torch.Tensor], MetricRecord]:
    """The update (trained - received) per tensor, and the user's train metrics."""
    _, local_record = only_record(reply.content.array_records, "ArrayRecord", "train reply")
    _, metrics = only_record(reply.content.metric_records, "MetricRecord", "train reply")
    if KEY_NUM_EXAMPLES not in metrics:
        raise ValueError(f"train reply metrics lack '{KEY_NUM_EXAMPLES}'")
    if set(local_record.keys()) != set(global_record.keys()):
        raise ValueError("train reply arrays do not have the instruction's keys")
    deltas = {
        name: torch.from_numpy(np.asarray(local_record[name].numpy()))
        - torch.from_numpy(np.asarray(global_record[name].numpy()))
        for name in global_record.keys()
    }
    return deltas, metrics


def encode_update(
    instruction: Instruction,
    deltas: dict[str, torch.Tensor],
    load_memory: Callable[[], MemoryState],
    fp32: Codec,
) -> Encoded:
    """Encode the update with the instruction's codec, through its family's client
    half (memories load their state through ``load_memory``; ``fp32`` encodes a
    residual resync)."""
    return family_of(instruction.codec).encode(instruction, deltas, load_memory, fp32)


def reply_metrics(
    metrics: MetricRecord,
    encoded: Encoded,
    instruction: Instruction,
    deltas: dict[str, torch.Tensor],
    encode_s: float,
    *,
    measure_error: bool,
) -> MetricRecord:
    """The user's train metrics plus fedcomp's own measurements of this reply (the
    fp32 reference is the server's to compute: fedcomp.flower.reference)."""
    out = MetricRecord(dict(metrics))
    out[METRIC_ENCODE_S] = encode_s
    # joint and summed codes (no inputs given): no per-client decode to compare with
    if measure_error and encoded.inputs:
        out[METRIC_REL_ERROR] = relative_error(encoded.payloads, encoded.inputs)
    for key, value in encoded.stats.items():
        out[key] = value
    if encoded.memory is not None:
        out[METRIC_STATE_BYTES] = encoded.memory.nbytes
    return out
