"""What a run's round records say about it at its end: nothing learned, diverged, or
no better than it started, each a RunFailed naming the likely cause; and the loss
ratios that flag a round on its way there."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

from fedcomp.failures import RunFailed
from fedcomp.rules import COORDINATEWISE_ROBUST, codec_chain, is_sparse

#: A central loss this many times the run's reference (the initial model's loss, else
#: the first round's) has grown by orders of magnitude: the model is diverging.
DIVERGING_FACTOR = 100.0
_ADVICE = (
    "Lower the learning rate or the compression (codec, downlink), or cap influence "
    "(aggregation.norm_cap)."
)


def loss_growth(loss: float | None, reference: float | None) -> float | None:
    """How many times the reference loss this round's loss is, when both are known."""
    if loss is None or reference is None or not math.isfinite(loss) or reference <= 0:
        return None
    return loss / reference


def fail_if_diverged(rounds: list[dict[str, Any]], causes: str = _ADVICE) -> None:
    """A global model whose central loss or accuracy stopped being finite diverged (the
    rounds after it cannot have learned anything), and so did one whose last loss is
    still DIVERGING_FACTOR times its reference or more."""
    bad = next((r for r in rounds if r.get("nonfinite_metrics")), None)
    if bad is not None:
        raise RunFailed(
            f"the global model diverged: its central {', '.join(bad['nonfinite_metrics'])} "
            f"became non-finite at round {bad['round']}. {causes}"
        )
    if rounds and (rounds[-1].get("loss_growth") or 0.0) >= DIVERGING_FACTOR:
        last = rounds[-1]
        first = next(r for r in rounds if r.get("loss_growth"))
        raise RunFailed(
            f"the global model diverged: its central loss ended at {last['loss']:.4g}, "
            f"{last['loss_growth']:.0f}x the initial one (growing since round "
            f"{first['round']}). {causes}"
        )


def _changed_model(record: dict[str, Any]) -> bool:
    """Whether a round's aggregate replaced the model (some reply accepted, and neither
    the inner strategy nor the finiteness check discarded the round)."""
    return (
        record["replied"] > 0
        and not record.get("inner_failed")
        and not record.get("aggregate_nonfinite")
    )


def fail_if_nothing_learned(rounds: list[dict[str, Any]]) -> None:
    """A run in which no round changed the model cannot have learned: say so loudly,
    with what the replies were rejected for or why the rounds were discarded, instead
    of ending as a success."""
    if not rounds or any(_changed_model(r) for r in rounds):
        return
    rejected: Counter[str] = Counter()
    for record in rounds:
        rejected.update(record.get("rejected", {}))
        rejected.update({k: v for k, v in record["faults"].items() if k != "rejected_reply"})
        for flag in ("inner_failed", "aggregate_nonfinite"):
            rejected[flag] += record.get(flag, 0)
    rejected = +rejected  # drop the zero counts
    reasons = ", ".join(f"{k} {v}" for k, v in rejected.most_common()) or "no replies at all"
    if not any(r["replied"] for r in rounds):
        what = "no reply was accepted in any"
    else:  # replies were accepted, but every round was discarded after them
        what = "every round was discarded (inner_failed, aggregate_nonfinite) in each"
    raise RunFailed(
        f"{what} of the {len(rounds)} round(s): the model never changed. Failures by "
        f"kind: {reasons}. Check that the ClientApp has fedcomp.flower.CompressionMod, "
        "and the logs' rejected replies and inner-strategy errors."
    )


#: A run whose first rounds each received replies and refused all of them stops after
#: this many: a setting its clients cannot meet (a codec, a metric, the protocol) is not
#: fixed by more rounds, and a 300-round run should not spend them finding out.
EARLY_REFUSAL_ROUNDS = 3


