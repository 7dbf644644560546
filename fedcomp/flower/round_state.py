"""What one round carries between the wrapper's collaborators."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ConfigRecord, Message, MetricRecord

from fedcomp.aggregate import RunningMean
from fedcomp.controlvariates import PendingMirror
from fedcomp.results_file import RoundCounts
from fedcomp.traffic import Traffic

if TYPE_CHECKING:  # the joint family's module imports the reply checks, which import this
    from fedcomp.flower.consensus import ConsensusSum
    from fedcomp.flower.families.joint import JointRound
    from fedcomp.flower.families.stateless import BudgetRound


@dataclass
class Decoded:
    """One accepted-so-far reply, decoded."""

    stable_id: int
    deltas: dict[str, np.ndarray]
    weight: float
    metrics: MetricRecord
    message: Message
    #: The checked header and payloads (views into the reply's bundle): a reply decoded
    #: again (streaming) is not validated again.
    header: ConfigRecord = field(default_factory=ConfigRecord)
    payloads: dict[str, memoryview] = field(default_factory=dict)
    #: The bytes those payloads took in the message (validation.CheckedReply.sent_bytes).
    codec_bytes: int = 0
    #: Joint codes: the checked one-bit payloads, decoded together at hand-over.
    joint: dict[str, bytes | np.ndarray] = field(default_factory=dict)
    #: Residual memory: the mirror this reply moves the client to, stored only once
    #: the reply is accepted (after the outlier check).
    pending: PendingMirror | None = None
    #: Residual memory: the reply's sync mode.
    sync: int = 0
    #: Residual memory, streaming: the pending mirror was released with the update and
    #: is committed after the mean, decoded once more (ReplyDecoder.commit_deferred).
    deferred: bool = False
    #: Streaming hand-off: the update's L2 norm, measured when it was first decoded,
    #: then ``deltas`` is released and ``reload`` decodes the payload again when the
    #: reducer adds it (one dense update alive at a time; docs/trees.md).
    norm: float | None = None
    reload: Callable[[], dict[str, np.ndarray]] | None = None
    #: Influence bounds, applied when the update is loaded (a released update) or
    #: once all of them are decided (:meth:`settle`): a scale (norm clipping, the
    #: trust region's) and a shift along the round's consensus direction
    #: (fedcomp.flower.bounds). ``bounded``: whether any of them changed the update.
    scale: float = 1.0
    shift: tuple[float, dict[str, np.ndarray]] | None = None
    bounded: bool = False

    def load(self) -> dict[str, np.ndarray]:
        """The decoded update (bounded), decoding it again when it was released."""
        deltas = self.deltas if self.reload is None else self.reload()
        return _bounded(deltas, self.scale, self.shift)

    def rescale(self, factor: float) -> None:
        """Scale the update by ``factor`` (norm clipping)."""
        self.scale *= factor
        self.bounded = True

    def steer(self, factor: float, along: float, unit: dict[str, np.ndarray]) -> None:
        """Make the update ``factor * u + along * unit`` (``unit``: its floating
        tensors; once a round: the consensus trust region)."""
        assert self.shift is None, "one consensus shift a round"
        self.scale *= factor
        self.shift = (along, unit) if along != 0.0 else None
        self.bounded = True

    def settle(self) -> None:
        """Apply the bounds to an update held in memory (a released one gets them when
        it is loaded): both compute ``_bounded`` on the decoded update, bit for bit."""
        if self.reload is None and (self.scale != 1.0 or self.shift is not None):
            self.deltas = _bounded(self.deltas, self.scale, self.shift)
            self.scale, self.shift = 1.0, None


def _bounded(
    deltas: dict[str, np.ndarray], scale: float, shift: tuple[float, dict[str, np.ndarray]] | None
) -> dict[str, np.ndarray]:
    """``scale * u + along * unit`` per floating tensor (computed in float64, stored in
    the update's dtype); integer buffers as they are."""
    if scale == 1.0 and shift is None:
        return deltas
    out = {}
    for k, v in deltas.items():
        if v.dtype.kind != "f":
            out[k] = v
            continue
        value = v.astype(np.float64) * scale
        if shift is not None and k in shift[1]:
            value += shift[0] * shift[1][k].astype(np.float64)
        out[k] = value.astype(v.dtype)
    return out


@dataclass
class Presum:
    """The plain mean's running sum, taken while the replies are first decoded.

    The total weight is the one the replies claimed before any was decoded, and the
    sum runs in stable-id order: if every one of them is then accepted with its
    weight unchanged and unclipped, this IS the mean the reducer would compute (the
    same operations in the same order), and the second decode of every reply is
    saved; otherwise the reducer discards it and sums again (docs/trees.md).
    """

    running: RunningMean
    members: list[tuple[int, float]] = field(default_factory=list)

    def add(self, stable_id: int, update: dict[str, np.ndarray], weight: float) -> None:
        # Listed first: a sum left half-updated by an error can then never match.
        self.members.append((stable_id, weight))
        self.running.add(update, weight)

    def matches(self, decoded: list[Decoded]) -> bool:
        """Whether this sum is the plain mean of exactly these accepted replies."""
        return (
            self.members == [(d.stable_id, d.weight) for d in decoded]
            and not any(d.bounded for d in decoded)
            and self.running.total == float(sum(d.weight for d in decoded))
        )


@dataclass
class RoundState:
    """Everything one round needs between configure_train and the round's end."""

    number: int
    t_start: float
    global_arrays: dict[str, np.ndarray] = field(default_factory=dict)
    sent: dict[int, Message] = field(default_factory=dict)
    record: RoundCounts = field(default_factory=RoundCounts)
    per_client: dict[int, dict[str, Any]] = field(default_factory=dict)
    tensor_codecs: dict[str, str] = field(default_factory=dict)
    #: The round's public plan, when the family has one (the joint code's JointRound,
    #: the adaptive codec's BudgetRound): per-client fields of the instructions.
    plan: JointRound | BudgetRound | None = None
    #: The server's loss after the round before (None: not evaluated).
    previous_loss: float | None = None
    #: Every message of the round, both ways, by kind.
    traffic: Traffic = field(default_factory=Traffic)
    #: The plain mean summed during the first decode (streaming hand-off only).
    presum: Presum | None = None
    #: The influence bounds' consensus summed during the first decode (streaming;
    #: fedcomp.flower.consensus).
    consensus: ConsensusSum | None = None
