"""What one round carries between the wrapper's collaborators."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Message, MetricRecord

from fedcomp.controlvariates import PendingMirror
from fedcomp.flower.joint import JointRound
from fedcomp.results import RoundCounts
from fedcomp.traffic import Traffic


@dataclass
class Decoded:
    """One accepted-so-far reply, decoded."""

    stable_id: int
    deltas: dict[str, np.ndarray]
    weight: float
    metrics: MetricRecord
    message: Message
    #: Joint codes: the checked one-bit payloads, decoded together at hand-over.
    joint: dict[str, bytes] = field(default_factory=dict)
    #: Residual memory: the mirror this reply moves the client to, stored only once
    #: the reply is accepted (after the outlier check).
    pending: PendingMirror | None = None
    #: Residual memory: the reply's sync mode.
    sync: int = 0
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
