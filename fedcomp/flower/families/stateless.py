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

from fedcomp.codecs import Codec, TensorPolicy, parse_payload
from fedcomp.codecs.adaptive import AdaptiveCodec
from fedcomp.codecs.policy import encode_all
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
from fedcomp.flower.validation import ReplyError, decode_payloads


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


class AdaptiveServer(StatelessServer):
    """Each reply decoded as a stateless one, then held to the codec's bit budget."""

    def decode(
        self, payloads: Payloads, header: ConfigRecord, stable_id: int, state: Any
    ) -> DecodedUpdate:
        update = super().decode(payloads, header, stable_id, state)
        compressed = [n for n, used in update.codecs.items() if used == self.codec.name]
        check_budget(self.codec, {n: payloads[n] for n in compressed})
        return update


def check_budget(codec: AdaptiveCodec, payloads: Payloads) -> None:
    """A reply's EDEN widths against the budget: sum_t b_t n_t <= bits sum_t n_t."""
    spent = total = 0
    for buf in payloads.values():
        payload = parse_payload(buf)
        spent += codec.width_of(payload) * payload.header.numel
        total += payload.header.numel
    if spent > codec.bits * total:
        raise ReplyError(
            f"{codec.name}: the reply spends {spent / total:.4g} bits a coordinate, over its "
            f"budget of {codec.bits:g}",
            Failure.SPEC_MISMATCH,
        )


class AdaptiveFamily(StatelessFamily):
    """The adaptive codec: widths chosen per tensor for the whole reply, then encoded."""

    def encode(
        self,
        instruction: Instruction,
        deltas: dict[str, torch.Tensor],
        load_memory: LoadMemory,
        fp32: Codec,
    ) -> Encoded:
        codec, policy, seeds = self.codec, instruction.policy, instruction.seeds(deltas)
        compressed = {n: d for n, d in deltas.items() if policy.codec_for(d, codec) is codec}
        widths = codec.allocate(compressed)
        payloads = encode_all(
            codec,
            policy,
            deltas,
            seeds,
            lambda name, delta: codec.encode_at(delta, widths[name], seed=seeds[name]),
        )
        return Encoded(payloads, inputs=deltas)

    def server(
        self, policy: TensorPolicy | None, run_seed: int, mirror_dir: str | None
    ) -> ServerHalf:
        return AdaptiveServer(self.codec, policy, run_seed)

