"""Tensor policy: which tensors are compressed and which travel raw."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from fedcomp.codecs.base import Codec
from fedcomp.codecs.dense import RawCodec
from fedcomp.codecs.wire import Payload

_RAW = RawCodec()


@dataclass(frozen=True)
class TensorPolicy:
    """Integer buffers (e.g. ``num_batches_tracked``) and tensors with fewer than
    ``min_numel`` elements travel raw: compressing them saves nothing next to the
    fixed per-message overhead, and integer counters must stay exact.
    """

    min_numel: int = 256

    def __post_init__(self) -> None:
        if self.min_numel < 0:
            raise ValueError(f"min_numel must be >= 0, got {self.min_numel!r}")

    def travels_raw(self, floating: bool, numel: int) -> bool:
        """The rule, once for both sides: integer tensors and small ones travel raw."""
        return not floating or numel < self.min_numel

    def compressed(self, arrays: Mapping[str, np.ndarray]) -> list[str]:
        """The tensors the policy compresses, in model order: the list the client and
        the server both derive (e.g. the one-bit code's jointly coded tensors)."""
        return [
            name
            for name, array in arrays.items()
            if not self.travels_raw(np.asarray(array).dtype.kind == "f", np.asarray(array).size)
        ]

    def codec_for(self, x: torch.Tensor, codec: Codec) -> Codec:
        """The codec that tensor ``x`` travels with."""
        return _RAW if self.travels_raw(x.is_floating_point(), x.numel()) else codec


#: A stateful family's own step on one tensor the policy compresses: (name, tensor) to
#: its payload; the step keeps whatever state it leads to.
Compress = Callable[[str, torch.Tensor], Payload]


def encode_all(
    codec: Codec,
    policy: TensorPolicy,
    deltas: Mapping[str, torch.Tensor],
    seeds: Mapping[str, int],
    compress: Compress | None = None,
) -> dict[str, bytes]:
    """Each tensor encoded with the codec the policy picks for it: the raw codec, or
    ``codec`` (through ``compress`` when given). The raw-or-compressed split, written
    once for every family and both the client and the reference encoding; raw
    tensors never reach ``compress``, so they carry no state."""
    payloads = {}
    for name, delta in deltas.items():
        chosen = policy.codec_for(delta, codec)
        if chosen is codec and compress is not None:
            payloads[name] = bytes(compress(name, delta))
        else:
            payloads[name] = bytes(chosen.encode(delta, seed=seeds[name]))
    return payloads
