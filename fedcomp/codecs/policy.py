"""Tensor policy: which tensors are compressed and which travel raw."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from fedcomp.codecs.base import Codec
from fedcomp.codecs.dense import RawCodec

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
