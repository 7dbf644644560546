"""Bounded influence of one client on the mean: pure functions over a round's numbers.

The wrapper applies them to decoded updates; they are kept here, Flower-free, so tests
call them directly. Four rules, each measured against the round's own scale, in the
order the wrapper applies them (docs/reliability.md, "Bounded influence"):

1. Weights: a claimed num-examples is capped at ``weight_cap`` times the round's LOWER
   median claim (:func:`cap_weights`): one client of two cannot raise it.
2. Outliers: an update beyond ``reject_factor`` times the UPPER median norm
   (:func:`rejection_reference`) is rejected; hostile clients cannot lower it.
3. Norms: an update beyond ``norm_cap`` times the reference norm is scaled down to it.
   The reference is the LOWER median norm (:func:`reference_norm`), which fewer than
   half of the clients cannot raise; when half of them pull it down (it falls below
   the upper median by ``collapse_ratio``), it falls back to the last round whose
   reference did not collapse (:func:`robust_reference`). It never disables clipping.
4. Direction: each client's contribution to the weighted mean is held inside a trust
   region around the round's consensus step, the plain mean of the updates each
   clipped to the reference norm (:func:`consensus_coefficients`): at most
   ``push_against`` times the consensus norm against it, ``push_along`` along it and
   ``push_side`` across it. One client moves the consensus by at most
   ``2 x reference / n``.

With a single reply there is no round statistic and the last round's reference (or
only the absolute bounds) applies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

#: The default norm rule's factor: an update is clipped to 10 times the round's
#: reference norm. Measured on honest runs (docs/reliability.md): it never binds there.
DEFAULT_NORM_CAP = 10.0
#: The default weight cap: a claim is capped at 5 times the round's lower median claim.
#: Measured honest ratios: 2.7 (digits, 10 clients, Dirichlet 0.3), 3.5 (16 clients, 4
#: a round), 1.4 (Fashion-MNIST, Dirichlet 0.5); a Dirichlet 0.1 split reaches 5.8.
DEFAULT_WEIGHT_CAP = 5.0
#: The reference norm collapsed when the lower median is below the upper median by
#: more than this factor: half of the updates are near zero.
DEFAULT_COLLAPSE_RATIO = 10.0
#: The consensus trust region, in multiples of the consensus step's norm: how far one
#: client's contribution may push against the consensus, along it and across it.
#: Honest contributions measured: never against it, at most 0.97 along and 1.64 across
#: (experiments/results/influence_honest.md).
DEFAULT_PUSH_AGAINST = 0.5
DEFAULT_PUSH_ALONG = 2.0
DEFAULT_PUSH_SIDE = 3.0
#: The trust region's scale is never below this fraction of the reference norm: late in
#: training the clients' common step shrinks to a sixth of r and below, their
#: differences do not (the digits leaderboard: an honest contribution 0.58 C against the
#: consensus at C = 0.15 r, 0.37 x max(C, r / 4)).
DEFAULT_CONSENSUS_FLOOR = 0.25
#: The default absolute bound on a reply's num-examples (10^9 examples on one client;
#: 10^299 clients would be needed to overflow the total).
MAX_NUM_EXAMPLES = 1e9


@dataclass(frozen=True)
class Influence:
    """The bounds on one client's influence, as the wrapper applies them (the module
    docstring has the four rules).

    weight_cap: cap each reply's num-examples at this multiple of the round's lower
    median claim (0: off). norm_cap: scale an update whose L2 norm exceeds this
    multiple of the round's reference norm down to it (0: off). reject_factor: reject
    a reply whose update norm is beyond this multiple of the upper median norm (0: off):
    a guard against huge finite values. max_num_examples: the largest num-examples a
    reply may claim at all (a reply claiming more is rejected): more than any client
    holds, and small enough that the round's total weight stays finite for any number
    of clients. collapse_ratio: the reference norm falls back to the last clean
    round's when the lower median is this many times below the upper median (0: never).
    push_against, push_along, push_side: the consensus trust region, in multiples of
    the consensus step's norm C (all 0: off). consensus_floor: the region's scale is
    max(C, consensus_floor x the reference norm). escalation: a client bound round after
    round gets less room each time (:func:`room_of`, :func:`next_strikes`).

    With the defaults, one client of n moves the weighted mean update by at most
    ``push_against`` times the consensus step against it (the consensus itself by at
    most 2 / n of the reference norm), whatever weight it claims: docs/reliability.md
    states the bound and what it does not stop.
    """

    weight_cap: float = DEFAULT_WEIGHT_CAP
    norm_cap: float = DEFAULT_NORM_CAP
    reject_factor: float = 1000.0
    max_num_examples: float = MAX_NUM_EXAMPLES
    collapse_ratio: float = DEFAULT_COLLAPSE_RATIO
    push_against: float = DEFAULT_PUSH_AGAINST
    push_along: float = DEFAULT_PUSH_ALONG
    push_side: float = DEFAULT_PUSH_SIDE
    consensus_floor: float = DEFAULT_CONSENSUS_FLOOR
    escalation: bool = True

    @property
    def consensus(self) -> bool:
        """Whether the consensus trust region is on."""
        return self.push_along > 0 or self.push_side > 0 or self.push_against > 0


#: Coordinates per float32 partial sum of squares in :func:`update_norm`.
NORM_ROW = 4096
_TINY32 = float(np.finfo(np.float32).tiny)


def update_norm(deltas: Mapping[str, np.ndarray]) -> float:
    """L2 norm of an update's floating-point tensors.

    Squares are summed in float32 over rows of ``NORM_ROW`` coordinates and the rows in
    float64: relative error at most ``NORM_ROW * 2^-24`` (2.4e-4) in the sum of squares,
    about 1e-6 in practice, at a fifteenth of the time of squaring every coordinate in
    float64 (a model-sized float64 temporary per reply). The norm only feeds the
    median-based rules (outliers, clipping). A tensor whose float32 sum overflows, or is
    so small that its squares underflow, is summed again in float64, so a huge or a tiny
    update gets its true norm.
    """
    return float(np.sqrt(sum(_sum_squares(v) for v in deltas.values() if v.dtype.kind == "f")))


def _sum_squares(value: np.ndarray) -> float:
    flat = np.ascontiguousarray(value).reshape(-1)
    if flat.dtype != np.float64:
        flat = flat.astype(np.float32, copy=False)
        whole = flat.size - flat.size % NORM_ROW
        rows, tail = flat[:whole].reshape(-1, NORM_ROW), flat[whole:]
        with np.errstate(over="ignore"):  # an overflow is caught just below
            total = float(np.einsum("ij,ij->i", rows, rows).sum(dtype=np.float64))
            total += float(np.dot(tail, tail))
        # Squares below float32's smallest normal lose their digits: a sum that small
        # (tiny per coordinate, times the bound's 2^12) is redone in float64 as well.
        if np.isfinite(total) and total >= flat.size * _TINY32 * 2.0**12:
            return total
    return float(np.sum(np.square(flat, dtype=np.float64)))


def weight_cap(weights: Sequence[float], factor: float) -> float | None:
    """The largest weight a reply may claim: ``factor`` x the lower median claim,
    ``sorted(weights)[(n - 1) // 2]`` (None: off). With two claims it is the smaller
    one: a client claiming 10^9 examples beside one honest client weighs at most
    ``factor`` times it (the plain median of two, their mean, it would set at will)."""
    if factor <= 0 or not weights:
        return None
    return factor * lower_median(weights)


def lower_median(values: Sequence[float]) -> float:
    """``sorted(values)[(n - 1) // 2]``: the smaller of the two middle values."""
    return float(sorted(values)[(len(values) - 1) // 2])


def cap_weights(
    weights: Sequence[float], factor: float, room: Sequence[float] | None = None
) -> list[float]:
    """The weights with each one capped at :func:`weight_cap` (unchanged when off).
    ``room``: per weight, the client's room (:func:`room_of`): its cap is
    ``factor * room`` times the lower median (a client that lost its room loses its
    weight with it)."""
    if factor <= 0 or not weights:
        return [float(w) for w in weights]
    lower = lower_median(weights)
    room = room or [1.0] * len(weights)
    return [min(float(w), lower * factor * f) for w, f in zip(weights, room, strict=True)]


def reference_norm(norms: Sequence[float]) -> float | None:
    """The round's reference norm: the lower median, ``sorted(norms)[(n - 1) // 2]``
    (None with fewer than two norms).

    Hostile clients cannot lift it: with at most ``n // 2`` of the n updates hostile,
    at least ``ceil(n / 2)`` are honest, so the ``ceil(n / 2)``-th smallest norm (this
    one) is at most the ``ceil(n / 2)``-th smallest honest norm, however large the
    hostile norms are. With two updates it is the smaller one (the plain median of two
    is their mean, which one hostile client sets at will).
    """
    if len(norms) < 2:
        return None
    return lower_median(norms)


def rejection_reference(norms: Sequence[float]) -> float | None:
    """The norm outliers are measured against: the upper median,
    ``sorted(norms)[n // 2]`` (None with fewer than two norms).

    Hostile clients cannot lower it below the smallest honest norm: with at most
    ``n // 2`` of the n updates hostile, only they can lie below the smallest honest
    norm, so at most ``n // 2`` norms do, and the one at index ``n // 2`` is at least
    that honest norm however small the hostile norms are. With two updates it is the
    larger one: neither can get the other rejected (a large one is clipped instead).
    """
    if len(norms) < 2:
        return None
    return float(sorted(norms)[len(norms) // 2])


def outliers(norms: Sequence[float], factor: float) -> list[bool]:
    """Which updates are beyond ``factor`` x the rejection reference (the upper median;
    none with fewer than two updates)."""
    reference = rejection_reference(norms)
    if factor <= 0 or reference is None:
        return [False] * len(norms)
    bound = factor * reference
    return [norm > bound for norm in norms]


def robust_reference(
    norms: Sequence[float], previous: float | None, collapse_ratio: float
) -> tuple[float | None, bool]:
    """The reference norm the round's updates are clipped against, and whether it fell
    back from the round's own (:func:`reference_norm`).

    It falls back to ``previous`` (the last reference that did not fall back) when the
    round has fewer than two updates, or when its lower median is more than
    ``collapse_ratio`` times below its upper median: then at least half of the updates
    are near zero, and the lower median would clip every other update to nothing. With
    no previous reference the round's lower median stands (it cannot be raised by half
    of the clients, so nothing is let through unclipped; docs/reliability.md says what
    this leaves open).
    """
    reference = reference_norm(norms)
    if reference is None:
        return previous, previous is not None
    upper = rejection_reference(norms)
    assert upper is not None  # two or more norms
    collapsed = collapse_ratio > 0 and reference * collapse_ratio < upper
    if collapsed and previous is not None:
        return previous, True
    return reference, collapsed


def clip_scales(
    norms: Sequence[float],
    factor: float,
    reference: float | None,
    room: Sequence[float] | None = None,
) -> list[float]:
    """Per update, the factor that brings its norm down to ``factor`` x ``reference``
    (times the client's ``room``, :func:`room_of`; 1.0 for those within it; all 1.0
    when ``factor`` is 0 or there is no reference). A reference of 0 clips every
    nonzero update to 0: it never switches clipping off."""
    if factor <= 0 or reference is None:
        return [1.0] * len(norms)
    room = room or [1.0] * len(norms)
    caps = [factor * reference * f for f in room]
    return [cap / norm if norm > cap else 1.0 for norm, cap in zip(norms, caps, strict=True)]


def total_weight_is_finite(weights: Sequence[float]) -> bool:
    """Whether the weights sum to a finite positive total (in float64, the mean's)."""
    total = float(np.sum(np.asarray(weights, dtype=np.float64)))
    return bool(np.isfinite(total) and total > 0)


@dataclass(frozen=True)
class TrustRegion:
    """The consensus trust region, in multiples of the consensus step's norm: how far
    one contribution may reach against the consensus, along it and across it."""

    against: float
    along: float
    side: float


def consensus_coefficients(
    shares: Sequence[float],
    along: Sequence[float],
    norms: Sequence[float],
    consensus_norm: float,
    region: TrustRegion,
    room: Sequence[float] | None = None,
) -> list[tuple[float, float]]:
    """Per update, the coefficients ``(lam, mu)`` of ``u' = lam * u + mu * c`` that hold
    its contribution ``share * u'`` to the weighted mean inside the trust region around
    the consensus direction ``c`` (a unit vector; ``consensus_norm`` is the consensus
    step's norm C).

    Each update is given by its share of the total weight, its component along ``c``
    (``u . c``) and its norm. Its contribution's component along ``c`` is clamped to
    ``[-region.against * C, region.along * C]`` and the part across ``c`` is scaled
    down to at most ``region.side * C``, each bound times the client's ``room``
    (:func:`room_of`); ``(1.0, 0.0)`` leaves an update inside the region exactly as it
    is. With C = 0 every contribution goes to 0.
    """
    out = []
    room = room or [1.0] * len(shares)
    for share, a, norm, f in zip(shares, along, norms, room, strict=True):
        low, high = -region.against * consensus_norm * f, region.along * consensus_norm * f
        side = region.side * consensus_norm * f
        if share <= 0:  # a zero weight contributes nothing, whatever its update
            out.append((1.0, 0.0))
            continue
        across = math.sqrt(max(norm * norm - a * a, 0.0))
        lam = side / (share * across) if share * across > side else 1.0
        reach = share * a
        a_new = a if low <= reach <= high else (high if reach > high else low) / share
        out.append((lam, a_new - lam * a))
    return out


#: The most strikes one round adds (a reply cut to 1/16 of itself or less).
MAX_STRIKES_A_ROUND = 4.0
#: Strikes a client loses in a round no bound changed its reply.
STRIKE_DECAY = 0.5
#: The most strikes a client can hold (room 2^-8): one that was cut by mistake, e.g.
#: against a reference half of the clients pulled down, earns its room back within
#: 16 clean rounds.
MAX_STRIKES = 8.0


def room_of(strikes: float) -> float:
    """The share of the bounds a client with ``strikes`` gets: ``2^-strikes``. Honest
    clients are never bounded (docs/reliability.md has the measurement), so they keep
    0 strikes and their whole room."""
    return 0.5**strikes


def next_strikes(strikes: float, kept: float, decay: float = STRIKE_DECAY) -> float:
    """A client's strikes after a round it took part in: ``log2(1 / kept) - 1`` more
    (at most MAX_STRIKES_A_ROUND) when the norm and direction bounds kept the fraction
    ``kept`` < 1/2 of its update (compounded), ``decay`` fewer (never below 0) when
    they cut none of it. The first halving is free (an honest client far larger than
    the round's median is clipped by a few tens of percent, round after round, and
    must not lose its room for it); a reply cut to a tenth costs 2.3 strikes, so a
    client that is cut hard round after round loses its room geometrically; one that
    behaves earns it back."""
    if kept >= 1.0:
        return max(0.0, strikes - decay)
    cost = MAX_STRIKES_A_ROUND if kept <= 0 else min(MAX_STRIKES_A_ROUND, -math.log2(kept) - 1)
    return min(MAX_STRIKES, strikes + max(0.0, cost))
