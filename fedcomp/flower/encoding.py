"""The client half of reply encoding: a train reply's update as packed payloads.

The mod (fedcomp.flower.mod) reads the instruction and adapts records and
Context.state; everything here is what it calls to turn the update (trained minus
received model) into payloads: stateless codecs, error feedback, the client half of
the residual protocol (fedcomp.controlvariates), the one-bit joint code, and the
reply's own measurements (codec bytes, relative error, fp32 reference bytes). The
server half is fedcomp.flower.decoding.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedcomp.codecs import Codec, ErrorFeedback, ResidualMemory, TensorPolicy, decode_bytes
from fedcomp.codecs.memory import TensorStateMemory, encode_with_feedback
from fedcomp.codecs.residual import SYNC_FULL, SYNC_NORMAL
from fedcomp.controlvariates import choose_sync, covered_tensors, encode_residual, residual_header
from fedcomp.flower.accounting import wire_bytes
from fedcomp.flower.memory_state import MemoryState
from fedcomp.keys import (
    KEY_ACK_ROUND,
    KEY_JOINT_CLIENTS,
    KEY_JOINT_INDEX,
    KEY_JOINT_TAU,
    KEY_NUM_EXAMPLES,
    KEY_RESYNC,
    METRIC_CODEC_BYTES,
    METRIC_ENCODE_S,
    METRIC_FP32_CODEC_BYTES,
    METRIC_FP32_CONTENT_WIRE_BYTES,
    METRIC_OUT_OF_RANGE,
    METRIC_REL_ERROR,
    METRIC_STATE_BYTES,
    RECORD_PAYLOAD,
)
from fedcomp.onebit import OneBitCode
from fedcomp.onebit.federated import joint_seed, out_of_range_fraction, unpack_taus
from fedcomp.rng import derive_seed


def single(records: dict, kind: str, where: str) -> tuple[str, object]:
    """The one record of ``kind`` a message part must hold."""
    if len(records) != 1:
        raise ValueError(f"{where} must hold exactly one {kind}, found {len(records)}")
    return next(iter(records.items()))


@dataclass
class Encoded:
    """What encoding one reply produced (payloads, and for memories the new state)."""

    payloads: dict[str, bytes]
    inputs: dict[str, torch.Tensor]  # what the codec was asked to encode (error metric)
    memory: MemoryState | None = None
    pending: dict[str, np.ndarray] = field(default_factory=dict)
    pending_version: int = 0
    header: dict[str, int | str] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class JointPlan:
    """A joint (one-bit) round as this client sees it: its position among the n
    selected clients and the public tau blocks of each jointly coded tensor."""

    index: int
    clients: int
    taus: dict[str, np.ndarray]


def joint_plan(
    code: OneBitCode, policy: TensorPolicy, config: ConfigRecord, global_record: ArrayRecord
) -> JointPlan:
    """Read the round's joint parameters; the jointly coded tensors are those the
    policy compresses, in model order (the server derives the same list)."""
    for key in (KEY_JOINT_INDEX, KEY_JOINT_CLIENTS, KEY_JOINT_TAU):
        if key not in config:
            raise ValueError(f"joint codec {code.name!r} needs '{key}' in the train config")
    index, clients = int(config[KEY_JOINT_INDEX]), int(config[KEY_JOINT_CLIENTS])
    if not 0 <= index < clients:
        raise ValueError(f"joint index {index} is not in [0, {clients})")
    names = policy.compressed({k: np.asarray(v.numpy()) for k, v in global_record.items()})
    blocks = [code.num_blocks(int(np.prod(global_record[n].shape))) for n in names]
    taus = unpack_taus(config[KEY_JOINT_TAU], blocks)
    return JointPlan(index=index, clients=clients, taus=dict(zip(names, taus, strict=True)))


def relative_error(payloads: dict[str, bytes], inputs: dict[str, torch.Tensor]) -> float:
    """sum ||decode(payload) - x||^2 / sum ||x||^2, in float64 (0 for an all-zero input)."""
    num = den = 0.0
    for name, x in inputs.items():
        reference = x.to(torch.float64)
        num += float(((decode_bytes(payloads[name]).to(torch.float64) - reference) ** 2).sum())
        den += float((reference**2).sum())
    return num / den if den > 0 else 0.0


def _packed(payload: bytes) -> Array:
    """A raw uint8 Array: no np.save header, the bytes travel as they are."""
    return Array(dtype="uint8", shape=(len(payload),), stype="raw", data=payload)


def payload_content(payloads: dict[str, bytes]) -> RecordDict:
    """The reply content holding one packed payload per tensor, in model order.

    The server measures the wire bytes of exactly this shape of RecordDict, so the
    fp32 reference and the real payload differ only in the payload bytes.
    """
    return RecordDict({RECORD_PAYLOAD: ArrayRecord({n: _packed(b) for n, b in payloads.items()})})


@dataclass
class Instruction:
    """What the mod reads from one train instruction."""

    config: ConfigRecord
    codec: Any
    policy: TensorPolicy
    stable_id: int
    round: int
    run_seed: int
    global_record: ArrayRecord
    plan: JointPlan | None

    def seeds(self, names) -> dict[str, int]:
        """Each tensor's public seed: (run seed, round, stable id, tensor name)."""
        return {n: derive_seed(self.run_seed, self.round, self.stable_id, n) for n in names}


