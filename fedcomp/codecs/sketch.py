"""``sketch``: a count sketch of each compressed tensor (Charikar, Chen and Farach-Colton
2002), the client half of FetchSGD (Rothchild et al. 2020).

A count sketch of x in R^n with r rows and c columns holds, in row j, the bucket sums
S[j, b] = sum_{i: h_j(i) = b} s_j(i) x_i, for public buckets h_j(i) in [0, c) and signs
s_j(i) in {-1, +1}. It is linear, so the server adds the clients' sketches into the
sketch of their weighted sum. Each row's estimate s_j(i) S[j, h_j(i)] is unbiased for
x_i over the draws, with variance sum_{l != i} x_l^2 / c; the median over the rows is
the unsketch U(S), which recovers the heavy coordinates (exactly, for a coordinate that
shares its bucket with no other nonzero coordinate in most rows).

The draws come from (run seed, tensor name) only, neither the round nor the client
(:func:`sketch_seed`): every client's sketch of a tensor shares them, so sketches add,
and the server's momentum and error sketches (fedcomp.flower.families.sketch, where
FetchSGD's server step lives) stay in one space across rounds.

Cost: r c values of 32 bits (16 with ``dtype="bf16"``) for n coordinates, where
c = ceil(p n / r) for the codec's ``fraction`` p: about 32 p bits a coordinate (p = 1/64
is half a bit). ``keep`` (FetchSGD's k, as a share of the sketched coordinates) and
``momentum`` (its rho) are the server's: they travel in the spec but not in a payload.

Decoded alone (``decode_bytes``) a payload is U(S), a biased estimate of that client's
tensor: what a reader without the other replies can recover. The protocol decodes
the sum instead.

Body layout (little-endian), after the common header (its seed is the sketch's public
seed, checked by the server)::

    u8  rows r
    u8  value dtype code (fedcomp.codecs.wire.DTYPE_CODES: float32 or bfloat16)
    u32 columns c
    r c values, row by row
"""

from __future__ import annotations

import math
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedcomp.codecs.base import Codec, header_for, register
from fedcomp.codecs.blocks import check_finite
from fedcomp.codecs.wire import CODE_DTYPES, DTYPE_CODES, Payload, PayloadError
from fedcomp.rng import derive_seed

_PARAMS = struct.Struct("<BBI")
#: Rows a payload may declare: the median's benefit is flat long before this.
MAX_ROWS = 15
#: The values' wire dtypes, by the name the codec takes.
VALUE_DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16}
#: Bytes of public draws kept per process (the client's and the server's draws of a
#: tensor are the same every round: drawing them once saves the encoder most of its work).
DRAW_CACHE_BYTES = 512 << 20


def sketch_seed(run_seed: int, name: str) -> int:
    """The public seed of one tensor's buckets and signs for the whole run (no round,
    no client: sketches of the same tensor add, and the server's sketches persist)."""
    return derive_seed(run_seed, "sketch", name)


def columns(numel: int, rows: int, fraction: float) -> int:
    """Columns of a tensor's sketch: ceil(p n / r), at least one (r c is about p n)."""
    return max(1, math.ceil(fraction * numel / rows))


@dataclass(frozen=True)
class Draws:
    """One tensor's public draws: for row j and coordinate i, the flat position
    j c + h_j(i) of its bucket in the r x c table, and its sign s_j(i)."""

    slots: np.ndarray  # (rows, numel) intp
    signs: np.ndarray  # (rows, numel) int8, +1 or -1
    cols: int

    @property
    def rows(self) -> int:
        return int(self.slots.shape[0])


_CACHE: OrderedDict[tuple[int, int, int, int], Draws] = OrderedDict()

#: splitmix64 (Steele, Lea and Flood 2014): the stream's increment and its finalizer.
GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_U64 = np.uint64


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 values (wrapping arithmetic)."""
    z = (z ^ (z >> _U64(30))) * _U64(_MIX1)
    z = (z ^ (z >> _U64(27))) * _U64(_MIX2)
    return z ^ (z >> _U64(31))


def row_keys(seed: int, rows: int) -> np.ndarray:
    """Each row's stream key, from the tensor's public seed."""
    j = np.arange(1, rows + 1, dtype=_U64)
    return mix64(_U64(seed) + j * _U64(GOLDEN))


def words(seed: int, rows: int, coords: np.ndarray) -> np.ndarray:
    """The (rows x len(coords)) 64-bit words of the draws: row j's splitmix64 stream
    from its key, word i = mix64(key_j + (i + 1) golden). A counter-based hash: any
    word is computed alone, here for some coordinates, in a compiled loop for all
    (fedcomp.codecs.sketch_compiled), always the same."""
    steps = (np.asarray(coords).astype(_U64) + _U64(1)) * _U64(GOLDEN)
    return mix64(row_keys(seed, rows)[:, None] + steps[None, :])


def slots(seed: int, rows: int, cols: int, coords: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The flat table positions j c + h_j(i) (intp) and the signs s_j(i) (int8) of the
    given coordinates, (rows x len(coords)) each: from word w, the bucket floor(u c /
    2^32) of its low 32 bits u (multiply-shift, uniform up to c / 2^32), the sign -1
    when bit 32 is set."""
    raw = words(seed, rows, coords)
    buckets = ((raw & _U64(0xFFFFFFFF)) * _U64(cols)) >> _U64(32)
    offsets = (np.arange(rows, dtype=_U64) * _U64(cols))[:, None]
    signs = (1 - 2 * ((raw >> _U64(32)) & _U64(1)).astype(np.int8)).astype(np.int8, copy=False)
    return (buckets + offsets).astype(np.intp), signs


