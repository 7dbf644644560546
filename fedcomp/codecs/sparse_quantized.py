"""``sparseq``: top-k values sent in b bits, indices as a bitmap or as gaps, entropy coded.

Top-k keeps the largest magnitudes (biased: pair it with error feedback, ``ef``); each
kept value is then stochastically rounded to ``bits`` bits with one float32 max|v|
scale per ``block`` kept values (the uniform codec's layout, on the k values). The
indices travel in whichever of four forms is smallest for this tensor, recorded in the
payload: a bitmap of the tensor, or the LEB128 gaps between sorted indices, each raw or
behind zstd (a real entropy coder: FSE/Huffman after LZ matching).

Selection (DGC's sampled threshold): the magnitude at quantile ``1 - 2k/n`` of a
seeded sample of ``SAMPLE`` coordinates is a threshold; the coordinates above it are
the candidates (about 2k) and an exact top-k among them is taken. Whenever there are
at least k candidates this IS the exact top-k (every top-k value is above the
threshold); otherwise the threshold is lowered, and after that the whole tensor is
sorted. Only a pass over the tensor is paid, never a sort of it.

Body layout (little-endian), after the common header::

    u8 index format (0 bitmap, 1 gaps, 2 zstd bitmap, 3 zstd gaps), u8 0, u16 0,
    u32 0, u64 k, u64 index bytes
    index section (index bytes)
    the uniform codec's body for the k values (u8 bits, u8 0, u32 block | scales | codes)
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from fedcomp.codecs import zstdframes
from fedcomp.codecs.base import Codec, header_for, register
from fedcomp.codecs.blocks import check_block, check_finite, check_range
from fedcomp.codecs.packing import decode_varints, encode_varints
from fedcomp.codecs.quantizers import UniformCodec
from fedcomp.codecs.sparse import check_size, kept
from fedcomp.codecs.wire import Payload, PayloadError, PayloadHeader

_PARAMS = struct.Struct("<BBHIQQ")
BITMAP, GAPS, ZSTD_BITMAP, ZSTD_GAPS = 0, 1, 2, 3
#: Coordinates sampled to set the selection threshold.
SAMPLE = 1 << 16


def select_topk(flat: torch.Tensor, k: int, seed: int, sampled: bool = True) -> torch.Tensor:
    """Sorted indices of the k largest magnitudes (exact; see the module docstring)."""
    n = flat.numel()
    if k == 0:
        return torch.zeros(0, dtype=torch.int64)
    if sampled and n > 4 * SAMPLE and 8 * k < n:
        gen = torch.Generator().manual_seed(seed % (1 << 63))
        sample = flat[torch.randint(n, (SAMPLE,), generator=gen)].abs()
        for spread in (2.0, 8.0):
            q = max(0.0, 1.0 - spread * k / n)
            threshold = torch.quantile(sample, q).item()
            candidates = _at_least(flat, threshold)
            if candidates.numel() >= k:
                top = torch.topk(flat[candidates].abs(), k, sorted=False).indices
                return candidates[top].sort().values
    return torch.topk(flat.abs(), k, sorted=False).indices.sort().values


def _at_least(flat: torch.Tensor, threshold: float) -> torch.Tensor:
    """Indices (ascending) of the coordinates with |x| >= threshold, a cache-sized
    piece at a time: no tensor-sized |x| or mask is ever allocated."""
    step = 1 << 20
    found = [
        torch.nonzero(flat[start : start + step].abs() >= threshold).reshape(-1) + start
        for start in range(0, flat.numel(), step)
    ]
    return torch.cat(found)


def _index_candidates(idx: np.ndarray, n: int) -> dict[int, bytes]:
    mask = np.zeros(n, dtype=bool)
    mask[idx] = True
    bitmap = np.packbits(mask).tobytes()
    gaps = encode_varints(np.diff(idx, prepend=-1) - 1)
    forms = {BITMAP: bitmap, GAPS: gaps}
    if zstdframes.available():
        forms[ZSTD_BITMAP] = zstdframes.compress(bitmap)
        forms[ZSTD_GAPS] = zstdframes.compress(gaps)
    return forms


def decode_indices(fmt: int, data: bytes, k: int, n: int) -> np.ndarray:
    """The k sorted indices of an index section, checked (count, order, range)."""
    if fmt in (ZSTD_BITMAP, ZSTD_GAPS):
        limit = (n + 7) // 8 if fmt == ZSTD_BITMAP else 9 * k
        data = zstdframes.inflate(data, limit=limit, what="sparseq index section")
        fmt -= 2
    if fmt == BITMAP:
        if len(data) != (n + 7) // 8:
            raise PayloadError(f"sparseq: bitmap of {len(data)} bytes for {n} coordinates")
        bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8))
        if bits[n:].any():
            raise PayloadError("sparseq: bitmap bits set beyond the tensor")
        idx = np.flatnonzero(bits[:n])
        if idx.size != k:
            raise PayloadError(f"sparseq: bitmap holds {idx.size} indices, k is {k}")
        return idx
    gaps = decode_varints(data, k)
    idx = np.cumsum(gaps.astype(np.float64) + 1) - 1  # float64: no uint64 wrap-around
    if k and idx[-1] >= n:
        raise PayloadError("sparseq: index beyond the tensor")
    return idx.astype(np.int64)


@register
class SparseQuantizedCodec(Codec):
    """Top-k (or a fraction) of the coordinates, values in ``bits`` bits (see module).

    Parameters
    ----------
    fraction, k : keep this share (default 1%) or this many coordinates
    bits : int in 1..8 (default 4), block : kept values per scale (default 256)
    selection : "sampled" (DGC's threshold, exact whenever it finds k candidates) or
        "exact" (a full top-k)
    """

    codec_id = 14
    name = "sparseq"
    unbiased = False

    def __init__(
        self,
        fraction: float | None = None,
        k: int | None = None,
        bits: int = 4,
        block: int = 256,
        selection: str = "sampled",
    ) -> None:
        if fraction is None and k is None:
            fraction = 0.01
        check_size(fraction, k, self.name)
        if selection not in ("sampled", "exact"):
            raise ValueError(f"sparseq: selection must be sampled or exact, got {selection!r}")
        self.values = UniformCodec(bits=bits, block=check_block(block))
        self.fraction, self.k, self.selection = fraction, k, selection

    def spec(self) -> dict:
        size = {"k": self.k} if self.k is not None else {"fraction": self.fraction}
        return {
            "name": self.name,
            **size,
            "bits": self.values.bits,
            "block": self.values.block,
            "selection": self.selection,
        }

    @classmethod
    def _split(cls, payload: Payload) -> tuple[int, int, bytes, Payload]:
        """(format, k, index section, the values' uniform payload), bounded."""
        h, body = payload.header, memoryview(payload.body)
        if len(body) < _PARAMS.size:
            raise PayloadError(f"{cls.name}: body too short for its parameters")
        if not h.dtype.is_floating_point:
            raise PayloadError(f"{cls.name}: payload declares a non-float dtype {h.dtype}")
        fmt, zero, zero2, zero3, k, index_bytes = _PARAMS.unpack_from(body, 0)
        check_range(cls.name, "index format", fmt, 0, 3)
        check_range(cls.name, "reserved", zero + zero2 + zero3, 0, 0)
        check_range(cls.name, "k", k, 1 if h.numel else 0, h.numel)
        check_range(cls.name, "index bytes", index_bytes, 0, (h.numel + 7) // 8 + 9 * k + 64)
        end = _PARAMS.size + index_bytes
        if len(body) < end:
            raise PayloadError(f"{cls.name}: body too short for its index section")
        values = Payload(PayloadHeader(UniformCodec.codec_id, torch.float32, (k,)), body[end:])
        return fmt, k, bytes(body[_PARAMS.size : end]), values

    @classmethod
    def read_params(cls, payload: Payload) -> dict[str, int]:
        fmt, k, _, values = cls._split(payload)
        return {"index format": fmt, "k": k, **UniformCodec.read_params(values)}

    def expected_params(self, numel: int) -> dict[str, int]:
        return {
            "k": kept(numel, self.fraction, self.k),
            "bits": self.values.bits,
            "block": self.values.block,
        }

    def nominal_bits(self, numel: int) -> float:
        """An upper bound: the values' bits and scales, and the smaller of a bitmap and
        one varint byte per gap (the zstd forms only make it smaller)."""
        k = kept(numel, self.fraction, self.k)
        if not numel:
            return 0.0
        values = k * self.values.bits + 32 * math.ceil(k / self.values.block)
        return (values + 8 * min((numel + 7) // 8, 2 * k)) / numel

    def encode(self, x: torch.Tensor, *, seed: int = 0) -> Payload:
        if not x.is_floating_point():
            raise ValueError(f"{self.name} codec needs a floating-point tensor, got {x.dtype}")
        check_finite(x, self.name)
        flat = x.detach().reshape(-1).to(torch.float32)
        k = kept(flat.numel(), self.fraction, self.k)
        idx = select_topk(flat, k, seed, sampled=self.selection == "sampled")
        forms = _index_candidates(idx.numpy().astype(np.int64), flat.numel())
        fmt = min(forms, key=lambda f: (len(forms[f]), f))
        values = self.values.encode(flat[idx], seed=seed)
        body = _PARAMS.pack(fmt, 0, 0, 0, k, len(forms[fmt])) + forms[fmt] + bytes(values.body)
        return Payload(header_for(self.codec_id, x), body)

    @classmethod
    def decode_payload(cls, payload: Payload) -> torch.Tensor:
        h = payload.header
        fmt, k, index, values = cls._split(payload)
        idx = decode_indices(fmt, index, k, h.numel)
        decoded = UniformCodec.decode_payload(values)
        out = torch.zeros(h.numel, dtype=torch.float32)
        out[torch.from_numpy(idx)] = decoded
        return out.reshape(h.shape).to(h.dtype)
