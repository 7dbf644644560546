"""Memories: client state around a stateless codec.

``ErrorFeedback`` (EF; GRACE calls it "residual memory") adds the error the codec made
last time to this round's update before encoding, so a biased codec (sign, top-k)
loses nothing in the long run: the sum of what the server decodes telescopes to the
sum of the updates minus the current error.

The server needs no state for EF: it decodes the inner codec's payload as usual, and
that is the update. State lives on the client, one explicit object per
client, committed only once the server acknowledged the reply that carried it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedcomp.codecs.base import Codec
from fedcomp.codecs.wire import Payload

if TYPE_CHECKING:  # policy imports the codecs; only its type is needed here
    from fedcomp.codecs.policy import TensorPolicy


class Memory:
    """A stateful wrapper around a codec (the second codec shape of docs/architecture.md)."""

    name: str
    inner: Codec
    #: The protocol family (fedcomp.flower.families).
    family: str = "feedback"

    def spec(self) -> dict[str, Any]:
        raise NotImplementedError

    def inner_for_round(self, server_round: int) -> Codec:
        """The stateless codec the client uses (and the server checks) in this round."""
        return self.inner


class TensorStateMemory(Memory):
    """A memory keeping two arrays per compressed tensor: ``state`` under the tensor's
    name and ``extra`` under ``<name><SUFFIX>`` (DGC: v and the momentum u; PowerSGD:
    the error and Q). Subclasses encode one tensor; the loop over a reply is here."""

    SUFFIX: str
    family = "tensor_state"

    def encode_tensor(
        self,
        delta: torch.Tensor,
        state: torch.Tensor | None,
        extra: torch.Tensor | None,
        *,
        seed: int,
        server_round: int,
    ) -> tuple[Payload, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The payload, the new (state, extra), and the vector that was encoded."""
        raise NotImplementedError

    def encode_round(
        self,
        policy: TensorPolicy,
        deltas: Mapping[str, torch.Tensor],
        seeds: Mapping[str, int],
        carried: Mapping[str, np.ndarray],
        server_round: int,
    ) -> tuple[dict[str, bytes], dict[str, np.ndarray], dict[str, torch.Tensor]]:
        """The client half on one reply: payloads, the new state of every compressed
        tensor (raw ones carry none) and what was encoded per tensor (error metric)."""
        payloads: dict[str, bytes] = {}
        pending: dict[str, np.ndarray] = {}
        inputs: dict[str, torch.Tensor] = {}
        for name, delta in deltas.items():
            codec = policy.codec_for(delta, self.inner)
            if codec is not self.inner:  # raw tensors carry no state
                payloads[name] = bytes(codec.encode(delta, seed=seeds[name]))
                inputs[name] = delta
                continue
            state, extra = carried.get(name), carried.get(name + self.SUFFIX)
            if state is None or extra is None or state.shape != tuple(delta.shape):
                state = extra = None  # a new tensor, or the model changed shape: afresh
            payload, new_state, new_extra, encoded = self.encode_tensor(
                delta,
                None if state is None else torch.from_numpy(state),
                None if extra is None else torch.from_numpy(extra),
                seed=seeds[name],
                server_round=server_round,
            )
            payloads[name] = bytes(payload)
            pending[name], pending[name + self.SUFFIX] = new_state.numpy(), new_extra.numpy()
            inputs[name] = encoded
        return payloads, pending, inputs


class ErrorFeedback(Memory):
    """Error feedback around any codec: send Q(x + e), keep e' = x + e - decode(Q(x + e)).

    Parameters
    ----------
    inner : Codec
        The codec that is fed back (typically ``sign`` or ``topk``).
    """

    name = "ef"

    def __init__(self, inner: Codec) -> None:
        if not isinstance(inner, Codec):
            raise ValueError(f"ef: inner must be a codec, got {inner!r}")
        self.inner = inner

    def spec(self) -> dict[str, Any]:
        inner = self.inner.spec()
        return {"name": self.name, "inner": inner.pop("name"), **inner}

    def encode(
        self, x: torch.Tensor, residual: torch.Tensor | None, *, seed: int
    ) -> tuple[Payload, torch.Tensor]:
        """Encode ``x`` plus the carried error; return the payload and the new error.

        Neither argument is modified: the caller commits the new error only once the
        server has acknowledged the reply that carried this payload.
        """
        corrected = x.detach().to(torch.float32)
        if residual is not None:
            if residual.shape != x.shape:
                raise ValueError(f"ef: residual shape {tuple(residual.shape)} != {tuple(x.shape)}")
            corrected = corrected + residual
        payload = self.inner.encode(corrected.to(x.dtype), seed=seed)
        new_residual = corrected - self.inner.decode(payload).to(torch.float32)
        return payload, new_residual


def encode_with_feedback(
    memory: ErrorFeedback,
    policy: TensorPolicy,
    deltas: Mapping[str, torch.Tensor],
    seeds: Mapping[str, int],
    carried: Mapping[str, np.ndarray],
) -> tuple[dict[str, bytes], dict[str, np.ndarray]]:
    """The client half of error feedback on one reply: encode delta + the carried error
    on the tensors the policy compresses (raw tensors carry none); returns the payloads
    and the new errors, which the client commits once the server acknowledged them."""
    payloads, pending = {}, {}
    for name, delta in deltas.items():
        codec = policy.codec_for(delta, memory.inner)
        if codec is not memory.inner:  # raw tensors carry no error
            payloads[name] = bytes(codec.encode(delta, seed=seeds[name]))
            continue
        residual = carried.get(name)
        if residual is not None and residual.shape != tuple(delta.shape):
            residual = None  # the model changed shape: start this tensor afresh
        payload, new_residual = memory.encode(
            delta, None if residual is None else torch.from_numpy(residual), seed=seeds[name]
        )
        payloads[name] = bytes(payload)
        pending[name] = new_residual.numpy()
    return payloads, pending
