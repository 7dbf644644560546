"""The one-bit code's query set, bit shares and inclusion probabilities (docs/onebit.md).

Everything here is in units of tau: a client's value x becomes z = x / tau before any
query is asked, so one query set serves every block of a tensor.

Queries (each answered with one bit):

- ``LOC(l, phi)``: ``1{(z - phi P_l / 4) mod P_l >= P_l / 2}``, quadrature square waves
  that localize the coarse center;
- ``BASE(b)``: ``1{U L_0 < rho(L_0, b, z)}`` with a public uniform U;
- ``REF(j, b', t)``: ``1{rho(2 L_j, b', z) >= t L_j}`` (deterministic refinement), or, with
  ``refine="stochastic"``, the seed note's ``SREF(j, b, b')``:
  ``1{3 L_j U <= f_{j,b,b'}(z) + L_j}``.

Every query is one row of a small table (:class:`QuerySet`); the encoder and the decoder
evaluate all rows with the same vectorized formula
``1{(z - offset) mod period >= threshold + U * dither}`` (SREF has its own).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

KIND_LOC = 0
KIND_BASE = 1
KIND_REF = 2
KIND_SREF = 3

#: (b', t) pairs of the deterministic refinement queries, and their share within a scale.
REF_PAIRS = ((0, 1.0), (0, 0.5), (0, 1.5), (1, 0.5), (1, 1.5))
REF_PAIR_SHARES = (0.26, 0.185, 0.185, 0.185, 0.185)
#: (b, b') pairs of the stochastic refinement queries (equal shares).
SREF_PAIRS = ((0, 0), (0, 1), (1, 0), (1, 1))

CENTERS = ("inband", "previous", "zero")
REFINES = ("deterministic", "stochastic")


@dataclass(frozen=True)
class Geometry:
    """The scales of the code, in units of tau.

    Attributes
    ----------
    base : float
        ``L_0 = a0`` (a0 = 8 by default).
    num_scales : int
        ``J``: refinement scales j = 0..J-1 link ``L_j`` to ``L_{j+1}``; ``L_J >= top``.
    periods : tuple of float
        Localization periods ``P_0 > P_1 > ... >= 2 L_0`` (empty when the range needs none).
    """

    base: float
    num_scales: int
    periods: tuple[float, ...]

    def scale(self, j: int) -> float:
        return self.base * 2.0**j

    @property
    def top(self) -> float:
        """``L_J``: values farther than ``L_J / 4`` from the center wrap."""
        return self.scale(self.num_scales)


def make_geometry(
    lam_over_tau: float, *, top: float = 8192.0, a0: float = 8.0, localize: bool = True
) -> Geometry:
    """Scales ``L_j`` and localization periods ``P_l`` for a range ``lambda / tau``.

    Parameters
    ----------
    lam_over_tau : float
        The range bound in units of tau (``|center| <= lambda``).
    top : float
        ``L_J`` is the smallest ``a0 * 2^J >= top``.
    a0 : float
        ``L_0`` in units of tau.
    localize : bool
        Whether in-band localization periods are needed (``center="inband"``).
    """
    if not (math.isfinite(lam_over_tau) and lam_over_tau >= 0):
        raise ValueError(f"onebit: lambda / tau must be finite and >= 0, got {lam_over_tau!r}")
    if not (math.isfinite(top) and top > 0 and math.isfinite(a0) and a0 > 0):
        raise ValueError(f"onebit: top and a0 must be positive, got top={top!r}, a0={a0!r}")
    num_scales = max(0, math.ceil(math.log2(top / a0) - 1e-12))
    periods: list[float] = []
    if localize and lam_over_tau > 0:
        p = a0 * 2.0 ** math.ceil(math.log2(4 * lam_over_tau / a0))
        while p >= 2 * a0:
            periods.append(p)
            p /= 2
    return Geometry(base=a0, num_scales=num_scales, periods=tuple(periods))


@dataclass(frozen=True)
class QuerySet:
    """The public query table of one tensor, and the round's bit allocation.

    Arrays are indexed by query q. ``counts[q]`` is ``t_q = n b p_q`` (capped at n),
    ``inclusion[q]`` is ``pi_q = t_q / n``, ``cuts`` the cumulative sums
    ``C_0 = 0 .. C_Q = n b`` used by systematic sampling.
    """

    geometry: Geometry
    kind: np.ndarray  # int8
    scale_index: np.ndarray  # int16: l for LOC, j for REF/SREF, 0 for BASE
    phase: np.ndarray  # int8: phi, b, b' (REF), or b (SREF)
    phase2: np.ndarray  # int8: b' for SREF, else 0
    offset: np.ndarray  # float64
    period: np.ndarray  # float64
    threshold: np.ndarray  # float64
    dither: np.ndarray  # float64: coefficient of U (BASE: L_0)
    counts: np.ndarray  # float64
    inclusion: np.ndarray  # float64
    cuts: np.ndarray  # float64, length Q + 1
    num_clients: int
    bits: int

    @property
    def num_queries(self) -> int:
        return int(self.kind.size)

    @property
    def num_loc(self) -> int:
        return int(np.count_nonzero(self.kind == KIND_LOC))

    def needs_uniform(self) -> np.ndarray:
        """Which queries draw a public U (BASE, and SREF)."""
        return (self.kind == KIND_BASE) | (self.kind == KIND_SREF)


def _rows(geometry: Geometry, refine: str, decay: float) -> tuple[list[tuple], list[float]]:
    """Query rows ``(kind, scale, phase, phase2, offset, period, threshold, dither)``
    and their relative shares, before the LOC/BASE/REF totals are applied."""
    loc: list[tuple] = []
    for level, p in enumerate(geometry.periods):
        for phi in (0, 1):
            loc.append((KIND_LOC, level, phi, 0, phi * p / 4, p, p / 2, 0.0))
    l0 = geometry.base
    base = [(KIND_BASE, 0, b, 0, b * l0 / 2, l0, 0.0, l0) for b in (0, 1)]
    ref: list[tuple] = []
    ref_share: list[float] = []
    weights = [2.0 ** (-decay * j) for j in range(geometry.num_scales)]
    total = sum(weights) or 1.0
    for j in range(geometry.num_scales):
        lj = geometry.scale(j)
        if refine == "deterministic":
            for (bp, t), share in zip(REF_PAIRS, REF_PAIR_SHARES, strict=True):
                ref.append((KIND_REF, j, bp, 0, bp * lj, 2 * lj, t * lj, 0.0))
                ref_share.append(weights[j] / total * share)
        else:
            for b, bp in SREF_PAIRS:
                ref.append((KIND_SREF, j, b, bp, 0.0, 0.0, 0.0, 3 * lj))
                ref_share.append(weights[j] / total / len(SREF_PAIRS))
    return loc + base + ref, [0.0] * len(loc) + [0.5, 0.5] + ref_share


def allocate(shares: np.ndarray, num_clients: int, bits: int) -> np.ndarray:
    """Slots per query ``t_q = n b p_q``, capped at n, the excess spread over the rest.

    The cap is what makes every client's b queries distinct: a query's interval in
    the systematic sample is at most n slots long, and one client's slots are n apart.
    """
    total = float(num_clients * bits)
    counts = np.zeros_like(shares)
    free = shares > 0
    remaining = total
    while True:
        share_sum = shares[free].sum()
        if share_sum <= 0:
            raise ValueError(
                f"onebit: {bits} bits per client exceed the {np.count_nonzero(shares > 0)}"
                " queries this code asks; lower bits"
            )
        trial = np.where(free, shares / share_sum * remaining, counts)
        over = free & (trial > num_clients)
        if not over.any():
            counts = trial
            break
        counts[over] = num_clients
        remaining -= num_clients * np.count_nonzero(over)
        free &= ~over
    # Tiny float drift must not leave the last cut short of n b: rescale only the
    # uncapped counts (a capped count above n could hand a client one query twice).
    capped = counts >= num_clients
    rest = counts[~capped].sum()
    if rest > 0:
        counts[~capped] *= (total - num_clients * np.count_nonzero(capped)) / rest
    return counts


def build_query_set(
    geometry: Geometry,
    *,
    num_clients: int,
    bits: int,
    refine: str = "deterministic",
    decay: float = 0.5,
    loc_votes: float = 20.0,
    loc_share_range: tuple[float, float] = (0.1, 0.5),
    base_share: float = 0.2,
) -> QuerySet:
    """The query table and its allocation for ``num_clients`` clients sending ``bits`` each.

    Shares follow docs/onebit.md: LOC in total ``clip(loc_votes * #LOC / (n b), lo, hi)``
    (about ``loc_votes`` answers per localization query), BASE ``base_share``, and the
    refinement queries the rest, ``2^(-decay j)`` across scales (``decay = 0`` is the
    seed note's 1/r density: equal mass per dyadic scale).
    """
    if refine not in REFINES:
        raise ValueError(f"onebit: refine must be one of {REFINES}, got {refine!r}")
    if num_clients < 1 or bits < 1:
        raise ValueError(f"onebit: need num_clients >= 1 and bits >= 1, got {num_clients}, {bits}")
    rows, rel = _rows(geometry, refine, decay)
    rel_arr = np.asarray(rel, dtype=np.float64)
    kind = np.asarray([r[0] for r in rows], dtype=np.int8)
    num_loc = int(np.count_nonzero(kind == KIND_LOC))
    loc_total = 0.0
    if num_loc:
        lo, hi = loc_share_range
        loc_total = min(max(loc_votes * num_loc / (num_clients * bits), lo), hi)
        rel_arr[kind == KIND_LOC] = loc_total / num_loc
    ref_mask = (kind == KIND_REF) | (kind == KIND_SREF)
    base_total = base_share if ref_mask.any() else 1.0 - loc_total
    rel_arr[kind == KIND_BASE] *= base_total
    rel_arr[ref_mask] *= max(0.0, 1.0 - loc_total - base_total)
    if ref_mask.any() and 1.0 - loc_total - base_total <= 0:
        raise ValueError(
            f"onebit: base_share={base_share} and the localization share {loc_total:.2f} "
            "leave no bits for the refinement queries; lower base_share"
        )
    counts = allocate(rel_arr, num_clients, bits)
    cuts = np.concatenate([[0.0], np.cumsum(counts)])
    cuts[-1] = float(num_clients * bits)
    table = np.asarray([r[4:] for r in rows], dtype=np.float64).reshape(-1, 4)
    return QuerySet(
        geometry=geometry,
        kind=kind,
        scale_index=np.asarray([r[1] for r in rows], dtype=np.int16),
        phase=np.asarray([r[2] for r in rows], dtype=np.int8),
        phase2=np.asarray([r[3] for r in rows], dtype=np.int8),
        offset=table[:, 0].copy(),
        period=table[:, 1].copy(),
        threshold=table[:, 2].copy(),
        dither=table[:, 3].copy(),
        counts=counts,
        inclusion=counts / num_clients,
        cuts=cuts,
        num_clients=num_clients,
        bits=bits,
    )
