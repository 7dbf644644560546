"""Evaluation inside the train round (settings.evaluate_in_train): the clients evaluate
the model they received before training, the round's client accuracy is the mean of
those evaluations weighted by each client's own evaluation count, and no evaluate
message is sent. With the setting off the evaluate messages are still there."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Message, MessageType, MetricRecord

from clients.client_app import make_client_app
from experiments.inprocess import InProcessGrid, initial_arrays, set_task_identity
from fedcomp.data import client_datasets, server_test_set
from fedcomp.flower.evaluation import pre_train_mean
from fedcomp.flower.reply_format import metrics_of, replace_metrics, reply_header
from fedcomp.keys import (
    KEY_NUM_EXAMPLES,
    KEY_ROUND,
    METRIC_PRE_TRAIN_ACCURACY,
    METRIC_PRE_TRAIN_EXAMPLES,
    METRIC_PRE_TRAIN_LOSS,
    RECORD_METRICS,
)
from fedcomp.models import build_model
from fedcomp.results_file import ResultsError, build_results
from fedcomp.settings import Settings, settings_from_dict, settings_from_run_config, validate
from strategies.server_app import build_strategy, client_task

N = 4
ROUNDS = 2
PRE_TRAIN_KEYS = (METRIC_PRE_TRAIN_ACCURACY, METRIC_PRE_TRAIN_LOSS, METRIC_PRE_TRAIN_EXAMPLES)


def _settings(in_train: bool) -> Settings:
    return settings_from_dict(
        {
            "num_clients": N,
            "num_rounds": ROUNDS,
            "train": {"local_epochs": 1},
            "fraction_evaluate": 0.0 if in_train else 1.0,
            "evaluate_in_train": in_train,
        }
    )


# --------------------------------------------------------------------- the setting


def _error(fn, settings: Settings) -> str:
    try:
        fn(settings)
    except ValueError as exc:
        return str(exc)
    return "ok"


def test_the_setting_refuses_evaluate_messages_naming_both_keys() -> None:
    with pytest.raises(ValueError, match=r"fraction_evaluate=1\.0.*evaluate_in_train"):
        validate(settings_from_dict({"evaluate_in_train": True}))
    # the flat run config of flwr run / the Deployment Engine is checked the same way
    with pytest.raises(ValueError, match=r"fraction_evaluate=0\.5"):
        settings_from_run_config({"evaluate_in_train": True, "fraction_evaluate": 0.5})
    # the ServerApp's own construction refuses it with the same message
    both = settings_from_dict({"evaluate_in_train": True})
    assert _error(validate, both) == _error(build_strategy, both) != "ok"
    assert validate(_settings(True)).evaluate_in_train is True
    assert Settings().evaluate_in_train is False  # off by default


def test_the_task_names_the_setting_only_when_it_is_on() -> None:
    # off: the task, hence every instruction's bytes, is what it was without the setting
    assert "evaluate_in_train" not in client_task(_settings(False))
    task = client_task(_settings(True))
    assert task["evaluate_in_train"] is True
    validate(settings_from_dict(task))  # a client validates its task as a whole


# --------------------------------------------------------------------- the weighted mean


def _pre(acc: float, loss: float, examples: float, num_examples: float = 1.0) -> dict:
    return {
        KEY_NUM_EXAMPLES: num_examples,
        METRIC_PRE_TRAIN_ACCURACY: acc,
        METRIC_PRE_TRAIN_LOSS: loss,
        METRIC_PRE_TRAIN_EXAMPLES: examples,
    }


def test_the_mean_is_weighted_by_the_evaluation_counts_not_num_examples() -> None:
    # Training-set sizes (num-examples) the other way round from the evaluation counts:
    # weighing by them would give (0.2*1 + 0.8*100 ... ) a different number.
    replies = [(0, _pre(0.2, 3.0, 30, num_examples=900)), (1, _pre(0.8, 1.0, 10, 100))]
    acc, loss, total = pre_train_mean(replies, max_examples=1e9)
    assert acc == pytest.approx((0.2 * 30 + 0.8 * 10) / 40, rel=1e-15)
    assert loss == pytest.approx((3.0 * 30 + 1.0 * 10) / 40, rel=1e-15)
    assert total == 40


@pytest.mark.parametrize(
    "bad",
    [
        {METRIC_PRE_TRAIN_ACCURACY: 1.5},
        {METRIC_PRE_TRAIN_ACCURACY: -0.1},
        {METRIC_PRE_TRAIN_LOSS: -1.0},
        {METRIC_PRE_TRAIN_EXAMPLES: 0},
        {METRIC_PRE_TRAIN_EXAMPLES: 2.5},
        {METRIC_PRE_TRAIN_EXAMPLES: 1e10},  # above max_examples
        {METRIC_PRE_TRAIN_LOSS: math.nan},
    ],
)
def test_an_out_of_range_evaluation_is_left_out_of_the_mean(bad: dict) -> None:
    good = (0, _pre(0.25, 2.0, 8))
    assert pre_train_mean([good, (1, {**_pre(0.75, 1.0, 8), **bad})], 1e9) == (0.25, 2.0, 8)


def test_replies_without_an_evaluation_give_no_mean() -> None:
    assert pre_train_mean([(0, {KEY_NUM_EXAMPLES: 5, "train_loss": 1.0})], 1e9) is None
    assert pre_train_mean([], 1e9) is None


def test_results_json_names_the_kind_of_client_evaluation() -> None:
    rnd = {
        **dict.fromkeys(["accuracy", "loss", "client_accuracy", "client_loss"], None),
        **dict.fromkeys(["uplink_codec_bytes", "uplink_record_bytes", "uplink_wire_bytes"], 0),
        **dict.fromkeys(["downlink_record_bytes", "downlink_wire_bytes", "selected"], 0),
        **dict.fromkeys(["replied", "failures", "resyncs", "nonfinite"], 0),
        **dict.fromkeys(["decode_s", "aggregate_s", "round_s"], 0.0),
        "round": 1,
        "per_client": [],
        "faults": {},
        "codec": {},
    }
    for kind in ("pre-train", "evaluate"):
        build_results({}, [{**rnd, "client_eval": kind}], wall_s=0.0)
    build_results({}, [rnd], wall_s=0.0)  # a file written before the field
    with pytest.raises(ResultsError, match=r"rounds\[0\]\.client_eval: 'post-train'"):
        build_results({}, [{**rnd, "client_eval": "post-train"}], wall_s=0.0)


# --------------------------------------------------------------------- in-process runs


@dataclass
class Watch:
    """An inner mod on the train handler: the dense model each client received and
    the metrics it replied with, by (round, partition id)."""

    received: dict[tuple[int, int], dict[str, np.ndarray]] = field(default_factory=dict)
    metrics: dict[tuple[int, int], dict[str, float]] = field(default_factory=dict)

    def __call__(self, msg, ctxt, call_next):
        rnd = int(next(c for c in msg.content.config_records.values() if KEY_ROUND in c)[KEY_ROUND])
        pid = int(ctxt.node_config["partition-id"])
        arrays = next(iter(msg.content.array_records.values()))
        self.received[rnd, pid] = {k: np.array(v.numpy()) for k, v in arrays.items()}
        reply = call_next(msg, ctxt)
        self.metrics[rnd, pid] = dict(reply.content[RECORD_METRICS])
        return reply


@dataclass
class Run:
    records: list[dict]
    central: dict[int, dict[str, float]]
    models: dict[int, dict[str, np.ndarray]]  # the aggregate after each round (0: initial)
    grid: InProcessGrid
    watch: Watch


def _run(settings: Settings, tamper=None) -> Run:
    watch = Watch()
    grid = InProcessGrid(make_client_app(inner_mods=[watch]), N, tamper=tamper)
    strategy = build_strategy(settings)
    central, models = {}, {}

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        models[server_round] = {k: np.array(v.numpy()) for k, v in arrays.items()}
        acc, loss = _accuracy_and_loss(settings, models[server_round], server_test_set(settings))
        central[server_round] = {"accuracy": acc, "loss": loss}
        return MetricRecord(central[server_round])

    strategy.start(grid, initial_arrays(settings), num_rounds=ROUNDS, evaluate_fn=evaluate_fn)
    return Run(strategy.rounds, central, models, grid, watch)


def _accuracy_and_loss(settings: Settings, arrays, data) -> tuple[float, float]:
    """Accuracy and mean cross-entropy computed here, from the definitions (not with
    fedcomp.training.evaluate, which the clients use)."""
    model = build_model(settings.model, settings.dataset.name, settings.seed)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in arrays.items()})
    model.eval()
    with torch.no_grad():
        logits = model(data.x)
    loss = torch.nn.functional.cross_entropy(logits.double(), data.y, reduction="mean")
    return float((logits.argmax(1) == data.y).double().mean()), float(loss)


def _eval_split(settings: Settings, pid: int):
    train_set, val_set = client_datasets(settings, pid)
    return val_set if len(val_set) > 0 else train_set


def _expected_mean(run: Run, settings: Settings, rnd: int, pids: list[int]) -> tuple[float, float]:
    """The clients' own evaluation of the model they received in round ``rnd``,
    weighted by the size of their evaluation split: computed here from scratch."""
    sizes = {p: len(_eval_split(settings, p)) for p in pids}
    evals = {
        p: _accuracy_and_loss(settings, run.watch.received[rnd, p], _eval_split(settings, p))
        for p in pids
    }
    total = sum(sizes.values())
    acc = sum(evals[p][0] * sizes[p] for p in pids) / total
    loss = sum(evals[p][1] * sizes[p] for p in pids) / total
    return acc, loss


def _messages(grid: InProcessGrid, kind: str) -> list[Message]:
    # round messages only (the first-contact identity queries have no numeric group)
    return [
        m for m in grid.sent if m.metadata.message_type == kind and m.metadata.group_id.isdigit()
    ]


@pytest.fixture(scope="module")
def runs() -> dict[bool, Run]:
    set_task_identity()  # module-scoped fixtures run before conftest's autouse one
    return {on: _run(_settings(on)) for on in (True, False)}


def test_with_the_setting_no_evaluate_message_is_sent(runs: dict[bool, Run]) -> None:
    on, off = runs[True], runs[False]
    assert _messages(on.grid, MessageType.EVALUATE) == []
    assert len(_messages(off.grid, MessageType.EVALUATE)) == N * ROUNDS
    # the train messages are the same in number either way
    assert len(_messages(on.grid, MessageType.TRAIN)) == len(_messages(off.grid, MessageType.TRAIN))


def test_clients_evaluate_the_model_they_received_the_previous_aggregate(
    runs: dict[bool, Run],
) -> None:
    run = runs[True]
    for rnd in range(1, ROUNDS + 1):
        for pid in range(N):
            received = run.watch.received[rnd, pid]
            previous = run.models[rnd - 1]  # the aggregate of round r-1 (0: the initial)
            assert all(np.array_equal(received[k], previous[k]) for k in previous)


def test_the_recorded_client_accuracy_is_the_weighted_mean_of_the_clients_evaluations(
    runs: dict[bool, Run],
) -> None:
    settings = _settings(True)
    for record in runs[True].records:
        rnd = record["round"]
        assert record["client_eval"] == "pre-train"
        acc, loss = _expected_mean(runs[True], settings, rnd, list(range(N)))
        assert record["client_accuracy"] == pytest.approx(acc, rel=1e-12)
        assert record["client_loss"] == pytest.approx(loss, rel=1e-5)  # float32 logits
        assert record["client_metrics"][METRIC_PRE_TRAIN_EXAMPLES] == sum(
            len(_eval_split(settings, p)) for p in range(N)
        )


def test_the_setting_changes_neither_training_nor_the_central_evaluation(
    runs: dict[bool, Run],
) -> None:
    on, off = runs[True], runs[False]
    assert on.central == off.central
    for rnd in range(ROUNDS + 1):
        assert all(np.array_equal(on.models[rnd][k], off.models[rnd][k]) for k in on.models[rnd])


def test_with_the_setting_off_train_replies_carry_no_evaluation(runs: dict[bool, Run]) -> None:
    off = runs[False]
    assert all(not set(PRE_TRAIN_KEYS) & set(m) for m in off.watch.metrics.values())
    assert all(set(PRE_TRAIN_KEYS) <= set(m) for m in runs[True].watch.metrics.values())
    for record in off.records:
        assert record["client_eval"] == "evaluate"
        assert METRIC_PRE_TRAIN_ACCURACY not in record["client_metrics"]
    # The evaluate replies measure the round's new aggregate; the pre-train metrics the
    # model received, the previous round's: with every client sampled both ways (and
    # the same models, above) round r+1's pre-train accuracy is round r's evaluate one.
    for before, after in zip(off.records, runs[True].records[1:], strict=False):
        assert after["client_accuracy"] == pytest.approx(before["client_accuracy"], rel=1e-12)


BAD = 2


def _tamper_metrics(change):
    def tamper(pid: int, reply: Message, instruction: Message) -> Message:
        if pid == BAD and instruction.metadata.message_type == MessageType.TRAIN:
            metrics = metrics_of(reply_header(reply.content))
            change(metrics)
            replace_metrics(reply.content, metrics)
        return reply

    return tamper


def _set(key, value):
    def change(metrics):
        metrics[key] = value

    return change


def _drop_evaluation(metrics):
    for key in PRE_TRAIN_KEYS:
        del metrics[key]


def _drop_one(metrics):
    del metrics[METRIC_PRE_TRAIN_LOSS]


@pytest.mark.parametrize(
    "change",
    [
        _set(METRIC_PRE_TRAIN_ACCURACY, math.nan),
        _set(METRIC_PRE_TRAIN_LOSS, math.inf),
        _drop_evaluation,
        _drop_one,
        _set(METRIC_PRE_TRAIN_ACCURACY, 7.0),
        _set(METRIC_PRE_TRAIN_LOSS, -0.5),
        _set(METRIC_PRE_TRAIN_EXAMPLES, 1e12),
        _set(METRIC_PRE_TRAIN_EXAMPLES, 2.5),
    ],
    ids=[
        "nan_accuracy",
        "inf_loss",
        "missing",
        "incomplete",
        "accuracy_7",
        "negative_loss",
        "huge_count",
        "fractional_count",
    ],
)
def test_a_bad_evaluation_costs_only_its_client(change) -> None:
    """Issue 41, finding 2: the pre-train evaluation is checked with the rest of the
    train reply (all three fields or none, finite, accuracy in [0, 1], loss >= 0, an
    integer count in [1, max_num_examples]): a reply that fails is refused whole, as
    any bad train metric, and the mean is the other clients'."""
    settings = _settings(True)
    run = _run(settings, tamper=_tamper_metrics(change))
    others = [p for p in range(N) if p != BAD]
    first = run.records[0]
    assert (first["replied"], first["failures"]) == (N - 1, 1)
    assert first["rejected"] == {"bad_metrics": 1}
    for record in run.records:
        acc, _ = _expected_mean(run, settings, record["round"], others)
        assert record["client_accuracy"] == pytest.approx(acc, rel=1e-12)