def draws(seed: int, numel: int, rows: int, cols: int) -> Draws:
    """The buckets and signs of a (rows x cols) sketch of ``numel`` coordinates
    (:func:`slots` of them all), kept in a small per-process cache
    (DRAW_CACHE_BYTES), least recently used out first; draws larger than the whole
    cache are made and returned, never kept (9 bytes a row and coordinate: 1.1 GB for
    5 rows of 25M coordinates)."""
    key = (seed, numel, rows, cols)
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        return hit
    found = Draws(*slots(seed, rows, cols, np.arange(numel)), cols)
    if found.slots.nbytes + found.signs.nbytes > DRAW_CACHE_BYTES:
        return found
    _CACHE[key] = found
    while sum(d.slots.nbytes + d.signs.nbytes for d in _CACHE.values()) > DRAW_CACHE_BYTES:
        _CACHE.popitem(last=False)
    return found


def count_sketch(x: np.ndarray, d: Draws) -> np.ndarray:
    """The (rows x cols) count sketch of the flat vector ``x``, in float64."""
    weights = (d.signs * np.asarray(x, dtype=np.float64).reshape(1, -1)).reshape(-1)
    flat = np.bincount(d.slots.reshape(-1), weights=weights, minlength=d.rows * d.cols)
    return flat.reshape(d.rows, d.cols)


def row_estimates(table: np.ndarray, d: Draws) -> np.ndarray:
    """Each row's estimate s_j(i) S[j, h_j(i)] of every coordinate, (rows x numel)."""
    return np.asarray(table, dtype=np.float64).reshape(-1)[d.slots] * d.signs


def unsketch_draws(table: np.ndarray, d: Draws) -> np.ndarray:
    """U(S) from the draws: every coordinate's median over the rows of its estimates."""
    if d.slots.shape[1] == 0:
        return np.zeros(0)
    return np.median(row_estimates(table, d), axis=0)


def sketch_of(x: np.ndarray, seed: int, rows: int, cols: int) -> np.ndarray:
    """The (rows x cols) count sketch of the flat vector ``x`` with the public draws of
    ``seed``, in float64: the compiled loop for large tensors where Numba is there,
    else :func:`count_sketch` on the cached draws (the same sums in the same order)."""
    from fedcomp.codecs import sketch_compiled

    if sketch_compiled.available(x.size):
        return sketch_compiled.sketch(x, row_keys(seed, rows), cols)
    return count_sketch(x, draws(seed, x.size, rows, cols))


def unsketch(table: np.ndarray, seed: int, numel: int) -> np.ndarray:
    """U(S) of a (rows x cols) table of ``numel`` coordinates drawn with ``seed``."""
    from fedcomp.codecs import sketch_compiled

    rows, cols = table.shape
    if sketch_compiled.available(numel):
        return sketch_compiled.unsketch(table, row_keys(seed, rows), numel)
    return unsketch_draws(table, draws(seed, numel, rows, cols))


def top_k(estimates: np.ndarray, k: int) -> np.ndarray:
    """The indices of the k largest |estimates|, ascending; among equal magnitudes at
    the boundary, the lowest indices (a definition that does not depend on how a
    partition orders ties)."""
    n = estimates.size
    if k >= n:
        return np.arange(n)
    magnitude = np.abs(estimates)
    level = np.partition(magnitude, n - k)[n - k]  # the k-th largest
    above = np.flatnonzero(magnitude > level)
    ties = np.flatnonzero(magnitude == level)[: k - above.size]
    return np.sort(np.concatenate([above, ties]))


def _fraction(key: str, value: Any, *, upper_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"sketch: {key} must be a number, got {value!r}")
    ok = 0 <= value < 1 if upper_open else 0 < value <= 1
    if not ok:
        raise ValueError(
            f"sketch: {key} must be in {'[0, 1)' if upper_open else '(0, 1]'}, got {value!r}"
        )
    return float(value)


