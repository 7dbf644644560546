"""Sparsifiers: top-k (largest magnitudes, indices varint-coded) and random-k
(indices regenerated from the public seed, none sent; unbiased scaling).

Body layouts (little-endian), after the common header:

- topk:  ``u64 k, u64 varint_bytes`` | LEB128 gaps between sorted indices | float32 values
- randk: ``u64 k`` | float32 values of the k regenerated indices (unscaled; decode
  multiplies by numel / k)
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from fedcomp.codecs.base import Codec, header_for, register
from fedcomp.codecs.blocks import check_finite, check_range, expect_length
from fedcomp.codecs.packing import decode_varints, encode_varints
from fedcomp.codecs.wire import Payload, PayloadError

_TOPK = struct.Struct("<QQ")
_RANDK = struct.Struct("<Q")


def check_size(fraction: float | None, k: int | None, codec: str) -> None:
    if (fraction is None) == (k is None):
        raise ValueError(f"{codec}: give exactly one of fraction and k")
    if fraction is not None and not (isinstance(fraction, int | float) and 0 < fraction <= 1):
        raise ValueError(f"{codec}: fraction must be in (0, 1], got {fraction!r}")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"{codec}: k must be a positive integer, got {k!r}")


def kept(numel: int, fraction: float | None, k: int | None) -> int:
    """How many coordinates a tensor of ``numel`` elements keeps (at least one)."""
    if numel == 0:
        return 0
    wanted = k if k is not None else math.ceil(fraction * numel)
    return max(1, min(numel, wanted))


def _values_bytes(values: torch.Tensor) -> bytes:
    return values.to(torch.float32).numpy().astype("<f4").tobytes()


def _read_values(body: memoryview, offset: int, count: int) -> torch.Tensor:
    values = np.frombuffer(body[offset : offset + 4 * count], dtype="<f4").copy()
    if not np.isfinite(values).all():
        raise PayloadError("non-finite values in a sparse payload")
    return torch.from_numpy(values)


def random_subset(seed: int, numel: int, k: int) -> np.ndarray:
    """k distinct indices in [0, numel), uniform over k-subsets, sorted.

    numpy's ``Generator.choice(replace=False, shuffle=False)`` on a counter-based Philox
    stream (a set-based Floyd sampler: O(k), 7x faster than sorting deduplicated draws
    here). Client and server regenerate the same subset from the seed as long as they
    run the same numpy release (its sampling algorithms are not frozen across releases;
    the seed check then still holds, so a mismatch shows up as a worse model, never as a
    crash: pin numpy in deployments, as constraints.txt does).
    """
    if not 0 <= k <= numel:
        raise ValueError(f"cannot pick {k} of {numel} indices")
    rng = np.random.Generator(np.random.Philox(seed))
    return np.sort(rng.choice(numel, size=k, replace=False, shuffle=False))


class _Sparsifier(Codec):
    """Shared size parameters: keep ``k`` coordinates, or a ``fraction`` (default 1%)."""

    def __init__(self, fraction: float | None = None, k: int | None = None) -> None:
        if fraction is None and k is None:
            fraction = 0.01
        check_size(fraction, k, self.name)
        self.fraction, self.k = fraction, k

    def spec(self) -> dict:
        size = {"k": self.k} if self.k is not None else {"fraction": self.fraction}
        return {"name": self.name, **size}

    def expected_params(self, numel: int) -> dict[str, int]:
        return {"k": kept(numel, self.fraction, self.k)}

    @classmethod
    def _read_k(cls, payload: Payload, struct_: struct.Struct) -> tuple[int, ...]:
        """The fixed fields of the body, with k bounded by the tensor size."""
        h, body = payload.header, memoryview(payload.body)
        if len(body) < struct_.size:
            raise PayloadError(f"{cls.name}: body too short for its parameters")
        if not h.dtype.is_floating_point:
            raise PayloadError(f"{cls.name}: payload declares a non-float dtype {h.dtype}")
        fields = struct_.unpack_from(body, 0)
        check_range(cls.name, "k", fields[0], 1 if h.numel else 0, h.numel)
        return fields


@register
class TopKCodec(_Sparsifier):
    """Keep the k largest-magnitude coordinates (biased; pair it with ``ef``)."""

    codec_id = 7
    name = "topk"
    unbiased = False

    def nominal_bits(self, numel: int) -> float:
        """32 bits per kept value plus the expected varint length of the index gaps,
        for indices spread like a uniform random subset (gaps about geometric)."""
        k = kept(numel, self.fraction, self.k)
        if k == 0:
            return 0.0
        p = k / numel
        # P(gap >= 128^j) = (1 - p)^(128^j): each such gap needs one more varint byte.
        varint_bytes = 1.0 + sum((1.0 - p) ** (128**j) for j in range(1, 9))
        return k * (32.0 + 8.0 * varint_bytes) / numel

    def encode(self, x: torch.Tensor, *, seed: int = 0) -> Payload:
        if not x.is_floating_point():
            raise ValueError(f"topk codec needs a floating-point tensor, got {x.dtype}")
        check_finite(x, self.name)
        flat = x.detach().reshape(-1).to(torch.float32)
        k = kept(flat.numel(), self.fraction, self.k)
        # DGC's sampled threshold, then an exact top-k among the candidates (the exact
        # top-k set, without sorting the tensor; fedcomp.codecs.sparse_quantized)
        from fedcomp.codecs.sparse_quantized import select_topk  # it imports this module

        idx = select_topk(flat, k, seed)
        idx_np = idx.numpy().astype(np.int64)
        gaps = np.diff(idx_np, prepend=-1) - 1  # >= 0 for strictly increasing indices
        varints = encode_varints(gaps)
        body = _TOPK.pack(k, len(varints)) + varints + _values_bytes(flat[idx])
        return Payload(header_for(self.codec_id, x), body)

    @classmethod
    def read_params(cls, payload: Payload) -> dict[str, int]:
        k, nvar = cls._read_k(payload, _TOPK)
        # An index gap below 2^32 takes at most 5 LEB128 bytes, and no varint the
        # decoder accepts takes more than 9: a longer stream is refused before reading.
        check_range(cls.name, "varint bytes", nvar, k, 9 * k)
        return {"k": k, "varint_bytes": nvar}

    @classmethod
    def decode_payload(cls, payload: Payload) -> torch.Tensor:
        h, body = payload.header, memoryview(payload.body)
        params = cls.read_params(payload)
        k, nvar, n = params["k"], params["varint_bytes"], h.numel
        expect_length(body, _TOPK.size + nvar + 4 * k, "topk")
        gaps = decode_varints(body[_TOPK.size : _TOPK.size + nvar], k)
        idx = np.cumsum(gaps.astype(np.float64) + 1) - 1  # float64: no uint64 wrap-around
        if k and idx[-1] >= n:
            raise PayloadError("topk: index beyond the tensor")
        values = _read_values(body, _TOPK.size + nvar, k)
        out = torch.zeros(n, dtype=torch.float32)
        out[torch.from_numpy(idx.astype(np.int64))] = values
        return out.reshape(h.shape).to(h.dtype)


@register
class RandKCodec(_Sparsifier):
    """Keep k coordinates chosen by the public seed, scaled by numel / k (unbiased).

    No index is sent: the server regenerates them from the seed in the header, which it
    checks against the seed it derives from (run seed, round, stable id, tensor).
    omega = numel / k - 1.
    """

    codec_id = 8
    name = "randk"
    unbiased = True
    needs_seed = True

    def variance_factor(self, numel: int) -> float:
        k = kept(numel, self.fraction, self.k)
        return numel / k - 1 if k else 0.0

    def nominal_bits(self, numel: int) -> float:
        return kept(numel, self.fraction, self.k) * 32.0 / max(numel, 1)

    def encode(self, x: torch.Tensor, *, seed: int) -> Payload:
        if not x.is_floating_point():
            raise ValueError(f"randk codec needs a floating-point tensor, got {x.dtype}")
        check_finite(x, self.name)
        flat = x.detach().reshape(-1).to(torch.float32)
        k = kept(flat.numel(), self.fraction, self.k)
        idx = torch.from_numpy(random_subset(seed, flat.numel(), k))
        body = _RANDK.pack(k) + _values_bytes(flat[idx])
        return Payload(header_for(self.codec_id, x, seed=seed), body)

    @classmethod
    def read_params(cls, payload: Payload) -> dict[str, int]:
        (k,) = cls._read_k(payload, _RANDK)
        return {"k": k}

    @classmethod
    def decode_payload(cls, payload: Payload) -> torch.Tensor:
        h, body = payload.header, memoryview(payload.body)
        k, n = cls.read_params(payload)["k"], h.numel
        expect_length(body, _RANDK.size + 4 * k, "randk")
        values = _read_values(body, _RANDK.size, k)
        out = torch.zeros(n, dtype=torch.float32)
        if k:
            idx = torch.from_numpy(random_subset(h.seed, n, k))
            out[idx] = values * (n / k)
        return out.reshape(h.shape).to(h.dtype)
