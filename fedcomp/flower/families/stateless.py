"""Stateless codecs (fp32, bf16, uniform, QSGD, top-k, EDEN, ...): each update encoded
alone, each reply decoded alone, no state on either side.

Client half: every tensor encoded with the codec the policy picks (raw or the asked
codec) and its public seed. Server half: every payload checked against the spec the
server sent and decoded (fedcomp.flower.validation.decode_payloads).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedcomp.budgets import LossSchedule, weight_budgets
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
from fedcomp.keys import KEY_BIT_BUDGET


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


@dataclass
class BudgetRound:
    """The adaptive codec's plan of one round: each selected client's bit budget."""

    budgets: dict[int, float]

    def fields(self, stable_id: int) -> dict[str, float]:
        return {KEY_BIT_BUDGET: self.budgets[stable_id]}

    def stats(self) -> dict[str, float]:
        values = list(self.budgets.values())
        return {
            "budget_mean": sum(values) / len(values),
            "budget_min": min(values),
            "budget_max": max(values),
        }


class AdaptiveServer(StatelessServer):
    """Each reply decoded as a stateless one, then held to its bit budget: the codec's,
    or the one the server sent that client this round (fedcomp.budgets)."""

    def __init__(self, codec: AdaptiveCodec, policy: TensorPolicy | None, run_seed: int) -> None:
        super().__init__(codec, policy, run_seed)
        self.schedule = (
            LossSchedule(codec.start, codec.bits, codec.patience)
            if codec.schedule == "loss"
            else None
        )
        #: Each client's last accepted weight (its claimed examples, bounded).
        self.weights: dict[int, float] = {}

    def plan(self, state: Any, selected: list[int], policy: TensorPolicy) -> None:
        if not self.codec.adapts or not selected:
            return
        mean = self.codec.bits
        if self.schedule is not None:
            mean = self.schedule.observe(state.number, state.previous_loss)
        if self.codec.clients == "weights":
            known = [self.weights[s] for s in selected if s in self.weights]
            default = sum(known) / len(known) if known else 1.0
            weights = {s: self.weights.get(s, default) for s in selected}
            budgets = weight_budgets(mean, weights, self.codec.choices[0], self.codec.bits)
        else:
            budgets = dict.fromkeys(selected, mean)
        state.plan = BudgetRound(budgets)
        state.record.joint = state.plan.stats()

    def decode(
        self, payloads: Payloads, header: ConfigRecord, stable_id: int, state: Any
    ) -> DecodedUpdate:
        update = super().decode(payloads, header, stable_id, state)
        compressed = [n for n, used in update.codecs.items() if used == self.codec.name]
        budget = state.plan.budgets[stable_id] if state.plan is not None else self.codec.bits
        check_budget(self.codec, {n: payloads[n] for n in compressed}, budget)
        return update

    def accepted(self, stable_id: int, weight: float) -> None:
        self.weights[stable_id] = float(weight)

    def state_dict(self) -> dict[str, Any]:
        if not self.codec.adapts:
            return {}
        return {
            "adaptive": {
                "schedule": None if self.schedule is None else self.schedule.state_dict(),
                "weights": {str(k): v for k, v in self.weights.items()},
            }
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state.get("adaptive")
        if saved is None:
            return
        if self.schedule is not None and saved["schedule"] is not None:
            self.schedule.load_state_dict(saved["schedule"])
        self.weights = {int(k): float(v) for k, v in saved["weights"].items()}


def check_budget(codec: AdaptiveCodec, payloads: Payloads, budget: float | None = None) -> None:
    """A reply's EDEN widths against its budget (the codec's ``bits`` unless given):
    sum_t b_t n_t <= budget sum_t n_t."""
    budget = codec.bits if budget is None else budget
    spent = total = 0
    for buf in payloads.values():
        payload = parse_payload(buf)
        spent += codec.width_of(payload) * payload.header.numel
        total += payload.header.numel
    if spent > budget * total:
        raise ReplyError(
            f"{codec.name}: the reply spends {spent / total:.4g} bits a coordinate, over its "
            f"budget of {budget:g}",
            Failure.SPEC_MISMATCH,
        )


class AdaptiveFamily(StatelessFamily):
    """The adaptive codec: widths chosen per tensor for the whole reply, under the
    budget the server sent (else the codec's), then encoded."""

    def read_plan(
        self, policy: TensorPolicy, config: ConfigRecord, global_record: ArrayRecord
    ) -> float | None:
        """The server's budget for this client and round, if it sent one."""
        if KEY_BIT_BUDGET not in config:
            return None
        return self.codec.check_budget_value(float(config[KEY_BIT_BUDGET]))

    def encode(
        self,
        instruction: Instruction,
        deltas: dict[str, torch.Tensor],
        load_memory: LoadMemory,
        fp32: Codec,
    ) -> Encoded:
        codec, policy, seeds = self.codec, instruction.policy, instruction.seeds(deltas)
        compressed = {n: d for n, d in deltas.items() if policy.codec_for(d, codec) is codec}
        widths = codec.allocate(compressed, instruction.plan)
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
