"""Residual compression against a per-client control variate (the seed method).

Client m keeps h_m (same shapes as the update) and sends q_m = Q(delta_m - h_m) with an
unbiased codec Q; the server keeps a mirror of h_m and reconstructs
ghat_m = h_m + decode(q_m). Both sides then apply the SAME float32 update from the
decoded residual, h_m <- h_m + alpha * decode(q_m), so client and mirror stay bit-identical
on one platform. The compression noise scales with ||delta_m - h_m||^2 instead of
||delta_m||^2, and h_m tracks delta_m when alpha <= 1 / (1 + omega).

This module holds the pure maths (no flwr): the memory object, the per-tensor alpha,
the update, and the checksum both sides compare. The protocol (versions, acks,
resyncs) is fedcomp.controlvariates (its maths and the server's mirror store) and
fedcomp.flower.families.residual (its two halves on Flower's messages).
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from fedcomp.codecs.base import Codec
from fedcomp.codecs.memory import Memory, inner_fields
from fedcomp.codecs.wire import Payload
from fedcomp.rng import derive_seed

#: How a reply relates to the control variate (the header's ``fedcomp.resync`` field).
SYNC_NORMAL = 0  # Q(delta - h) against the committed h of the stated version
SYNC_FULL = 1  # full-precision delta; both sides set h = delta (alpha = 1)
SYNC_RESTART = 2  # Q(delta - 0): a client without state restarts from h = 0
BOOTSTRAPS = ("zero", "fp32")


def state_checksum(state: Mapping[str, np.ndarray]) -> str:
    """A short digest of a control variate (names, shapes and float32 bytes, in order)."""
    digest = hashlib.blake2b(digest_size=8)
    for name in sorted(state):
        value = np.ascontiguousarray(state[name], dtype=np.float32)
        digest.update(name.encode() + b"\0" + str(value.shape).encode() + b"\0")
        digest.update(value.tobytes())
    return digest.hexdigest()


def apply_residual(h: np.ndarray | None, decoded: np.ndarray, alpha: float) -> np.ndarray:
    """h + alpha * decoded in float32, elementwise (the same expression on both sides)."""
    step = np.float32(alpha) * decoded.astype(np.float32, copy=False)
    return step if h is None else (h.astype(np.float32, copy=False) + step).astype(np.float32)


class ResidualMemory(Memory):
    """``residual(inner=...)``: Q(delta - h) with a control variate h per client.

    Parameters
    ----------
    inner : Codec
        An unbiased stateless codec (uniform, qsgd, randk, fp16 is biased and refused).
    alpha : float, optional
        Step of the control-variate update. Default: 1 / (1 + omega) per tensor, with
        omega the inner codec's variance factor for that tensor's size (the convergence
        limit of the method); a larger value is allowed with a warning naming the limit.
    bootstrap : {"zero", "fp32"}
        What a client without state sends (first contact, wiped device): "zero" restarts
        from h = 0 in the same reply at the codec's usual size (Q(delta) is unbiased, so
        nothing is lost); "fp32" sends a full-precision resync (h = delta at once, at 32
        bits per coordinate). A server that finds a MISMATCH always asks for fp32.
    bias_draws : int
        A diagnostic, off at 0: with K >= 2, each client also encodes each residual r
        with K other public seeds and reports :func:`draw_bias` of their decodings, an
        unbiased estimate of the codec's squared bias ||E decode(encode(r)) - r||^2 on
        its real residuals (K more encodes a round; nothing more is sent).
    """

    name = "residual"
    family = "residual"
    #: The server's update from a client is h + decode(q) (ef21's: the new mirror).
    estimate_is_mirror = False

    def __init__(
        self,
        inner: Codec,
        alpha: float | None = None,
        bootstrap: str = "zero",
        bias_draws: int = 0,
    ) -> None:
        self.check_inner(inner, alpha)
        if (
            isinstance(bias_draws, bool)
            or not isinstance(bias_draws, int)
            or bias_draws < 0
            or bias_draws == 1
        ):
            raise ValueError(
                f"{self.name}: bias_draws must be 0 (off) or an integer >= 2, got {bias_draws!r}"
            )
        self.bias_draws = bias_draws
        if alpha is not None and not (isinstance(alpha, int | float) and 0 < alpha <= 1):
            raise ValueError(f"{self.name}: alpha must be in (0, 1], got {alpha!r}")
        if bootstrap not in BOOTSTRAPS:
            raise ValueError(
                f"{self.name}: bootstrap={bootstrap!r}; allowed: {', '.join(BOOTSTRAPS)}"
            )
        self.inner = inner
        self.alpha = alpha
        self.bootstrap = bootstrap
        self._warned: set[int] = set()

    def check_inner(self, inner: Codec, alpha: float | None) -> None:
        """Refuse an inner codec the method's estimate cannot be unbiased with."""
        if not isinstance(inner, Codec):
            raise ValueError(
                f"residual: inner must be a stateless codec, got {type(inner).__name__} "
                "(error feedback and joint codes cannot sit inside residual)"
            )
        if not inner.unbiased:
            raise ValueError(
                f"residual: inner codec {inner.name!r} is not unbiased; use uniform, qsgd, "
                "randk, eden with scale=unbiased, or subsample of one of them (the "
                "reconstruction h + decode(q) must be unbiased), or ef21 around it"
            )
        if inner.variance_factor(1) is None and alpha is None:
            # EDEN's Hadamard rotations claim no bound on omega, so 1/(1+omega) has no
            # value to default to: the user states alpha (1/(1+measured omega)).
            raise ValueError(
                f"residual: inner codec {inner.name!r} claims no variance bound omega, so "
                "alpha cannot default to 1/(1+omega); give alpha in (0, 1], e.g. "
                "1/(1+omega) with omega measured (docs/residual.md)"
            )

    def spec(self) -> dict[str, Any]:
        spec = {"name": self.name, **inner_fields(self.inner)}
        if self.alpha is not None:
            spec["alpha"] = self.alpha
        if self.bootstrap != "zero":
            spec["bootstrap"] = self.bootstrap
        if self.bias_draws:
            spec["bias_draws"] = self.bias_draws
        return spec

    def bias_estimate(self, residual: torch.Tensor, seed: int) -> float:
        """:func:`draw_bias` of ``bias_draws`` decodings of ``residual``, each encoded
        with its own seed derived from the tensor's (never the one the reply used)."""
        r = residual.detach().to(torch.float64).numpy()
        draws = [
            self.inner.decode(self.inner.encode(residual, seed=derive_seed(seed, "bias", k)))
            .to(torch.float64)
            .numpy()
            for k in range(self.bias_draws)
        ]
        return draw_bias(draws, r)

    def alpha_limit(self, numel: int) -> float | None:
        """1 / (1 + omega) for a tensor of ``numel`` elements; None when the inner codec
        claims no omega."""
        omega = self.inner.variance_factor(numel)
        return None if omega is None else 1.0 / (1.0 + float(omega))

    def alpha_for(self, numel: int) -> float:
        """The alpha used for a tensor (identical on client and server)."""
        limit = self.alpha_limit(numel)
        if self.alpha is None:
            assert limit is not None  # __init__ refuses an unbounded inner codec without alpha
            return limit
        if limit is None:
            return self.alpha
        if self.alpha > limit * (1 + 1e-12) and numel not in self._warned:
            self._warned.add(numel)
            warnings.warn(
                f"{self.name}: alpha={self.alpha} exceeds the convergence limit "
                f"1/(1+omega)={limit:.4g} for tensors of {numel} elements",
                stacklevel=2,
            )
        return self.alpha

    def encode(
        self, delta: torch.Tensor, h: np.ndarray | None, *, seed: int
    ) -> tuple[Payload, np.ndarray]:
        """Encode delta - h; return the payload and the decoded residual (float32).

        The client decodes its own payload: that is exactly what the server decodes,
        so both sides update h from the same numbers.
        """
        x = delta.detach().to(torch.float32)
        if h is not None:
            if tuple(h.shape) != tuple(x.shape):
                raise ValueError(f"residual: h shape {h.shape} != update shape {tuple(x.shape)}")
            x = x - torch.from_numpy(np.ascontiguousarray(h, dtype=np.float32))
        # In the update's own dtype, as every codec is (a float64 model's payload
        # claims float64, which the server checks); a no-op for float32 models.
        payload = self.inner.encode(x.to(delta.dtype), seed=seed)
        decoded = self.inner.decode(payload).to(torch.float32).numpy()
        return payload, decoded

    def noise_bound(self, residual_norm2: float, numel: int) -> float:
        """omega * ||r||^2: the expected compression noise of one tensor."""
        omega = self.inner.variance_factor(numel)
        return float(omega) * residual_norm2 if omega is not None else math.inf


def draw_bias(draws: list[np.ndarray], r: np.ndarray) -> float:
    """An unbiased estimate of ||E[x_k] - r||^2 from K >= 2 independent draws x_k:
    (K ||m - r||^2 - mean_k ||x_k - r||^2) / (K - 1), m the draws' mean. (E||m - r||^2 =
    ||b||^2 + V / K and E||x_k - r||^2 = ||b||^2 + V, V the draws' total variance.)"""
    k = len(draws)
    if k < 2:
        raise ValueError(f"draw_bias needs at least 2 draws, got {k}")
    x = np.stack([np.asarray(d, dtype=np.float64).reshape(-1) for d in draws])
    target = np.asarray(r, dtype=np.float64).reshape(-1)
    mean_error = float(np.sum((x.mean(axis=0) - target) ** 2))
    single = float(np.mean(np.sum((x - target) ** 2, axis=1)))
    return (k * mean_error - single) / (k - 1)