@register
class CountSketchCodec(Codec):
    """A count sketch of each compressed tensor, summed and unsketched by the server
    (see the module).

    Parameters
    ----------
    fraction : float in (0, 1]
        The sketch's size as a share of the tensor's coordinates (r c ~ p n).
    rows : int in [1, MAX_ROWS]
        Rows r (independent hashes; the unsketch is their median).
    keep : float in (0, 1]
        The server's FetchSGD k, as a share of all sketched coordinates.
    momentum : float in [0, 1)
        The server's momentum rho on the summed sketch (FetchSGD's S_u).
    dtype : {"float32", "bf16"}
        The sketch values' wire dtype.
    """

    codec_id = 18
    name = "sketch"
    family = "sketch"
    unbiased = False  # the median of the rows is not (each row's estimate is)
    needs_seed = True

    def __init__(
        self,
        *,
        fraction: float = 1 / 32,
        rows: int = 5,
        keep: float = 0.01,
        momentum: float = 0.0,
        dtype: str = "float32",
    ) -> None:
        if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"sketch: rows must be an integer in [1, {MAX_ROWS}], got {rows!r}")
        if dtype not in VALUE_DTYPES:
            raise ValueError(
                f"sketch: dtype must be one of {', '.join(VALUE_DTYPES)}, got {dtype!r}"
            )
        self.fraction = _fraction("fraction", fraction)
        self.keep = _fraction("keep", keep)
        self.momentum = _fraction("momentum", momentum, upper_open=True)
        self.rows, self.dtype = rows, dtype

    def spec(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "fraction": self.fraction,
            "rows": self.rows,
            "keep": self.keep,
            "momentum": self.momentum,
            "dtype": self.dtype,
        }

    def columns(self, numel: int) -> int:
        return columns(numel, self.rows, self.fraction)

    @classmethod
    def read_params(cls, payload: Payload) -> dict[str, int]:
        body = memoryview(payload.body)
        if len(body) < _PARAMS.size:
            raise PayloadError(f"{cls.name}: body too short for its parameters")
        if not payload.header.dtype.is_floating_point:
            raise PayloadError(f"{cls.name}: payload declares a non-float dtype")
        rows, code, cols = _PARAMS.unpack_from(body, 0)
        numel = payload.header.numel
        if not 1 <= rows <= MAX_ROWS:
            raise PayloadError(f"{cls.name}: {rows} rows, allowed 1 to {MAX_ROWS}")
        if CODE_DTYPES.get(code) not in VALUE_DTYPES.values():
            raise PayloadError(f"{cls.name}: value dtype code {code} is not float32 or bf16")
        # any fraction <= 1 gives r c <= n + r: a larger table is not a sketch of this tensor
        if not 1 <= cols or rows * cols > numel + rows:
            raise PayloadError(f"{cls.name}: a {rows} x {cols} sketch of {numel} coordinates")
        itemsize = CODE_DTYPES[code].itemsize
        if len(body) != _PARAMS.size + rows * cols * itemsize:
            raise PayloadError(
                f"{cls.name}: body is {len(body)} bytes, a {rows} x {cols} sketch needs "
                f"{_PARAMS.size + rows * cols * itemsize}"
            )
        return {"rows": rows, "columns": cols, "value dtype": code}

    def expected_params(self, numel: int) -> dict[str, int]:
        code = DTYPE_CODES[VALUE_DTYPES[self.dtype]]
        return {"rows": self.rows, "columns": self.columns(numel), "value dtype": code}

    @classmethod
    def read_table(cls, payload: Payload) -> np.ndarray:
        """The payload's (rows x cols) table in float64 (its parameters checked first)."""
        params = cls.read_params(payload)
        rows, cols = params["rows"], params["columns"]
        dtype = CODE_DTYPES[params["value dtype"]]
        raw = bytearray(memoryview(payload.body)[_PARAMS.size :])
        values = torch.frombuffer(raw, dtype=dtype) if raw else torch.zeros(0, dtype=dtype)
        return values.to(torch.float64).numpy().reshape(rows, cols)

    def nominal_bits(self, numel: int) -> float:
        n = max(numel, 1)
        return self.rows * self.columns(n) * VALUE_DTYPES[self.dtype].itemsize * 8 / n

    def encode(self, x: torch.Tensor, *, seed: int) -> Payload:
        if not x.is_floating_point():
            raise ValueError(f"{self.name} codec needs a floating-point tensor, got {x.dtype}")
        check_finite(x, self.name)
        flat = x.detach().reshape(-1)
        flat = (
            flat.numpy() if flat.dtype in (torch.float32, torch.float64) else flat.float().numpy()
        )
        cols = self.columns(flat.size)
        table = sketch_of(flat, seed, self.rows, cols)
        wire = VALUE_DTYPES[self.dtype]
        values = torch.from_numpy(table.reshape(-1)).to(wire)
        if not torch.isfinite(values).all():  # float32's range exceeded by a bucket's sum
            raise ValueError(f"{self.name}: a bucket's sum overflows {self.dtype}")
        params = _PARAMS.pack(self.rows, DTYPE_CODES[wire], cols)
        body = values.view(torch.int16 if wire.itemsize == 2 else torch.int32).numpy().tobytes()
        return Payload(header_for(self.codec_id, x, seed), params + body)

    @classmethod
    def decode_payload(cls, payload: Payload) -> torch.Tensor:
        h = payload.header
        table = cls.read_table(payload)
        estimate = unsketch(table, h.seed, h.numel)
        return torch.from_numpy(estimate).reshape(h.shape).to(h.dtype)
