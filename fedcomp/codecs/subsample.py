"""``subsample``: a random subset of the coordinates, chosen by public randomness, coded by
any stateless codec; no index is sent.

``make_codec("subsample", inner="eden", fraction=0.25, bits=1)`` keeps k = ceil(p n)
coordinates drawn from the payload's public seed (fedcomp.codecs.sparse.random_subset,
the draw random-k uses), codes those k values as one vector with the inner codec, and
decodes ``(n / k) scatter(decode(inner))``. The server regenerates the subset from the
seed it derives itself, so the code costs about p times the inner codec's bits per
coordinate: 1-bit EDEN on a quarter of the coordinates is a quarter of a bit.

Unbiased exactly when the inner codec is: E over the subset of (n / k) 1_S x = x. Its
variance factor is (1 + omega_inner(k)) n / k - 1 (random-k's n / k - 1 with an exact
inner code), the price of the bits it saves; error feedback or control variates
(fedcomp.codecs.memory, residual) are the remedies. Random-k is this codec with the
fp32 inner code.

Body layout (little-endian), after the common header (its seed is the subset's public
seed, checked by the server)::

    u32 k
    the inner codec's payload for the k kept values, float32, in index order, as
    fedcomp.codecs.base.pack_inner writes it: one byte (inner codec id, seed flag),
    then its body (its header, a float32 vector of k values seeded inner_seed(seed),
    is the reader's; payload format 1 carried it in full)
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import torch

from fedcomp.codecs.base import (
    Codec,
    decode_inner,
    header_for,
    inner_seed,
    pack_inner,
    parse_inner_vector,
    register,
)
from fedcomp.codecs.blocks import check_finite
from fedcomp.codecs.sparse import kept, random_subset
from fedcomp.codecs.wire import Payload, PayloadError, check_field

_PARAMS = struct.Struct("<I")


def kept_count(numel: int, fraction: float) -> int:
    """The coordinates a tensor of ``numel`` elements keeps: ceil(p n), at least one
    (random-k's count, so that ``subsample`` with the fp32 inner code is random-k)."""
    return kept(numel, fraction, None)


@register
class SubsampledCodec(Codec):
    """A seeded random subset of the coordinates, coded by a stateless inner codec (see
    the module).

    Parameters
    ----------
    inner : Codec
        A stateless codec (not a memory, a joint code or another subsample).
    fraction : float in (0, 1]
        The share of the coordinates kept.
    """

    codec_id = 16
    name = "subsample"
    unbiased = False  # set from the inner codec
    needs_seed = True

    def __init__(self, inner: Codec, *, fraction: float) -> None:
        if not isinstance(inner, Codec) or isinstance(inner, SubsampledCodec):
            raise ValueError(f"subsample: inner must be a stateless codec, got {inner!r}")
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, int | float)
            or not 0 < fraction <= 1
        ):
            raise ValueError(f"subsample: fraction must be in (0, 1], got {fraction!r}")
        self.inner, self.fraction = inner, float(fraction)
        self.unbiased = inner.unbiased

    def spec(self) -> dict[str, Any]:
        inner = self.inner.spec()
        return {"name": self.name, "inner": inner.pop("name"), "fraction": self.fraction, **inner}

    @classmethod
    def _split(cls, payload: Payload) -> tuple[int, Payload]:
        """k and the inner payload, checked against the header before anything else."""
        body = memoryview(payload.body)
        if len(body) < _PARAMS.size:
            raise PayloadError(f"{cls.name}: body too short for its parameters")
        if not payload.header.dtype.is_floating_point:
            raise PayloadError(f"{cls.name}: payload declares a non-float dtype")
        (k,) = _PARAMS.unpack_from(body, 0)
        numel = payload.header.numel
        if not (0 < k <= numel or k == numel == 0):
            raise PayloadError(f"{cls.name}: keeps {k} of {numel} coordinates")
        return k, parse_inner_vector(cls, body[_PARAMS.size :], k, payload.header.seed)

    @classmethod
    def read_params(cls, payload: Payload) -> dict[str, int]:
        k, inner = cls._split(payload)
        return {"k": k, "inner codec id": inner.header.codec_id}

    def expected_params(self, numel: int) -> dict[str, int]:
        return {"k": kept_count(numel, self.fraction), "inner codec id": self.inner.codec_id}

    def check_payload(self, payload: Payload) -> None:
        """k for the spec's fraction, then the inner payload against the inner codec
        (its parameters and its seed)."""
        super().check_payload(payload)
        _, inner = self._split(payload)
        self.inner.check_payload(inner)
        want = inner_seed(payload.header.seed) if self.inner.needs_seed else 0
        check_field(f"{self.name} inner {self.inner.name}", "seed", inner.header.seed, want)

    def variance_factor(self, numel: int) -> float | None:
        if not self.unbiased or numel == 0:
            return None if not self.unbiased else 0.0
        k = kept_count(numel, self.fraction)
        inner = self.inner.variance_factor(k)
        return None if inner is None else (1.0 + inner) * numel / k - 1.0

    def nominal_bits(self, numel: int) -> float:
        k = kept_count(max(numel, 1), self.fraction)
        return self.inner.nominal_bits(k) * k / max(numel, 1)

    def encode(self, x: torch.Tensor, *, seed: int) -> Payload:
        if not x.is_floating_point():
            raise ValueError(f"{self.name} codec needs a floating-point tensor, got {x.dtype}")
        # every coordinate, not only the kept ones: a NaN is refused whatever the draw
        check_finite(x, self.name)
        flat = x.detach().reshape(-1).to(torch.float32)
        k = kept_count(flat.numel(), self.fraction)
        idx = torch.from_numpy(random_subset(seed, flat.numel(), k))
        inner = self.inner.encode(flat[idx].contiguous(), seed=inner_seed(seed))
        return Payload(header_for(self.codec_id, x, seed), _PARAMS.pack(k) + pack_inner(inner))

    @classmethod
    def decode_payload(cls, payload: Payload) -> torch.Tensor:
        h = payload.header
        k, inner = cls._split(payload)
        out = np.zeros(h.numel, dtype=np.float32)
        if k:
            values = decode_inner(inner, cls.name).reshape(-1).to(torch.float32)
            # numpy's scatter: a quarter faster than torch's index_put at 25M coordinates
            out[random_subset(h.seed, h.numel, k)] = (values * (h.numel / k)).numpy()
        return torch.from_numpy(out).reshape(h.shape).to(h.dtype)
