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
    from fedcomp.flower.families.joint import JointRound


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
    #: Joint codes: the checked one-bit payloads, decoded together at hand-over.
    joint: dict[str, bytes] = field(default_factory=dict)
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
    #: Norm clipping of a released update, applied when it is loaded.
    scale: float = 1.0

    def load(self) -> dict[str, np.ndarray]:
        """The decoded update (clipped), decoding it again when it was released."""
        if self.reload is None:
            return self.deltas
        deltas = self.reload()
        if self.scale == 1.0:
            return deltas
        return {
            k: (v * self.scale).astype(v.dtype) if v.dtype.kind == "f" else v
            for k, v in deltas.items()
        }


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
            and all(d.scale == 1.0 for d in decoded)
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
    joint: JointRound | None = None
    #: Every message of the round, both ways, by kind.
    traffic: Traffic = field(default_factory=Traffic)
    #: The plain mean summed during the first decode (streaming hand-off only).
    presum: Presum | None = None
