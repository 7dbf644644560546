"""Residual compression against a per-client control variate (fedcomp.controlvariates).

Client half: the client keeps h, its control variate (Context.state,
fedcomp.flower.memory_state); it encodes r = delta - h with the inner codec, moves h by
alpha * decode(q) once the server acknowledged the reply, and says in the reply header
which version of h it encoded against (or asks for a restart, or sends a
full-precision resync). Server half: one mirror of h per client; a reply is decoded as
``h + decode(q)`` against the mirror of the version it names; the mirror moves only
when the reply is accepted; a version or checksum mismatch asks that client for a
resync. The maths is fedcomp.controlvariates'; this module is the protocol's two
halves on Flower's messages.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord

from fedcomp.codecs import Codec, TensorPolicy, make_codec_from_spec
from fedcomp.codecs.ef21 import MOMENTUM_SUFFIX, momentum_average
from fedcomp.codecs.residual import SYNC_FULL, SYNC_NORMAL
from fedcomp.controlvariates import (
    ControlVariateServer,
    MirrorStore,
    choose_sync,
    covered_tensors,
    encode_residual,
    residual_header,
)
from fedcomp.failures import Failure
from fedcomp.flower.families.base import (
    DecodedUpdate,
    Encoded,
    Family,
    Instruction,
    LoadMemory,
    Payloads,
    ServerHalf,
)
from fedcomp.flower.families.feedback import FeedbackServer
from fedcomp.flower.memory_state import MemoryState
from fedcomp.flower.validation import ReplyError, compressed_names
from fedcomp.keys import KEY_ACK_ROUND, KEY_CV_CHECKSUM, KEY_CV_VERSION, KEY_RESYNC

_FP32 = make_codec_from_spec({"name": "fp32"})


def int_field(header: ConfigRecord, key: str, default: int) -> int:
    """An integer header field; anything else is a malformed reply, not a crash."""
    value = header.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ReplyError(f"header field {key}={value!r} is not an integer", Failure.MALFORMED)
    return value


class ResidualServer(FeedbackServer):
    """The server's mirrors of the clients' control variates, and each reply decoded
    against its client's mirror."""

    def __init__(
        self, codec: Any, policy: TensorPolicy | None, run_seed: int, mirror_dir: str | None
    ) -> None:
        super().__init__(codec, policy, run_seed)
        self.cv = ControlVariateServer(codec, MirrorStore(mirror_dir or None))
        self.mirror_dir = mirror_dir

    def decode(
        self, payloads: Payloads, header: ConfigRecord, stable_id: int, state: Any
    ) -> DecodedUpdate:
        """The reply's update ``h + decode(q)`` and the mirror it moves its client to
        (not stored: the mirror moves only when the reply is accepted)."""
        sync = int_field(header, KEY_RESYNC, 0)
        # A full-precision resync sends the covered tensors in fp32.
        codec = _FP32 if sync == SYNC_FULL else self.wire_codec(state.number)
        update = self.decode_with(codec, payloads, stable_id, state)
        ghat, pending = self.cv.prepare(
            stable_id,
            {name: update.deltas[name] for name in compressed_names(update.codecs)},
            version=int_field(header, KEY_CV_VERSION, -1),
            checksum=str(header.get(KEY_CV_CHECKSUM, "")),
            sync=sync,
        )
        update.deltas.update(ghat)
        update.pending, update.sync = pending, sync
        return update

    def commit(self, pending: Any) -> None:
        self.cv.commit(pending)

    def resync_requested(self, stable_id: int) -> bool:
        return stable_id in self.cv.resync_requested

    def mirrors_in_memory(self) -> bool:
        return not self.mirror_dir

    def state_dict(self) -> dict[str, Any]:
        return {"cv": self.cv.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("cv") is not None:
            self.cv.load_state_dict(state["cv"])


class ResidualFamily(Family):
    """Both halves of residual compression."""

    def encode(
        self,
        instruction: Instruction,
        deltas: dict[str, torch.Tensor],
        load_memory: LoadMemory,
        fp32: Codec,
    ) -> Encoded:
        """The client half on this reply; the mod only adapts it to the message."""
        memory, h = self.begin(instruction, load_memory)
        return self.encode_against(instruction, deltas, memory, h, fp32)

    def begin(
        self, instruction: Instruction, load_memory: LoadMemory
    ) -> tuple[MemoryState, dict[str, np.ndarray]]:
        """The client's memory after the server's acknowledgement, and its state."""
        memory = load_memory()
        ack = int(instruction.config.get(KEY_ACK_ROUND, -1))
        return memory, memory.begin_round(ack, json.dumps(self.codec.spec()))

    def encode_against(
        self,
        instruction: Instruction,
        deltas: dict[str, torch.Tensor],
        memory: MemoryState,
        h: dict[str, np.ndarray],
        fp32: Codec,
    ) -> Encoded:
        """Encode ``deltas`` against the control variate ``h`` (memory's committed one)."""
        codec, policy, config = self.codec, instruction.policy, instruction.config
        covered = covered_tensors(deltas, policy, codec.inner)
        sync = choose_sync(
            version=memory.version,
            h=h,
            covered=covered,
            shapes={n: tuple(d.shape) for n, d in deltas.items()},
            resync_asked=bool(int(config.get(KEY_RESYNC, 0))),
            bootstrap=codec.bootstrap,
        )
        normal = sync == SYNC_NORMAL
        seeds = instruction.seeds(deltas)
        payloads, pending, stats = encode_residual(
            codec, policy, deltas, seeds, h if normal else {}, covered,
            full=sync == SYNC_FULL, fp32=fp32,
        )  # fmt: skip
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

    def server(
        self, policy: TensorPolicy | None, run_seed: int, mirror_dir: str | None
    ) -> ServerHalf:
        return ResidualServer(self.codec, policy, run_seed, mirror_dir)


class EF21Family(ResidualFamily):
    """Both halves of ef21: residual's, with the client's momentum average as the input.

    The server half is residual's (its estimate is the mirror, as the memory says); the
    client keeps v beside g (fedcomp.codecs.ef21) and commits both on the same ack.
    """

    def encode(
        self,
        instruction: Instruction,
        deltas: dict[str, torch.Tensor],
        load_memory: LoadMemory,
        fp32: Codec,
    ) -> Encoded:
        memory, state = self.begin(instruction, load_memory)
        h = {n: a for n, a in state.items() if not n.endswith(MOMENTUM_SUFFIX)}
        eta = self.codec.momentum
        v = {n: momentum_average(state.get(n + MOMENTUM_SUFFIX), d, eta) for n, d in deltas.items()}
        encoded = self.encode_against(instruction, v, memory, h, fp32)
        if eta != 1.0:
            encoded.pending.update(
                {n + MOMENTUM_SUFFIX: x.to(torch.float32).numpy() for n, x in v.items()}
            )
        return encoded
