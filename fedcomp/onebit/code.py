"""``OneBitCode``: the one-bit non-adaptive refinement code as a joint code.

A joint code has no per-client decoder: each client's bits answer public random
queries, and only the server, holding every reply, can decode the mean. The surface:

- :meth:`OneBitCode.encode` (client): one tensor, its position among the round's n
  selected clients, the round's public parameters (seed, tau) -> a packed payload;
- :meth:`OneBitCode.decode_mean` (server): the payloads that arrived, their positions,
  the same public parameters -> the weighted mean;
- :meth:`OneBitCode.check` validates one reply on its own (the wrapper drops bad
  replies like lost ones; the decoder's Horvitz-Thompson weights use the planned
  inclusion probabilities), and
  :meth:`OneBitCode.next_tau` turns the replies' scale codes into the next round's tau.

Payload body (after the common wire header, whose seed field carries the public seed)::

    u8 format, u8 bits, u8 center, u8 refine, u32 client index, u32 n, u32 block,
    u32 digest of the public parameters | u8 scale code per block | packed bits,
    (numel, b) order, little bit order

"Equal bits" comparisons count all of it: ``b + 8 / block`` bits per coordinate plus
the fixed header.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedcomp.codecs.base import JOINT_ONEBIT_ID
from fedcomp.codecs.wire import (
    Payload,
    PayloadError,
    PayloadHeader,
    check_field,
    parse_payload,
)
from fedcomp.onebit.bits import encode_bits
from fedcomp.onebit.decode import JointDecode, Received, decode_joint
from fedcomp.onebit.decode_compiled import available as compiled_available
from fedcomp.onebit.decode_compiled import decode_compiled
from fedcomp.onebit.decode_runs import decode_runs
from fedcomp.onebit.queries import CENTERS, REFINES, QuerySet, build_query_set, make_geometry

#: Wire codec id of the one-bit code (reserved beside the per-client codec registry).
ONEBIT_CODEC_ID = JOINT_ONEBIT_ID
FORMAT = 1
_BODY = struct.Struct("<BBBBIIII")
#: Robust spread: 1.4826 * median |x - reference| estimates the standard deviation.
MAD_TO_SIGMA = 1.4826
#: Largest factor by which tau may change from one round to the next.
MAX_TAU_STEP = 4.0
#: Scale codes: 4 steps per octave around 2^0 (code 128); 0 means "all zero".
_CODE_STEPS = 4.0


def scale_code(spread: np.ndarray) -> np.ndarray:
    """8-bit log-scale codes of non-negative spreads (0 for zero)."""
    with np.errstate(divide="ignore"):
        code = np.rint(_CODE_STEPS * np.log2(spread)) + 128
    code = np.clip(np.nan_to_num(code, nan=0.0, neginf=1.0), 1, 255)
    return np.where(spread > 0, code, 0).astype(np.uint8)


def scale_value(code: np.ndarray) -> np.ndarray:
    """The spread a scale code stands for (0 for code 0)."""
    value = np.exp2((code.astype(np.float64) - 128) / _CODE_STEPS)
    return np.where(code > 0, value, 0.0)


def block_spreads(x: np.ndarray, block: int, reference: np.ndarray | None) -> np.ndarray:
    """``1.4826 * median |x - r|`` per block of ``block`` coordinates.

    ``r`` is the given reference (e.g. the previous round's aggregate, which the server
    also knows) or, without one, the block's own median.
    """
    num_blocks = -(-x.size // block)
    out = np.empty(num_blocks)
    for i in range(num_blocks):
        part = x[i * block : (i + 1) * block]
        ref = np.median(part) if reference is None else reference[i * block : (i + 1) * block]
        out[i] = MAD_TO_SIGMA * np.median(np.abs(part - ref)) if part.size else 0.0
    return out


def decode_one_group(received: Received, qs: QuerySet, **common) -> JointDecode:
    """The plain weighted mean (one group): the compiled decoder where it can run
    (Numba installed, power-of-two scales), else the NumPy run-sum decoder; both
    give the same estimate (tested to the last bit with equal weights)."""
    if compiled_available(qs):
        return decode_compiled(received, qs, **common)
    return decode_runs(received, qs, **common)


@dataclass(frozen=True)
class OneBitCode:
    """The one-bit code's settings (everything the round's public parameters add is
    ``seed``, ``tau`` and the client set).

    Parameters
    ----------
    bits : int
        Bits per coordinate per client (b).
    lam : float
        Range bound of the center, ``|center| <= lam`` (absolute units).
    center : {"inband", "previous", "zero"}
        Where the coarse center comes from: the clients' localization bits, the
        server's side information (last round's aggregate), or 0.
    refine : {"deterministic", "stochastic"}
        Refinement bits sent exactly (default) or the seed note's coin variant.
    top : float
        ``L_J >= top * tau``: values farther than ``L_J / 4`` from the center wrap.
    a0 : float
        ``L_0 = a0 * tau``.
    decay : float
        Refinement share of scale j proportional to ``2^(-decay j)`` (0: the seed's 1/r).
    loc_votes : float
        Target answers per localization query.
    min_resultant : float
        Localization stops at a level whose vote resultant is below this.
    block : int
        Coordinates per tau block (one 8-bit scale code per block per client).
    groups : int
        Median of means over this many client groups (1: plain mean).
    base_share : float
        Share of the bits spent on BASE queries.
    tau_prior : float
        Federated use only: the tau of round 1, before any client has sent a scale
        code (the library calls take tau explicitly).
    """

    bits: int = 1
    lam: float = 100.0
    center: str = "inband"
    refine: str = "deterministic"
    top: float = 8192.0
    a0: float = 8.0
    decay: float = 0.5
    loc_votes: float = 20.0
    min_resultant: float = 0.3
    block: int = 1024
    groups: int = 1
    base_share: float = 0.2
    tau_prior: float = 1.0

    name = "onebit"
    #: The protocol family (fedcomp.flower.families): decoded only jointly.
    family = "joint"

    def __post_init__(self) -> None:
        def bad(key: str, allowed: str) -> ValueError:
            return ValueError(f"onebit: {key}={getattr(self, key)!r} is invalid; {allowed}")

        if (
            isinstance(self.bits, bool)
            or not isinstance(self.bits, int)
            or not 1 <= self.bits <= 64
        ):
            raise bad("bits", "use an integer in 1..64")
        if self.center not in CENTERS:
            raise bad("center", f"use one of {', '.join(CENTERS)}")
        if self.refine not in REFINES:
            raise bad("refine", f"use one of {', '.join(REFINES)}")
        for key in ("lam", "top", "a0", "loc_votes", "tau_prior"):
            value = getattr(self, key)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise bad(key, "use a finite number >= 0")
        for key in ("top", "a0", "tau_prior"):
            if getattr(self, key) <= 0:
                raise bad(key, "use a positive number")
        if not 0 <= self.min_resultant <= 2:
            raise bad("min_resultant", "use a number in [0, 2]")
        if not 0 < self.base_share < 0.5:
            # localization may take up to half the bits: refinement needs the rest
            raise bad("base_share", "use a number in (0, 0.5)")
        if not 1e-30 <= self.tau_prior <= 1e30:
            raise bad("tau_prior", "use a number in [1e-30, 1e30] (it travels as float32)")
        if not math.isfinite(self.decay):
            raise bad("decay", "use a finite number")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise bad("block", "use a positive integer")
        if isinstance(self.groups, bool) or not isinstance(self.groups, int) or self.groups < 1:
            raise bad("groups", "use a positive integer")

    # ------------------------------------------------------------------ public plan
    def spec(self) -> dict:
        """The settings as a codec spec (``make_codec_from_spec`` round-trips it)."""
        return {"name": self.name, **{f: getattr(self, f) for f in self.__dataclass_fields__}}

    def nominal_bits(self, numel: int) -> float:
        """Bits per coordinate on the wire, scale codes included (headers excluded)."""
        return self.bits + 8.0 / min(self.block, max(numel, 1))

    def num_blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def block_taus(self, tau: float | Sequence[float] | np.ndarray, numel: int) -> np.ndarray:
        """tau per block (a scalar is broadcast), validated."""
        blocks = self.num_blocks(numel)
        arr = np.asarray(tau.numpy() if isinstance(tau, torch.Tensor) else tau, dtype=np.float64)
        if arr.ndim == 0:
            arr = np.full(blocks, float(arr))
        if arr.shape != (blocks,):
            raise ValueError(
                f"onebit: tau must be a scalar or one value per block ({blocks} blocks of"
                f" {self.block}), got shape {arr.shape}"
            )
        if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
            raise ValueError("onebit: tau must be finite and positive in every block")
        return arr

    def query_set(self, taus: np.ndarray, num_clients: int) -> QuerySet:
        """The public query table for these block scales and this client count."""
        lam_over_tau = self.lam / float(taus.min()) if taus.size else 0.0
        geometry = make_geometry(
            lam_over_tau, top=self.top, a0=self.a0, localize=self.center == "inband"
        )
        return build_query_set(
            geometry,
            num_clients=num_clients,
            bits=self.bits,
            refine=self.refine,
            decay=self.decay,
            loc_votes=self.loc_votes,
            base_share=self.base_share,
        )

    def digest(self, taus: np.ndarray, num_clients: int) -> int:
        """CRC-32 of every public parameter: a stale or foreign config shows up as a
        mismatch instead of silently wrong bits."""
        head = repr((sorted(self.spec().items()), num_clients)).encode()
        crc = zlib.crc32(taus.astype("<f8").tobytes(), zlib.crc32(head))
        # The derived cuts too: a client whose float arithmetic differed would
        # otherwise answer other queries without anyone noticing.
        return zlib.crc32(self.query_set(taus, num_clients).cuts.tobytes(), crc)

    # ------------------------------------------------------------------ client
    def encode(
        self,
        x: torch.Tensor | np.ndarray,
        *,
        client_index: int,
        num_clients: int,
        seed: int,
        tau: float | Sequence[float] | np.ndarray,
        reference: torch.Tensor | np.ndarray | None = None,
    ) -> Payload:
        """Encode one client's tensor: b bits per coordinate plus a scale code per block.

        Raises
        ------
        ValueError
            On a non-finite value, a client index outside ``[0, num_clients)``, or a bad tau.
        """
        values = _as_float64(x)
        if not 0 <= client_index < num_clients:
            raise ValueError(f"onebit: client_index {client_index} not in [0, {num_clients})")
        if not np.all(np.isfinite(values)):
            raise ValueError("onebit: the tensor has NaN or infinite values; refusing to encode")
        taus = self.block_taus(tau, values.size)
        qs = self.query_set(taus, num_clients)
        z = values / np.repeat(taus, self.block)[: values.size]
        bits = encode_bits(z, qs, client_index=client_index, seed=seed)
        ref = None if reference is None else _as_float64(reference)
        codes = scale_code(block_spreads(values, self.block, ref))
        body = _BODY.pack(
            FORMAT,
            self.bits,
            CENTERS.index(self.center),
            REFINES.index(self.refine),
            client_index,
            num_clients,
            self.block,
            self.digest(taus, num_clients),
        )
        packed = np.packbits(bits.reshape(-1), bitorder="little")
        dtype = x.dtype if isinstance(x, torch.Tensor) else torch.float32
        shape = tuple(x.shape)
        header = PayloadHeader(ONEBIT_CODEC_ID, dtype, shape, seed & ((1 << 64) - 1))
        return Payload(header=header, body=body + codes.tobytes() + packed.tobytes())

    # ------------------------------------------------------------------ server
    def check(
        self,
        payload: bytes | bytearray | memoryview | Payload,
        *,
        client_index: int,
        num_clients: int,
        seed: int,
        tau: float | Sequence[float] | np.ndarray,
        shape: Sequence[int],
        digest: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Validate one reply against the public plan.

        ``digest`` is :meth:`digest` of the plan when the caller has it (it is the same
        for every reply of a round; computed here otherwise).

        Returns
        -------
        packed : ndarray of uint8
            The packed answer bits.
        codes : ndarray of uint8
            The scale codes, one per block.

        Raises
        ------
        PayloadError
            On anything that does not match: codec, shape, seed, bits, client index,
            client count, block, parameter digest, or length.
        """
        shape = tuple(int(d) for d in shape)
        numel = math.prod(shape)
        parsed = payload if isinstance(payload, Payload) else parse_payload(payload, numel)
        _check_header(parsed.header, shape, seed)
        body = memoryview(parsed.body)
        if len(body) < _BODY.size:
            raise PayloadError(f"truncated onebit payload: {len(body)} body bytes")
        taus = self.block_taus(tau, numel)
        if digest is None:
            digest = self.digest(taus, num_clients)
        self._check_parameters(_BODY.unpack_from(body, 0), client_index, num_clients, digest)
        blocks = self.num_blocks(numel)
        size = -(-numel * self.bits // 8)
        if len(body) != _BODY.size + blocks + size:
            raise PayloadError(
                f"onebit payload body is {len(body)} bytes, expected {_BODY.size + blocks + size}"
            )
        codes = np.frombuffer(body, dtype=np.uint8, count=blocks, offset=_BODY.size)
        packed = np.frombuffer(body, dtype=np.uint8, offset=_BODY.size + blocks)
        return packed, codes

    def _check_parameters(
        self, sent: tuple[int, ...], client_index: int, num_clients: int, digest: int
    ) -> None:
        """The body's fixed fields against this code and the public plan."""
        fmt, bits, center, refine, index, n, block, sent_digest = sent
        expected = {
            "format": (fmt, FORMAT),
            "bits": (bits, self.bits),
            "center": (center, CENTERS.index(self.center)),
            "refine": (refine, REFINES.index(self.refine)),
            "client index": (index, client_index),
            "client count": (n, num_clients),
            "block": (block, self.block),
            "public parameter digest": (sent_digest, digest),
        }
        for what, (got, want) in expected.items():
            check_field("onebit", what, got, want)

    def decode(
        self,
        payloads: Sequence[bytes | bytearray | memoryview | Payload],
        *,
        client_indices: Sequence[int],
        num_clients: int,
        seed: int,
        tau: float | Sequence[float] | np.ndarray,
        shape: Sequence[int],
        weights: Sequence[float] | None = None,
        side_center: torch.Tensor | np.ndarray | None = None,
    ) -> tuple[torch.Tensor, JointDecode]:
        """Decode the weighted mean, with the decoder's diagnostics (units of tau)."""
        shape = tuple(int(d) for d in shape)
        numel = math.prod(shape)
        _check_indices(len(payloads), client_indices)
        taus = self.block_taus(tau, numel)
        weights_arr = _checked_weights(weights, len(payloads))
        digest = self.digest(taus, num_clients)
        packed = [
            self.check(
                p,
                client_index=i,
                num_clients=num_clients,
                seed=seed,
                tau=taus,
                shape=shape,
                digest=digest,
            )[0]
            for p, i in zip(payloads, client_indices, strict=True)
        ]
        tau_k = np.repeat(taus, self.block)[:numel]
        start = None
        if self.center == "previous":
            if side_center is None:
                raise ValueError('onebit: center="previous" needs side_center')
            start = _as_float64(side_center) / tau_k
        received = Received(
            packed=np.stack(packed) if numel else np.zeros((len(packed), 0), np.uint8),
            client_indices=np.asarray(client_indices, dtype=np.int64),
            weights=weights_arr,
        )
        result = self._decode_received(
            received, self.query_set(taus, num_clients), numel=numel, seed=seed, start=start
        )
        if not np.all(np.isfinite(result.mean)):
            raise ValueError("onebit: the decoded mean is not finite (check the weights)")
        mean = torch.from_numpy(result.mean * tau_k).to(torch.float32).reshape(shape)
        return mean, result

    def _decode_received(
        self, received: Received, qs: QuerySet, *, numel: int, seed: int, start: np.ndarray | None
    ) -> JointDecode:
        """The checked replies through the joint decoder: one group (and a lone reply)
        by the fastest available decoder, several by the median of the groups' means."""
        common = {
            "numel": numel,
            "seed": seed,
            "start": start,
            "localize_center": self.center == "inband",
            "min_resultant": self.min_resultant,
        }
        if self.groups == 1 or len(received.client_indices) == 1:
            return decode_one_group(received, qs, **common)
        return decode_joint(received, qs, groups=self.groups, **common)

    def decode_mean(self, payloads, **kwargs) -> torch.Tensor:
        """The weighted mean of the clients' tensors (see :meth:`decode`)."""
        if "shape" not in kwargs:
            kwargs["shape"] = _shape_of(payloads)
        return self.decode(payloads, **kwargs)[0]

    def next_tau(
        self,
        payloads: Sequence[bytes | Payload],
        *,
        shape: Sequence[int],
        previous: np.ndarray | float,
    ) -> np.ndarray:
        """Next round's tau per block: the median over clients of their scale codes
        (blocks where every client sent zero keep ``previous``)."""
        numel = math.prod(int(d) for d in shape)
        blocks = self.num_blocks(numel)
        rows = []
        for p in payloads:
            body = memoryview((p if isinstance(p, Payload) else parse_payload(p, numel)).body)
            rows.append(np.frombuffer(body, np.uint8, count=blocks, offset=_BODY.size))
        prev = np.broadcast_to(np.asarray(previous, dtype=np.float64), (blocks,))
        if not rows:
            return prev.copy()
        spread = np.median(scale_value(np.stack(rows)), axis=0)
        new = np.where(spread > 0, spread, prev)
        # At most 4x per round either way: with few clients the median is one client's
        # code, and one absurd code must not set the scale of the next round.
        return np.clip(new, prev / MAX_TAU_STEP, prev * MAX_TAU_STEP)


def _check_indices(count: int, client_indices: Sequence[int]) -> None:
    """One distinct client index per payload, and at least one payload."""
    if count != len(client_indices):
        raise ValueError("onebit: one client index per payload")
    if len(set(client_indices)) != len(client_indices):
        raise ValueError("onebit: duplicate client indices")
    if not count:
        raise ValueError("onebit: no payloads to decode")


def _checked_weights(weights: Sequence[float] | None, count: int) -> np.ndarray:
    """The replies' weights (all 1 when not given): finite, >= 0, with a positive sum."""
    weights_arr = np.ones(count) if weights is None else np.asarray(weights, float)
    if weights_arr.shape != (count,) or not np.all(np.isfinite(weights_arr)):
        raise ValueError("onebit: weights must be one finite number per payload")
    if np.any(weights_arr < 0) or weights_arr.sum() <= 0:
        raise ValueError("onebit: weights must be >= 0 with a positive sum")
    return weights_arr


def _check_header(h: PayloadHeader, shape: tuple[int, ...], seed: int) -> None:
    """The payload header against the plan: the one-bit codec, the tensor's shape, the
    round's public seed, and a float dtype."""
    check_field("onebit", "codec id", h.codec_id, ONEBIT_CODEC_ID)
    check_field("onebit", "shape", tuple(h.shape), shape)
    check_field("onebit", "public seed", h.seed, seed & ((1 << 64) - 1))
    if not h.dtype.is_floating_point:  # the wrapper also compares it with the model's
        raise PayloadError(f"onebit payload declares a non-float dtype {h.dtype}")


def _as_float64(x: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if not x.is_floating_point():
            raise ValueError(f"onebit needs a floating-point tensor, got {x.dtype}")
        return x.detach().reshape(-1).to(torch.float64).numpy()
    return np.asarray(x, dtype=np.float64).reshape(-1)


def _shape_of(payloads) -> tuple[int, ...]:
    if not payloads:
        raise ValueError("onebit: no payloads to decode")
    first = payloads[0]
    parsed = first if isinstance(first, Payload) else parse_payload(first)
    return tuple(parsed.header.shape)
