"""CompressedStrategy: the server half of fedcomp, a Flower adapter around any strategy.

Pair it with ``fedcomp.flower.mod.CompressionMod`` on the ClientApp::

    strategy = CompressedStrategy(FedAvg(fraction_evaluate=0.5), codec={"name": "fp32"})
    strategy.start(grid=grid, initial_arrays=arrays, num_rounds=10)

A Flower adapter: it runs Flower's round loop and hands each step to one part
(fedcomp.flower.wiring builds them): the outbox samples over stable ids and sends
each client its own instruction, the uplink turns the train replies into what the
inner strategy aggregates, the round book closes each round into its record, and the
checkpoint gathers the state a resumed run needs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedcomp.downlink import DownlinkSpec
from fedcomp.flower.accounting import count_replies
from fedcomp.flower.evaluation import (
    record_client_metrics,
    record_pre_train_metrics,
    valid_evaluate_replies,
)
from fedcomp.flower.inner_calls import InnerCalls
from fedcomp.flower.options import ServerOptions
from fedcomp.flower.round_book import print_through_flower
from fedcomp.flower.round_state import RoundState
from fedcomp.flower.wiring import build_parts, summary_line
from fedcomp.influence import update_norm
from fedcomp.observers import Reporting
from fedcomp.traffic import Kind, Traffic

log = logging.getLogger(__name__)

#: The run seed when none is given (logged in the summary): public randomness must be
#: reproducible, so never Flower's random run id.
DEFAULT_RUN_SEED = 0

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


class CompressedStrategy(Strategy):
    """Decode compressed client updates and delegate aggregation to a Flower strategy.

    Parameters
    ----------
    strategy : Strategy
        The inner Flower strategy (FedAvg, FedAdam, FedMedian, ...). Its sampling
        settings are used (``fraction_train``, ``fraction_evaluate``,
        ``min_train_nodes``, ``min_evaluate_nodes``, ``min_available_nodes``: the
        wrapper waits for that many nodes, then samples over all connected ones,
        seeded, by stable id).
    codec : Mapping
        Codec spec sent to the clients, e.g. ``{"name": "fp32"}`` (checked here).
    downlink : DownlinkSpec or Mapping, optional
        Downlink compression (fedcomp.downlink; docs/downlink.md), e.g.
        ``{"name": "uniform", "bits": 4}``; default ``fp32``: the full model in every
        instruction, as Flower sends it.
    run_seed : int (default: 0, logged)
        Seed of all public randomness (client sampling, codec draws). Never Flower's
        random run id.
    options : fedcomp.flower.options.ServerOptions, optional
        Hand-off and trees, influence bounds, the policy and task settings sent to the
        clients, and how stable ids are learned.
    reporting : fedcomp.observers.Reporting, optional
        Observers (``on_round``, ``update_probe``), the client metric names the round
        line shows, and the end-of-run learning check.
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        codec: Mapping[str, Any],
        downlink: DownlinkSpec | Mapping[str, Any] | None = None,
        run_seed: int = DEFAULT_RUN_SEED,
        options: ServerOptions | None = None,
        reporting: Reporting | None = None,
    ) -> None:
        if not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be a Flower Strategy, found {type(strategy)}")
        self.strategy, self.run_seed = strategy, run_seed
        self.inner = InnerCalls(strategy)
        self.options = options = options or ServerOptions()
        self.reporting = reporting or Reporting()
        parts = build_parts(strategy, codec, downlink, run_seed, options, self.reporting)
        self.parts, self.replicas, self.clients = parts, parts.replicas, parts.clients
        self.uplink, self.outbox, self.book = parts.uplink, parts.outbox, parts.book
        self.checkpoint = parts.checkpoint
        self.last_arrays: ArrayRecord | None = None
        self._offset = 0  # rounds a resumed run already completed
        self._state: RoundState | None = None
        #: Messages exchanged between rounds (first contact), counted in the next one.
        self._pending_traffic = Traffic()
        #: Stable ids sent an evaluate instruction in the current round.
        self._evaluate_sent: set[int] = set()

    @property
    def rounds(self) -> list[dict[str, Any]]:
        """The round records so far (``results.json``'s rounds)."""
        return self.book.rounds

    # ------------------------------------------------------------------ lifecycle

    def summary(self) -> None:
        log.info(summary_line(self.parts, self.options, self.run_seed))
        self.strategy.summary()

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
        first_round: int | None = None,
    ) -> Result:
        """Learn stable ids at first contact, then run Flower's round loop.

        After :meth:`load_state_dict` the run resumes after the last round the state
        holds: Flower's loop counts from 1 again, the wrapper (records, seeds, sampling,
        the inner strategy) sees the real round numbers. ``first_round`` overrides it.
        """
        if first_round is None:
            first_round = self.checkpoint.completed_round + 1
        if not 1 <= first_round <= num_rounds:
            raise ValueError(f"first_round={first_round} is not in 1..{num_rounds}")
        self.book.num_rounds = num_rounds
        self._offset = first_round - 1
        print_through_flower()
        self._refresh_ids(grid)

        def evaluate_and_close(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            if server_round == 0 and self._offset:
                return None  # resumed: the initial model was evaluated in the first run
            server_round = self._real(server_round) if server_round else 0
            result = evaluate_fn(server_round, arrays) if evaluate_fn else None
            if evaluate_fn and self.replicas and (state := self._current(server_round)):
                self.replicas.evaluate_replica(server_round, state.record, evaluate_fn)
            self.last_arrays = arrays  # the model after this round (checkpoints)
            self.book.close(server_round, result, self._state)
            if server_round and self._current(server_round) is not None:
                self._state = None  # closed
            return result

        result = super().start(
            grid,
            initial_arrays,
            num_rounds - self._offset,
            timeout,
            train_config,
            evaluate_config,
            evaluate_and_close,
        )
        self.book.judge(self._offset, type(self.strategy).__name__)
        return result

    def _real(self, server_round: int) -> int:
        """The real round number of Flower's loop count (they differ after a resume)."""
        return server_round + self._offset

    def _current(self, server_round: int) -> RoundState | None:
        """The round's state, when this round is the one under way."""
        state = self._state
        return state if state is not None and state.number == server_round else None

    # ------------------------------------------------------------------ instructions

    def _refresh_ids(self, grid: Grid) -> None:
        """Learn the stable ids of newly connected nodes (counted in the next round)."""
        self.clients.refresh(
            grid,
            expected=self.outbox.sampling.min_available_nodes,
            timeout=self.options.identity.timeout,
            traffic=self._pending_traffic,
        )

    # ------------------------------------------------------------------ training

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample over stable ids and send each client its own config."""
        server_round = self._real(server_round)
        self._refresh_ids(grid)
        state = RoundState(number=server_round, t_start=time.perf_counter())
        state.previous_loss = self.book.last_loss()
        state.record.identity_failures = self.clients.new_identity_failures()
        state.traffic, self._pending_traffic = self._pending_traffic, Traffic()
        state.global_arrays = {k: np.asarray(v.numpy()) for k, v in arrays.items()}
        self._state = state
        if self.replicas is not None:
            self.replicas.server.start(state.global_arrays)  # version 0: the initial model
        template = self.inner.configure("configure_train", server_round, arrays, config, grid)
        if template is None:
            state.record.inner_failed = 1
        if not template:
            return []
        selected = self.outbox.sample(server_round, MessageType.TRAIN)
        self.uplink.prepare(state, selected, self.parts.policy)
        resync = self.uplink.resync_requested
        state.sent = self.outbox.train(template, selected, state, resync=resync, plan=state.plan)
        state.record.selected = len(selected)
        return list(state.sent.values())

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Hand the replies to the uplink, its result to the inner strategy."""
        server_round = self._real(server_round)
        state = self._current(server_round)
        if state is None:
            raise RuntimeError("aggregate_train called without configure_train for this round")
        t0 = time.perf_counter()
        replies = list(replies)
        self.clients.note_replies(replies)
        decoded = self.uplink.receive(replies, state, self.clients.accepted_round)
        # Evaluation inside the train round: the accepted replies' own evaluation of
        # the model they received (settings.evaluate_in_train); replies without it
        # leave the record to the evaluate replies.
        record_pre_train_metrics(
            state.record,
            [(d.stable_id, d.metrics) for d in decoded],
            self.options.influence.max_num_examples,
            self.options.influence.weight_cap,
        )
        t1 = time.perf_counter()
        handed = self.uplink.hand_off(decoded, state)
        arrays, metrics = None, None
        if not decoded:
            log.warning("round %d: no valid replies, the global model is unchanged", server_round)
        elif handed is not None:
            result = self.inner.aggregate_train(server_round, handed)
            if result is None:
                state.record.inner_failed = 1
            arrays, metrics = result or (None, None)
        arrays, metrics = self.uplink.settle(arrays, metrics, state)
        state.record.replied = len(decoded)
        state.record.decode_s, state.record.aggregate_s = t1 - t0, time.perf_counter() - t1
        if arrays is not None:
            new = {k: np.asarray(v.numpy()) for k, v in arrays.items()}
            state.record.step_norm = update_norm(
                {k: new[k] - state.global_arrays[k] for k in new if k in state.global_arrays}
            )
            if (probe := self.reporting.update_probe) is not None:
                ids = [d.stable_id for d in decoded]
                state.record.diagnostics = dict(probe(server_round, state.global_arrays, new, ids))
            if self.replicas is not None:  # x_t is the inner strategy's; x_hat moves a step
                state.record.downlink = self.replicas.advance(new)
        return arrays, metrics

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs, as plain data (ServerCheckpoint)."""
        return self.checkpoint.state_dict(self.replicas)

    def load_state_dict(
        self, state: Mapping[str, Any], *, clients_kept_state: bool = False
    ) -> None:
        """Restore :meth:`state_dict`'s output into a wrapper built with the same
        settings; :meth:`start` then continues after the completed round.

        ``clients_kept_state``: the clients still hold their downlink replicas (kept in
        files across the restart), so steps continue from them; otherwise every
        client is sent x_hat in full first."""
        self.checkpoint.load_state_dict(state, self.replicas, clients_kept_state=clients_kept_state)

    # ------------------------------------------------------------------ evaluation

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        server_round = self._real(server_round)
        template = self.inner.configure("configure_evaluate", server_round, arrays, config, grid)
        if template is None and (state := self._current(server_round)) is not None:
            state.record.inner_failed = 1
        if not template:
            return []
        selected = self.outbox.sample(server_round, MessageType.EVALUATE)
        self._evaluate_sent = set(selected)
        sent = self.outbox.evaluate(template, selected, server_round, self._current(server_round))
        return list(sent.values())

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Aggregate client evaluation metrics in stable-id order.

        Replies are checked first (fedcomp.flower.evaluation): Flower's aggregation
        raises on inconsistent replies, which would end the ServerApp. A failed
        evaluation never stops the run. Every aggregated metric is recorded
        (``client_metrics``); the round line shows the first of
        ``reporting.accuracy_keys`` and ``reporting.loss_keys`` present.
        """
        server_round = self._real(server_round)
        replies = list(replies)
        self.clients.note_replies(replies)
        state, stable_of = self._current(server_round), self.clients.ids.stable_of
        if state is not None:
            count_replies(state.traffic, Kind.EVALUATE_REPLY, replies, stable_of)
        influence = self.options.influence
        valid = valid_evaluate_replies(
            replies,
            server_round,
            stable_of=stable_of,
            asked=self._evaluate_sent,
            max_examples=influence.max_num_examples,
            weight_cap=influence.weight_cap,
        )
        metrics = self.inner.aggregate_evaluate(server_round, valid)
        if state is not None and metrics:
            r = self.reporting
            record_client_metrics(state.record, metrics, r.accuracy_keys, r.loss_keys)
        return metrics
