"""The one-bit code across federated rounds: public seeds, tau and side information.

Pure helpers shared by the client mod and the server wrapper (no Flower import):
the per-tensor public seed, the wire form of the round's tau blocks, and the server's
state between rounds (:class:`JointServerState`: tau per block from the clients' scale
codes, and last round's aggregate as the side-information center).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedcomp.onebit.code import OneBitCode
from fedcomp.onebit.queries import make_geometry
from fedcomp.rng import derive_seed


def joint_seed(run_seed: int, server_round: int, name: str) -> int:
    """The public seed of one tensor's draws in one round (no client id: it is shared)."""
    return derive_seed(run_seed, server_round, "onebit", name)


def pack_taus(taus: Sequence[np.ndarray]) -> bytes:
    """Concatenate per-tensor tau blocks as little-endian float32."""
    if not taus:
        return b""
    return np.concatenate([np.asarray(t, dtype="<f4") for t in taus]).tobytes()


def unpack_taus(buf: bytes, blocks: Sequence[int]) -> list[np.ndarray]:
    """Split packed tau blocks back per tensor (float64 holding float32 values).

    Raises
    ------
    ValueError
        When the length does not match or a tau is not finite and positive.
    """
    values = np.frombuffer(bytes(buf), dtype="<f4")
    if values.size != sum(blocks):
        raise ValueError(f"tau config holds {values.size} values, the model needs {sum(blocks)}")
    if not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise ValueError("tau config holds a non-finite or non-positive value")
    out, start = [], 0
    for count in blocks:
        out.append(values[start : start + count].astype(np.float64))
        start += count
    return out


def out_of_range_fraction(z_abs: np.ndarray, code: OneBitCode) -> float:
    """Fraction of |x / tau| beyond ``L_J / 4`` (they wrap unless the center is near)."""
    if z_abs.size == 0:
        return 0.0
    top = make_geometry(0.0, top=code.top, a0=code.a0, localize=False).top
    return float(np.mean(z_abs > top / 4))


@dataclass
class JointServerState:
    """The server's one-bit state between rounds (saved with the strategy).

    Attributes
    ----------
    taus : dict
        Tensor name -> tau per block (float32-exact float64; the clients get the same
        numbers, so the public-parameter digests agree).
    centers : dict
        Tensor name -> last round's decoded aggregate (``center="previous"``).
    """

    prior: float
    taus: dict[str, np.ndarray] = field(default_factory=dict)
    centers: dict[str, np.ndarray] = field(default_factory=dict)

    def taus_for(self, code: OneBitCode, numels: Mapping[str, int]) -> dict[str, np.ndarray]:
        """This round's tau blocks, starting from the prior for a new (or reshaped) tensor."""
        out = {}
        for name, numel in numels.items():
            blocks = code.num_blocks(numel)
            tau = self.taus.get(name)
            if tau is None or tau.shape != (blocks,):
                tau = np.full(blocks, self.prior)
            out[name] = np.asarray(tau, dtype=np.float32).astype(np.float64)
        return out

    def center_for(self, name: str, numel: int) -> np.ndarray:
        center = self.centers.get(name)
        return center if center is not None and center.size == numel else np.zeros(numel)

    def update(self, name: str, tau: np.ndarray, mean: np.ndarray) -> None:
        self.taus[name] = np.asarray(tau, dtype=np.float64)
        self.centers[name] = np.asarray(mean, dtype=np.float64).reshape(-1)

    def state_dict(self) -> dict[str, Any]:
        return {
            "prior": self.prior,
            "taus": {k: v.tolist() for k, v in self.taus.items()},
            "centers": {k: v.tolist() for k, v in self.centers.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.prior = float(state["prior"])
        self.taus = {k: np.asarray(v, dtype=np.float64) for k, v in state["taus"].items()}
        self.centers = {k: np.asarray(v, dtype=np.float64) for k, v in state["centers"].items()}
