"""Client evaluation on the server: which evaluate replies are fit to aggregate, which
aggregated metrics the round line shows, and the evaluation that train replies carry
when the clients evaluate inside the train round (settings.evaluate_in_train)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from flwr.app import Message, MetricRecord, RecordDict

from fedcomp.failures import Failure
from fedcomp.flower.validation import ReplyError, check_evaluate_reply, majority_keys
from fedcomp.influence import MAX_NUM_EXAMPLES, cap_weights
from fedcomp.keys import (
    KEY_NUM_EXAMPLES,
    METRIC_PRE_TRAIN_ACCURACY,
    METRIC_PRE_TRAIN_EXAMPLES,
    METRIC_PRE_TRAIN_LOSS,
)
from fedcomp.own_metrics import PRE_TRAIN_METRICS, own_metrics_problem
from fedcomp.results_file import CLIENT_EVAL_EVALUATE, CLIENT_EVAL_PRE_TRAIN, RoundCounts

log = logging.getLogger("fedcomp.flower.strategy")  # one logger for the wrapper's lines


def record_client_metrics(
    record: RoundCounts,
    metrics: MetricRecord,
    accuracy_keys: tuple[str, ...],
    loss_keys: tuple[str, ...],
) -> None:
    """Keep every aggregated client metric; the round line shows the first accuracy
    and loss names present."""
    record.client_metrics = {k: v for k, v in metrics.items() if not isinstance(v, list)}
    record.client_accuracy = first_present(metrics, accuracy_keys)
    record.client_loss = first_present(metrics, loss_keys)
    record.client_eval = CLIENT_EVAL_EVALUATE


def record_pre_train_metrics(
    record: RoundCounts,
    replies: Sequence[tuple[int, Mapping[str, float]]],
    max_examples: float,
    weight_cap: float = 0.0,
) -> None:
    """The round's client evaluation from its accepted train replies' pre-train metrics
    (stable id, metrics), when they carry them: nothing is recorded otherwise."""
    mean = pre_train_mean(replies, max_examples, weight_cap)
    if mean is None:
        return
    accuracy, loss, examples = mean
    record.client_accuracy, record.client_loss = accuracy, loss
    record.client_metrics = {
        METRIC_PRE_TRAIN_ACCURACY: accuracy,
        METRIC_PRE_TRAIN_LOSS: loss,
        METRIC_PRE_TRAIN_EXAMPLES: examples,
    }
    record.client_eval = CLIENT_EVAL_PRE_TRAIN


def pre_train_mean(
    replies: Sequence[tuple[int, Mapping[str, float]]],
    max_examples: float,
    weight_cap: float = 0.0,
) -> tuple[float, float, float] | None:
    """Accuracy and loss averaged over the replies, each weighted by its own
    ``pre-train-examples`` (not num-examples: the client's training set size is not
    the size of the data it evaluated on), and the examples in all; None when no reply
    carries a usable evaluation.

    The counts are capped like train weights (``weight_cap`` x the lower median
    count, fedcomp.influence.cap_weights) and the mean is taken with normalized
    weights, so it lies between the smallest and the largest value reported: finite
    for any finite reports. The replies were checked with the rest of their train
    metrics (fedcomp.own_metrics); one that is out of range here anyway is left out,
    logged."""
    kept = []
    for sid, metrics in replies:
        if METRIC_PRE_TRAIN_ACCURACY not in metrics:
            continue
        problem = own_metrics_problem({k: metrics.get(k) for k in PRE_TRAIN_METRICS}, max_examples)
        if problem:
            log.warning("client %s: pre-train evaluation left out of the mean: %s", sid, problem)
            continue
        kept.append(metrics)
    if not kept:
        return None
    counts = [float(m[METRIC_PRE_TRAIN_EXAMPLES]) for m in kept]
    weights = np.asarray(cap_weights(counts, weight_cap), dtype=np.float64)
    shares = weights / weights.sum()
    accuracy = float(shares @ [float(m[METRIC_PRE_TRAIN_ACCURACY]) for m in kept])
    loss = float(shares @ [float(m[METRIC_PRE_TRAIN_LOSS]) for m in kept])
    return accuracy, loss, float(weights.sum())


def first_present(metrics: MetricRecord, keys: tuple[str, ...]) -> float | None:
    for key in keys:
        if key in metrics and not isinstance(metrics[key], list):
            return float(metrics[key])
    return None


def valid_evaluate_replies(
    replies: list[Message],
    server_round: int,
    *,
    stable_of: Callable[[int], int | None],
    asked: set[int],
    max_examples: float = MAX_NUM_EXAMPLES,
    weight_cap: float = 0.0,
) -> list[Message]:
    """The evaluate replies fit to aggregate, sorted by stable id: asked this round, one
    per client, one MetricRecord of finite numbers with a positive example count of at
    most ``max_examples``, the metric names most replies carry (Flower's aggregation
    raises on inconsistent replies, which would end the ServerApp). Example counts are
    capped at ``weight_cap`` x the lower median count (fedcomp.influence.cap_weights),
    as train weights are: one client cannot set the aggregated metrics by its count."""
    sids = [stable_of(m.metadata.src_node_id) for m in replies]
    repeats = Counter(sids)
    checked = []
    for sid, msg in zip(sids, replies, strict=True):
        if msg.has_error():
            log.warning("round %d: evaluation failed on client %s", server_round, sid)
            continue
        try:
            if sid is None or sid not in asked:
                raise ReplyError("not asked to evaluate this round", Failure.NOT_ASKED)
            if repeats[sid] > 1:
                raise ReplyError("more than one evaluate reply", Failure.DUPLICATE)
            metrics = check_evaluate_reply(msg.content, max_examples=max_examples)
        except ReplyError as exc:
            log.warning(
                "round %d: evaluate reply of client %s set aside [%s]: %.300s",
                server_round,
                sid,
                exc.kind,
                exc,
            )
            continue
        checked.append((sid, frozenset(metrics.keys()), msg))
    if not checked:
        return []
    keys = majority_keys([k for _, k, _ in checked])
    for sid, other, _ in checked:
        if other != keys:
            log.warning(
                "round %d: evaluate reply of client %s set aside: metric names %.200s, "
                "most replies carry %.200s",
                server_round,
                sid,
                sorted(other),
                sorted(keys),
            )
    kept = [m for _, k, m in sorted(checked, key=lambda c: c[0]) if k == keys]
    return cap_evaluate_weights(kept, weight_cap)


def cap_evaluate_weights(replies: list[Message], factor: float) -> list[Message]:
    """The replies with each example count capped (a capped reply is a copy with the
    new count; the others are the replies themselves)."""
    counts = [
        float(next(iter(m.content.metric_records.values()))[KEY_NUM_EXAMPLES]) for m in replies
    ]
    out = []
    for msg, count, capped in zip(replies, counts, cap_weights(counts, factor), strict=True):
        if capped >= count:
            out.append(msg)
            continue
        (name, metrics), *_ = msg.content.metric_records.items()
        content = RecordDict(dict(msg.content.items()))
        content[name] = MetricRecord({**dict(metrics), KEY_NUM_EXAMPLES: capped})
        out.append(Message(content, reply_to=msg))
    return out
