"""The compression mod: encodes a ClientApp's train reply as packed payloads.

Add it to any ClientApp whose train handler replies with one ArrayRecord (the
trained model) and one MetricRecord holding ``num-examples``::

    from fedcomp.flower.mod import CompressionMod
    app = ClientApp(mods=[CompressionMod()])

On the server, wrap the strategy with ``fedcomp.flower.strategy.CompressedStrategy``:
it sends the codec spec this mod needs (``KEY_CODEC``); without it the mod answers
with an Error naming the wrapper, as Flower's central-DP mods do.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.constant import ErrorCode

from fedcomp.codecs import (
    Codec,
    ErrorFeedback,
    ResidualMemory,
    TensorPolicy,
    decode_bytes,
    make_codec,
    make_codec_from_spec,
)
from fedcomp.codecs.memory import encode_with_feedback
from fedcomp.codecs.residual import (
    SYNC_FULL,
    SYNC_NORMAL,
)
from fedcomp.controlvariates import (
    choose_sync,
    covered_tensors,
    encode_residual,
    residual_header,
)
from fedcomp.downlink import Replica, ReplicaError
from fedcomp.flower.accounting import wire_bytes
from fedcomp.flower.identity import identity_reply, is_identity_message, stable_id_of
from fedcomp.flower.memory_state import (
    MemoryState,
    load_memory,
    load_memory_file,
    memory_path,
    save_memory_file,
    store_memory,
)
from fedcomp.flower.replica import (
    downlink_config,
    load_replica,
    rebuild_model,
    replica_header,
    store_replica,
)
from fedcomp.flower.shared_settings import restore as restore_settings
from fedcomp.keys import (
    KEY_ACK_ROUND,
    KEY_CODEC,
    KEY_DOWNLINK,
    KEY_EXPECTED_ID,
    KEY_HANDLES,
    KEY_JOINT_CLIENTS,
    KEY_JOINT_INDEX,
    KEY_JOINT_TAU,
    KEY_NUM_EXAMPLES,
    KEY_POLICY,
    KEY_PROTOCOL,
    KEY_RESYNC,
    KEY_ROUND,
    KEY_RUN_SEED,
    KEY_SETTINGS,
    KEY_STABLE_ID,
    METRIC_CODEC_BYTES,
    METRIC_ENCODE_S,
    METRIC_FP32_CODEC_BYTES,
    METRIC_FP32_CONTENT_WIRE_BYTES,
    METRIC_OUT_OF_RANGE,
    METRIC_REL_ERROR,
    METRIC_STATE_BYTES,
    PROTOCOL_VERSION,
    RECORD_HEADER,
    RECORD_METRICS,
    RECORD_PAYLOAD,
)
from fedcomp.onebit import OneBitCode
from fedcomp.onebit.federated import joint_seed, out_of_range_fraction, unpack_taus
from fedcomp.rng import derive_seed

_WRAPPER = "fedcomp.flower.strategy.CompressedStrategy"
#: The message kinds this mod handles (it rebuilds train and evaluate instructions).
HANDLES = f"{MessageType.TRAIN},{MessageType.EVALUATE}"


@dataclass
class _Encoded:
    """What encoding one reply produced (payloads, and for memories the new state)."""

    payloads: dict[str, bytes]
    inputs: dict[str, torch.Tensor]  # what the codec was asked to encode (error metric)
    memory: MemoryState | None = None
    pending: dict[str, np.ndarray] = field(default_factory=dict)
    pending_version: int = 0
    header: dict[str, int | str] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class _JointPlan:
    """A joint (one-bit) round as this client sees it: its position among the n
    selected clients and the public tau blocks of each jointly coded tensor."""

    index: int
    clients: int
    taus: dict[str, np.ndarray]


def _joint_plan(
    code: OneBitCode, policy: TensorPolicy, config: ConfigRecord, global_record: ArrayRecord
) -> _JointPlan:
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
    return _JointPlan(index=index, clients=clients, taus=dict(zip(names, taus, strict=True)))


def _as_numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: np.asarray(v.numpy()) for k, v in record.items()}


def _from_wrapper(msg: Message) -> bool:
    """True when the instruction carries fields of fedcomp's strategy wrapper."""
    return any(KEY_SETTINGS in c or KEY_DOWNLINK in c for c in msg.content.config_records.values())


def _held_header(digest: str | None, replica: Replica | None) -> dict[str, Any]:
    """Reply header fields saying what this client holds: the message kinds this mod
    handles, the run settings' digest and the downlink replica (when the server uses
    them)."""
    if digest is None:
        return {}
    return {
        KEY_HANDLES: HANDLES,
        KEY_SETTINGS: digest,
        **(replica_header(replica) if replica is not None else {}),
    }


def _precondition_error(msg: Message, reason: str) -> Message:
    return Message(Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=reason), reply_to=msg)