def update_of(
    reply: Message, global_record: ArrayRecord
) -> tuple[dict[str, torch.Tensor], MetricRecord]:
    """The update (trained - received) per tensor, and the user's train metrics."""
    _, local_record = single(reply.content.array_records, "ArrayRecord", "train reply")
    _, metrics = single(reply.content.metric_records, "MetricRecord", "train reply")
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
    """Encode the update with the instruction's codec (memories load their state
    through ``load_memory``; ``fp32`` encodes a residual resync)."""
    codec, policy, config = instruction.codec, instruction.policy, instruction.config
    seeds = instruction.seeds(deltas)
    ack = int(config.get(KEY_ACK_ROUND, -1))
    if isinstance(codec, TensorStateMemory):  # two arrays per tensor (DGC, PowerSGD)
        memory = load_memory()
        carried = memory.begin_round(ack, json.dumps(codec.spec()))
        payloads, pending, inputs = codec.encode_round(
            policy, deltas, seeds, carried, instruction.round
        )
        return Encoded(payloads, inputs=inputs, memory=memory, pending=pending)
    if isinstance(codec, ErrorFeedback):
        return encode_feedback_reply(codec, policy, deltas, seeds, load_memory(), ack)
    if isinstance(codec, ResidualMemory):
        resync_asked = bool(int(config.get(KEY_RESYNC, 0)))
        return encode_residual_reply(
            codec, policy, deltas, seeds, load_memory(), ack, resync_asked, fp32=fp32
        )
    if instruction.plan is not None:
        return encode_joint(
            codec,
            policy,
            deltas,
            seeds,
            instruction.plan,
            instruction.run_seed,
            instruction.round,
        )
    return Encoded(encode_all(codec, policy, deltas, seeds), inputs=deltas)


def reply_metrics(
    metrics: MetricRecord,
    encoded: Encoded,
    instruction: Instruction,
    deltas: dict[str, torch.Tensor],
    encode_s: float,
    *,
    measure_error: bool,
    fp32: Codec | None,
) -> MetricRecord:
    """The user's train metrics plus fedcomp's own measurements of this reply
    (``fp32``: also the fp32 reference bytes of the same tensors; None skips them)."""
    out = MetricRecord(dict(metrics))
    out[METRIC_ENCODE_S] = encode_s
    out[METRIC_CODEC_BYTES] = sum(len(b) for b in encoded.payloads.values())
    if measure_error and instruction.plan is None:  # joint codes: no per-client decode
        out[METRIC_REL_ERROR] = relative_error(encoded.payloads, encoded.inputs)
    for key, value in encoded.stats.items():
        out[key] = value
    if encoded.memory is not None:
        out[METRIC_STATE_BYTES] = encoded.memory.nbytes
    if fp32 is not None:  # the fp32 reference bytes of the same tensors
        seeds = instruction.seeds(deltas)
        reference = encode_all(fp32, instruction.policy, deltas, seeds)
        out[METRIC_FP32_CODEC_BYTES] = sum(len(b) for b in reference.values())
        out[METRIC_FP32_CONTENT_WIRE_BYTES] = wire_bytes(payload_content(reference))
    return out


