"""A client's memory state in ``Context.state``, with the commit-after-ack rule.

The client keeps two copies: the COMMITTED state (what the server's view agrees with)
and the PENDING state produced by the last reply. The server's next config to this
client names the last round whose reply it accepted (``KEY_ACK_ROUND``); only then
does the pending state become committed. A lost or rejected reply therefore loses
nothing: its pending state is dropped and the committed one is used again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedcomp.npzfile import read_npz_meta, write_npz_meta

STATE_COMMITTED = "fedcomp.memory.committed"
STATE_PENDING = "fedcomp.memory.pending"
STATE_META = "fedcomp.memory.meta"
_NO_ROUND = -1


@dataclass
class MemoryState:
    """One client's memory: committed and pending per-tensor arrays."""

    spec: str = ""
    committed: dict[str, np.ndarray] = field(default_factory=dict)
    pending: dict[str, np.ndarray] = field(default_factory=dict)
    pending_round: int = _NO_ROUND
    #: Version of the committed state (0: none) and of the pending one; the residual
    #: memory sends the committed version so the server can check its mirror.
    version: int = 0
    pending_version: int = 0

    def begin_round(self, ack_round: int, spec: str) -> dict[str, np.ndarray]:
        """Apply the server's acknowledgement; return the state to encode against.

        A different codec spec than the stored one starts from a clean state, and so
        does an ack of -1: the server has accepted no reply of this client in this run
        (resumed runs keep their acks), so whatever is stored (a file left by another
        run in a shared state directory) is not state the server agrees with.
        """
        if spec != self.spec or ack_round < 0:
            self.spec, self.committed, self.version = spec, {}, 0
        elif self.pending_round != _NO_ROUND and ack_round == self.pending_round:
            self.committed, self.version = self.pending, self.pending_version
        self.pending, self.pending_round, self.pending_version = {}, _NO_ROUND, 0
        return self.committed

    def state_dict(self) -> dict[str, object]:
        """A plain, serializable copy (for checkpoints)."""
        return {
            **self.meta(),
            "committed": {k: v.copy() for k, v in self.committed.items()},
            "pending": {k: v.copy() for k, v in self.pending.items()},
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        loaded = MemoryState.from_parts(
            state,
            {k: np.array(v) for k, v in dict(state["committed"]).items()},
            {k: np.array(v) for k, v in dict(state["pending"]).items()},
        )
        self.__dict__.update(loaded.__dict__)

    def stage(self, server_round: int, pending: dict[str, np.ndarray], version: int = 0) -> None:
        """Remember the state this round's reply would lead to, until it is acked."""
        self.pending, self.pending_round, self.pending_version = pending, server_round, version

    def meta(self) -> dict[str, str | int]:
        """The scalar fields, under the one spelling both stores use."""
        return {
            "spec": self.spec,
            "pending_round": self.pending_round,
            "version": self.version,
            "pending_version": self.pending_version,
        }

    @classmethod
    def from_parts(
        cls,
        meta: Mapping[str, Any],
        committed: dict[str, np.ndarray],
        pending: dict[str, np.ndarray],
    ) -> MemoryState:
        """Rebuild from :meth:`meta` and the two array sets (either store)."""
        return cls(
            spec=str(meta["spec"]),
            committed=committed,
            pending=pending,
            pending_round=int(meta["pending_round"]),
            version=int(meta["version"]),
            pending_version=int(meta["pending_version"]),
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the committed and pending arrays (the client's memory overhead)."""
        return sum(a.nbytes for a in (*self.committed.values(), *self.pending.values()))


def _arrays(record: ArrayRecord | None) -> dict[str, np.ndarray]:
    return {} if record is None else {k: np.array(v.numpy()) for k, v in record.items()}


def load_memory(state: RecordDict) -> MemoryState:
    """Read the memory from ``Context.state`` (empty when absent)."""
    meta = state.config_records.get(STATE_META)
    if meta is None:
        return MemoryState()
    return MemoryState.from_parts(
        meta,
        _arrays(state.array_records.get(STATE_COMMITTED)),
        _arrays(state.array_records.get(STATE_PENDING)),
    )


def store_memory(state: RecordDict, memory: MemoryState) -> None:
    """Write the memory into ``Context.state``; call it LAST in the mod (Flower's
    deployment runtime keeps state written before a failure, simulation drops it)."""
    state[STATE_COMMITTED] = ArrayRecord({k: Array(v) for k, v in memory.committed.items()})
    state[STATE_PENDING] = ArrayRecord({k: Array(v) for k, v in memory.pending.items()})
    state[STATE_META] = ConfigRecord(memory.meta())


def memory_path(directory: str | Path, stable_id: int) -> Path:
    return Path(directory) / f"client-{stable_id:06d}.npz"


def save_memory_file(path: str | Path, memory: MemoryState) -> None:
    """Write the memory to a file, atomically (temporary file, then rename): a device
    that restarts, or a resumed simulation, continues from the last complete write."""
    arrays = {f"c/{k}": v for k, v in memory.committed.items()}
    arrays.update({f"p/{k}": v for k, v in memory.pending.items()})
    write_npz_meta(path, memory.meta(), arrays)


def load_memory_file(path: str | Path) -> MemoryState | None:
    """Read a memory file (None when there is none)."""
    saved = read_npz_meta(path)
    if saved is None:
        return None
    meta, arrays = saved
    committed = {k[2:]: v for k, v in arrays.items() if k.startswith("c/")}
    pending = {k[2:]: v for k, v in arrays.items() if k.startswith("p/")}
    return MemoryState.from_parts(meta, committed, pending)
