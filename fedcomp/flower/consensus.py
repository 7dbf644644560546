"""The round's consensus step, for the trust region of fedcomp.flower.bounds.

The consensus is c = sum_i f_i clip_R(u_i) / sum_i f_i over the round's accepted
updates: each decoded update clipped to the radius R, weighted by its client's room f_i
(fedcomp.influence.room_of; 1 for every client with no strikes). R is the last round's
reference norm, known before any reply arrives, so the streaming hand-off sums the
consensus while it first decodes the replies (:class:`ConsensusSum`, like the plain
mean's Presum) and no reply is decoded again for it; in a run's first round R is the
round's own reference and the sum takes a pass of its own (:func:`consensus_pass`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class ConsensusSum:
    """The consensus summed one update at a time, in stable-id order.

    ``radius``: R; ``room``: each client's room (absent: 1). The sum is float64, so
    the order of the additions moves it by rounding only.
    """

    radius: float
    room: Callable[[int], float]
    members: list[int] = field(default_factory=list)
    total: float = 0.0
    sums: dict[str, torch.Tensor] = field(default_factory=dict)

    def add(self, stable_id: int, update: Mapping[str, np.ndarray], norm: float) -> None:
        """Add ``f clip_R(u)`` (``norm``: ||u||, measured by the caller)."""
        self.members.append(stable_id)  # listed first: a half-added sum never matches
        f = self.room(stable_id)
        factor = f * (self.radius / norm if norm > self.radius else 1.0)
        self.total += f
        for name, value in update.items():
            if value.dtype.kind != "f":
                continue
            x = torch.from_numpy(np.ascontiguousarray(value)).to(torch.float64)
            if name in self.sums:
                self.sums[name].add_(x, alpha=factor)
            else:
                self.sums[name] = x * factor

    def matches(self, stable_ids: list[int]) -> bool:
        """Whether this is the sum over exactly these clients (none set aside since)."""
        return self.members == stable_ids

    def mean(self) -> dict[str, np.ndarray]:
        """c, per floating tensor, in float64 (zeros: no update was added)."""
        if self.total <= 0:
            return {k: np.zeros_like(v.numpy()) for k, v in self.sums.items()}
        return {k: v.numpy() / self.total for k, v in self.sums.items()}


def consensus_pass(
    loads: list[Callable[[], Mapping[str, np.ndarray]]],
    stable_ids: list[int],
    norms: list[float],
    radius: float,
    room: Callable[[int], float],
) -> dict[str, np.ndarray]:
    """The consensus over updates loaded one at a time (a released update is decoded
    again for it)."""
    summed = ConsensusSum(radius, room)
    for load, sid, norm in zip(loads, stable_ids, norms, strict=True):
        summed.add(sid, load(), norm)
    return summed.mean()
