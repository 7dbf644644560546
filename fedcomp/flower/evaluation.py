"""Client evaluation on the server: which evaluate replies are fit to aggregate, and
which aggregated metrics the round line shows."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from flwr.app import Message, MetricRecord

from fedcomp.failures import Failure
from fedcomp.flower.validation import ReplyError, check_evaluate_reply, majority_keys
from fedcomp.results_file import RoundCounts

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
