"""Stateless codecs (fp32, bf16, uniform, QSGD, top-k, EDEN, ...): each update encoded
alone, each reply decoded alone, no state on either side.

Client half: every tensor encoded with the codec the policy picks (raw or the asked
codec) and its public seed. Server half: every payload checked against the spec the
server sent and decoded (fedcomp.flower.validation.decode_payloads).
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import ConfigRecord

from fedcomp.codecs import Codec, TensorPolicy
from fedcomp.codecs.policy import encode_all
from fedcomp.flower.families.base import (
    DecodedUpdate,
    Encoded,
    Family,
    Instruction,
    LoadMemory,
    Payloads,
    ServerHalf,
)
from fedcomp.flower.validation import decode_payloads


class StatelessServer(ServerHalf):
    """Decodes each reply with the codec the clients were asked to use this round."""

    def __init__(self, codec: Any, policy: TensorPolicy | None, run_seed: int) -> None:
        self.codec, self.policy, self.run_seed = codec, policy, run_seed

    def wire_codec(self, server_round: int) -> Codec:
        """The stateless codec every compressed payload of this round must be."""
        return self.codec

    def decode_with(
        self, codec: Codec, payloads: Payloads, stable_id: int, state: Any
    ) -> DecodedUpdate:
        deltas, codecs = decode_payloads(
            payloads,
            state.global_arrays,
            codec=codec,
            policy=self.policy,
            run_seed=self.run_seed,
            server_round=state.number,
            stable_id=stable_id,
        )
        return DecodedUpdate(deltas, codecs)

    def decode(
        self, payloads: Payloads, header: ConfigRecord, stable_id: int, state: Any
    ) -> DecodedUpdate:
        return self.decode_with(self.wire_codec(state.number), payloads, stable_id, state)


class StatelessFamily(Family):
    """Both halves of a stateless codec."""

    def encode(
        self,
        instruction: Instruction,
        deltas: dict[str, torch.Tensor],
        load_memory: LoadMemory,
        fp32: Codec,
    ) -> Encoded:
        seeds = instruction.seeds(deltas)
        return Encoded(encode_all(self.codec, instruction.policy, deltas, seeds), inputs=deltas)

    def server(
        self, policy: TensorPolicy | None, run_seed: int, mirror_dir: str | None
    ) -> ServerHalf:
        return StatelessServer(self.codec, policy, run_seed)
