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


# numpy's exact k-subset sampler is Floyd's algorithm (O(k)) while k <= numel / 20 or
# numel <= 10,000; beyond that it shuffles a tail of the whole range (random access, then
# a sort: 0.38 s for a quarter of 25M coordinates, six times 1-bit EDEN's encode). There
# a level on a stream of 8-bit keys is sequential work instead (about 0.07 s).
_FLOYD_MAX_NUMEL = 10_000
_FLOYD_MAX_SHARE = 20
_KEY_LEVELS = 1 << 8


def random_subset(seed: int, numel: int, k: int) -> np.ndarray:
    """k distinct indices in [0, numel), uniform over k-subsets, sorted.

    Drawn from a counter-based Philox stream seeded ``seed``, so client and server
    regenerate the same subset. Small shares (``k <= numel / 20`` or ``numel <=
    10,000``) use numpy's ``Generator.choice(replace=False, shuffle=False)`` (Floyd's
    set-based sampler, O(k)); larger ones ``_threshold_subset``. numpy's sampling
    algorithms are not frozen across releases; the seed check then still holds, so a
    mismatch shows up as a worse model, never as a crash: pin numpy in deployments, as
    constraints.txt does.
    """
    if not 0 <= k <= numel:
        raise ValueError(f"cannot pick {k} of {numel} indices")
    bits = np.random.Philox(seed)
    if numel <= _FLOYD_MAX_NUMEL or k <= numel // _FLOYD_MAX_SHARE:
        rng = np.random.Generator(bits)
        return np.sort(rng.choice(numel, size=k, replace=False, shuffle=False))
    return _threshold_subset(bits, numel, k)


def _threshold_subset(
    bits: np.random.Philox, numel: int, k: int, margin: float = 4.0
) -> np.ndarray:
    """A uniform k-subset: the indices whose key is at most a level, thinned to exactly k.

    Every index gets an 8-bit key, a byte of the stream's raw words (little-endian, so
    the subset does not depend on the machine). The level is set so that about
    ``margin`` standard deviations more than k keys fall at or below it (raised, with a
    new pass, in the rare draw where fewer do); the surplus is dropped uniformly, from
    the same stream. Keys are i.i.d. and the level depends only on counts, so the law of
    the result is invariant under any permutation of the indices: uniform over
    k-subsets, whatever the margin (it only trades a second pass against a larger drop).
    """
    keys = bits.random_raw(-(-numel // 8)).astype("<u8", copy=False).view(np.uint8)[:numel]
    want = k + margin * math.sqrt(k) + 1.0
    top = min(math.ceil(want / numel * _KEY_LEVELS) - 1, _KEY_LEVELS - 1)
    idx = np.flatnonzero(keys <= top)
    while idx.size < k:  # the last level keeps every index, so this ends
        top = min(2 * top + 1, _KEY_LEVELS - 1)
        idx = np.flatnonzero(keys <= top)
    rng = np.random.Generator(bits)  # the stream continues after the keys
    surplus = rng.choice(idx.size, size=idx.size - k, replace=False, shuffle=False)
    return np.delete(idx, surplus)


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
    contractive = True  # ||x - topk(x)||^2 <= (1 - k/n) ||x||^2
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
