"""The statistics that decide where the one-bit code can win, measured on the clients'
exact updates of a round (simulation diagnostics only: fedcomp.diagnostics).

Per coordinate the clients' values x_i have a center c (their median); the spread tau
is the one-bit code's own scale, one per block of BLOCK coordinates (its default
block): 1.4826 times the median of |x_i - c| over the block's clients and coordinates
(the standard deviation for Gaussian values). The one-bit code (docs/onebit.md) must
cover the range its clients' values can take, lambda, with bits whose error scales
with tau; fixed-range codes spend their levels on lambda. Its reference study's
crossover: it wins at b bits a coordinate when lambda^2 / (3 (2^b - 1)^2) > V / b, with
V about 180 for tails like a Student-t with 4 degrees of freedom and 1,000 at 2.5, and
it loses at 1.5.

Measured per round over the sampled coordinates:

- ``offset_ratio``: the median over coordinates of |c| / tau (a common offset);
- ``range_ratio``: the 99th percentile over coordinates of max_i |x_i| / tau (lambda /
  tau, the range a fixed code covers, in spreads);
- ``tail_index``: Hill's estimator on the pooled |x_i - c| / tau (its top 2%): a
  Student-t's degrees of freedom;
- ``kurtosis``: the pooled excess kurtosis of (x_i - c) / tau (0 for Gaussian values);
- ``onebit_margin``: the crossover's left side over its right side at 1 bit (above 1:
  the one-bit code's regime, by its reference study).
"""

from __future__ import annotations

import math

import numpy as np

#: The crossover's constant V against the tail index: (degrees of freedom, V) measured in
#: the one-bit code's reference study; log V is interpolated linearly between them.
CROSSOVER = ((2.5, 1000.0), (4.0, 180.0))
#: Below this tail index the one-bit code loses whatever the range (its study: df 1.5).
HEAVIEST = 2.0
#: Coordinates sharing one spread, as the one-bit code's tau blocks do.
BLOCK = 1024


def center_and_spread(
    stack: np.ndarray, block: int = BLOCK
) -> tuple[np.ndarray, np.ndarray]:
    """Per coordinate (column) of a (clients x coordinates) stack: the median over the
    clients, and the spread of its block of ``block`` consecutive columns, 1.4826
    times the median of |x - center| over the block (repeated for each column)."""
    x = np.asarray(stack, dtype=np.float64)
    center = np.median(x, axis=0)
    deviation = np.abs(x - center)
    tau = np.empty(x.shape[1])
    for start in range(0, x.shape[1], block):
        part = slice(start, start + block)
        tau[part] = 1.4826 * np.median(deviation[:, part])
    return center, tau


def hill_tail_index(magnitudes: np.ndarray, top: float = 0.02) -> float:
    """Hill's estimator of the tail index from the largest ``top`` share of positive
    magnitudes: 1 / mean(log(x_(i) / x_(k+1))) over the k largest."""
    x = np.sort(np.asarray(magnitudes, dtype=np.float64)[magnitudes > 0])[::-1]
    k = max(2, int(top * x.size))
    if x.size <= k:
        return math.nan
    logs = np.log(x[:k] / x[k])
    mean = float(logs.mean())
    return 1.0 / mean if mean > 0 else math.inf


def crossover_constant(tail_index: float) -> float:
    """V at this tail index (log-linear between the study's points, held beyond them;
    infinite below HEAVIEST: the code does not win there)."""
    if not math.isfinite(tail_index):
        return CROSSOVER[-1][1] if tail_index > 0 else math.inf
    if tail_index < HEAVIEST:
        return math.inf
    (d0, v0), (d1, v1) = CROSSOVER
    t = min(1.0, max(0.0, (tail_index - d0) / (d1 - d0)))
    return math.exp((1 - t) * math.log(v0) + t * math.log(v1))


def onebit_margin(range_ratio: float, tail_index: float, bits: int = 1) -> float:
    """lambda^2 / (3 (2^b - 1)^2) over V / b: above 1, the one-bit code's regime."""
    v = crossover_constant(tail_index)
    if math.isinf(v):
        return 0.0
    return (range_ratio**2 / (3 * (2**bits - 1) ** 2)) / (v / bits)


def spread_statistics(stack: np.ndarray) -> dict[str, float]:
    """The module's statistics of a (clients x coordinates) stack of exact updates
    (coordinates whose spread is zero are left out)."""
    x = np.asarray(stack, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 3:
        return {}
    center, tau = center_and_spread(x)
    keep = tau > 0
    if not keep.any():
        return {}
    x, center, tau = x[:, keep], center[keep], tau[keep]
    z = (x - center) / tau
    range_ratio = float(np.percentile(np.abs(x).max(axis=0) / tau, 99))
    pooled = z.reshape(-1)
    tail = hill_tail_index(np.abs(pooled))
    std = float(pooled.std())
    return {
        "offset_ratio": float(np.median(np.abs(center) / tau)),
        "range_ratio": range_ratio,
        "tail_index": tail,
        "kurtosis": float(np.mean((pooled - pooled.mean()) ** 4) / std**4 - 3.0) if std else 0.0,
        "onebit_margin": onebit_margin(range_ratio, tail),
    }
