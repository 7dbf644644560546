"""Residual compression's protocol, both halves: the client's reply (sync mode, the
encoded residual, the h it leads to) and the server's per-client mirrors.

The client half (:func:`choose_sync`, :func:`encode_residual`, :func:`residual_header`)
is what the residual family's client half (fedcomp.flower.families.residual) runs on
the tensors the policy compresses; the server half
(``MirrorStore``, ``ControlVariateServer``) reconstructs the same updates and keeps the
same h. Both update h with the same float32 expression (``apply_residual``).

``MirrorStore`` keeps one mirror h_m per stable client id, in memory or in a directory
(one ``.npz`` per client, written atomically), so cross-device runs are not bounded by
RAM: the store costs clients x model size (x4 bytes in float32). ``ControlVariateServer``
applies the protocol: a reply is decoded against the mirror only when its version and
checksum match; otherwise the client is asked to resync (a full-precision update that
resets both copies), and nothing is ever decoded against the wrong h_m.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedcomp.codecs.base import Codec
from fedcomp.codecs.policy import TensorPolicy, encode_all
from fedcomp.codecs.residual import (
    SYNC_FULL,
    SYNC_NORMAL,
    SYNC_RESTART,
    ResidualMemory,
    apply_residual,
    state_checksum,
)
from fedcomp.codecs.wire import Payload
from fedcomp.failures import Failure, Rejection
from fedcomp.keys import (
    KEY_CV_CHECKSUM,
    KEY_CV_VERSION,
    KEY_RESYNC,
    METRIC_CV_BIAS,
    METRIC_CV_BOUND,
    METRIC_CV_DELTA,
    METRIC_CV_NOISE,
    METRIC_CV_RESIDUAL,
)
from fedcomp.npzfile import write_npz_atomic

# --- client half ---------------------------------------------------------------------


def covered_tensors(
    deltas: Mapping[str, torch.Tensor], policy: TensorPolicy, inner: Codec
) -> set[str]:
    """The tensors under the control variate: those the policy compresses."""
    return {n for n, d in deltas.items() if policy.codec_for(d, inner) is inner}


def choose_sync(
    *,
    version: int,
    h: Mapping[str, np.ndarray],
    covered: set[str],
    shapes: Mapping[str, tuple[int, ...]],
    resync_asked: bool,
    bootstrap: str,
) -> int:
    """What this reply is: a normal residual, a full-precision resync, or a restart.

    No usable state (a new device, wiped state, a changed model) restarts in this very
    reply, from h = 0 or with a full-precision resync (the bootstrap setting); a server
    that asks for a resync always gets full precision.
    """
    stateless = version == 0 or set(h) != covered or any(h[n].shape != shapes[n] for n in covered)
    if resync_asked:
        return SYNC_FULL
    if stateless:
        return SYNC_FULL if bootstrap == "fp32" else SYNC_RESTART
    return SYNC_NORMAL


def encode_residual(
    memory: ResidualMemory,
    policy: TensorPolicy,
    deltas: Mapping[str, torch.Tensor],
    seeds: Mapping[str, int],
    h: Mapping[str, np.ndarray],
    covered: set[str],
    *,
    full: bool,
    fp32: Codec,
) -> tuple[dict[str, bytes], dict[str, np.ndarray], dict[str, float]]:
    """Encode delta - h on the covered tensors (h = 0 where absent); the other tensors
    as the policy says (raw ones never against h). Returns the payloads, the h each
    covered tensor leads to, and the statistics (||delta - h||^2, ||delta||^2, the
    noise, omega ||r||^2). ``full`` sends the covered tensors in ``fp32`` and sets
    h = delta (alpha = 1)."""
    pending: dict[str, np.ndarray] = {}
    stats = dict.fromkeys(
        (METRIC_CV_RESIDUAL, METRIC_CV_DELTA, METRIC_CV_NOISE, METRIC_CV_BOUND), 0.0
    )

    def compress(name: str, delta: torch.Tensor) -> Payload:
        if name not in covered:  # compressed, but not under the control variate
            return memory.inner.encode(delta, seed=seeds[name])
        delta_np = delta.to(torch.float32).numpy()
        delta2 = float(np.square(delta_np, dtype=np.float64).sum())
        stats[METRIC_CV_DELTA] += delta2
        if full:
            payload = fp32.encode(delta, seed=seeds[name])
            pending[name] = apply_residual(None, fp32.decode(payload).numpy(), 1.0)
            stats[METRIC_CV_RESIDUAL] += delta2
        else:
            base = h.get(name)
            payload, r_hat = memory.encode(delta, base, seed=seeds[name])
            r = delta_np if base is None else delta_np - base
            r2 = float(np.square(r, dtype=np.float64).sum())
            pending[name] = apply_residual(base, r_hat, memory.alpha_for(delta.numel()))
            stats[METRIC_CV_RESIDUAL] += r2
            stats[METRIC_CV_NOISE] += float(np.square(r_hat - r, dtype=np.float64).sum())
            stats[METRIC_CV_BOUND] += memory.noise_bound(r2, delta.numel())
            if memory.bias_draws:
                x = torch.from_numpy(r).to(delta.dtype)
                stats[METRIC_CV_BIAS] = stats.get(METRIC_CV_BIAS, 0.0) + memory.bias_estimate(
                    x, seeds[name]
                )
        return payload

    payloads = encode_all(memory.inner, policy, deltas, seeds, compress)
    if math.isinf(stats[METRIC_CV_BOUND]):
        del stats[METRIC_CV_BOUND]  # the inner codec claims no omega: no bound to state
    return payloads, pending, stats


def residual_header(sync: int, version: int, h: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The reply header fields the server checks its mirror against."""
    normal = sync == SYNC_NORMAL
    return {
        KEY_CV_VERSION: version if normal else 0,
        # Not "": Flower's ConfigRecord.count_bytes raises on empty strings.
        KEY_CV_CHECKSUM: state_checksum(h) if normal else "none",
        KEY_RESYNC: sync,
    }


