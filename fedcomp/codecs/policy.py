"""Tensor policy: which tensors are compressed and which travel raw."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from fedcomp.codecs.base import Codec
from fedcomp.codecs.dense import RawCodec
from fedcomp.codecs.wire import Payload

_RAW = RawCodec()


#: The one-bit joint code's smallest compressed tensor: its queries need a coordinate
#: count to spread over the clients (fedcomp.onebit), whatever ``min_numel`` says.
JOINT_MIN_NUMEL = 256

#: What a compressed payload carries beyond its codec's nominal bytes and a raw one
#: does not: the codec's parameters and, for wrappers (rotate, subsample, entropy), the
#: inner payload's header (measured: at most 56 B for every registered codec).
MARGIN_BYTES = 64


@dataclass(frozen=True)
class TensorPolicy:
    """Which tensors travel raw: integer buffers (``num_batches_tracked``: counters must
    stay exact), tensors with fewer than ``min_numel`` elements (0 by default: none),
    and tensors the codec would not carry in fewer bytes than raw: its nominal bytes
    for the tensor's shape (scales and padding to its blocks included) plus
    MARGIN_BYTES, against the raw bytes. Every other floating tensor is compressed,
    whatever its size: with a fixed size threshold instead (256 elements before
    December 2026), 1,544 B of a 1-bit EDEN reply of the Fashion-MNIST CNN were raw
    float32 that the codec carries in a ninth of the bytes.
    """

    min_numel: int = 0

    def __post_init__(self) -> None:
        if self.min_numel < 0:
            raise ValueError(f"min_numel must be >= 0, got {self.min_numel!r}")

    def travels_raw(
        self,
        floating: bool,
        shape: tuple[int, ...],
        codec: Codec | None = None,
        itemsize: int = 4,
    ) -> bool:
        """The rule, once for both sides: integer tensors, small ones, and those
        ``codec`` would not carry in fewer bytes than raw (``itemsize`` bytes each)."""
        numel = math.prod(shape)
        if not floating or numel < self.min_numel:
            return True
        if codec is None:
            return False
        return codec.nominal_bytes(tuple(shape)) + MARGIN_BYTES >= itemsize * numel

    def compressed(self, arrays: Mapping[str, np.ndarray]) -> list[str]:
        """The tensors the one-bit joint code compresses, in model order: the list the
        client and the server both derive (at least JOINT_MIN_NUMEL elements)."""
        floor = TensorPolicy(max(self.min_numel, JOINT_MIN_NUMEL))
        return [
            name
            for name, array in arrays.items()
            if not floor.travels_raw(np.asarray(array).dtype.kind == "f", np.shape(array))
        ]

    def codec_for(self, x: torch.Tensor, codec: Codec) -> Codec:
        """The codec that tensor ``x`` travels with."""
        raw = self.travels_raw(x.is_floating_point(), tuple(x.shape), codec, x.element_size())
        return _RAW if raw else codec


#: A stateful family's own step on one tensor the policy compresses: (name, tensor) to
#: its payload; the step keeps whatever state it leads to.
Compress = Callable[[str, torch.Tensor], Payload]


def encode_all(
    codec: Codec,
    policy: TensorPolicy,
    deltas: Mapping[str, torch.Tensor],
    seeds: Mapping[str, int],
    compress: Compress | None = None,
    names: Collection[str] | None = None,
) -> dict[str, bytes]:
    """Each tensor encoded with the codec the policy picks for it: the raw codec, or
    ``codec`` (through ``compress`` when given). The raw-or-compressed split, written
    once for every family and both the client and the reference encoding; raw
    tensors never reach ``compress``, so they carry no state. ``names``: the
    compressed tensors when a family has its own list (the one-bit joint code's
    :meth:`TensorPolicy.compressed`, which its plan follows).
    """
    payloads = {}
    for name, delta in deltas.items():
        if names is None:
            chosen = policy.codec_for(delta, codec)
        else:
            chosen = codec if name in names else _RAW
        if chosen is codec and compress is not None:
            payloads[name] = bytes(compress(name, delta))
        else:
            payloads[name] = bytes(chosen.encode(delta, seed=seeds[name]))
    return payloads
