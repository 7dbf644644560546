"""PowerSGD (Vogels et al., 2019): rank-r compression per layer with warm start and
error feedback.

Each tensor is seen as a matrix: its first dimension by the product of the others (a
convolution's kernel is ``out x in k k``); a 1-d tensor is one row. One power iteration
gives ``P = orth(M Q)`` and ``Q' = M^T P``, and ``P Q'^T`` is the rank-r estimate of M;
the payload holds P and Q' in float32: ``r (rows + cols)`` values instead of
``rows cols``. When that is not smaller (small or 1-d tensors), the tensor travels in
float32 as it is.

- ``lowrank`` (the stateless codec): Q starts from the public seed every time.
- ``powersgd`` (the memory): Q is warm-started from the client's previous Q' and the
  error ``M - P Q'^T`` is fed back into the next round (the PowerSGD paper's two
  ingredients, without which one power iteration is a poor approximation). Both live in
  the client's memory state (``e`` under each tensor's name, ``Q`` under
  ``<name>/q``), committed after the server's acknowledgement and checkpointed with it.

In federated learning there is no all-reduce of P between the two half-iterations (as
in DDP's hook): each client sends its own P and Q', and the server sums the products.

Body layout (little-endian), after the common header::

    u8 rank, u8 mode (0 low rank, 1 dense float32), u16 0, u32 rows, u32 cols
    mode 0: P (rows x rank float32, row-major) | Q' (cols x rank float32)
    mode 1: rows x cols float32
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedcomp.codecs.base import Codec, header_for, register
from fedcomp.codecs.blocks import check_finite, check_range, expect_length
from fedcomp.codecs.memory import TensorStateMemory, TensorStep
from fedcomp.codecs.wire import Payload, PayloadError, check_field

if TYPE_CHECKING:
    pass

_PARAMS = struct.Struct("<BBHII")
LOW_RANK, DENSE = 0, 1
MAX_RANK = 64
Q_SUFFIX = "/q"


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The matrix a tensor is seen as: first dimension x the rest (1-d: one row)."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], math.prod(shape[1:])


def uses_low_rank(rows: int, cols: int, rank: int) -> bool:
    """Low rank only when it is smaller than the dense matrix."""
    return rank * (rows + cols) < rows * cols


def random_q(seed: int, cols: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed % (1 << 63))
    return torch.randn(cols, rank, generator=gen)


def power_step(m: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One power iteration: ``P = orth(M Q)``, ``Q' = M^T P`` (float32)."""
    p = m @ q
    p, _ = torch.linalg.qr(p, mode="reduced")  # orthonormal columns
    return p, m.T @ p


