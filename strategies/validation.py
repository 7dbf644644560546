"""Validating and decoding one client's reply: every check that protects the server.

A reply that fails any of them becomes a logged failure for that client (``ReplyError``
or ``PayloadError``); the server aggregates the others. Sizes and shapes claimed by a
payload are compared with the global model BEFORE anything is decoded or allocated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedcomp.codecs import codec_class_by_id, decode_bytes, parse_payload
from fedcomp.codecs.dense import RawCodec
from fedcomp.codecs.wire import DTYPE_CODES
from fedcomp.keys import (
    KEY_NUM_EXAMPLES,
    KEY_PROTOCOL,
    KEY_ROUND,
    KEY_STABLE_ID,
    PROTOCOL_VERSION,
    RECORD_HEADER,
    RECORD_PAYLOAD,
)
from fedcomp.rng import derive_seed


class ReplyError(ValueError):
    """A reply that fails validation; it becomes a logged failure for that client."""


def _torch_dtype(array: np.ndarray) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype


def check_reply(
    content: RecordDict, stable_id: int, server_round: int
) -> tuple[ConfigRecord, MetricRecord, float, ArrayRecord]:
    """Check the header, the weight and the records; return them.

    Raises
    ------
    ReplyError
        Naming the first problem found.
    """
    header = content.config_records.get(RECORD_HEADER)
    if header is None:
        raise ReplyError(
            f"no '{RECORD_HEADER}' record: add clients.mod.CompressionMod to the ClientApp"
        )
    if int(header.get(KEY_PROTOCOL, -1)) != PROTOCOL_VERSION:
        raise ReplyError(f"protocol version {header.get(KEY_PROTOCOL)!r} != {PROTOCOL_VERSION}")
    if header.get(KEY_STABLE_ID) != stable_id:
        raise ReplyError(
            f"header claims stable id {header.get(KEY_STABLE_ID)!r}, node is {stable_id}"
        )
    if header.get(KEY_ROUND) != server_round:
        raise ReplyError(f"header is for round {header.get(KEY_ROUND)!r}, not {server_round}")
    metrics = content.metric_records.get("metrics")
    if metrics is None or KEY_NUM_EXAMPLES not in metrics:
        raise ReplyError(f"metrics lack '{KEY_NUM_EXAMPLES}'")
    weight = metrics[KEY_NUM_EXAMPLES]
    if isinstance(weight, list) or not math.isfinite(weight) or weight <= 0:
        raise ReplyError(f"invalid {KEY_NUM_EXAMPLES}={weight!r}")
    payloads = content.array_records.get(RECORD_PAYLOAD)
    if payloads is None:
        raise ReplyError(f"no '{RECORD_PAYLOAD}' record")
    return header, metrics, float(weight), payloads


def decode_payloads(
    payloads: ArrayRecord,
    global_arrays: Mapping[str, np.ndarray],
    *,
    run_seed: int,
    server_round: int,
    stable_id: int,
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Decode every tensor's payload after checking it against the global model.

    Returns the decoded updates and, per tensor, the name of the codec it used.
    """
    if list(payloads.keys()) != list(global_arrays):
        raise ReplyError("payload tensor names differ from the global model's")
    deltas, codecs = {}, {}
    for name, reference in global_arrays.items():
        buf = payloads[name].data
        header = parse_payload(buf, max_numel=reference.size).header
        # Check the claimed shape and dtype BEFORE decoding allocates anything.
        if header.shape != reference.shape:
            raise ReplyError(f"{name}: shape {header.shape} != global {reference.shape}")
        if DTYPE_CODES[header.dtype] != DTYPE_CODES[_torch_dtype(reference)]:
            raise ReplyError(f"{name}: dtype {header.dtype} != global {reference.dtype}")
        codec_cls = codec_class_by_id(header.codec_id)
        if codec_cls is None:
            raise ReplyError(f"{name}: unknown codec id {header.codec_id}")
        # Codecs that regenerate public draws carry the derived seed: it must be the
        # one the server derives itself, or decoding would use other draws.
        needs = codec_cls.needs_seed
        expected_seed = derive_seed(run_seed, server_round, stable_id, name) if needs else 0
        if header.seed != expected_seed:
            raise ReplyError(f"{name}: seed in header does not match the server's")
        delta = decode_bytes(buf, max_numel=reference.size).numpy()
        if delta.dtype.kind == "f" and not np.isfinite(delta).all():
            raise ReplyError(f"{name}: non-finite values in the update")
        deltas[name] = delta
        codecs[name] = codec_cls.name
    return deltas, codecs


def compressed_names(codecs: Mapping[str, str]) -> set[str]:
    """Tensors that did not travel raw (those a residual memory covers)."""
    return {name for name, codec in codecs.items() if codec != RawCodec.name}
