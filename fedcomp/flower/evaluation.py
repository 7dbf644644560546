"""Client evaluation on the server: which evaluate replies are fit to aggregate, which
aggregated metrics the round line shows, and the evaluation that train replies carry
when the clients evaluate inside the train round (settings.evaluate_in_train)."""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from flwr.app import Message, MetricRecord

from fedcomp.failures import Failure
from fedcomp.flower.validation import ReplyError, check_evaluate_reply, majority_keys
from fedcomp.keys import (
    METRIC_PRE_TRAIN_ACCURACY,
    METRIC_PRE_TRAIN_EXAMPLES,
    METRIC_PRE_TRAIN_LOSS,
)
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
) -> None:
    """The round's client evaluation from its accepted train replies' pre-train metrics
    (stable id, metrics), when they carry them: nothing is recorded otherwise."""
    mean = pre_train_mean(replies, max_examples)
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
    replies: Sequence[tuple[int, Mapping[str, float]]], max_examples: float
) -> tuple[float, float, float] | None:
    """Accuracy and loss averaged over the replies, each weighted by its own
    ``pre-train-examples`` (not num-examples: the client's training set size is not
    the size of the data it evaluated on), and the examples in all; None when no reply
    carries a usable evaluation.

    A reply whose values are out of range (accuracy outside [0, 1], a negative loss,
    a count that is not an integer in [1, ``max_examples``]) is left out of the mean,
    logged: its update was accepted on its own checks, and a count alone must not let
    one client outweigh the others. Non-finite values never reach here (the train
    reply checks refuse the whole reply)."""
    total = acc_sum = loss_sum = 0.0
    for sid, metrics in replies:
        if METRIC_PRE_TRAIN_ACCURACY not in metrics:
            continue
        problem = _pre_train_problem(metrics, max_examples)
        if problem:
            log.warning("client %s: pre-train evaluation left out of the mean: %s", sid, problem)
            continue
        weight = float(metrics[METRIC_PRE_TRAIN_EXAMPLES])
        total += weight
        acc_sum += weight * float(metrics[METRIC_PRE_TRAIN_ACCURACY])
        loss_sum += weight * float(metrics[METRIC_PRE_TRAIN_LOSS])
    if total == 0:
        return None
    return acc_sum / total, loss_sum / total, total


def _pre_train_problem(metrics: Mapping[str, float], max_examples: float) -> str:
    """What is wrong with one reply's pre-train metrics ("" when nothing is)."""
    keys = (METRIC_PRE_TRAIN_ACCURACY, METRIC_PRE_TRAIN_LOSS, METRIC_PRE_TRAIN_EXAMPLES)
    values = [metrics.get(k) for k in keys]
    if any(isinstance(v, list) or v is None or not math.isfinite(v) for v in values):
        return f"needs finite {', '.join(keys)}, got {values!r}"
    accuracy, loss, examples = values
    if not 0 <= accuracy <= 1:
        return f"{METRIC_PRE_TRAIN_ACCURACY}={accuracy!r} is not in [0, 1]"
    if loss < 0:
        return f"{METRIC_PRE_TRAIN_LOSS}={loss!r} is negative"
    if examples != int(examples) or not 1 <= examples <= max_examples:
        return (
            f"{METRIC_PRE_TRAIN_EXAMPLES}={examples!r} is not an integer in [1, {max_examples:g}]"
        )
    return ""


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
) -> list[Message]:
    """The evaluate replies fit to aggregate, sorted by stable id: asked this round, one
    per client, one MetricRecord of finite numbers with a positive example count, the
    metric names most replies carry (Flower's aggregation raises on inconsistent
    replies, which would end the ServerApp)."""
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
            metrics = check_evaluate_reply(msg.content)
        except ReplyError as exc:
            log.warning(
                "round %d: evaluate reply of client %s set aside [%s]: %s",
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
                "round %d: evaluate reply of client %s set aside: metric names %s, "
                "most replies carry %s",
                server_round,
                sid,
                sorted(other),
                sorted(keys),
            )
    return [m for _, k, m in sorted(checked, key=lambda c: c[0]) if k == keys]