@register
class LowRankCodec(Codec):
    """Rank-``rank`` compression with one power iteration from a seeded Q (see module)."""

    codec_id = 15
    name = "lowrank"
    unbiased = False

    def __init__(self, rank: int = 2) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
            raise ValueError(f"{self.name}: rank must be an integer in 1..{MAX_RANK}, got {rank!r}")
        self.rank = rank

    def spec(self) -> dict[str, Any]:
        return {"name": self.name, "rank": self.rank}

    @classmethod
    def read_params(cls, payload: Payload) -> dict[str, int]:
        h, body = payload.header, memoryview(payload.body)
        if len(body) < _PARAMS.size:
            raise PayloadError(f"{cls.name}: body too short for its parameters")
        if not h.dtype.is_floating_point:
            raise PayloadError(f"{cls.name}: payload declares a non-float dtype {h.dtype}")
        rank, mode, zero, rows, cols = _PARAMS.unpack_from(body, 0)
        check_range(cls.name, "reserved", zero, 0, 0)
        check_range(cls.name, "mode", mode, LOW_RANK, DENSE)
        check_field(cls.name, "matrix shape", (rows, cols), matrix_shape(h.shape))
        return {"rank": check_range(cls.name, "rank", rank, 1, MAX_RANK), "mode": mode}

    def expected_params(self, numel: int) -> dict[str, int]:
        return {"rank": self.rank}

    def check_payload(self, payload: Payload) -> None:
        super().check_payload(payload)
        rows, cols = matrix_shape(payload.header.shape)
        want = LOW_RANK if uses_low_rank(rows, cols, self.rank) else DENSE
        check_field(self.name, "mode", self.read_params(payload)["mode"], want)

    def nominal_bits(self, numel: int) -> float:
        """Bits per coordinate for a SQUARE matrix of ``numel`` elements (the size alone
        does not say the shape; a 1-d tensor is dense float32)."""
        side = max(math.isqrt(max(numel, 1)), 1)
        if not uses_low_rank(side, side, self.rank):
            return 32.0
        return 32.0 * self.rank * 2 * side / max(numel, 1)

    def nominal_bytes(self, shape: tuple[int, ...]) -> float:
        """The factors' float32 bytes for the matrix ``shape`` is seen as (first
        dimension x the rest), or the dense float32 bytes when low rank is no smaller."""
        rows, cols = matrix_shape(tuple(shape))
        if uses_low_rank(rows, cols, self.rank):
            return 4.0 * self.rank * (rows + cols)
        return 4.0 * rows * cols

    def encode_with(self, x: torch.Tensor, q: torch.Tensor) -> tuple[Payload, torch.Tensor]:
        """Encode with a given Q (the memory's warm start); return the payload and Q'."""
        if not x.is_floating_point():
            raise ValueError(f"{self.name} codec needs a floating-point tensor, got {x.dtype}")
        check_finite(x, self.name)
        rows, cols = matrix_shape(tuple(x.shape))
        m = x.detach().to(torch.float32).reshape(rows, cols)
        if not uses_low_rank(rows, cols, self.rank):
            body = _PARAMS.pack(self.rank, DENSE, 0, rows, cols) + m.numpy().astype("<f4").tobytes()
            return Payload(header_for(self.codec_id, x), body), q
        p, q_new = power_step(m, q)
        body = (
            _PARAMS.pack(self.rank, LOW_RANK, 0, rows, cols)
            + p.numpy().astype("<f4").tobytes()
            + q_new.numpy().astype("<f4").tobytes()
        )
        return Payload(header_for(self.codec_id, x), body), q_new

    def encode(self, x: torch.Tensor, *, seed: int = 0) -> Payload:
        _, cols = matrix_shape(tuple(x.shape))
        return self.encode_with(x, random_q(seed, cols, self.rank))[0]

    @classmethod
    def decode_payload(cls, payload: Payload) -> torch.Tensor:
        h, body = payload.header, memoryview(payload.body)
        params = cls.read_params(payload)
        rows, cols = matrix_shape(h.shape)
        rank = params["rank"]
        count = rows * cols if params["mode"] == DENSE else rank * (rows + cols)
        expect_length(body, _PARAMS.size + 4 * count, cls.name)
        values = np.frombuffer(body[_PARAMS.size :], dtype="<f4")
        if not np.isfinite(values).all():
            raise PayloadError(f"{cls.name}: non-finite values")
        if params["mode"] == DENSE:
            m = torch.from_numpy(values.copy()).reshape(rows, cols)
        else:
            p = torch.from_numpy(values[: rows * rank].copy()).reshape(rows, rank)
            q = torch.from_numpy(values[rows * rank :].copy()).reshape(cols, rank)
            m = p @ q.T
        return m.reshape(h.shape).to(h.dtype)


class PowerSGDMemory(TensorStateMemory):
    """PowerSGD's warm start and error feedback around :class:`LowRankCodec`."""

    name = "powersgd"
    SUFFIX = Q_SUFFIX

    def __init__(self, rank: int = 2) -> None:
        self.inner = LowRankCodec(rank)

    def spec(self) -> dict[str, Any]:
        return {"name": self.name, "rank": self.inner.rank}

    def encode_tensor(
        self,
        x: torch.Tensor,
        error: torch.Tensor | None,
        q: torch.Tensor | None,
        *,
        seed: int,
        server_round: int = 0,
    ) -> TensorStep:
        """The error is the state, Q the extra array (under ``<name>/q``); the round
        does not matter (no warm-up)."""
        m = x.detach().to(torch.float32)
        if error is not None:
            m = m + error
        cols = matrix_shape(tuple(x.shape))[1]
        if q is None or tuple(q.shape) != (cols, self.inner.rank):
            q = random_q(seed, cols, self.inner.rank)
        payload, q_new = self.inner.encode_with(m.to(x.dtype), q)
        sent = LowRankCodec.decode_payload(payload).to(torch.float32)
        return TensorStep(payload, state=m - sent, extra=q_new, encoded=m)
