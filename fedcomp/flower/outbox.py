"""The server's outgoing side: who is asked each round, and what each one is sent.

:class:`Outbox` samples over stable ids (seeded from the run seed, with the inner
strategy's fractions and minimum counts), builds each client's instruction from the
inner strategy's template (fedcomp.flower.instructions), puts in it what the downlink
sends (the full model, or replica steps: fedcomp.flower.replica) and counts it
(fedcomp.flower.accounting).
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Message, MessageType

from fedcomp.flower.accounting import count_instructions, record_bytes
from fedcomp.flower.families.base import RoundPlan
from fedcomp.flower.holdings import ClientHoldings
from fedcomp.flower.instructions import Instructions, Sampling, sample
from fedcomp.flower.packed import pack_into
from fedcomp.flower.replica import ReplicaSender
from fedcomp.flower.round_records import empty_client_row
from fedcomp.flower.round_state import RoundState
from fedcomp.traffic import Kind


class Outbox:
    """Sampling, instructions, the downlink's payload and their bytes, per round.

    ``seeded_initial``: the downlink's initial model is rebuilt from the seed on the
    clients, so the server counts on every client's mod from the first contact.
    """

    def __init__(
        self,
        instructions: Instructions,
        clients: ClientHoldings,
        replicas: ReplicaSender | None,
        sampling: Sampling,
        *,
        run_seed: int,
        seeded_initial: bool,
    ) -> None:
        self.instructions, self.clients, self.replicas = instructions, clients, replicas
        self.sampling, self.run_seed, self.seeded_initial = sampling, run_seed, seeded_initial

    def sample(self, server_round: int, kind: str) -> list[int]:
        """The stable ids asked to train (or evaluate) in this round."""
        s, train = self.sampling, kind == MessageType.TRAIN
        fraction = s.fraction_train if train else s.fraction_evaluate
        minimum = s.min_train_nodes if train else s.min_evaluate_nodes
        purpose = "train-sample" if train else "evaluate-sample"
        ids = self.clients.ids.stable_ids()
        return sample(ids, fraction, self.run_seed, purpose, server_round, minimum=minimum)

    def train(
        self,
        template: list[Message],
        selected: list[int],
        state: RoundState,
        *,
        resync: Callable[[int], bool],
        plan: RoundPlan | None,
    ) -> dict[int, Message]:
        """Each selected client's train instruction, counted in the round's traffic and
        per-client rows (always model-free where a downlink replica is kept)."""
        sent = self._build(template, selected, state.number, MessageType.TRAIN, resync, plan)
        carry = self._carrier(lambda sid: True)
        wire = count_instructions(state.traffic, Kind.TRAIN_INSTRUCTION, sent, carry)
        for sid, msg in sent.items():
            row = state.per_client.setdefault(sid, empty_client_row(sid))
            row["downlink_record_bytes"] = record_bytes(msg.content)
            row["downlink_wire_bytes"] = wire[sid]
        return sent

    def evaluate(
        self,
        template: list[Message],
        selected: list[int],
        server_round: int,
        state: RoundState | None,
    ) -> dict[int, Message]:
        """Each selected client's evaluate instruction (counted when ``state`` is the
        round under way)."""
        sent = self._build(template, selected, server_round, MessageType.EVALUATE, None, None)

        def model_free(sid: int) -> bool:
            # To mods that declared they rebuild evaluate instructions; with a seeded
            # initial model the server already counts on the clients' mods, so also to
            # clients it has not heard from yet.
            seeded = self.seeded_initial and sid not in self.clients.handles
            return seeded or self.clients.handles_kind(sid, MessageType.EVALUATE)

        traffic = state.traffic if state is not None else None
        count_instructions(traffic, Kind.EVALUATE_INSTRUCTION, sent, self._carrier(model_free))
        return sent

    def _build(
        self,
        template: list[Message],
        selected: list[int],
        server_round: int,
        kind: str,
        resync: Callable[[int], bool] | None,
        plan: RoundPlan | None,
    ) -> dict[int, Message]:
        return self.instructions.build(
            template,
            selected,
            server_round,
            kind,
            node_of=self.clients.ids.node_of,
            ack_round=self.clients.ack_round,
            resync=resync or (lambda sid: False),
            plan=plan,
            restores=lambda sid: self.clients.handles_kind(sid, kind),
        )

    def _carrier(self, model_free: Callable[[int], bool]) -> Callable[[int, Message], int | None]:
        """What makes an instruction what goes on the wire: the downlink's payload in
        place of the model (without a downlink codec the fp32 model stays, as Flower
        sends it), then fedcomp's fields packed (fedcomp.flower.packed). Returns the fp32
        instruction's wire bytes (None: the message is its own reference)."""
        replicas = self.replicas

        def carry(sid: int, msg: Message) -> int | None:
            records = msg.content.config_records.values()
            for record in records:  # the fp32 reference is this message, fields packed
                pack_into(record)
            fp32 = None
            if replicas is not None:
                fp32 = replicas.carry(msg, sid, model_free=model_free(sid))
                for record in records:  # and the downlink's own fields with them
                    pack_into(record)
            return fp32

        return carry
