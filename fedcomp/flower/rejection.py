"""Setting a reply aside: counted under its failure kind, logged once, the round goes on.

A reply is set aside for what it is (fedcomp.failures.Failure: malformed, not asked,
duplicate, non-finite, ...), for train metric names that differ from the round's
majority, or, in fedcomp.flower.bounds, for an outlying norm. Nothing here raises.
"""

from __future__ import annotations

import logging

from flwr.app import Message

from fedcomp.failures import Failure, failure_of, short_reason
from fedcomp.flower.handoff import client_metrics
from fedcomp.flower.round_state import Decoded, RoundState
from fedcomp.flower.validation import ReplyError, majority_keys
from fedcomp.keys import FAULT_REASON_PREFIX

log = logging.getLogger("fedcomp.flower.strategy")  # one logger for the wrapper's lines


def reject(state: RoundState, sid: int | None, exc: Exception) -> None:
    """Count and log one rejected reply under its failure kind."""
    kind = failure_of(exc)
    state.record.count_rejection(str(kind), fault=kind is not Failure.RESYNC)
    if kind is Failure.NONFINITE:
        state.record.nonfinite += 1
    if kind is Failure.RESYNC:
        state.record.resync_requests += 1
        log.warning("round %d: client %s: %.300s", state.number, sid, exc)
        return
    if kind is Failure.UNEXPECTED:  # a decoder bug, not the client's fault alone
        log.error(
            "round %d: reply of client %s could not be decoded (%s: %.300s)",
            state.number,
            sid,
            type(exc).__name__,
            exc,
            exc_info=exc,
        )
    else:
        log.warning(
            "round %d: rejected reply of client %s [%s]: %.300s", state.number, sid, kind, exc
        )


def count_error_reply(
    state: RoundState, sid: int | None, msg: Message, expected: str | None = None
) -> None:
    """An error reply (the client's mod or app failed): a fault of the kind the run's
    own fault injection drew for this client and round (``expected``, the server's
    draw, fedcomp.injected) when its reason names it, else ``error_reply``. The
    client's error text alone never sets the kind counted."""
    reason = str(msg.error.reason)
    injected = expected is not None and FAULT_REASON_PREFIX + expected in reason
    state.record.count_fault(expected if injected else "error_reply")
    log.warning(
        "round %d: client %s replied with an error: %s",
        state.number,
        sid,
        short_reason(msg.error.reason),
    )


def drop_metric_misfits(decoded: list[Decoded], state: RoundState) -> list[Decoded]:
    """Set aside replies whose train metric names (fedcomp's own excepted) differ
    from those most replies carry: the inner strategy's metric aggregation needs one
    key set, and a reply with one more key made Flower end the ServerApp. The
    majority is taken over names, so the result does not depend on reply order; with
    no majority (a tie) every reply is set aside."""
    if not decoded:
        return decoded
    names = [frozenset(client_metrics(d).keys()) for d in decoded]
    keys = majority_keys(names, strict=True)
    kept = []
    for item, other in zip(decoded, names, strict=True):
        if other == keys:
            kept.append(item)
            continue
        majority = (
            "no key set is carried by most replies"
            if keys is None
            else f"most replies carry {sorted(keys)}"
        )
        exc = ReplyError(
            f"train metric names {sorted(other)!r:.200}, {majority:.200}", Failure.BAD_METRICS
        )
        reject(state, item.stable_id, exc)
    return kept
