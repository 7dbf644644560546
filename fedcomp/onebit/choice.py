"""When to use the one-bit code rather than a fixed-range (dithered uniform) code or EDEN.

docs/onebit.md's crossover: per client and coordinate, subtractive-dither uniform on the
range [-lambda, lambda] has error variance ``lambda^2 / (3 (2^b - 1)^2)``; the one-bit
code about ``V(df) / b`` (tau = 1), where V depends on the tail of the updates. One-bit
is preferred when the first is larger, and, with the in-band center, only when the
round has enough answers to localize (``n b >= 240``).

V is calibrated on this repository's own benchmark (``make bench-dme``, top = 8192 tau,
MSE x n b at n = 1000, b = 1): about 230 at df 4, 770 at df 2.5, 1.5e4 at df 1.5
(docs/onebit.md's reference study: 180 and 1000; df 1.5 grows with the top scale).
"""

from __future__ import annotations

import itertools
import math

#: Measured per-client variance factor V(df), units of tau^2 (see the module docstring).
TAIL_VARIANCE = {1.5: 1.5e4, 2.5: 770.0, 4.0: 230.0}
#: Answers per coordinate the in-band center needs (docs/onebit.md).
INBAND_MIN_ANSWERS = 240


def tail_variance(df: float) -> float:
    """V(df), log-linear between the measured points (clamped outside them)."""
    points = sorted(TAIL_VARIANCE.items())
    if df <= points[0][0]:
        return points[0][1]
    if df >= points[-1][0]:
        return points[-1][1]
    for (d0, v0), (d1, v1) in itertools.pairwise(points):
        if d0 <= df <= d1:
            t = (df - d0) / (d1 - d0)
            return math.exp((1 - t) * math.log(v0) + t * math.log(v1))
    raise AssertionError(df)


def eden_variance(lam_over_tau: float, bits: int, tail_df: float) -> float:
    """EDEN's per-coordinate error variance for updates ``mu + tau t_df`` with mu uniform
    in [-lambda, lambda] (tau = 1): ``nu_b E[x^2]``, where ``nu_b = D_b / (1 - D_b)`` is its
    normalized MSE (D_b the Lloyd-Max distortion of N(0, 1): nu_1 = pi/2 - 1) and
    ``E[x^2] = lambda^2 / 3 + df / (df - 2)``, infinite for df <= 2: EDEN's error grows
    with the vector's norm, one-bit's with the spread around its center."""
    if bits > 4:
        return math.inf  # EDEN is defined here for 1..4 bits
    if tail_df <= 2:
        return math.inf
    from fedcomp.codecs.eden import normalized_mse  # lazily: the core of the codecs

    return normalized_mse(bits) * (lam_over_tau**2 / 3 + tail_df / (tail_df - 2))


def prefer_onebit(
    lam_over_tau: float, bits: int, num_clients: int, tail_df: float, center: str = "inband"
) -> bool:
    """True when the one-bit code is expected to beat both dithered uniform and EDEN at
    ``bits`` (all three errors of the mean fall as 1/n, so n only gates the center)."""
    if center == "inband" and num_clients * bits < INBAND_MIN_ANSWERS:
        return False
    dither = lam_over_tau**2 / (3 * (2**bits - 1) ** 2)
    best_baseline = min(dither, eden_variance(lam_over_tau, bits, tail_df))
    return best_baseline > tail_variance(tail_df) / bits
