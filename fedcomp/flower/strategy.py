"""CompressedStrategy: the server half of fedcomp, wrapping any Flower strategy.

Pair it with ``fedcomp.flower.mod.CompressionMod`` on the ClientApp::

    strategy = CompressedStrategy(FedAvg(fraction_evaluate=0.5), codec={"name": "fp32"})
    strategy.start(grid=grid, initial_arrays=arrays, num_rounds=10)

Per round it (1) samples clients itself with a generator seeded from the run seed,
over STABLE ids learned at first contact, with the inner strategy's own fractions and
minimum node counts, and sends each one its own config (the codec spec, the round,
the run seed); (2) validates every reply (a bad one is a
logged failure, never a crash), decodes it, and hands the inner strategy either one
dense reply per client, sorted by stable id (``handoff="per_client"``), or one
synthetic reply with the float32 weighted mean summed in stable-id order
(``handoff="pre_aggregated"``); (3) measures codec, record and wire bytes of every
real message, up and down, and reports them per round.

The class is lifecycle and delegation; its collaborators are chosen once, at
construction: ``Instructions`` (what each client is sent), ``ReplyDecoder``
(validation, decoding, failure kinds, outliers, mirrors and acknowledgements), a
hand-off (per client, plain mean, reduction tree or joint decode), and the pure
influence rules of ``fedcomp.influence``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import (
    Result,
    Strategy,
)

from fedcomp.aggregation import Aggregation
from fedcomp.codecs import (
    ResidualMemory,
    TensorPolicy,
    make_codec_from_spec,
)
from fedcomp.controlvariates import ControlVariateServer, MirrorStore
from fedcomp.downlink import DownlinkSpec, parse_downlink
from fedcomp.flower.accounting import count, record_bytes
from fedcomp.flower.budget import available_memory, check_round_memory
from fedcomp.flower.decoding import ReplyDecoder
from fedcomp.flower.evaluation import first_present, valid_evaluate_replies
from fedcomp.flower.guards import (
    DIVERGING_FACTOR,
    LOSS_FLAG_FACTOR,
    all_finite,
    best_loss,
    cap_weights,
    cast_like,
    clip_norms,
    fail_if_diverged,
    fail_if_not_learning,
    fail_if_nothing_learned,
    likely_causes,
    loss_growth,
    print_through_flower,
)
from fedcomp.flower.handoff import make_handoff
from fedcomp.flower.holdings import ClientHoldings
from fedcomp.flower.identity import DEFAULT_REPLY_TIMEOUT
from fedcomp.flower.inner_state import inner_state_dict, load_inner_state_dict
from fedcomp.flower.instructions import Instructions, Sampling, sample
from fedcomp.flower.joint import plan_round
from fedcomp.flower.records import client_rows, empty_client_row, log_line, round_record
from fedcomp.flower.replica import ReplicaSender
from fedcomp.flower.round_state import Decoded, RoundState
from fedcomp.influence import Influence, total_weight_is_finite
from fedcomp.onebit import OneBitCode
from fedcomp.onebit.federated import JointServerState
from fedcomp.reporting import Reporting
from fedcomp.rules import check_server_options
from fedcomp.traffic import Kind, Traffic
from fedcomp.trees.aggregate import TreeConfig, TreeStats

log = logging.getLogger(__name__)

#: The run seed when none is given (logged in the summary): public randomness must be
#: reproducible, so never Flower's random run id.
DEFAULT_RUN_SEED = 0


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
    run_seed : int (default: 0, logged)
        Seed of all public randomness (client sampling, codec draws). Never Flower's
        random run id.
    aggregation : fedcomp.aggregation.Aggregation, optional
        The hand-off (``per_client`` or ``pre_aggregated``), the reduction tree and the
        residual mirrors' directory (default: per client, in memory).
    influence : fedcomp.influence.Influence, optional
        Bounds on one client's influence: the weight cap, the norm cap and the outlier
        rejection factor (default: no caps, rejection beyond 1000x the median norm).
    downlink : DownlinkSpec or Mapping, optional
        Downlink compression (fedcomp.downlink; docs/downlink.md), e.g.
        ``{"name": "uniform", "bits": 4}``; default ``fp32``: the full model in every
        instruction, as Flower sends it.
    task : Mapping, optional
        Settings the app's ClientApp needs, sent JSON-encoded until each client holds them.
    policy : TensorPolicy, optional
        Which tensors travel raw; sent to the clients (default: the mod's own).
    reporting : fedcomp.reporting.Reporting, optional
        Observers (``on_round``, ``update_probe``) and the client metric names the round
        line shows.
    identity_timeout : float
        Seconds to wait for the inner strategy's ``min_available_nodes`` nodes.
    identity_reply_timeout : float
        Seconds a round waits for identity replies (a node that misses it is asked
        again after 1, 2, 4, ... rounds; fedcomp.flower.identity.StableIds).
    bind_keys : bool
        Bind each stable id to its first SuperNode's public key (with SuperNode
        authentication only; docs/deployment.md).
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        codec: Mapping[str, Any],
        run_seed: int = DEFAULT_RUN_SEED,
        aggregation: Aggregation | None = None,
        influence: Influence | None = None,
        downlink: DownlinkSpec | Mapping[str, Any] | None = None,
        task: Mapping[str, Any] | None = None,
        policy: TensorPolicy | None = None,
        reporting: Reporting | None = None,
        identity_timeout: float = 600.0,
        identity_reply_timeout: float = DEFAULT_REPLY_TIMEOUT,
        bind_keys: bool = False,
    ) -> None:
        if not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be a Flower Strategy, found {type(strategy)}")
        self.strategy = strategy
        self.run_seed = run_seed
        #: Flower's sampling settings, read from the inner strategy (one source).
        self.sampling = Sampling.of(strategy)
        self.aggregation = aggregation or Aggregation()
        self.influence = influence or Influence()
        self.reporting = reporting or Reporting()
        self.identity_timeout = identity_timeout
        self.identity_reply_timeout = identity_reply_timeout
        self.bind_keys = bind_keys
        # The same rules, and messages, as the settings check before Ray starts.
        check_server_options(
            codec_name=str(codec.get("name")),
            handoff=self.aggregation.handoff,
            strategy_name=type(strategy).__name__.lower(),
            trees=self.aggregation.trees,
            fraction_train=self.sampling.fraction_train,
            fraction_evaluate=self.sampling.fraction_evaluate,
            weight_cap=self.influence.weight_cap,
            norm_cap=self.influence.norm_cap,
            reject_factor=self.influence.reject_factor,
            max_num_examples=self.influence.max_num_examples,
        )
        self.codec = make_codec_from_spec(codec)  # fails fast on a bad spec
        #: Joint codes (one-bit) decode only the mean of all replies together.
        self.joint = isinstance(self.codec, OneBitCode)
        if self.joint and policy is None:
            policy = TensorPolicy()  # sent, so client and server pick the same tensors
        self.policy = policy or TensorPolicy()
        self.downlink = (
            downlink
            if isinstance(downlink, DownlinkSpec)
            else parse_downlink(downlink or {"name": "fp32"})
        )
        self._build_collaborators(policy, task)
        self.rounds: list[dict[str, Any]] = []
        self.initial_evaluation: dict[str, float] | None = None
        self._num_rounds = 0
        self._offset = 0
        #: Stable ids sent an evaluate instruction in the current round.
        self._evaluate_sent: set[int] = set()
        #: The last round a loaded checkpoint holds (0: a new run).
        self._completed_round = 0
        self.last_arrays: ArrayRecord | None = None
        self._state: RoundState | None = None
        #: Messages exchanged between rounds (first contact), counted in the next one.
        self._pending_traffic = Traffic()
        #: Identity failures already reported in a round record, by kind.
        self._identity_seen: dict[Any, int] = {}
        #: The last round's reference norm (fedcomp.influence.reference_norm): what a
        #: round with a single reply is clipped against.
        self._reference_norm: float | None = None

    def _build_collaborators(
        self, policy: TensorPolicy | None, task: Mapping[str, Any] | None
    ) -> None:
        """Choose every collaborator once, from the settings."""
        self.joint_state = JointServerState(prior=self.codec.tau_prior) if self.joint else None
        self.instructions = Instructions(
            self.codec.spec(), run_seed=self.run_seed, policy=policy, task=task
        )
        #: Residual memory: the server's mirrors of the clients' control variates.
        self.cv = (
            ControlVariateServer(self.codec, MirrorStore(self.aggregation.mirror_dir or None))
            if isinstance(self.codec, ResidualMemory)
            else None
        )
        #: Downlink replicas (None: the full fp32 model in every instruction, as Flower).
        self.replicas = ReplicaSender.of(self.downlink, self.policy, self.run_seed)
        self.clients = ClientHoldings(
            self.instructions.shared,
            self.replicas,
            reply_timeout=self.identity_reply_timeout,
            bind_keys=self.bind_keys,
        )
        self.tree_stats = TreeStats()
        self.decoder = ReplyDecoder(
            self.codec,
            policy=policy,
            run_seed=self.run_seed,
            cv=self.cv,
            stable_of=self.clients.ids.stable_of,
            reject_factor=self.influence.reject_factor,
            max_weight=self.influence.max_num_examples,
            # the plain mean and the trees take updates one at a time: release them
            # between passes (the one-bit path keeps its bits: decoding.py)
            stream=self.aggregation.pre_aggregated,
            presum=self.aggregation.pre_aggregated and self.aggregation.trees == TreeConfig(),
        )
        self.handoff_impl = make_handoff(
            self.aggregation.handoff,
            trees=self.aggregation.trees,
            tree_stats=self.tree_stats,
            code=self.codec,
            joint_state=self.joint_state,
            run_seed=self.run_seed,
        )

    # ------------------------------------------------------------------ lifecycle

    def summary(self) -> None:
        log.info(
            "CompressedStrategy: codec %s, downlink %s, handoff %s, run seed %d, sampling "
            "(from the inner strategy) train %.2f (min %d) evaluate %.2f (min %d), waiting "
            "for %d nodes",
            self.instructions.codec_json,
            json.dumps({**self.downlink.codec, "memory": self.downlink.memory}),
            self.aggregation.handoff,
            self.run_seed,
            self.sampling.fraction_train,
            self.sampling.min_train_nodes,
            self.sampling.fraction_evaluate,
            self.sampling.min_evaluate_nodes,
            self.sampling.min_available_nodes,
        )
        self.strategy.summary()

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        first_round: int | None = None,
    ) -> Result:
        """Learn stable ids at first contact, then run Flower's round loop.

        After :meth:`load_state_dict` the run resumes after the last round the state
        holds: Flower's loop counts from 1 again, the wrapper (records, seeds, sampling,
        the inner strategy) sees the real round numbers. ``first_round`` overrides it.
        """
        if first_round is None:
            first_round = self._completed_round + 1
        if not 1 <= first_round <= num_rounds:
            raise ValueError(f"first_round={first_round} is not in 1..{num_rounds}")
        self._num_rounds = num_rounds
        self._offset = first_round - 1
        print_through_flower()
        self._refresh_ids(grid)

        def evaluate_and_close(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            if server_round == 0 and self._offset:
                return None  # resumed: the initial model was evaluated in the first run
            server_round += self._offset if server_round else 0
            result = evaluate_fn(server_round, arrays) if evaluate_fn else None
            self._evaluate_replica(server_round, evaluate_fn)
            self.last_arrays = arrays  # the model after this round (checkpoints)
            self._close_round(server_round, result)
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
        fail_if_nothing_learned(self.rounds[self._offset :])
        fail_if_diverged(self.rounds[self._offset :])
        if self.reporting.learning_check:
            fail_if_not_learning(
                self.initial_evaluation,
                self.rounds,
                self.reporting.learning_margin,
                likely_causes(self.instructions.codec_json, type(self.strategy).__name__),
            )
        return result

    # ------------------------------------------------------------------ instructions

    def _refresh_ids(self, grid: Grid) -> None:
        """Learn the stable ids of newly connected nodes (counted in the next round)."""
        self.clients.refresh(
            grid,
            expected=self.sampling.min_available_nodes,
            timeout=self.identity_timeout,
            traffic=self._pending_traffic,
        )

    def _new_identity_failures(self) -> dict[str, int]:
        """Identity exchanges that failed since the last call, by kind."""
        total = dict(self.clients.ids.failures)
        new = {str(k): v - self._identity_seen.get(k, 0) for k, v in total.items()}
        self._identity_seen = total
        return {k: v for k, v in new.items() if v}

    def _inner_configure(
        self, method: str, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> list[Message]:
        """The inner strategy's instructions; a failure there skips the round's
        instructions (logged), never the run."""
        try:
            return list(getattr(self.strategy, method)(server_round, arrays, config, grid))
        except Exception as exc:
            self._log_inner_failure(server_round, method, "nothing is sent", exc)
            if self._state is not None and self._state.number == server_round:
                self._state.record.inner_failed = 1
            return []

    def _sample(self, server_round: int, fraction: float, purpose: str) -> list[int]:
        minimum = (
            self.sampling.min_train_nodes
            if purpose == "train-sample"
            else self.sampling.min_evaluate_nodes
        )
        ids = self.clients.ids.stable_ids()
        return sample(ids, fraction, self.run_seed, purpose, server_round, minimum=minimum)

    def _messages(
        self, template: list[Message], stable_ids: list[int], server_round: int, kind: str
    ) -> dict[int, Message]:
        return self.instructions.build(
            template,
            stable_ids,
            server_round,
            kind,
            node_of=self.clients.ids.node_of,
            ack_round=self.clients.ack_round,
            resync=lambda sid: self.cv is not None and sid in self.cv.resync_requested,
            plan=self._state.joint if self._state is not None else None,
            restores=lambda sid: self.clients.handles_kind(sid, kind),
        )

    def _evaluate_replica(
        self,
        server_round: int,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None,
    ) -> None:
        """Central accuracy of x_hat, the model the clients train and evaluate on, when
        it differs from x_t (Flower's Result and ``accuracy`` hold x_t)."""
        state = self._state
        if (
            evaluate_fn is None
            or self.replicas is None
            or state is None
            or state.number != server_round
            or state.record.downlink is None
            or state.record.downlink["replica_drift"] == 0.0
        ):
            return
        result = evaluate_fn(server_round, self.replicas.full_record())
        if result is not None and "accuracy" in result:
            state.record.replica_accuracy = float(result["accuracy"])

    # ------------------------------------------------------------------ training

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample over stable ids and send each client its own config."""
        server_round += self._offset
        t_start = time.perf_counter()
        self._refresh_ids(grid)
        state = RoundState(number=server_round, t_start=t_start)
        state.record.identity_failures = self._new_identity_failures()
        state.traffic, self._pending_traffic = self._pending_traffic, Traffic()
        state.global_arrays = {k: np.asarray(v.numpy()) for k, v in arrays.items()}
        self._state = state
        if self.replicas is not None:
            self.replicas.server.start(state.global_arrays)  # version 0: the initial model
        template = self._inner_configure("configure_train", server_round, arrays, config, grid)
        if not template:
            return []
        selected = self._sample(server_round, self.sampling.fraction_train, "train-sample")
        if self.joint:
            state.joint = plan_round(
                self.codec, self.policy, self.joint_state, state.global_arrays, selected
            )
        self._check_memory(len(selected), state.global_arrays)
        state.sent = self._messages(template, selected, server_round, MessageType.TRAIN)
        for sid, msg in state.sent.items():
            fp32 = self.replicas.carry(msg, sid, model_free=True) if self.replicas else None
            row = state.per_client.setdefault(sid, empty_client_row(sid))
            row["downlink_record_bytes"] = record_bytes(msg.content)
            row["downlink_wire_bytes"] = count(
                state.traffic, Kind.TRAIN_INSTRUCTION, msg, client=sid, fp32_wire_bytes=fp32
            )
        state.record.selected = len(selected)
        return list(state.sent.values())

    def _check_memory(self, clients: int, global_arrays: Mapping[str, np.ndarray]) -> None:
        """Refuse, before any instruction leaves, a round whose dense copies cannot fit
        (fedcomp.flower.budget): the per-client hand-off holds two per client; residual
        compression's mirrors, one per client, live in memory unless mirror_dir keeps
        them on disk (state, not round memory, but they grow with the clients reached:
        counted here for this round's); the streaming paths hold none."""
        if not self.aggregation.pre_aggregated:
            copies, mode = 2, "aggregation.handoff=per_client"
        elif self.cv is not None and not self.aggregation.mirror_dir:
            copies, mode = 1, "residual compression (mirrors in memory)"
        else:
            return
        model = sum(np.asarray(v).size * 4 for v in global_arrays.values())
        check_round_memory(clients, model, copies, mode, available_memory())

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate and decode every reply, then hand over to the inner strategy."""
        server_round += self._offset
        state = self._state
        if state is None or state.number != server_round:
            raise RuntimeError("aggregate_train called without configure_train for this round")
        t0 = time.perf_counter()
        replies = list(replies)
        self.clients.note_replies(replies)
        decoded = self.decoder.decode_all(replies, state)
        decoded = self.decoder.drop_metric_misfits(decoded, state)
        decoded = self.decoder.drop_outliers(decoded, state)
        self.decoder.accept(decoded, state, self.clients.accepted_round)
        decode_s = time.perf_counter() - t0

        bounded = self._bound_influence(decoded, state)
        t1 = time.perf_counter()
        arrays, metrics = None, None
        try:
            replies_in = self.handoff_impl.replies(decoded, state) if bounded else None
        finally:  # the replies are acknowledged: their mirrors move whatever happens
            self.decoder.commit_deferred(decoded, state)
        if not decoded:
            log.warning("round %d: no valid replies, the global model is unchanged", server_round)
        elif replies_in is not None:
            arrays, metrics = self._inner_aggregate(server_round, replies_in, state)
        if arrays is not None:  # FedAdam & co. compute in float64: keep the model's dtypes
            arrays = cast_like(arrays, state.global_arrays)
        aggregate_s = time.perf_counter() - t1
        if arrays is not None and not all_finite(arrays):
            log.error(
                "round %d: the aggregate is not finite; the global model is kept", server_round
            )
            state.record.aggregate_nonfinite = 1
            arrays, metrics = None, None
        if self.reporting.update_probe is not None and arrays is not None:
            new_arrays = {k: np.asarray(v.numpy()) for k, v in arrays.items()}
            state.record.diagnostics = dict(
                self.reporting.update_probe(
                    server_round,
                    state.global_arrays,
                    new_arrays,
                    [d.stable_id for d in decoded],
                )
            )
        state.record.replied = len(decoded)
        state.record.decode_s, state.record.aggregate_s = decode_s, aggregate_s
        if self.replicas is not None and arrays is not None:
            # x_t is the inner strategy's; the clients move to x_hat by one step.
            new_arrays = {k: np.asarray(v.numpy()) for k, v in arrays.items()}
            state.record.downlink = self.replicas.advance(new_arrays)
        return arrays, metrics

    def _bound_influence(self, decoded: list[Decoded], state: RoundState) -> bool:
        """Cap weights and clip norms (fedcomp.influence); False when there is nothing
        to hand over: no reply, or a total weight that is not finite (the model is kept;
        the accepted replies' mirrors still move, as they were acknowledged)."""
        state.record.capped = cap_weights(decoded, self.influence.weight_cap)
        if not self.joint:
            state.record.clipped, reference, state.record.norm_ratio = clip_norms(
                decoded, self.influence.norm_cap, self._reference_norm
            )
            self._reference_norm = reference or self._reference_norm
        if decoded and not total_weight_is_finite([d.weight for d in decoded]):
            log.error("round %d: the total weight is not finite; the model is kept", state.number)
            state.record.aggregate_nonfinite = 1
            return False
        return bool(decoded)

    def _log_inner_failure(
        self, server_round: int, method: str, outcome: str, exc: Exception
    ) -> None:
        log.error(
            "round %d: the inner strategy %s failed in %s (%s: %s); %s",
            server_round,
            type(self.strategy).__name__,
            method,
            type(exc).__name__,
            exc,
            outcome,
            exc_info=exc,
        )

    def _inner_aggregate(
        self, server_round: int, replies: list[Message], state: RoundState
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The inner strategy's aggregate; a failure there fails the round (logged, the
        model kept), never the run."""
        try:
            return self.strategy.aggregate_train(server_round, replies)
        except Exception as exc:
            self._log_inner_failure(server_round, "aggregate_train", "the model is kept", exc)
            state.record.inner_failed = 1
            return None, None

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs, as plain data (public randomness needs none):
        acknowledgements, mirrors, tree statistics, one-bit state, the inner strategy's
        state through its adapter (fedcomp.flower.inner_state; an unsupported class is
        refused by name), the downlink's x_hat, versions and history, the round records
        and the last completed round. Not what each client holds (a resumed run is a
        new Flower run, with empty Context.state on every node)."""
        return {
            "accepted_round": dict(self.clients.accepted_round),
            "cv": self.cv.state_dict() if self.cv is not None else None,
            "tree_stats": self.tree_stats.state_dict(),
            "joint": self.joint_state.state_dict() if self.joint_state is not None else None,
            "inner": inner_state_dict(self.strategy),
            "rounds": list(self.rounds),
            "initial_evaluation": self.initial_evaluation,
            "completed_round": self.rounds[-1]["round"] if self.rounds else 0,
            "broadcast": self.replicas.server.state_dict() if self.replicas else None,
            "reference_norm": self._reference_norm,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output into a wrapper built with the same
        settings; :meth:`start` then continues after the completed round."""
        load_inner_state_dict(self.strategy, state["inner"])
        self.rounds = list(state["rounds"])
        self.initial_evaluation = state["initial_evaluation"]
        self._completed_round = int(state["completed_round"])
        self._reference_norm = state.get("reference_norm")
        self.clients.accepted_round = {int(k): int(v) for k, v in state["accepted_round"].items()}
        if self.cv is not None and state.get("cv") is not None:
            self.cv.load_state_dict(state["cv"])
        if "tree_stats" in state:
            self.tree_stats.load_state_dict(state["tree_stats"])
        if self.joint_state is not None and state.get("joint") is not None:
            self.joint_state.load_state_dict(state["joint"])
        if self.replicas is not None and state.get("broadcast") is not None:
            self.replicas.server.load_state_dict(state["broadcast"])
            self.clients.forget_all_replicas()  # a new Flower run: Context.state is empty

    # ------------------------------------------------------------------ evaluation

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        server_round += self._offset
        template = self._inner_configure("configure_evaluate", server_round, arrays, config, grid)
        if not template:
            return []
        selected = self._sample(server_round, self.sampling.fraction_evaluate, "evaluate-sample")
        self._evaluate_sent = set(selected)
        sent = self._messages(template, selected, server_round, MessageType.EVALUATE)
        for sid, msg in sent.items():
            # Model-free to mods that declared they rebuild evaluate instructions; with
            # a seeded initial model the server already counts on the clients' mods, so
            # also to clients it has not heard from yet.
            seeded = self.downlink.initial == "seeded" and sid not in self.clients.handles
            model_free = seeded or self.clients.handles_kind(sid, MessageType.EVALUATE)
            fp32 = self.replicas.carry(msg, sid, model_free=model_free) if self.replicas else None
            if self._state is not None and self._state.number == server_round:
                count(
                    self._state.traffic,
                    Kind.EVALUATE_INSTRUCTION,
                    msg,
                    client=sid,
                    fp32_wire_bytes=fp32,
                )
        return list(sent.values())

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Aggregate client evaluation metrics in stable-id order.

        Replies are checked first (asked this round, one per client, one MetricRecord
        of finite numbers with a positive example count, the metric names most replies
        carry): Flower's aggregation raises on inconsistent replies, which would end
        the ServerApp. A failed evaluation never stops the run. Every aggregated metric
        is recorded (``client_metrics``); the round line shows the first of
        ``reporting.accuracy_keys`` and ``reporting.loss_keys`` present.
        """
        server_round += self._offset
        replies = list(replies)
        self.clients.note_replies(replies)
        if self._state is not None and self._state.number == server_round:
            for msg in replies:
                sid = self.clients.ids.stable_of(msg.metadata.src_node_id)
                count(self._state.traffic, Kind.EVALUATE_REPLY, msg, client=sid)
        valid = valid_evaluate_replies(
            replies, server_round, stable_of=self.clients.ids.stable_of, asked=self._evaluate_sent
        )
        try:
            metrics = self.strategy.aggregate_evaluate(server_round, valid)
        except Exception as exc:  # evaluation is a report: it must not end the run
            log.error("round %d: client evaluation not aggregated: %s", server_round, exc)
            return None
        if self._state is not None and self._state.number == server_round and metrics:
            record = self._state.record
            record.client_metrics = {k: v for k, v in metrics.items() if not isinstance(v, list)}
            record.client_accuracy = first_present(metrics, self.reporting.accuracy_keys)
            record.client_loss = first_present(metrics, self.reporting.loss_keys)
        return metrics

    # ------------------------------------------------------------------ round records

    def _loss_reference(self) -> float | None:
        """The loss a diverging run is measured against: the initial model's, else the
        first recorded round's."""
        initial = (self.initial_evaluation or {}).get("loss")
        if isinstance(initial, float) and math.isfinite(initial):
            return initial
        return next((r["loss"] for r in self.rounds if r.get("loss") is not None), None)

    def _close_round(self, server_round: int, central: MetricRecord | None) -> None:
        central_dict = dict(central) if central is not None else {}
        nonfinite = sorted(
            k for k, v in central_dict.items() if isinstance(v, float) and not math.isfinite(v)
        )
        for key in nonfinite:  # recorded as unavailable, and the run fails at its end
            central_dict[key] = None
        if server_round == 0:
            self.initial_evaluation = central_dict
            if central_dict:
                log.info(
                    "round 0/%d | accuracy %.4f loss %.4f (initial model)",
                    self._num_rounds,
                    central_dict.get("accuracy", float("nan")),
                    central_dict.get("loss", float("nan")),
                )
            return
        state = self._state
        if state is None or state.number != server_round:
            return
        record = round_record(
            server_round,
            central_dict,
            state.record,
            client_rows(state.per_client, state.traffic),
            round_s=time.perf_counter() - state.t_start,
            codec_spec=json.loads(self.instructions.codec_json),
            tensor_codecs=state.tensor_codecs,
            cv=self.cv,
            traffic=state.traffic,
        )
        if nonfinite:
            record["nonfinite_metrics"] = nonfinite
        growth = loss_growth(record["loss"], self._loss_reference())
        if growth is not None and growth >= DIVERGING_FACTOR:
            record["loss_growth"] = growth
        above_best = loss_growth(
            record["loss"], best_loss((self.initial_evaluation or {}).get("loss"), self.rounds)
        )
        if above_best is not None and above_best >= LOSS_FLAG_FACTOR:
            record["loss_above_best"] = above_best
        self.rounds.append(record)
        self._state = None
        line = log_line(record, self._num_rounds)
        if nonfinite:
            log.error("%s | DIVERGED: central %s not finite", line, ", ".join(nonfinite))
        elif "loss_growth" in record:
            log.error("%s | DIVERGING: loss %.0fx the initial one", line, growth)
        elif record["replied"] == 0:
            log.warning("%s | NO REPLY ACCEPTED: the model did not change", line)
        elif "loss_above_best" in record:
            log.warning("%s | LOSS %.1fx ITS BEST SO FAR", line, record["loss_above_best"])
        else:
            log.info(line)
        if self.reporting.on_round is not None:
            self.reporting.on_round(record)
