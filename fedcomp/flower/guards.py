"""What the wrapper checks around the inner strategy and at the end of a run: influence
caps before aggregation, the model's dtypes and finiteness after it, and the run's
outcome (nothing learned, diverged), made loud."""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord

from fedcomp.failures import RunFailed
from fedcomp.flower.round_state import Decoded
from fedcomp.influence import clip_scales, reference_norm, update_norm, weight_cap
from fedcomp.keys import KEY_NUM_EXAMPLES
from fedcomp.rules import COORDINATEWISE_ROBUST, is_sparse

log = logging.getLogger("fedcomp.flower.strategy")  # one logger for the wrapper's lines


def cap_weights(decoded: list[Decoded], factor: float) -> int:
    """Cap num-examples at ``factor`` x the round's median; return how many."""
    cap = weight_cap([d.weight for d in decoded], factor)
    capped = 0
    for item in decoded:
        if cap is not None and item.weight > cap:
            item.weight = cap
            item.metrics[KEY_NUM_EXAMPLES] = cap  # what the inner strategy weighs by
            capped += 1
    return capped


def norm_of(item: Decoded) -> float:
    """A decoded update's L2 norm (measured at decoding when it was released)."""
    return item.norm if item.norm is not None else update_norm(item.deltas)


def clip_norms(
    decoded: list[Decoded], factor: float, fallback: float | None = None
) -> tuple[int, float | None, float | None]:
    """Scale updates beyond ``factor`` x the round's reference norm down to it (with a
    single reply, ``fallback``: the last round's); return how many, this round's
    reference and the largest norm's ratio to it before clipping (how close the round
    came to the cap; clipping, not rejection: a residual mirror has already moved with
    the reply)."""
    norms = [norm_of(d) for d in decoded]
    clipped = 0
    scales = clip_scales(norms, factor, fallback)
    for item, norm, scale in zip(decoded, norms, scales, strict=True):
        if scale != 1.0:
            if item.reload is not None:  # released: scaled when the reducer loads it
                item.scale = scale
            else:
                item.deltas = {
                    k: (v * scale).astype(v.dtype) if v.dtype.kind == "f" else v
                    for k, v in item.deltas.items()
                }
            clipped += 1
            log.warning(
                "client %s: update norm %.3g clipped to %.3g", item.stable_id, norm, norm * scale
            )
    reference = reference_norm(norms)
    ratio = max(norms) / reference if reference else None
    return clipped, reference, ratio


def cast_like(arrays: ArrayRecord, reference: Mapping[str, np.ndarray]) -> ArrayRecord:
    """The inner strategy's output in the global model's dtypes. Flower's FedOpt
    strategies return float64 arrays: every later instruction would carry twice the
    bytes, and every reply would fail the dtype check against the model."""
    if all(np.asarray(v.numpy()).dtype == reference[k].dtype for k, v in arrays.items()):
        return arrays
    return ArrayRecord(
        {
            k: Array(np.asarray(v.numpy()).astype(reference[k].dtype, copy=False))
            for k, v in arrays.items()
        }
    )


def all_finite(arrays: ArrayRecord) -> bool:
    """True when every floating-point array of the record is finite."""
    for value in arrays.values():
        array = np.asarray(value.numpy())
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            return False
    return True


def print_through_flower() -> None:
    """A plain Flower app configures only Flower's logger: when nothing would print
    fedcomp's round lines, print them with Flower's own console handlers (an app
    that configured logging itself keeps its configuration)."""
    ours = logging.getLogger("fedcomp")
    if ours.hasHandlers():
        return
    for handler in logging.getLogger("flwr").handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.INFO)


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


def fail_if_diverged(rounds: list[dict[str, Any]]) -> None:
    """A global model whose central loss or accuracy stopped being finite diverged (the
    rounds after it cannot have learned anything), and so did one whose last loss is
    still DIVERGING_FACTOR times its reference or more."""
    bad = next((r for r in rounds if r.get("nonfinite_metrics")), None)
    if bad is not None:
        raise RunFailed(
            f"the global model diverged: its central {', '.join(bad['nonfinite_metrics'])} "
            f"became non-finite at round {bad['round']}. {_ADVICE}"
        )
    if rounds and (rounds[-1].get("loss_growth") or 0.0) >= DIVERGING_FACTOR:
        last = rounds[-1]
        first = next(r for r in rounds if r.get("loss_growth"))
        raise RunFailed(
            f"the global model diverged: its central loss ended at {last['loss']:.4g}, "
            f"{last['loss_growth']:.0f}x the initial one (growing since round "
            f"{first['round']}). {_ADVICE}"
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


def likely_causes(codec_json: str, strategy_name: str) -> str:
    """The likely causes of a run that did not learn, given what it ran."""
    codec = json.loads(codec_json)
    if is_sparse(codec) and strategy_name.lower() in COORDINATEWISE_ROBUST:
        return (
            f"{strategy_name}'s coordinate-wise median or trimmed mean of sparse updates "
            "is zero almost everywhere: use a dense codec or a mean-based strategy."
        )
    if codec.get("name") == "randk" or codec.get("inner") == "randk":
        return (
            "random-k scales each kept coordinate by numel / k: unbiased, but its variance "
            "makes the steps far too large; use ef_topk or sparseq instead."
        )
    return (
        "Likely causes: too much compression for this task (codec, downlink), a "
        "learning rate too high or too low, or too few rounds."
    )
