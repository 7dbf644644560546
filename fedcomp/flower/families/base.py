"""The interface every codec family implements, and what its two halves exchange.

A family is a protocol between the mod and the wrapper: how a client turns its update
into payloads (the client half, :meth:`Family.encode`) and how the server turns one
reply's payloads back into that client's update (the server half,
:class:`ServerHalf`). The mod and the wrapper call these without knowing which family
they hold; a codec names its family (its ``family`` attribute) and
fedcomp.flower.families.family_of builds it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedcomp.codecs import Codec, TensorPolicy
from fedcomp.flower.memory_state import MemoryState
from fedcomp.rng import derive_seed


@dataclass
class Encoded:
    """What encoding one reply produced (payloads, and for memories the new state)."""

    payloads: dict[str, bytes]
    inputs: dict[str, torch.Tensor]  # what the codec was asked to encode (error metric)
    memory: MemoryState | None = None
    pending: dict[str, np.ndarray] = field(default_factory=dict)
    pending_version: int = 0
    header: dict[str, int | str] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class Instruction:
    """What the mod reads from one train instruction."""

    config: ConfigRecord
    codec: Any
    policy: TensorPolicy
    stable_id: int
    round: int
    run_seed: int
    global_record: ArrayRecord
    #: The round's public plan, for families that have one (the joint code).
    plan: Any = None

    def seeds(self, names) -> dict[str, int]:
        """Each tensor's public seed: (run seed, round, stable id, tensor name)."""
        return {n: derive_seed(self.run_seed, self.round, self.stable_id, n) for n in names}


@dataclass
class DecodedUpdate:
    """One reply's update as the server half decoded it."""

    deltas: dict[str, np.ndarray]
    #: Per tensor, the codec it travelled with.
    codecs: dict[str, str]
    #: Joint codes: the checked payloads, decoded together at hand-over.
    #: Summed codes: the checked sketch tables (float64), summed at hand-over.
    joint: dict[str, bytes | np.ndarray] = field(default_factory=dict)
    #: Residual memory: the mirror the reply moves its client to (stored on accept).
    pending: Any = None
    #: Residual memory: the reply's sync mode.
    sync: int = 0


class RoundPlan(Protocol):
    """A round's public plan, made by the server half before the instructions leave."""

    def fields(self, stable_id: int) -> Mapping[str, int | float | bytes]:
        """The plan's fields in this client's train instruction."""
        ...


LoadMemory = Callable[[], MemoryState]
#: One reply's payloads by tensor, in model order (views into its bundle).
Payloads = Mapping[str, bytes | memoryview]


class ServerHalf:
    """A family's server half. The defaults are the stateless family's: nothing
    planned, nothing to commit, no state across rounds."""

    #: Replies are decoded only together (the hand-off's mean is the family's own):
    #: no per-reply norm, no clipping, no release of dense updates between passes.
    joint: bool = False
    #: Residual memory: the mirrors (their statistics go into the round record).
    cv: Any = None

    def plan(self, state: Any, selected: list[int], policy: TensorPolicy) -> None:
        """Before the round's instructions leave (the joint code's public plan)."""

    def decode(
        self, payloads: Payloads, header: ConfigRecord, stable_id: int, state: Any
    ) -> DecodedUpdate:
        raise NotImplementedError

    def commit(self, pending: Any) -> None:
        """An accepted reply's state change (the residual mirror)."""

    def accepted(self, stable_id: int, weight: float) -> None:
        """A reply was accepted with this weight (its claimed examples, bounded)."""

    def resync_requested(self, stable_id: int) -> bool:
        return False

    def reducer(self) -> Any:
        """The family's own mean for the pre-aggregated hand-off (None: the settings')."""
        return None

    def mirrors_in_memory(self) -> bool:
        """Whether the family keeps one dense array per client in memory."""
        return False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


class Family:
    """A codec family: the codec, its client half (``encode``, ``read_plan``) and the
    factory of its server half (``server``)."""

    #: The server sends its tensor policy, so both halves pick the same tensors.
    sends_policy: bool = False

    def __init__(self, codec: Any) -> None:
        self.codec = codec

    def read_plan(
        self, policy: TensorPolicy, config: ConfigRecord, global_record: ArrayRecord
    ) -> Any:
        """The round's public plan from a train instruction (None: the family has none)."""
        return None

    def encode(
        self,
        instruction: Instruction,
        deltas: dict[str, torch.Tensor],
        load_memory: LoadMemory,
        fp32: Codec,
    ) -> Encoded:
        raise NotImplementedError

    def server(
        self, policy: TensorPolicy | None, run_seed: int, mirror_dir: str | None
    ) -> ServerHalf:
        raise NotImplementedError