def encode_feedback_reply(
    codec: ErrorFeedback,
    policy: TensorPolicy,
    deltas: dict[str, torch.Tensor],
    seeds: dict[str, int],
    memory: MemoryState,
    ack: int,
) -> Encoded:
    carried = memory.begin_round(ack, json.dumps(codec.spec()))
    payloads, pending = encode_with_feedback(codec, policy, deltas, seeds, carried)
    inputs = {  # EF encodes delta + the carried error
        n: d + torch.from_numpy(carried[n])
        if n in pending and n in carried and carried[n].shape == tuple(d.shape)
        else d
        for n, d in deltas.items()
    }
    return Encoded(payloads, inputs=inputs, memory=memory, pending=pending)


def encode_residual_reply(
    codec: ResidualMemory,
    policy: TensorPolicy,
    deltas: dict[str, torch.Tensor],
    seeds: dict[str, int],
    memory: MemoryState,
    ack: int,
    resync_asked: bool,
    *,
    fp32: Codec,
) -> Encoded:
    """The client half of the residual protocol (fedcomp.controlvariates) on this
    reply; the mod only adapts it to the message."""
    h = memory.begin_round(ack, json.dumps(codec.spec()))
    covered = covered_tensors(deltas, policy, codec.inner)
    sync = choose_sync(
        version=memory.version,
        h=h,
        covered=covered,
        shapes={n: tuple(d.shape) for n, d in deltas.items()},
        resync_asked=resync_asked,
        bootstrap=codec.bootstrap,
    )
    normal = sync == SYNC_NORMAL
    payloads, pending, stats = encode_residual(
        codec,
        policy,
        deltas,
        seeds,
        h if normal else {},
        covered,
        full=sync == SYNC_FULL,
        fp32=fp32,
    )
    inputs = (  # the codec encoded delta - h on the covered tensors
        {n: d - torch.from_numpy(h[n]) if n in covered else d for n, d in deltas.items()}
        if normal
        else deltas
    )
    return Encoded(
        payloads,
        inputs=inputs,
        memory=memory,
        pending=pending,
        pending_version=memory.version + 1 if normal else 1,
        header=residual_header(sync, memory.version, h),
        stats=stats,
    )


def encode_joint(
    code: OneBitCode,
    policy: TensorPolicy,
    deltas: dict[str, torch.Tensor],
    seeds: dict[str, int],
    plan: JointPlan,
    run_seed: int,
    server_round: int,
) -> Encoded:
    """One-bit payloads for the planned tensors (public seed, no client id), raw
    payloads for the rest."""
    payloads = {}
    beyond = total = 0
    for name, delta in deltas.items():
        tau = plan.taus.get(name)
        if tau is None:
            payloads[name] = bytes(policy.codec_for(delta, code).encode(delta, seed=seeds[name]))
            continue
        payloads[name] = bytes(
            code.encode(
                delta,
                client_index=plan.index,
                num_clients=plan.clients,
                seed=joint_seed(run_seed, server_round, name),
                tau=tau,
            )
        )
        z = np.abs(delta.detach().reshape(-1).double().numpy())
        z /= np.repeat(tau, code.block)[: z.size]
        beyond += out_of_range_fraction(z, code) * z.size
        total += z.size
    stats = {METRIC_OUT_OF_RANGE: beyond / total if total else 0.0}
    return Encoded(payloads, inputs={}, stats=stats)


def encode_all(
    codec: Codec,
    policy: TensorPolicy,
    deltas: dict[str, torch.Tensor],
    seeds: dict[str, int],
) -> dict[str, bytes]:
    """Each tensor encoded with the codec the policy picks for it."""
    return {
        name: bytes(policy.codec_for(delta, codec).encode(delta, seed=seeds[name]))
        for name, delta in deltas.items()
    }