def _single(records: dict, kind: str, where: str) -> tuple[str, object]:
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
class _Instruction:
    """What the mod reads from one train instruction."""

    config: ConfigRecord
    codec: Any
    policy: TensorPolicy
    stable_id: int
    round: int
    run_seed: int
    global_record: ArrayRecord
    plan: _JointPlan | None

    def seeds(self, names) -> dict[str, int]:
        """Each tensor's public seed: (run seed, round, stable id, tensor name)."""
        return {n: derive_seed(self.run_seed, self.round, self.stable_id, n) for n in names}


def _deltas(
    reply: Message, global_record: ArrayRecord
) -> tuple[dict[str, torch.Tensor], MetricRecord]:
    """The update (trained - received) per tensor, and the user's train metrics."""
    _, local_record = _single(reply.content.array_records, "ArrayRecord", "train reply")
    _, metrics = _single(reply.content.metric_records, "MetricRecord", "train reply")
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


class CompressionMod:
    """Flower mod that replaces a train reply's model with encoded updates.

    Parameters
    ----------
    policy : TensorPolicy, optional
        Which tensors travel raw (integer buffers, tensors below a size threshold).
    measure_fp32_reference : bool (default: True)
        Also measure the fp32 codec's bytes on the same tensors, the denominator
        of the reported compression ratios (costs one extra dense serialization).
    measure_error : bool (default: True)
        Report the codec's relative error sum ||decode(q) - x||^2 / sum ||x||^2 over
        the encoded tensors (costs one decode).
    state_dir : str or callable, optional
        Also keep the codec memory (error-feedback error, residual control variate) in
        ``<state_dir>/client-<stable id>.npz``, written atomically after every reply and
        read when ``Context.state`` has none: the memory survives a device restart (or
        a resumed simulation) instead of being resynced. A callable gets the instruction
        and returns the directory (or None).
    initial_model : callable, optional
        Builds the run's initial model (the ArrayRecord the server started from) from
        the instruction, e.g. from the seed in the app's run config: with the server's
        ``downlink.initial="seeded"`` a client with no replica then receives only the
        downlink steps since round 1, not the model (a checksum verifies the result).
    """

    def __init__(
        self,
        policy: TensorPolicy | None = None,
        *,
        measure_fp32_reference: bool = True,
        measure_error: bool = True,
        state_dir: str | Callable[[Message], str | None] | None = None,
        initial_model: Callable[[Message], ArrayRecord] | None = None,
    ) -> None:
        self.policy = policy or TensorPolicy()
        self.state_dir = state_dir
        self.initial_model = initial_model
        self.measure_fp32_reference = measure_fp32_reference
        self.measure_error = measure_error
        self._fp32 = make_codec("fp32")

    def __call__(self, msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
        kind = msg.metadata.message_type
        if kind not in (MessageType.TRAIN, MessageType.EVALUATE):
            return call_next(msg, ctxt)
        if kind == MessageType.EVALUATE and not _from_wrapper(msg):
            return call_next(msg, ctxt)  # not fedcomp's: untouched
        if is_identity_message(msg):  # first contact: answered here, no training
            return identity_reply(msg, ctxt, HANDLES)
        try:  # the run settings, when the instruction carries only their digest
            digest = restore_settings(msg.content, ctxt.state)
        except ValueError as exc:
            return _precondition_error(msg, f"CompressionMod: {exc}")
        replica = self._take_downlink(msg, ctxt)
        if isinstance(replica, Message):  # the replica cannot be brought up to date
            return replica
        held = _held_header(digest, replica)
        if kind == MessageType.EVALUATE:
            return self._evaluate(msg, ctxt, call_next, held)
        instruction = self._read_instruction(msg, ctxt)
        if isinstance(instruction, Message):  # a precondition failed: an error reply
            return instruction
        reply = call_next(msg, ctxt)
        if reply.has_error():
            return reply
        deltas, metrics = _deltas(reply, instruction.global_record)
        t0 = time.perf_counter()
        encoded = self._encode(msg, ctxt, instruction, deltas)
        encode_s = time.perf_counter() - t0
        if encoded.memory is not None:
            encoded.memory.stage(instruction.round, encoded.pending, encoded.pending_version)
        out_metrics = self._reply_metrics(metrics, encoded, instruction, deltas, encode_s)
        header = ConfigRecord(
            {
                KEY_STABLE_ID: instruction.stable_id,
                KEY_PROTOCOL: PROTOCOL_VERSION,
                KEY_ROUND: instruction.round,
                KEY_CODEC: json.dumps(instruction.codec.spec(), sort_keys=True),
                **encoded.header,
                **held,
            }
        )
        content = payload_content(encoded.payloads)
        content[RECORD_HEADER] = header
        content[RECORD_METRICS] = out_metrics
        reply = Message(content, reply_to=msg)
        if encoded.memory is not None:
            store_memory(ctxt.state, encoded.memory)  # last: nothing after this can fail
            directory = self._state_dir(msg)
            if directory:
                save_memory_file(memory_path(directory, instruction.stable_id), encoded.memory)
        return reply

    def _take_downlink(self, msg: Message, ctxt: Context) -> Replica | Message | None:
        """Bring this client's replica up to the server's x_hat and put the model into
        ``msg`` (fedcomp.flower.replica); None when the instruction has no downlink
        replica, an error reply (never trained on) when it cannot be done."""
        if downlink_config(msg.content) is None:
            return None
        try:
            path = self._replica_path(msg, ctxt)
            build = self.initial_model
            initial = (lambda: _as_numpy(build(msg))) if build is not None else None
            replica = rebuild_model(msg, load_replica(ctxt.state, path), initial)
            store_replica(ctxt.state, replica, path)
        except (ReplicaError, ValueError, KeyError, TypeError) as exc:
            return _precondition_error(msg, f"CompressionMod: downlink replica: {exc}")
        return replica

    def _replica_path(self, msg: Message, ctxt: Context) -> Path | None:
        directory = self._state_dir(msg)
        if not directory:
            return None
        return Path(directory) / f"replica-{stable_id_of(ctxt):06d}.npz"

    @staticmethod
    def _evaluate(
        msg: Message, ctxt: Context, call_next: ClientAppCallable, held: dict[str, Any]
    ) -> Message:
        """Evaluate instructions: the app's handler on the restored config and the
        rebuilt model; the reply header says what this client holds."""
        reply = call_next(msg, ctxt)
        if KEY_SETTINGS in held and not reply.has_error():
            reply.content[RECORD_HEADER] = ConfigRecord({KEY_STABLE_ID: stable_id_of(ctxt), **held})
        return reply

    def _read_instruction(self, msg: Message, ctxt: Context) -> _Instruction | Message:
        """Everything the reply needs from the instruction, checked BEFORE training (a
        bad instruction must not cost a round of local work); an error reply if not."""
        config = next((c for c in msg.content.config_records.values() if KEY_CODEC in c), None)
        if config is None:
            return _precondition_error(
                msg,
                f"CompressionMod: the train instruction has no '{KEY_CODEC}' config; "
                f"wrap the server strategy with {_WRAPPER}.",
            )
        if int(config.get(KEY_PROTOCOL, -1)) != PROTOCOL_VERSION:
            return _precondition_error(
                msg,
                f"CompressionMod: server protocol {config.get(KEY_PROTOCOL)!r}, "
                f"this client speaks {PROTOCOL_VERSION}",
            )
        try:
            codec = make_codec_from_spec(json.loads(str(config[KEY_CODEC])))
            stable_id = stable_id_of(ctxt)
            policy = self._policy(config)
        except (ValueError, TypeError) as exc:
            return _precondition_error(msg, f"CompressionMod: {exc}")
        expected = config.get(KEY_EXPECTED_ID)
        if expected is not None and int(expected) != stable_id:
            return _precondition_error(
                msg,
                f"CompressionMod: server expected stable id {expected}, this node is {stable_id}",
            )
        _, global_record = _single(msg.content.array_records, "ArrayRecord", "train instruction")
        plan = None
        if isinstance(codec, OneBitCode):
            try:
                plan = _joint_plan(codec, policy, config, global_record)
            except (ValueError, TypeError) as exc:
                return _precondition_error(msg, f"CompressionMod: {exc}")
        return _Instruction(
            config=config,
            codec=codec,
            policy=policy,
            stable_id=stable_id,
            round=int(config[KEY_ROUND]),
            run_seed=int(config[KEY_RUN_SEED]),
            global_record=global_record,
            plan=plan,
        )

    def _encode(
        self,
        msg: Message,
        ctxt: Context,
        instruction: _Instruction,
        deltas: dict[str, torch.Tensor],
    ) -> _Encoded:
        """Encode the update with the instruction's codec (memories load their state)."""
        codec, policy, config = instruction.codec, instruction.policy, instruction.config
        seeds = instruction.seeds(deltas)
        ack = int(config.get(KEY_ACK_ROUND, -1))
        if isinstance(codec, ErrorFeedback):
            memory = self._load_memory(msg, ctxt)
            return self._encode_feedback_reply(codec, policy, deltas, seeds, memory, ack)
        if isinstance(codec, ResidualMemory):
            resync_asked = bool(int(config.get(KEY_RESYNC, 0)))
            memory = self._load_memory(msg, ctxt)
            return self._encode_residual_reply(
                codec, policy, deltas, seeds, memory, ack, resync_asked
            )
        if instruction.plan is not None:
            return self._encode_joint(
                codec,
                policy,
                deltas,
                seeds,
                instruction.plan,
                instruction.run_seed,
                instruction.round,
            )
        return _Encoded(self._encode_all(codec, policy, deltas, seeds), inputs=deltas)

    def _reply_metrics(
        self,
        metrics: MetricRecord,
        encoded: _Encoded,
        instruction: _Instruction,
        deltas: dict[str, torch.Tensor],
        encode_s: float,
    ) -> MetricRecord:
        """The user's train metrics plus fedcomp's own measurements of this reply."""
        out = MetricRecord(dict(metrics))
        out[METRIC_ENCODE_S] = encode_s
        out[METRIC_CODEC_BYTES] = sum(len(b) for b in encoded.payloads.values())
        if self.measure_error and instruction.plan is None:  # joint codes: no per-client decode
            out[METRIC_REL_ERROR] = relative_error(encoded.payloads, encoded.inputs)
        for key, value in encoded.stats.items():
            out[key] = value
        if encoded.memory is not None:
            out[METRIC_STATE_BYTES] = encoded.memory.nbytes
        if self.measure_fp32_reference:
            seeds = instruction.seeds(deltas)
            reference = self._encode_all(self._fp32, instruction.policy, deltas, seeds)
            out[METRIC_FP32_CODEC_BYTES] = sum(len(b) for b in reference.values())
            out[METRIC_FP32_CONTENT_WIRE_BYTES] = wire_bytes(payload_content(reference))
        return out

    def _encode_feedback_reply(
        self,
        codec: ErrorFeedback,
        policy: TensorPolicy,
        deltas: dict[str, torch.Tensor],
        seeds: dict[str, int],
        memory: MemoryState,
        ack: int,
    ) -> _Encoded:
        carried = memory.begin_round(ack, json.dumps(codec.spec()))
        payloads, pending = encode_with_feedback(codec, policy, deltas, seeds, carried)
        inputs = {  # EF encodes delta + the carried error
            n: d + torch.from_numpy(carried[n])
            if n in pending and n in carried and carried[n].shape == tuple(d.shape)
            else d
            for n, d in deltas.items()
        }
        return _Encoded(payloads, inputs=inputs, memory=memory, pending=pending)

    def _encode_residual_reply(
        self,
        codec: ResidualMemory,
        policy: TensorPolicy,
        deltas: dict[str, torch.Tensor],
        seeds: dict[str, int],
        memory: MemoryState,
        ack: int,
        resync_asked: bool,
    ) -> _Encoded:
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
            fp32=self._fp32,
        )
        inputs = (  # the codec encoded delta - h on the covered tensors
            {n: d - torch.from_numpy(h[n]) if n in covered else d for n, d in deltas.items()}
            if normal
            else deltas
        )
        return _Encoded(
            payloads,
            inputs=inputs,
            memory=memory,
            pending=pending,
            pending_version=memory.version + 1 if normal else 1,
            header=residual_header(sync, memory.version, h),
            stats=stats,
        )

    @staticmethod
    def _encode_joint(
        code: OneBitCode,
        policy: TensorPolicy,
        deltas: dict[str, torch.Tensor],
        seeds: dict[str, int],
        plan: _JointPlan,
        run_seed: int,
        server_round: int,
    ) -> _Encoded:
        """One-bit payloads for the planned tensors (public seed, no client id), raw
        payloads for the rest."""
        payloads = {}
        beyond = total = 0
        for name, delta in deltas.items():
            tau = plan.taus.get(name)
            if tau is None:
                payloads[name] = bytes(
                    policy.codec_for(delta, code).encode(delta, seed=seeds[name])
                )
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
        return _Encoded(payloads, inputs={}, stats=stats)

    def _state_dir(self, msg: Message) -> str | None:
        return self.state_dir(msg) if callable(self.state_dir) else self.state_dir

    def _load_memory(self, msg: Message, ctxt: Context) -> MemoryState:
        """The memory in Context.state, else the one on disk (a restarted client)."""
        memory = load_memory(ctxt.state)
        directory = self._state_dir(msg)
        if directory and not memory.spec:
            saved = load_memory_file(memory_path(directory, stable_id_of(ctxt)))
            if saved is not None:
                return saved
        return memory

    def _policy(self, config: ConfigRecord) -> TensorPolicy:
        if KEY_POLICY not in config:
            return self.policy
        return TensorPolicy(**json.loads(str(config[KEY_POLICY])))

    @staticmethod
    def _encode_all(
        codec: Codec,
        policy: TensorPolicy,
        deltas: dict[str, torch.Tensor],
        seeds: dict[str, int],
    ) -> dict[str, bytes]:
        return {
            name: bytes(policy.codec_for(delta, codec).encode(delta, seed=seeds[name]))
            for name, delta in deltas.items()
        }
