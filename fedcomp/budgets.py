"""Bit budgets that change over the rounds and across clients: DAdaQuant's two rules
(Hoenig, Zhao and Mullins 2022), written for EDEN's error curve, for the adaptive codec
(fedcomp.codecs.adaptive, whose clients share a reply's budget among its tensors).

Over the rounds (DAdaQuant's time-adaptive quantization): the budget starts low and
rises by one bit (DAdaQuant doubles the quantization levels: one more bit) whenever the
server's loss has not reached a new minimum for ``patience`` rounds, up to a cap. Early
rounds, whose updates are large and noisy, get few bits; late ones, where the error of
the code is what is left, get more.

Across clients (its client-adaptive quantization): the weighted mean sum_i p_i x_i of
the clients' coded updates has error sum_i p_i^2 nu(b_i) ||x_i||^2. With EDEN's
normalized error nu(b) ~ c 4^-b (0.571, 0.133, 0.034, 0.0087 at 1-4 bits) and equal
norms, minimizing it at a fixed mean budget b gives b_i = b + log2 p_i - mean_j log2 p_j
(DAdaQuant's q_i ~ p_i^(2/3) is the same derivation on QSGD's curve): a client with
twice the weight gets one more bit. Within the allowed widths' range [low, high] the
minimizer is b_i = clamp(c + log2 p_i) with the one c that keeps the mean (found by
bisection: the mean of the clamps rises with c).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def weight_budgets(
    mean: float, weights: Mapping[int, float], low: float, high: float
) -> dict[int, float]:
    """Each client's budget clamp(c + log2 w_i, low, high), their mean ``mean`` (which
    must lie in [low, high]): without clamps, c = mean - mean_j log2 w_j."""
    if not weights:
        return {}
    if not low <= mean <= high:
        raise ValueError(f"mean budget {mean!r} is not in [{low}, {high}]")
    if mean in (low, high):  # the only budgets with that mean: every client there
        return dict.fromkeys(weights, float(mean))
    logs = {sid: math.log2(w) for sid, w in weights.items()}

    def spread(c: float) -> dict[int, float]:
        return {sid: min(high, max(low, c + v)) for sid, v in logs.items()}

    lo, hi = low - max(logs.values()), high - min(logs.values())  # all low .. all high
    for _ in range(200):  # the mean of the clamps is continuous and rises with c
        mid = 0.5 * (lo + hi)
        if sum(spread(mid).values()) < mean * len(logs):
            lo = mid
        else:
            hi = mid
    return spread(0.5 * (lo + hi))


@dataclass
class LossSchedule:
    """The budget over the rounds: ``start``, one bit more after ``patience`` rounds
    without a new lowest loss, never above ``cap``."""

    start: float
    cap: float
    patience: int
    budget: float = math.nan
    best: float = math.inf
    since: int = 0
    #: The last round whose loss was observed (a round is counted once).
    observed: int = 0

    def __post_init__(self) -> None:
        if math.isnan(self.budget):
            self.budget = self.start

    def observe(self, server_round: int, loss: float | None) -> float:
        """The budget for ``server_round``, given the loss of the round before (None:
        no evaluation, the budget stays)."""
        if loss is None or not math.isfinite(loss) or server_round <= self.observed:
            return self.budget
        self.observed = server_round
        if loss < self.best:
            self.best, self.since = loss, 0
            return self.budget
        self.since += 1
        if self.since >= self.patience and self.budget < self.cap:
            self.budget, self.since = min(self.cap, self.budget + 1.0), 0
        return self.budget

    def state_dict(self) -> dict[str, Any]:
        best = self.best if math.isfinite(self.best) else None
        return {"budget": self.budget, "best": best, "since": self.since, "observed": self.observed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.budget, self.since = float(state["budget"]), int(state["since"])
        self.best = math.inf if state["best"] is None else float(state["best"])
        self.observed = int(state["observed"])
