"""How far one reply may move the round: outliers set aside, weights capped, norms clipped.

The rules are fedcomp.influence's pure functions; this module applies them to a
round's decoded replies, in the order the wrapper uses (docs/reliability.md):
outliers are rejected before acknowledgement, caps and clips apply to what remains.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fedcomp.failures import Failure
from fedcomp.flower.rejection import reject
from fedcomp.flower.round_state import Decoded, RoundState
from fedcomp.flower.validation import ReplyError
from fedcomp.influence import (
    Influence,
    clip_scales,
    outliers,
    reference_norm,
    total_weight_is_finite,
    update_norm,
    weight_cap,
)
from fedcomp.keys import KEY_NUM_EXAMPLES

log = logging.getLogger("fedcomp.flower.strategy")  # one logger for the wrapper's lines


def norm_of(item: Decoded) -> float:
    """A decoded update's L2 norm (measured at decoding when it was released)."""
    return item.norm if item.norm is not None else update_norm(item.deltas)


def drop_outliers(decoded: list[Decoded], state: RoundState, factor: float) -> list[Decoded]:
    """Reject replies whose update norm is beyond ``factor`` x the round's reference."""
    norms = [norm_of(d) for d in decoded]
    kept = []
    for item, norm, out in zip(decoded, norms, outliers(norms, factor), strict=True):
        if out:
            exc = ReplyError(
                f"update norm {norm:.3g} is beyond {factor:g} x the round's median",
                Failure.OUTLIER,
            )
            reject(state, item.stable_id, exc)
        else:
            kept.append(item)
    return kept


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


@dataclass
class InfluenceBounds:
    """The caps of :class:`~fedcomp.influence.Influence` with the one thing they carry
    across rounds: the last round's reference norm, which a round with a single reply
    is clipped against (checkpointed)."""

    influence: Influence
    #: Norms are not clipped for joint codes: their replies are decoded only together.
    clip: bool = True
    reference_norm: float | None = None

    def apply(self, decoded: list[Decoded], state: RoundState) -> bool:
        """Cap weights and clip norms; False when there is nothing to hand over: no
        reply, or a total weight that is not finite (the model is kept; the accepted
        replies' mirrors still move, as they were acknowledged)."""
        state.record.capped = cap_weights(decoded, self.influence.weight_cap)
        if self.clip:
            state.record.clipped, reference, state.record.norm_ratio = clip_norms(
                decoded, self.influence.norm_cap, self.reference_norm
            )
            self.reference_norm = reference or self.reference_norm
        if decoded and not total_weight_is_finite([d.weight for d in decoded]):
            log.error("round %d: the total weight is not finite; the model is kept", state.number)
            state.record.aggregate_nonfinite = 1
            return False
        return bool(decoded)