def fail_if_refusing_everything(rounds: list[dict[str, Any]]) -> None:
    """Fail the run (RunFailed) when exactly its first EARLY_REFUSAL_ROUNDS rounds are
    recorded and each refused at least one reply and accepted none; name the refusals.

    Rounds with no reply at all (clients offline, timeouts) do not count: a deployment
    may wait for its devices. Only the start of a run is judged; later, a resync or a
    restarted client may recover, and the end-of-run checks judge what was learned."""
    if len(rounds) != EARLY_REFUSAL_ROUNDS:
        return
    if any(r["replied"] or not sum(r.get("rejected", {}).values()) for r in rounds):
        return
    refused: Counter[str] = Counter()
    for record in rounds:
        refused.update(record["rejected"])
    kinds = ", ".join(f"{k} {v}" for k, v in refused.most_common())
    raise RunFailed(
        f"every reply of the first {len(rounds)} rounds was refused ({kinds}): the run "
        "cannot learn, so it stops now. The log names each refused reply and why; a "
        "setting the clients cannot meet (the codec, its parameters, the protocol) is "
        "the likely cause."
    )


def fail_if_stuck_diverged(
    rounds: list[dict[str, Any]], causes: str = _ADVICE, wait: int = EARLY_REFUSAL_ROUNDS
) -> None:
    """Fail the run (RunFailed) when its global model's central metrics are non-finite
    and the last ``wait`` rounds, all evaluated so, changed nothing: a model that no
    reply can move stays where it is, and every later round would be spent on it
    (measured: a diverged FetchSGD run went on for 290 rounds at chance, each client's
    training failing on the model)."""
    last = rounds[-wait:]
    if len(last) < wait or not all(r.get("nonfinite_metrics") for r in last):
        return
    if any(_changed_model(r) for r in last):
        return
    streak = len(rounds) - wait  # back to where the model last evaluated finite
    while streak > 0 and rounds[streak - 1].get("nonfinite_metrics"):
        streak -= 1
    first = rounds[streak]
    raise RunFailed(
        f"the global model diverged: its central {', '.join(first['nonfinite_metrics'])} "
        f"became non-finite at round {first['round']}, and none of the last {wait} rounds "
        f"could change it (no reply accepted); the run stops now. {causes}"
    )


#: The round line flags a central loss this many times the run's best so far.
LOSS_FLAG_FACTOR = 3.0


def best_loss(initial: float | None, rounds: list[dict[str, Any]]) -> float | None:
    """The lowest finite central loss so far (the initial model's included)."""
    losses = [initial] + [r.get("loss") for r in rounds]
    finite = [v for v in losses if isinstance(v, float) and math.isfinite(v) and v > 0]
    return min(finite) if finite else None


def not_learning(initial: Mapping[str, Any], final: Mapping[str, Any], margin: float) -> str | None:
    """Why a model that went from ``initial`` to ``final`` (central accuracy and loss)
    did not learn, or None: its loss is not below the initial loss, or its accuracy is
    not ``margin`` above the initial accuracy. Metrics absent on either side are not
    judged."""
    reasons = []
    loss0, loss1 = initial.get("loss"), final.get("loss")
    if _number(loss0) and _number(loss1) and loss1 >= loss0:
        reasons.append(f"central loss {loss1:.4g} is not below the initial {loss0:.4g}")
    acc0, acc1 = initial.get("accuracy"), final.get("accuracy")
    if _number(acc0) and _number(acc1) and acc1 < acc0 + margin:
        reasons.append(f"accuracy {acc1:.4f} is not {margin:g} above the initial {acc0:.4f}")
    return " and ".join(reasons) or None


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def fail_if_not_learning(
    initial: Mapping[str, Any] | None,
    rounds: list[dict[str, Any]],
    margin: float,
    likely_causes: str,
) -> None:
    """A run whose model ends no better than it started fails, naming the likely cause."""
    if not initial or not rounds:
        return
    why = not_learning(initial, rounds[-1], margin)
    if why is not None:
        raise RunFailed(
            f"the model did not learn: after round {rounds[-1]['round']} its {why}. "
            f"{likely_causes} (Reporting(learning_check=False), "
            "or learning_check=false in the settings, turns this check off.)"
        )


