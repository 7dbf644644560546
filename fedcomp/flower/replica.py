"""The downlink replica in Flower messages, both halves (docs/downlink.md).

Server half (:class:`ReplicaSender`): replaces the model in each instruction by what
that client's replica needs: nothing but the version when it is current, the steps it
lacks when they weigh less than the model, else x_hat in full. Reads what each reply
says its client holds.

Client half (:func:`rebuild_model`, :func:`load_replica`, :func:`store_replica`): the
mod applies the steps to its replica, checks the checksum, and puts the model back
into the message under the strategy's arrays key before the app's handler sees it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedcomp.bundle import BundleError, pack_bundle, unpack_bundle
from fedcomp.codecs import Codec, TensorPolicy
from fedcomp.downlink import (
    MAX_STEPS,
    BroadcastServer,
    DownlinkSpec,
    Replica,
    ReplicaError,
    Step,
    check_chain,
    checksum,
    parse_downlink,
    scale_text,
    step_headers,
    wire_scale,
)
from fedcomp.flower.accounting import wire_bytes
from fedcomp.flower.reply_format import reply_header
from fedcomp.keys import (
    DOWNLINK_FULL,
    DOWNLINK_STEPS,
    KEY_DOWNLINK,
    KEY_DOWNLINK_ARRAYS,
    KEY_DOWNLINK_CHECKSUM,
    KEY_DOWNLINK_CODEC,
    KEY_DOWNLINK_PAYLOADS,
    KEY_DOWNLINK_STEPS,
    KEY_DOWNLINK_VERSION,
    KEY_REPLICA_CHECKSUM,
    KEY_REPLICA_VERSION,
    KEY_RUN_SEED,
)
from fedcomp.npzfile import read_npz_meta, write_npz_meta

#: Context.state records of the client's replica.
RECORD_REPLICA = "fedcomp.replica"
RECORD_REPLICA_META = "fedcomp.replica-meta"


# --- server half ---------------------------------------------------------------------


class ReplicaSender:
    """The server's downlink: builds the model part of instructions from a
    :class:`BroadcastServer`, moves x_hat after each round, reads what replies say."""

    def __init__(self, server: BroadcastServer) -> None:
        self.server = server
        self._full: tuple[int, ArrayRecord] | None = None
        #: The codec spec clients check "steps" against: it travels with the run settings
        #: (fedcomp.flower.shared_settings), once per client, not in every instruction.
        self.codec_json = json.dumps(server.spec.codec, sort_keys=True)

    @classmethod
    def of(cls, spec: DownlinkSpec, policy: TensorPolicy, run_seed: int) -> ReplicaSender | None:
        """The sender for a downlink spec; None for ``fp32`` (Flower's own full model)."""
        return cls(BroadcastServer(spec, policy, run_seed)) if spec.active else None

    def full_record(self) -> ArrayRecord:
        """x_hat as Flower arrays (made once per version, shared by the messages)."""
        if self._full is None or self._full[0] != self.server.version:
            x_hat = self.server.x_hat or {}
            self._full = (self.server.version, ArrayRecord({k: Array(v) for k, v in x_hat.items()}))
        return self._full[1]

    def carry(self, msg: Message, client: int, *, model_free: bool) -> int:
        """Replace ``msg``'s model by what the client's replica needs; return the wire
        bytes of the fp32 instruction it replaces (the message's fp32 reference)."""
        reference = wire_bytes(msg)
        self.attach(msg.content, client, model_free=model_free)
        return reference

    def evaluate_replica(
        self,
        server_round: int,
        record: Any,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None],
    ) -> None:
        """Central accuracy of x_hat, the model the clients train and evaluate on, into
        ``record.replica_accuracy`` when it differs from x_t (Flower's Result and the
        round's ``accuracy`` hold x_t)."""
        downlink = record.downlink
        if not downlink or downlink["replica_drift"] == 0.0:
            return
        result = evaluate_fn(server_round, self.full_record())
        if result is not None and "accuracy" in result:
            record.replica_accuracy = float(result["accuracy"])

    def advance(self, x_t: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """Move x_hat one step towards the inner strategy's new model; the round's
        ``downlink`` record."""
        step = self.server.advance(x_t)
        return {
            "version": step.target,
            "step_codec_bytes": step.nbytes,
            "replica_drift": self.server.drift(x_t),
            "history_steps": len(self.server.history),
        }

    def attach(self, content: RecordDict, client: int, *, model_free: bool) -> str:
        """Replace the model in one instruction's content; return the mode used.

        ``model_free``: the client's mod is known to rebuild the model from steps on
        this kind of message (always for train; for evaluate, once its mod declared it).
        """
        ((arrays_key, _),) = content.array_records.items()
        config = next(iter(content.config_records.values()))
        steps = self.server.steps_for(client) if model_free else None
        if steps is None:
            content[arrays_key] = self.full_record()
            mode = DOWNLINK_FULL
        else:
            del content[arrays_key]
            # Positional: the client knows the names (each step's tensors, model order).
            # Compact: the client rebuilds each payload's header (fedcomp.downlink.step_headers).
            config[KEY_DOWNLINK_PAYLOADS] = pack_bundle(
                {f"{s.target}/{n}": p for s in steps for n, p in s.payloads.items()},
                named=False,
                compact=True,
            )
            # No per-step checksum: the client checks the replica it ends with against
            # the instruction's own (KEY_DOWNLINK_CHECKSUM).
            config[KEY_DOWNLINK_STEPS] = json.dumps(
                [
                    [s.source, s.target, {n: scale_text(v) for n, v in s.scales.items()}]
                    for s in steps
                ],
                separators=(",", ":"),
            )
            config[KEY_DOWNLINK_ARRAYS] = arrays_key
            # the steps' payload headers derive their seeds from it (instructions carry
            # it anyway: the same key and value, no byte more)
            config[KEY_RUN_SEED] = self.server.run_seed
            mode = DOWNLINK_STEPS
        config[KEY_DOWNLINK] = mode
        config[KEY_DOWNLINK_VERSION] = self.server.version
        config[KEY_DOWNLINK_CHECKSUM] = self.server.checksum
        return mode

    def note_reply(self, client: int | None, reply: Message) -> None:
        """What a reply says its client holds; an error reply makes it unknown (the
        next instruction sends x_hat in full: a checksum mismatch, a wiped replica or
        a failed step are all answered with an error)."""
        if client is None:
            return
        if reply.has_error():
            self.server.forget(client)
            return
        header = reply_header(reply.content)
        if header is None or KEY_REPLICA_VERSION not in header:
            return
        version, digest = header[KEY_REPLICA_VERSION], header.get(KEY_REPLICA_CHECKSUM)
        if isinstance(version, int) and not isinstance(version, bool):
            self.server.confirm(client, version, str(digest))


# --- client half ---------------------------------------------------------------------


def downlink_config(content: RecordDict) -> ConfigRecord | None:
    """The instruction's config when it carries the downlink fields."""
    return next((c for c in content.config_records.values() if KEY_DOWNLINK in c), None)


def rebuild_model(
    msg: Message,
    replica: Replica,
    initial: Callable[[], Mapping[str, np.ndarray]] | None = None,
    policy: TensorPolicy | None = None,
    *,
    accept: Mapping[str, Any] | None = None,
) -> Replica:
    """Apply what the instruction carries to the replica and put the model back into
    ``msg`` (in place, so the reply still answers this message); return the new replica.

    The server (or a network without TLS) may be hostile: every field is checked before
    anything is decoded, so one instruction costs the client at most
    :data:`~fedcomp.downlink.MAX_STEPS` decodes of the model, whatever it holds (see
    :meth:`Replica.take_steps`; the record is indexed in one pass). ``policy``: the
    tensors the server sends raw (the run's policy; default :class:`TensorPolicy`).

    Raises
    ------
    ReplicaError
        Anything that keeps the replica from equalling the server's x_hat, and any
        malformed field of the instruction (the only exception it raises on one).

    ``initial`` builds version 0, the initial model, on a client with no replica
    (``downlink.initial=seeded``); the checksum after the steps checks it. ``accept``:
    the one downlink codec this client decodes (the mod's own setting).
    """
    config = downlink_config(msg.content)
    if config is None:
        raise ReplicaError("no downlink fields")
    mode = config[KEY_DOWNLINK]
    version = _field(config, KEY_DOWNLINK_VERSION, int)
    digest = _field(config, KEY_DOWNLINK_CHECKSUM, str)
    if mode == DOWNLINK_FULL:
        return replica.take_full(_full_model(msg), version, digest)
    if mode != DOWNLINK_STEPS:
        raise ReplicaError(
            f"unknown downlink mode {mode!r:.40}, allowed: {DOWNLINK_FULL}, {DOWNLINK_STEPS}"
        )
    codec = _downlink_codec(config, accept)
    arrays_key = _field(config, KEY_DOWNLINK_ARRAYS, str)
    blob = config.get(KEY_DOWNLINK_PAYLOADS)
    if blob is None:
        raise ReplicaError(f"a '{DOWNLINK_STEPS}' instruction without '{KEY_DOWNLINK_PAYLOADS}'")
    steps, replica, tensors = _steps_and_base(config, replica, initial, version)
    # the payload headers are the tensors' the steps apply to (fedcomp.compact)
    _index_payloads(blob, steps, tensors, _field(config, KEY_RUN_SEED, int))
    new = replica.take_steps(steps, version, digest, codec=codec, policy=policy)
    del config[KEY_DOWNLINK_PAYLOADS]  # the app's handler sees the model, not the steps
    msg.content[arrays_key] = ArrayRecord({k: Array(v) for k, v in (new.arrays or {}).items()})
    return new


def _steps_and_base(
    config: ConfigRecord,
    replica: Replica,
    initial: Callable[[], Mapping[str, np.ndarray]] | None,
    version: int,
) -> tuple[list[Step], Replica, Mapping[str, np.ndarray]]:
    """The instruction's steps, checked to chain to ``version``; the replica they apply
    to (version 0 built here, ``initial``, when they start from it); and the model's
    tensors, whose shapes and dtypes the step payloads' headers take."""
    zero = _version_zero(initial) if initial is not None and replica.arrays is None else None
    held = replica.arrays if zero is None else zero.arrays  # the model's tensors
    if held is None:
        raise ReplicaError("no replica here (new, wiped or restarted): send the model")
    steps = _step_headers(_field(config, KEY_DOWNLINK_STEPS, str), list(held))
    check_chain(steps, version)
    from_zero = steps[0].source == 0 if steps else version == 0
    # Steps from version 0: the server believes this client holds nothing, so a held
    # replica (e.g. a file another run left in a shared state directory) is not used.
    if initial is not None and from_zero:  # version 0, built here
        replica = zero if zero is not None else _version_zero(initial)
    return steps, replica, replica.arrays if replica.arrays is not None else held


def _version_zero(initial: Callable[[], Mapping[str, np.ndarray]]) -> Replica:
    """Version 0 built by the client (the final checksum vouches for it)."""
    arrays = {k: np.asarray(v) for k, v in initial().items()}
    return Replica(arrays, 0, checksum(arrays))


def _field(config: ConfigRecord, key: str, kind: type) -> Any:
    """A config field of exactly this type (an int is never a bool here)."""
    value = config.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ReplicaError(f"instruction field {key}={value!r:.80}: a {kind.__name__} is needed")
    return value


def _full_model(msg: Message) -> dict[str, np.ndarray]:
    """The model a "full" instruction carries (its one ArrayRecord)."""
    records = list(msg.content.array_records.values())
    if len(records) != 1:
        raise ReplicaError(f"a '{DOWNLINK_FULL}' instruction with {len(records)} array records")
    try:
        return {k: np.asarray(v.numpy()) for k, v in records[0].items()}
    except (ValueError, TypeError) as exc:
        raise ReplicaError(f"the full model does not deserialize: {exc}") from exc


def _downlink_codec(config: ConfigRecord, accept: Mapping[str, Any] | None = None) -> Codec:
    """The downlink codec the instruction says the server encodes with, checked like
    the server's own setting (a stateless codec: at most entropy around rotate around
    a quantizer), and, with ``accept``, the one this client decodes."""
    text = _field(config, KEY_DOWNLINK_CODEC, str)
    try:
        spec = json.loads(text)
        if not isinstance(spec, dict):
            raise ValueError(f"a JSON object is needed, got {text!r:.80}")
        codec = parse_downlink(spec).build()
    except (ValueError, TypeError, RecursionError) as exc:
        raise ReplicaError(f"downlink codec: {exc}") from exc
    if accept is not None and dict(codec.spec()) != dict(accept):
        raise ReplicaError(
            f"downlink codec {json.dumps(codec.spec(), sort_keys=True):.200}: this client "
            f"accepts only {json.dumps(dict(accept), sort_keys=True):.200}"
        )
    return codec


def _max_headers_chars(names: list[str]) -> int:
    """The longest step list the server writes for a model with these tensors: per
    step two versions, and a scale per tensor (name and a float), with room to spare."""
    return MAX_STEPS * (96 + sum(len(json.dumps(n)) + 32 for n in names))


def _step_headers(text: str, names: list[str]) -> list[Step]:
    """The instruction's step list, each entry checked: [source, target, {tensor:
    scale}], versions integers, scales numbers for tensors of the model (read as the
    float32 the server applied, :func:`fedcomp.downlink.wire_scale`); the steps without
    their payloads yet."""
    if len(text) > _max_headers_chars(names):
        raise ReplicaError(f"a {len(text)}-character step list, more than {MAX_STEPS} steps hold")
    try:
        entries = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ReplicaError(f"the step list is not JSON: {exc!s:.200}") from exc
    if not isinstance(entries, list) or len(entries) > MAX_STEPS:
        raise ReplicaError(f"the step list must be a list of at most {MAX_STEPS} steps")
    return [_step_header(entry, set(names)) for entry in entries]


def _step_header(entry: Any, names: set[str]) -> Step:
    def number(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    if not (isinstance(entry, list) and len(entry) == 3):
        raise ReplicaError(f"step {entry!r:.80}: [source, target, scales] needed")
    source, target, scales = entry
    ok = (
        isinstance(source, int)
        and isinstance(target, int)
        and not isinstance(source, bool)
        and not isinstance(target, bool)
        and isinstance(scales, dict)
        and set(scales) <= names
        and all(number(v) for v in scales.values())
    )
    if not ok:
        raise ReplicaError(
            f"step {entry!r:.80}: integer versions and scales of the model's tensors needed"
        )
    try:
        with np.errstate(over="ignore"):  # a float32 overflow is inf, refused as not finite
            read = {k: wire_scale(v) for k, v in scales.items()}
    except OverflowError as exc:  # an integer beyond any float
        raise ReplicaError(f"step {entry!r:.80}: a scale out of range") from exc
    return Step(source, target, {}, "", read)


def _index_payloads(
    blob: object, steps: list[Step], held: Mapping[str, np.ndarray], run_seed: int
) -> None:
    """Put each step's payloads into it, from ONE pass over the bundle: every entry is
    "<target>/<tensor>" for a listed target (the targets increase: check_chain) and a
    tensor of the model, and there are exactly the steps' tensors, step by step in
    model order (a positional bundle takes these names)."""
    expected = len(steps) * len(held)
    names = [f"{step.target}/{name}" for step in steps for name in held]
    try:
        record = unpack_bundle(
            blob, max_entries=expected, names=names, headers=step_headers(held, run_seed)
        )
    except BundleError as exc:
        raise ReplicaError(f"'{KEY_DOWNLINK_PAYLOADS}': {exc}") from exc
    if len(record) != expected:
        raise ReplicaError(
            f"'{KEY_DOWNLINK_PAYLOADS}' holds {len(record)} payloads, {len(steps)} steps of "
            f"{len(held)} tensors make {expected}"
        )
    by_target = {str(step.target): step.payloads for step in steps}
    for key, payload in record.items():
        target, _, name = key.partition("/")
        if target not in by_target or name not in held:
            raise ReplicaError(f"payload {key!r:.80} is not '<target>/<tensor>' of a listed step")
        by_target[target][name] = payload


def replica_header(replica: Replica) -> dict[str, int | str]:
    """Reply header fields: the replica this client holds."""
    return {KEY_REPLICA_VERSION: replica.version, KEY_REPLICA_CHECKSUM: replica.checksum}


def load_replica(state: RecordDict, path: Path | None) -> Replica:
    """The replica in Context.state, else in its file, else none."""
    if RECORD_REPLICA in state and RECORD_REPLICA_META in state:
        meta = state[RECORD_REPLICA_META]
        arrays = {k: np.asarray(v.numpy()) for k, v in state[RECORD_REPLICA].items()}
        return Replica(arrays, int(meta["version"]), str(meta["checksum"]))
    saved = read_npz_meta(path) if path is not None else None
    if saved is not None:
        meta, arrays = saved
        return Replica(arrays, int(meta["version"]), str(meta["checksum"]))
    return Replica()


def store_replica(state: RecordDict | None, replica: Replica, path: Path | None) -> None:
    """Keep the replica in Context.state (None: not there) and, with a path, in its
    file."""
    arrays = replica.arrays or {}
    if state is not None:
        state[RECORD_REPLICA] = ArrayRecord({k: Array(v) for k, v in arrays.items()})
        state[RECORD_REPLICA_META] = ConfigRecord(
            {"version": replica.version, "checksum": replica.checksum}
        )
    if path is not None:
        write_npz_meta(path, {"version": replica.version, "checksum": replica.checksum}, arrays)
