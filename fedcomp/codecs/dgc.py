"""Deep Gradient Compression's ideas, adapted to federated rounds: the ``dgc`` memory.

DGC (Lin et al., 2018) sends the top 0.1% of each worker's accumulated gradient at every
optimizer step and keeps the rest locally, with four additions: momentum correction,
momentum factor masking, local gradient clipping and a sparsity warm-up. In federated
learning the mod sees one update per ROUND (the result of many local steps), so each
idea is restated per round (docs/codecs.md, "DGC in rounds"):

- momentum correction: a client-side momentum over rounds, ``u <- m u + delta``, is
  accumulated into the memory, ``v <- v + u``, and ``v`` is what gets compressed (with
  ``m = 0`` this is plain error feedback);
- momentum factor masking: where the payload sent a coordinate, ``u`` is zeroed (its
  momentum was delivered) and ``v`` keeps only the coding error there;
- clipping: the accumulated ``v`` is scaled down to at most ``clip`` times the norm of
  this round's update (0: off), so stale accumulation cannot dominate a reply;
- warm-up: during the first ``warmup_rounds`` rounds the inner sparsifier keeps a
  share that falls exponentially from ``warmup_start`` to its own ``fraction``; the
  server validates each round's payloads against that round's share.

The server needs no state (it decodes the inner codec's payloads); the client's state is
``v`` under each tensor's name and ``u`` under ``<name>/momentum``, committed after the
server's acknowledgement like every memory.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from fedcomp.codecs.base import Codec
from fedcomp.codecs.memory import TensorStateMemory, TensorStep, inner_fields

if TYPE_CHECKING:
    pass

MOMENTUM_SUFFIX = "/momentum"


class DGCMemory(TensorStateMemory):
    """Momentum correction, masking, clipping and warm-up around a sparsifier.

    Parameters
    ----------
    inner : Codec
        A stateless codec; with ``warmup_rounds`` it must take a ``fraction`` (sparseq,
        topk, randk).
    momentum : float in [0, 1) (default 0.9)
    clip : float >= 0 (default 0: off)
    warmup_rounds : int >= 0 (default 0), warmup_start : float in (0, 1] (default 0.25)
    """

    name = "dgc"
    SUFFIX = MOMENTUM_SUFFIX

    def __init__(
        self,
        inner: Codec,
        *,
        momentum: float = 0.9,
        clip: float = 0.0,
        warmup_rounds: int = 0,
        warmup_start: float = 0.25,
    ) -> None:
        if not isinstance(inner, Codec):
            raise ValueError(f"dgc: inner must be a stateless codec, got {inner!r}")
        if not (isinstance(momentum, int | float) and 0 <= momentum < 1):
            raise ValueError(f"dgc: momentum must be in [0, 1), got {momentum!r}")
        if not (isinstance(clip, int | float) and clip >= 0 and math.isfinite(clip)):
            raise ValueError(f"dgc: clip must be a finite number >= 0, got {clip!r}")
        if (
            isinstance(warmup_rounds, bool)
            or not isinstance(warmup_rounds, int)
            or warmup_rounds < 0
        ):
            raise ValueError(f"dgc: warmup_rounds must be an integer >= 0, got {warmup_rounds!r}")
        if not (isinstance(warmup_start, int | float) and 0 < warmup_start <= 1):
            raise ValueError(f"dgc: warmup_start must be in (0, 1], got {warmup_start!r}")
        target = inner.spec().get("fraction")
        if warmup_rounds and target is None:
            raise ValueError(
                f"dgc: warmup_rounds needs an inner codec with a fraction, got {inner.spec()}"
            )
        self.inner = inner
        self.momentum, self.clip = float(momentum), float(clip)
        self.warmup_rounds, self.warmup_start = warmup_rounds, float(warmup_start)

    def spec(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "momentum": self.momentum,
            "clip": self.clip,
            "warmup_rounds": self.warmup_rounds,
            "warmup_start": self.warmup_start,
            **inner_fields(self.inner),
        }

    def fraction_for_round(self, server_round: int) -> float | None:
        """The inner share kept in ``server_round`` (exponential warm-up, then its own)."""
        target = self.inner.spec().get("fraction")
        if target is None or server_round > self.warmup_rounds or self.warmup_start <= target:
            return target
        t = (max(server_round, 1) - 1) / self.warmup_rounds
        return self.warmup_start ** (1 - t) * target**t

    def inner_for_round(self, server_round: int) -> Codec:
        fraction = self.fraction_for_round(server_round)
        if fraction is None or fraction == self.inner.spec().get("fraction"):
            return self.inner
        from fedcomp.codecs import make_codec_from_spec  # the factory imports this module

        return make_codec_from_spec({**self.inner.spec(), "fraction": fraction})

    def encode_tensor(
        self,
        delta: torch.Tensor,
        v: torch.Tensor | None,
        u: torch.Tensor | None,
        *,
        seed: int,
        server_round: int,
    ) -> TensorStep:
        """v is the state, u the extra array (under ``<name>/momentum``); both start
        afresh when u's shape is not the tensor's."""
        if u is not None and u.shape != delta.shape:
            u = v = None
        x = delta.detach().to(torch.float32)
        u = x.clone() if u is None else self.momentum * u + x
        v = u.clone() if v is None else v + u
        if self.clip > 0:
            limit = self.clip * float(x.norm())
            norm = float(v.norm())
            if norm > limit > 0:
                v = v * (limit / norm)
        codec = self.inner_for_round(server_round)
        payload = codec.encode(v.to(delta.dtype), seed=seed)
        sent = codec.decode(payload).to(torch.float32)
        new_v = v - sent
        new_u = torch.where(sent != 0, torch.zeros_like(u), u)  # momentum factor masking
        return TensorStep(payload, state=new_v, extra=new_u, encoded=v)
