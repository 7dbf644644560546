"""Error-feedback memories: error feedback around any codec (``ef``), and the memories
that keep two arrays per tensor (DGC's momentum and residual, PowerSGD's error and Q).

Client half: the memory carried from the last acknowledged reply (Context.state,
fedcomp.flower.memory_state) goes into this round's encoding, and the new memory is
staged until the server acknowledges the reply. Server half: no state; each payload is
the inner codec's (for DGC, the codec of this round's sparsity warm-up), decoded as a
stateless one.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from fedcomp.codecs import Codec, TensorPolicy
from fedcomp.codecs.memory import encode_with_feedback
from fedcomp.flower.families.base import Encoded, Family, Instruction, LoadMemory, ServerHalf
from fedcomp.flower.families.stateless import StatelessServer
from fedcomp.keys import KEY_ACK_ROUND


class FeedbackServer(StatelessServer):
    """Decodes with the inner codec of the round (a memory may change it by round)."""

    def wire_codec(self, server_round: int) -> Codec:
        return self.codec.inner_for_round(server_round)


class _MemoryFamily(Family):
    def server(
        self, policy: TensorPolicy | None, run_seed: int, mirror_dir: str | None
    ) -> ServerHalf:
        return FeedbackServer(self.codec, policy, run_seed)


class FeedbackFamily(_MemoryFamily):
    """Error feedback: encode delta + the carried error; the new error is staged."""

    def encode(
        self,
        instruction: Instruction,
        deltas: dict[str, torch.Tensor],
        load_memory: LoadMemory,
        fp32: Codec,
    ) -> Encoded:
        codec, policy = self.codec, instruction.policy
        memory = load_memory()
        carried = memory.begin_round(_ack(instruction), json.dumps(codec.spec()))
        seeds = instruction.seeds(deltas)
        payloads, pending = encode_with_feedback(codec, policy, deltas, seeds, carried)
        inputs = {  # EF encodes delta + the carried error
            n: d + torch.from_numpy(carried[n])
            if n in pending and n in carried and carried[n].shape == tuple(d.shape)
            else d
            for n, d in deltas.items()
        }
        return Encoded(payloads, inputs=inputs, memory=memory, pending=pending)


class TensorStateFamily(_MemoryFamily):
    """DGC and PowerSGD: the memory encodes the round itself (two arrays per tensor)."""

    def encode(
        self,
        instruction: Instruction,
        deltas: dict[str, torch.Tensor],
        load_memory: LoadMemory,
        fp32: Codec,
    ) -> Encoded:
        memory = load_memory()
        carried = memory.begin_round(_ack(instruction), json.dumps(self.codec.spec()))
        payloads, pending, inputs = self.codec.encode_round(
            instruction.policy, deltas, instruction.seeds(deltas), carried, instruction.round
        )
        return Encoded(payloads, inputs=inputs, memory=memory, pending=pending)


def _ack(instruction: Instruction) -> int:
    """The last round whose reply the server accepted (the memory commits up to it)."""
    return int(instruction.config.get(KEY_ACK_ROUND, -1))


__all__: list[Any] = ["FeedbackFamily", "FeedbackServer", "TensorStateFamily"]
