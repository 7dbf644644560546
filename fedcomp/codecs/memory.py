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
from typing import Any, NamedTuple

import numpy as np
import torch

from fedcomp.codecs.base import Codec
from fedcomp.codecs.policy import TensorPolicy, encode_all
from fedcomp.codecs.wire import Payload


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


def inner_fields(inner: Codec) -> dict[str, Any]:
    """A memory's spec fields for its inner codec: ``inner=<name>`` beside the inner
    codec's parameters, or ``inner=<its whole spec>`` when it is a wrapper with an
    ``inner`` of its own (subsample, rotate), whose keys would otherwise collide."""
    spec = inner.spec()
    if "inner" in spec:
        return {"inner": spec}
    return {"inner": spec.pop("name"), **spec}


class TensorStep(NamedTuple):
    """One tensor through a :class:`TensorStateMemory`."""

    payload: Payload
    #: The new state (kept under the tensor's name) and extra array (under
    #: ``<name><SUFFIX>``), committed once the server acknowledged the payload.
    state: torch.Tensor
    extra: torch.Tensor
    #: The vector the inner codec encoded (the error metric compares with it).
    encoded: torch.Tensor


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
    ) -> TensorStep:
        """One compressed tensor, from its carried (state, extra) (None: afresh)."""
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
        pending: dict[str, np.ndarray] = {}
        inputs: dict[str, torch.Tensor] = dict(deltas)  # raw tensors: what they are

        def compress(name: str, delta: torch.Tensor) -> Payload:
            state, extra = carried.get(name), carried.get(name + self.SUFFIX)
            if state is None or extra is None or state.shape != tuple(delta.shape):
                state = extra = None  # a new tensor, or the model changed shape: afresh
            step = self.encode_tensor(
                delta,
                None if state is None else torch.from_numpy(state),
                None if extra is None else torch.from_numpy(extra),
                seed=seeds[name],
                server_round=server_round,
            )
            pending[name], pending[name + self.SUFFIX] = step.state.numpy(), step.extra.numpy()
            inputs[name] = step.encoded
            return step.payload

        return encode_all(self.inner, policy, deltas, seeds, compress), pending, inputs


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
        return {"name": self.name, **inner_fields(self.inner)}

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
    pending: dict[str, np.ndarray] = {}

    def compress(name: str, delta: torch.Tensor) -> Payload:
        residual = carried.get(name)
        if residual is not None and residual.shape != tuple(delta.shape):
            residual = None  # the model changed shape: start this tensor afresh
        payload, new_residual = memory.encode(
            delta, None if residual is None else torch.from_numpy(residual), seed=seeds[name]
        )
        pending[name] = new_residual.numpy()
        return payload

    return encode_all(memory.inner, policy, deltas, seeds, compress), pending
