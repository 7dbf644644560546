"""What the wrapper checks around the inner strategy and at the end of a run: influence
caps before aggregation, the model's dtypes and finiteness after it, and the run's
outcome (nothing learned, diverged), made loud."""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord

from fedcomp.failures import RunFailed
from fedcomp.flower.round_state import Decoded
from fedcomp.influence import clip_scales, update_norm, weight_cap
from fedcomp.keys import KEY_NUM_EXAMPLES

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


def clip_norms(decoded: list[Decoded], factor: float) -> int:
    """Scale updates beyond ``factor`` x the median norm down to it; return how many
    (clipping, not rejection: a residual mirror has already moved with the reply)."""
    norms = [norm_of(d) for d in decoded]
    clipped = 0
    for item, norm, scale in zip(decoded, norms, clip_scales(norms, factor), strict=True):
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
    return clipped


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


def fail_if_nothing_learned(rounds: list[dict[str, Any]]) -> None:
    """A run in which no round accepted a single reply cannot have learned: say so
    loudly, with what the replies were rejected for, instead of ending as a success."""
    if not rounds or any(r["replied"] > 0 for r in rounds):
        return
    rejected: Counter[str] = Counter()
    for record in rounds:
        rejected.update(record.get("rejected", {}))
        rejected.update({k: v for k, v in record["faults"].items() if k != "rejected_reply"})
    reasons = ", ".join(f"{k} {v}" for k, v in rejected.most_common()) or "no replies at all"
    raise RunFailed(
        f"no reply was accepted in any of the {len(rounds)} round(s): the model never "
        f"changed. Failures by kind: {reasons}. Check that the ClientApp has "
        "fedcomp.flower.CompressionMod and the logs' rejected replies."
    )
