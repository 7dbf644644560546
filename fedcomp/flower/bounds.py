"""How far one reply may move the round: outliers set aside, weights capped, norms
clipped, contributions held to the round's consensus, and each client's strikes.

The rules are fedcomp.influence's pure functions; this module applies them to a
round's decoded replies, in the order the wrapper uses (docs/reliability.md,
"Bounded influence"): outliers are rejected before acknowledgement, the bounds apply to
what remains, and what they cut sets each client's room for the next rounds.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedcomp.failures import Failure
from fedcomp.flower.consensus import ConsensusSum, consensus_pass
from fedcomp.flower.rejection import reject
from fedcomp.flower.round_state import Decoded, RoundState
from fedcomp.flower.validation import ReplyError
from fedcomp.influence import (
    Influence,
    TrustRegion,
    clip_scales,
    consensus_coefficients,
    next_strikes,
    outliers,
    reference_norm,
    robust_reference,
    room_of,
    total_weight_is_finite,
    update_norm,
)
from fedcomp.influence import cap_weights as caps
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


def cap_weights(
    decoded: list[Decoded], factor: float, room: list[float] | None = None
) -> dict[int, float]:
    """Cap num-examples at ``factor`` x the round's lower median claim (times each
    client's room); return the capped clients' kept fractions (stable id -> new / old)."""
    capped = {}
    weights = caps([d.weight for d in decoded], factor, room)
    for item, weight in zip(decoded, weights, strict=True):
        if weight < item.weight:
            capped[item.stable_id] = weight / item.weight
            item.weight = weight
            item.metrics[KEY_NUM_EXAMPLES] = weight  # what the inner strategy weighs by
    return capped


def clip_norms(
    decoded: list[Decoded], factor: float, reference: float | None, room: list[float] | None = None
) -> tuple[dict[int, float], float | None]:
    """Scale updates beyond ``factor`` x ``reference`` down to it; return the clipped
    clients' kept fractions (stable id -> scale) and the largest norm's ratio to the
    reference before clipping (how close the round came to the cap; clipping, not
    rejection: a residual mirror has already moved with the reply)."""
    norms = [norm_of(d) for d in decoded]
    clipped = {}
    for item, norm, scale in zip(
        decoded, norms, clip_scales(norms, factor, reference, room), strict=True
    ):
        if scale != 1.0:
            item.rescale(scale)
            clipped[item.stable_id] = scale
            log.warning(
                "client %s: update norm %.3g clipped to %.3g", item.stable_id, norm, norm * scale
            )
    ratio = max(norms) / reference if reference and norms else None
    return clipped, ratio


def hold_to_consensus(
    decoded: list[Decoded],
    consensus: Mapping[str, np.ndarray],
    region: TrustRegion,
    room: list[float] | None = None,
    floor: float = 0.0,
) -> tuple[dict[int, float], float, int]:
    """Hold each contribution to the weighted mean inside the trust region around the
    round's consensus step ``consensus`` (fedcomp.flower.consensus;
    fedcomp.influence.consensus_coefficients); return the held clients' kept
    fractions (stable id -> ||u'|| / ||u||), the consensus norm C and how many
    updates were loaded again. The region's scale is max(C, ``floor``): near
    convergence the clients' common step shrinks, their differences do not.

    A contribution whose norm is within the region's smallest bound times C (and the
    client's room) is inside it whatever its direction, and is not loaded again; the
    others are loaded once more for their component along the consensus (a released
    update is decoded again for it)."""
    total = sum(d.weight for d in decoded)
    room = room or [1.0] * len(decoded)
    size = float(np.sqrt(sum(float(np.dot(v.ravel(), v.ravel())) for v in consensus.values())))
    unit = {k: (v / size if size > 0 else v).astype(np.float32) for k, v in consensus.items()}
    shares = [d.weight / total for d in decoded]
    norms = [norm_of(d) * d.scale for d in decoded]  # after norm clipping
    smallest = min(region.against, region.along, region.side)
    scale = max(size, floor)
    along, screened = [], []
    for item, share, norm, f in zip(decoded, shares, norms, room, strict=True):
        inside = share * norm <= smallest * scale * f  # whatever its direction
        screened.append(inside)
        along.append(0.0 if inside or size == 0 else _dot(item.load(), unit))
    coefficients = consensus_coefficients(shares, along, norms, scale, region, room)
    held = {}
    for item, (lam, mu), a, norm, inside in zip(
        decoded, coefficients, along, norms, screened, strict=True
    ):
        if inside or (lam == 1.0 and mu == 0.0):
            continue
        item.steer(lam, mu, unit)
        kept = lam * lam * norm * norm + 2 * lam * mu * a + mu * mu
        held[item.stable_id] = math.sqrt(max(kept, 0.0)) / norm if norm > 0 else 0.0
        log.warning(
            "client %s: update held to the round's consensus (x%.3g, %+.3g along it)",
            item.stable_id,
            lam,
            mu,
        )
    return held, size, sum(not inside for inside in screened) if size > 0 else 0


def _raw_loader(item: Decoded):
    """The decoded update before any bound (a released one decoded again)."""
    return (lambda: item.deltas) if item.reload is None else item.reload


def _shrink(kept: dict[int, float], step: dict[int, float]) -> None:
    """Fold one bound's kept fractions into the round's (they compound)."""
    for sid, fraction in step.items():
        kept[sid] = kept.get(sid, 1.0) * fraction


def _dot(update: dict[str, np.ndarray], unit: dict[str, np.ndarray]) -> float:
    """The update's component along the unit vector, summed in float64."""
    return float(
        sum(np.dot(update[k].ravel().astype(np.float64), u.ravel()) for k, u in unit.items())
    )


@dataclass
class InfluenceBounds:
    """The rules of :class:`~fedcomp.influence.Influence` with what they carry across
    rounds (both checkpointed): the last reference norm that did not fall back, which
    a collapsed round or a round with a single reply is clipped against, and each
    client's strikes (fedcomp.influence.next_strikes), which set its room."""

    influence: Influence
    #: Norms are not bounded for joint codes: their replies are decoded only together.
    clip: bool = True
    reference_norm: float | None = None
    strikes: dict[int, float] = field(default_factory=dict)

    def apply(self, decoded: list[Decoded], state: RoundState) -> bool:
        """Cap weights, clip norms, hold contributions to the consensus; False when
        there is nothing to hand over: no reply, or a total weight that is not finite
        (the model is kept; the accepted replies' mirrors still move, as they were
        acknowledged)."""
        rules, record = self.influence, state.record
        room = [self.room(d.stable_id) for d in decoded]
        # What the norm and direction bounds keep of each reply: its strikes. A capped
        # weight is no strike: honest partitions can be this unequal, and a strike would
        # cap such a client harder each round (its share is bounded by the cap anyway).
        kept: dict[int, float] = {}
        capped = cap_weights(decoded, rules.weight_cap, room)
        record.capped, record.bounded["capped"] = len(capped), sorted(capped)
        if decoded and not total_weight_is_finite([d.weight for d in decoded]):
            log.error("round %d: the total weight is not finite; the model is kept", state.number)
            record.aggregate_nonfinite = 1
            return False
        if self.clip and decoded and not self._clip(decoded, state, room, kept):
            return False
        for item in decoded:
            item.settle()
        self._strike(decoded, state, kept)
        return bool(decoded)

    def room(self, stable_id: int) -> float:
        """The share of the bounds this client gets (1.0 without escalation)."""
        if not self.influence.escalation:
            return 1.0
        return room_of(self.strikes.get(stable_id, 0.0))

    def _strike(self, decoded: list[Decoded], state: RoundState, kept: dict[int, float]) -> None:
        """Each accepted client's strikes after this round (escalation), from the
        fraction of its reply the bounds kept."""
        if not self.influence.escalation:
            return
        for item in decoded:
            sid = item.stable_id
            strikes = next_strikes(self.strikes.get(sid, 0.0), kept.get(sid, 1.0))
            if strikes:
                self.strikes[sid] = strikes
            else:
                self.strikes.pop(sid, None)
        state.record.strikes = {sid: s for sid, s in sorted(self.strikes.items()) if s > 0}

    def _clip(
        self, decoded: list[Decoded], state: RoundState, room: list[float], kept: dict[int, float]
    ) -> bool:
        """Clip norms and hold contributions; False: the round is ambiguous (its
        reference collapsed with no earlier one to fall back on) and is not handed over."""
        rules, record = self.influence, state.record
        previous = self.reference_norm  # the consensus radius (fedcomp.flower.consensus)
        norms = [norm_of(d) for d in decoded]
        # Clients that lost half their room or more do not vote on the reference; a
        # single client in good standing among them sets it.
        votes = [n for n, f in zip(norms, room, strict=True) if f >= 0.5] or norms
        if len(votes) == 1 and len(norms) > 1:
            reference, fell_back = votes[0], False
        else:
            reference, fell_back = robust_reference(
                votes, self.reference_norm, rules.collapse_ratio
            )
        if fell_back and len(decoded) > 1 and previous is None:
            # Half the updates near zero, or half huge: with no clean round to fall back
            # on, nothing tells the two halves apart. Clipping against either median
            # would let one half stall or blow up the model: keep it instead.
            record.reference_fallback = 1
            log.error(
                "round %d: the update norms' lower median %.3g is more than %g times below "
                "their upper median (half of them near zero, or half huge) and no earlier "
                "round gives a reference: the model is kept",
                state.number,
                reference_norm(votes) or 0.0,
                rules.collapse_ratio,
            )
            return False
        if fell_back and len(decoded) > 1:
            record.reference_fallback = 1
            log.warning(
                "round %d: the update norms' lower median %.3g is more than %g times below "
                "their upper median (half of them near zero, or half huge): clipped against "
                "an earlier round's reference",
                state.number,
                reference_norm(votes) or 0.0,
                rules.collapse_ratio,
            )
        elif reference is not None:
            self.reference_norm = reference
        record.reference_norm = reference
        clipped, record.norm_ratio = clip_norms(decoded, rules.norm_cap, reference, room)
        record.clipped, record.bounded["clipped"] = len(clipped), sorted(clipped)
        _shrink(kept, clipped)
        if rules.consensus and reference is not None and len(decoded) > 1:
            region = TrustRegion(rules.push_against, rules.push_along, rules.push_side)
            consensus = self._consensus(decoded, state, previous or reference)
            floor = rules.consensus_floor * reference
            held, size, loads = hold_to_consensus(decoded, consensus, region, room, floor)
            record.consensus_loads += loads
            record.consensus_ratio = size / reference if reference > 0 else 0.0
            record.held, record.bounded["held"] = len(held), sorted(held)
            _shrink(kept, held)
        return True

    def start_consensus(self) -> ConsensusSum | None:
        """The consensus sum a streaming round takes while it first decodes its
        replies: with the last round's reference as radius (None: no reference yet, or
        the trust region is off)."""
        if not (self.clip and self.influence.consensus) or self.reference_norm is None:
            return None
        return ConsensusSum(self.reference_norm, self.room)

    def _consensus(
        self, decoded: list[Decoded], state: RoundState, radius: float
    ) -> dict[str, np.ndarray]:
        """The round's consensus: the sum taken while decoding when it holds exactly
        these replies with this radius, else a pass of its own."""
        summed, state.consensus = state.consensus, None
        ids = [d.stable_id for d in decoded]
        if summed is not None and summed.radius == radius and summed.matches(ids):
            return summed.mean()
        state.record.consensus_loads += len(decoded)
        loads = [_raw_loader(d) for d in decoded]
        return consensus_pass(loads, ids, [norm_of(d) for d in decoded], radius, self.room)

    def state_dict(self) -> dict[str, Any]:
        return {
            "reference_norm": self.reference_norm,
            "strikes": [[sid, s] for sid, s in sorted(self.strikes.items())],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.reference_norm = state.get("reference_norm")
        self.strikes = {int(sid): float(s) for sid, s in state.get("strikes", [])}
