"""``ef21``: error feedback as a mirrored estimate (EF21), with client momentum
(EF21-SGDM).

EF21 (Richtarik, Sokolov, Fatkhullin, NeurIPS 2021, Algorithm 1) keeps on client m an
estimate g_m of its update, mirrored on the server, and sends only the compressed
change; EF21-SGDM (Fatkhullin, Tyurin, Richtarik, NeurIPS 2023, Algorithm 2) feeds it a
momentum average v_m of the updates instead of the last one::

    v_m <- (1 - eta) v_m + eta delta_m        (v_m = delta_m on first contact)
    q_m  = C(v_m - g_m)
    g_m <- g_m + alpha decode(q_m)            (client and server mirror, same float32)

and the server's update from client m is its new g_m. With eta = 1 this is EF21; with
alpha = 1 and a contractive codec C (E||C(x) - x||^2 <= (1 - d) ||x||^2, d > 0) the
estimate's error ||v_m - g_m|| shrinks by sqrt(1 - d) a round when v_m stands still,
which is how EF21 removes the lag of classic error feedback (no error is carried into
later rounds: the estimate itself is the state). An unbiased codec with variance factor
omega is made contractive by its step, alpha = 1 / (1 + omega) (the paper's Section 2.1
remark), the default for codecs that state omega.

It differs from residual compression (fedcomp.codecs.residual, DIANA-like) only in the
server's estimate: residual sends h_m + decode(q_m) (unbiased, noisier), ef21 the mirror
itself (biased towards the past, quieter). So it shares residual's protocol (versions,
acknowledgements, resyncs and the server's mirrors); the momentum v_m is client state
only, kept beside g_m under ``<name>/ef21_momentum`` and committed with it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedcomp.codecs.base import Codec
from fedcomp.codecs.residual import ResidualMemory

#: The client's momentum array of a tensor is kept under ``<tensor name><suffix>``.
MOMENTUM_SUFFIX = "/ef21_momentum"


def momentum_average(previous: np.ndarray | None, delta: torch.Tensor, eta: float) -> torch.Tensor:
    """(1 - eta) v + eta delta, computed in float32 and given in delta's dtype (the
    payload claims the model's); delta itself when there is no v (first contact, or a
    tensor whose shape changed) or eta is 1."""
    x = delta.detach()
    if previous is None or tuple(previous.shape) != tuple(x.shape) or eta == 1.0:
        return x
    v = torch.from_numpy(np.ascontiguousarray(previous, dtype=np.float32))
    return (v * (1.0 - eta) + x.to(torch.float32) * eta).to(x.dtype)


class EF21Memory(ResidualMemory):
    """``ef21(inner=..., momentum=...)``: EF21 (``momentum=1``) or EF21-SGDM.

    Parameters
    ----------
    inner : Codec
        A contractive codec (``contractive``: topk, sign, bf16, eden with scale=mse;
        alpha defaults to 1), an unbiased one that states omega (alpha defaults to
        1 / (1 + omega)), or any other stateless codec with alpha given.
    momentum : float in (0, 1]
        eta: the weight of this round's update in the client's running average.
    alpha : float in (0, 1], optional
        The estimate's step.
    bootstrap : {"zero", "fp32"}
        As residual's: what a client without state sends.
    """

    name = "ef21"
    family = "ef21"
    #: The server's update from a client is its new mirror (residual: h + decode(q)).
    estimate_is_mirror = True

    def __init__(
        self,
        inner: Codec,
        momentum: float = 1.0,
        alpha: float | None = None,
        bootstrap: str = "zero",
    ) -> None:
        if isinstance(momentum, bool) or not (
            isinstance(momentum, int | float) and 0 < momentum <= 1
        ):
            raise ValueError(f"ef21: momentum must be in (0, 1], got {momentum!r}")
        super().__init__(inner, alpha, bootstrap)
        self.momentum = float(momentum)

    def check_inner(self, inner: Codec, alpha: float | None) -> None:
        """Any stateless codec whose step has a default or is given."""
        if not isinstance(inner, Codec):
            raise ValueError(f"ef21: inner must be a stateless codec, got {type(inner).__name__}")
        if alpha is None and not inner.contractive and inner.variance_factor(1) is None:
            raise ValueError(
                f"ef21: inner codec {inner.name!r} is neither contractive nor unbiased with "
                "a stated omega, so alpha has no default; give alpha in (0, 1] (the step "
                "that makes alpha decode(encode(x)) a contraction), or use topk, sign, bf16 "
                "or eden with scale=mse"
            )

    def spec(self) -> dict[str, Any]:
        spec = super().spec()  # name, inner, alpha, bootstrap: residual's keys
        if self.momentum != 1.0:
            spec["momentum"] = self.momentum
        return spec

    def alpha_for(self, numel: int) -> float:
        """1 for a contractive codec, else residual's rule (the given alpha, or
        1 / (1 + omega)); identical on client and server."""
        if self.alpha is None and self.inner.contractive:
            return 1.0
        return super().alpha_for(numel)