# --- server half ---------------------------------------------------------------------


@dataclass
class Mirror:
    """One client's control variate as the server sees it."""

    version: int
    arrays: dict[str, np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


class MirrorStore:
    """Mirrors keyed by stable client id; on disk when ``directory`` is given."""

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = Path(directory) if directory is not None else None
        self._memory: dict[int, Mirror] = {}
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, stable_id: int) -> Path:
        assert self.directory is not None
        return self.directory / f"client-{stable_id}.npz"

    def get(self, stable_id: int) -> Mirror | None:
        if self.directory is None:
            return self._memory.get(stable_id)
        path = self._path(stable_id)
        if not path.exists():
            return None
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files if k != "__version__"}
            return Mirror(int(data["__version__"]), arrays)

    def put(self, stable_id: int, mirror: Mirror) -> None:
        if self.directory is None:
            self._memory[stable_id] = mirror
            return
        write_npz_atomic(
            self._path(stable_id), {"__version__": np.int64(mirror.version), **mirror.arrays}
        )

    def drop(self, stable_id: int) -> None:
        if self.directory is None:
            self._memory.pop(stable_id, None)
        else:
            self._path(stable_id).unlink(missing_ok=True)

    def ids(self) -> list[int]:
        if self.directory is None:
            return sorted(self._memory)
        return sorted(int(p.stem.split("-", 1)[1]) for p in self.directory.glob("client-*.npz"))

    def nbytes(self) -> int:
        """Bytes held by all mirrors (their arrays)."""
        return sum(m.nbytes for sid in self.ids() if (m := self.get(sid)) is not None)

    def state_dict(self) -> dict[str, Any]:
        return {
            str(sid): {"version": m.version, "arrays": {k: v.copy() for k, v in m.arrays.items()}}
            for sid in self.ids()
            if (m := self.get(sid)) is not None
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for sid in self.ids():
            self.drop(sid)
        for sid, entry in state.items():
            arrays = {k: np.array(v, dtype=np.float32) for k, v in entry["arrays"].items()}
            self.put(int(sid), Mirror(int(entry["version"]), arrays))


class ResyncRequired(Rejection):
    """The reply cannot be decoded against the server's mirror; the client must resync."""

    default_kind = Failure.RESYNC


@dataclass
class PendingMirror:
    """The mirror an accepted reply moves a client to (stored by ``commit``)."""

    stable_id: int
    mirror: Mirror
    #: A full-precision resync: it also answers a pending resync request.
    resync: bool = False


class ControlVariateServer:
    """Reconstruct ghat_m = h_m + decode(q_m) (ef21: the new mirror) and keep the
    mirrors in step.

    Parameters
    ----------
    memory : ResidualMemory
        The residual memory (it gives the per-tensor alpha, identical on both sides).
    store : MirrorStore
        Where the mirrors live.
    """

    def __init__(self, memory: ResidualMemory, store: MirrorStore | None = None) -> None:
        self.memory = memory
        self.store = store or MirrorStore()
        #: Clients that must send a full-precision resync in their next reply.
        self.resync_requested: set[int] = set()

    def prepare(
        self,
        stable_id: int,
        decoded: Mapping[str, np.ndarray],
        *,
        version: int,
        checksum: str,
        sync: int,
    ) -> tuple[dict[str, np.ndarray], PendingMirror]:
        """The client's update from its decoded residuals (or its resync update), and
        the mirror it leads to, NOT yet stored.

        ``decoded`` holds only the tensors under the control variate (the policy's
        compressed tensors). ``sync`` says what the reply is (SYNC_NORMAL, SYNC_FULL,
        SYNC_RESTART). The wrapper commits the mirror only once the reply is accepted
        (a reply rejected later, e.g. as an outlier, leaves the mirror where the
        client's committed state is). On a mismatch, :class:`ResyncRequired` is raised
        and the client is asked for a full-precision resync.
        """
        ghat = {k: v.astype(np.float32, copy=False) for k, v in decoded.items()}
        if sync == SYNC_FULL:
            arrays = {k: apply_residual(None, v, 1.0) for k, v in decoded.items()}
            return ghat, PendingMirror(stable_id, Mirror(1, arrays), resync=True)
        if sync == SYNC_RESTART:  # against h = 0: the client had no state
            if stable_id in self.resync_requested:
                raise ResyncRequired("a full-precision resync was requested, got a restart")
            arrays = {
                k: apply_residual(None, v, self.memory.alpha_for(v.size))
                for k, v in decoded.items()
            }
            return self._estimate(ghat, arrays), PendingMirror(stable_id, Mirror(1, arrays))
        if sync != SYNC_NORMAL:  # the client's state is unknown: start both over
            self.resync_requested.add(stable_id)
            raise ResyncRequired(f"unknown sync mode {sync!r}: resync requested")
        mirror = self._matching_mirror(stable_id, decoded, version, checksum)
        ghat, updated = {}, {}
        for name, r_hat in decoded.items():
            h = mirror.arrays[name]
            ghat[name] = (h + r_hat.astype(np.float32, copy=False)).astype(np.float32)
            updated[name] = apply_residual(h, r_hat, self.memory.alpha_for(h.size))
        return self._estimate(ghat, updated), PendingMirror(
            stable_id, Mirror(mirror.version + 1, updated)
        )

    def _estimate(
        self, unbiased: dict[str, np.ndarray], mirror: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """The client's update: h + decode(q) (residual), or the new mirror (ef21)."""
        return mirror if self.memory.estimate_is_mirror else unbiased

    def _matching_mirror(
        self, stable_id: int, decoded: Mapping[str, np.ndarray], version: int, checksum: str
    ) -> Mirror:
        """The mirror a normal reply was encoded against, or ResyncRequired."""
        mirror = self.store.get(stable_id)
        problem = None
        if mirror is None:
            problem = "the server has no control variate for this client"
        elif mirror.version != version:
            problem = f"version {version!r} != server's {mirror.version}"
        elif set(mirror.arrays) != set(decoded):
            problem = "tensor names differ from the server's control variate"
        elif state_checksum(mirror.arrays) != checksum:
            problem = "checksum differs from the server's control variate"
        if problem is not None:
            self.resync_requested.add(stable_id)
            raise ResyncRequired(f"control variate mismatch ({problem}): resync requested")
        assert mirror is not None
        return mirror

    def commit(self, pending: PendingMirror) -> None:
        """Store the mirror of an accepted reply."""
        self.store.put(pending.stable_id, pending.mirror)
        if pending.resync:
            self.resync_requested.discard(pending.stable_id)

    def state_dict(self) -> dict[str, Any]:
        return {"mirrors": self.store.state_dict(), "resync": sorted(self.resync_requested)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.store.load_state_dict(state["mirrors"])
        self.resync_requested = {int(s) for s in state["resync"]}
