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
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from fedcomp.codecs import TensorPolicy
from fedcomp.downlink import (
    BroadcastServer,
    DownlinkSpec,
    Replica,
    ReplicaError,
    Step,
    checksum,
)
from fedcomp.flower.accounting import wire_bytes
from fedcomp.keys import (
    DOWNLINK_FULL,
    DOWNLINK_STEPS,
    KEY_DOWNLINK,
    KEY_DOWNLINK_ARRAYS,
    KEY_DOWNLINK_CHECKSUM,
    KEY_DOWNLINK_STEPS,
    KEY_DOWNLINK_VERSION,
    KEY_REPLICA_CHECKSUM,
    KEY_REPLICA_VERSION,
    RECORD_DOWNLINK,
    RECORD_HEADER,
)
from fedcomp.npzfile import read_npz_meta, write_npz_meta

#: Context.state records of the client's replica.
RECORD_REPLICA = "fedcomp.replica"
RECORD_REPLICA_META = "fedcomp.replica-meta"


def _packed(data: bytes) -> Array:
    return Array(dtype="uint8", shape=(len(data),), stype="raw", data=data)


# --- server half ---------------------------------------------------------------------


class ReplicaSender:
    """The server's downlink: builds the model part of instructions from a
    :class:`BroadcastServer`, moves x_hat after each round, reads what replies say."""

    def __init__(self, server: BroadcastServer) -> None:
        self.server = server
        self._full: tuple[int, ArrayRecord] | None = None

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
            content[RECORD_DOWNLINK] = ArrayRecord(
                {f"{s.target}/{n}": _packed(p) for s in steps for n, p in s.payloads.items()}
            )
            config[KEY_DOWNLINK_STEPS] = json.dumps(
                [[s.source, s.target, s.checksum, s.scales] for s in steps]
            )
            config[KEY_DOWNLINK_ARRAYS] = arrays_key
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
        header = reply.content.config_records.get(RECORD_HEADER)
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
) -> Replica:
    """Apply what the instruction carries to the replica and put the model back into
    ``msg`` (in place, so the reply still answers this message); return the new replica.

    Raises
    ------
    ReplicaError
        Anything that keeps the replica from equalling the server's x_hat.

    ``initial`` builds version 0, the initial model, on a client with no replica
    (``downlink.initial=seeded``); the checksum after the steps checks it.
    """
    config = downlink_config(msg.content)
    if config is None:
        raise ReplicaError("no downlink fields")
    mode = config[KEY_DOWNLINK]
    version, digest = int(config[KEY_DOWNLINK_VERSION]), str(config[KEY_DOWNLINK_CHECKSUM])
    if mode == DOWNLINK_FULL:
        ((_, record),) = msg.content.array_records.items()
        return replica.take_full(
            {k: np.asarray(v.numpy()) for k, v in record.items()}, version, digest
        )
    if mode != DOWNLINK_STEPS:
        raise ReplicaError(f"unknown downlink mode {mode!r}")
    record = msg.content.array_records.get(RECORD_DOWNLINK)
    if record is None:
        raise ReplicaError(f"a '{DOWNLINK_STEPS}' instruction without '{RECORD_DOWNLINK}'")
    steps = []
    for source, target, step_digest, scales in json.loads(str(config[KEY_DOWNLINK_STEPS])):
        prefix = f"{int(target)}/"
        payloads = {k[len(prefix) :]: record[k].data for k in record if k.startswith(prefix)}
        scales = {str(k): float(v) for k, v in dict(scales).items()}
        steps.append(Step(int(source), int(target), payloads, str(step_digest), scales))
    from_zero = steps[0].source == 0 if steps else version == 0
    # Steps from version 0: the server believes this client holds nothing, so a held
    # replica (e.g. a file another run left in a shared state directory) is not used.
    if initial is not None and from_zero:  # version 0, built here
        arrays = {k: np.asarray(v) for k, v in initial().items()}
        replica = Replica(arrays, 0, checksum(arrays))  # the final checksum vouches
    new = replica.take_steps(steps, version, digest)
    content = RecordDict({k: v for k, v in msg.content.items() if k != RECORD_DOWNLINK})
    content[str(config[KEY_DOWNLINK_ARRAYS])] = ArrayRecord(
        {k: Array(v) for k, v in (new.arrays or {}).items()}
    )
    msg.content = content
    return new


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