def bounded_clients(rounds: list[dict[str, Any]]) -> str:
    """The clients the influence bounds cut in at least half of the rounds, named with
    how often each bound did, or "" (fedcomp.flower.bounds)."""
    counts: dict[int, Counter[str]] = {}
    for record in rounds:
        for bound, ids in record.get("bounded", {}).items():
            for sid in ids:
                counts.setdefault(int(sid), Counter())[bound] += 1
    frequent = {sid: c for sid, c in counts.items() if max(c.values()) * 2 >= len(rounds)}
    if not frequent:
        return ""
    named = "; ".join(
        f"client {sid} ({', '.join(f'{k} in {v} rounds' for k, v in sorted(c.items()))})"
        for sid, c in sorted(frequent.items())[:10]
    )
    return (
        f"The influence bounds cut {len(frequent)} client(s) in most rounds: {named}. "
        "A hostile or misconfigured client is the likely cause (docs/reliability.md, "
        "'Bounded influence')."
    )


def likely_causes(codec_json: str, strategy_name: str, rounds: list[dict[str, Any]] = ()) -> str:
    """The likely causes of a run that did not learn, given what it ran: clients the
    influence bounds kept cutting first, then the codec and strategy."""
    bounded = bounded_clients(list(rounds))
    if bounded:
        return bounded
    codec = json.loads(codec_json)
    if is_sparse(codec) and strategy_name.lower() in COORDINATEWISE_ROBUST:
        return (
            f"{strategy_name}'s coordinate-wise median or trimmed mean of sparse updates "
            "is zero almost everywhere: use a dense codec or a mean-based strategy."
        )
    if "randk" in codec_chain(codec):
        return (
            "random-k scales each kept coordinate by numel / k: unbiased, but its variance "
            "makes the steps far too large; use ef_topk or sparseq instead."
        )
    return (
        "Likely causes: too much compression for this task (codec, downlink), a "
        "learning rate too high or too low, or too few rounds."
    )


#: A run whose model steps are below this fraction of its clients' typical update
#: (the rounds' reference norms), in the median round, did not follow its clients.
FOLLOW_RATIO = 0.01


def not_following(rounds: list[dict[str, Any]]) -> str | None:
    """Why a run's model did not follow its clients' updates, or None: in the median
    round that measured both, the model's step was below FOLLOW_RATIO times the
    reference norm (its clients' typical update). A check that needs no evaluation:
    a model stalled by near-zero steps fails it (docs/reliability.md)."""
    ratios = sorted(
        r["step_norm"] / r["reference_norm"]
        for r in rounds
        if _number(r.get("step_norm"))
        and _number(r.get("reference_norm"))
        and r["reference_norm"] > 0
    )
    if not ratios:
        return None
    median = ratios[(len(ratios) - 1) // 2]
    if median >= FOLLOW_RATIO:
        return None
    return (
        f"its steps were {median:.3g} times its clients' typical update in the median "
        f"round (below {FOLLOW_RATIO:g}): the aggregate did not follow the updates"
    )


def client_initial_and_final(
    rounds: list[dict[str, Any]],
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The clients' own evaluation of the initial and the final model, when the run
    has it: the pre-train evaluation (evaluate_in_train) of its first round measures
    the initial model; None otherwise."""
    evaluated = [r for r in rounds if r.get("client_eval") == "pre-train"]
    if not evaluated or evaluated[0]["round"] != 1 or len(evaluated) < 2:
        return None
    first, last = evaluated[0], evaluated[-1]
    as_central = lambda r: {"accuracy": r.get("client_accuracy"), "loss": r.get("client_loss")}  # noqa: E731
    return as_central(first), as_central(last)
