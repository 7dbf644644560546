"""Bounded influence of one client on the mean: pure functions over a round's numbers.

The wrapper applies them to decoded updates; they are kept here, Flower-free, so tests
call them directly. The norm rules measure each update against the round's own scale.
Clipping uses the LOWER median of the update norms (:func:`reference_norm`): with two
replies it is the smaller one, so one hostile client among two cannot raise the bound
it is held to, and with n replies fewer than half of them (rounded up) cannot.
Rejection uses the UPPER median (:func:`rejection_reference`), which hostile clients
cannot lower: with up to half of the replies zero or tiny, no honest update is
rejected (the lower median would make every honest update an "outlier" and leave the
hostile half alone in the mean). With a single reply there is no reference and only
the absolute bounds apply.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

#: The default norm rule's factor: an update is clipped to 10 times the round's
#: reference norm. Measured on honest runs (docs/reliability.md): it never binds there.
DEFAULT_NORM_CAP = 10.0
#: The default absolute bound on a reply's num-examples (10^9 examples on one client;
#: 10^299 clients would be needed to overflow the total).
MAX_NUM_EXAMPLES = 1e9


@dataclass(frozen=True)
class Influence:
    """The bounds on one client's influence, as the wrapper applies them.

    weight_cap: cap each reply's num-examples at this multiple of the round's median
    report (0: off). norm_cap: scale an update whose L2 norm exceeds this multiple of the
    round's reference norm (:func:`reference_norm`) down to it (0: off; clipping, not
    rejection); on by default at a factor honest runs do not reach (docs/reliability.md
    has the measurement). reject_factor: reject a reply whose update norm is beyond this
    multiple of the reference norm (0: off): a guard against huge finite values.
    max_num_examples: the largest num-examples a reply may claim at all (a reply
    claiming more is rejected): more than any client holds, and small enough that the
    round's total weight stays finite for any number of clients.

    With the defaults one client moves the mean update by at most ``norm_cap`` times
    the reference norm, whatever weight it claims: the aggregate is a weighted mean of
    updates each clipped to that norm.
    """

    weight_cap: float = 0.0
    norm_cap: float = DEFAULT_NORM_CAP
    reject_factor: float = 1000.0
    max_num_examples: float = MAX_NUM_EXAMPLES


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
    """The largest weight a reply may claim: ``factor`` x the median (None: off)."""
    if factor <= 0 or not weights:
        return None
    return factor * float(np.median(weights))


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
    return float(sorted(norms)[(len(norms) - 1) // 2])


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


def clip_scales(
    norms: Sequence[float], factor: float, fallback: float | None = None
) -> list[float]:
    """Per update, the factor that brings its norm down to ``factor`` x the reference
    norm (1.0 for those within it). With fewer than two updates the round has no
    reference of its own and ``fallback`` (the last round's) is used; without one,
    all 1.0."""
    reference = reference_norm(norms)
    if reference is None:
        reference = fallback
    if factor <= 0 or reference is None:
        return [1.0] * len(norms)
    cap = factor * reference
    return [cap / norm if norm > cap > 0 else 1.0 for norm in norms]


def total_weight_is_finite(weights: Sequence[float]) -> bool:
    """Whether the weights sum to a finite positive total (in float64, the mean's)."""
    total = float(np.sum(np.asarray(weights, dtype=np.float64)))
    return bool(np.isfinite(total) and total > 0)
