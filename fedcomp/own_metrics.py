"""fedcomp's own reply metrics: which names exist, which travel together, what each may be.

The mod adds these measurements to every train reply (fedcomp.keys names them); the
server copies them into the round record. They come from the client, so the server
checks them like any other field of a reply before anything reads them
(:func:`own_metrics_problem`): only known names, each group complete or absent, every
value a finite number in its range. A reply that fails is its sender's failure
(fedcomp.flower.validation), never an error in the round's bookkeeping. The pre-train
evaluation (settings.evaluate_in_train) is checked here too: it is not fedcomp's by
name, but the server reads it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from fedcomp.keys import (
    METRIC_CV_BIAS,
    METRIC_CV_BOUND,
    METRIC_CV_DELTA,
    METRIC_CV_NOISE,
    METRIC_CV_RESIDUAL,
    METRIC_ENCODE_S,
    METRIC_OUT_OF_RANGE,
    METRIC_PRE_TRAIN_ACCURACY,
    METRIC_PRE_TRAIN_EXAMPLES,
    METRIC_PRE_TRAIN_LOSS,
    METRIC_REL_ERROR,
    METRIC_STATE_BYTES,
)

#: Client metric names starting with this prefix are fedcomp's own.
OWN_PREFIX = "fedcomp."

#: The largest byte count a reply may report (1 TiB: more than any model's state).
MAX_REPORTED_BYTES = float(1 << 40)
#: The longest encode time a reply may report, in seconds (a day).
MAX_REPORTED_SECONDS = 86_400.0
#: The largest loss or squared norm a reply may report: finite with room to sum a
#: million of them in float64 (a diverging client reports inf or NaN instead, and is
#: refused for it).
MAX_REPORTED_VALUE = 1e300


@dataclass(frozen=True)
class Bound:
    """A metric's allowed values: a number in [low, high], an integer if ``integer``."""

    low: float
    high: float
    integer: bool = False

    def problem(self, name: str, value: object) -> str:
        """What is wrong with ``value`` ("" when nothing is)."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"{name}={value!r:.40} is not a number"
        if not math.isfinite(value) or not self.low <= value <= self.high:
            return f"{name}={value!r} is not in [{self.low:g}, {self.high:g}]"
        if self.integer and value != int(value):
            return f"{name}={value!r} is not an integer"
        return ""


_NORM2 = Bound(0.0, MAX_REPORTED_VALUE)

#: Every fedcomp metric a reply may carry, with its bounds.
OWN_METRICS: dict[str, Bound] = {
    METRIC_ENCODE_S: Bound(0.0, MAX_REPORTED_SECONDS),
    METRIC_REL_ERROR: _NORM2,
    METRIC_STATE_BYTES: Bound(0.0, MAX_REPORTED_BYTES, integer=True),
    METRIC_OUT_OF_RANGE: Bound(0.0, 1.0),
    METRIC_CV_RESIDUAL: _NORM2,
    METRIC_CV_DELTA: _NORM2,
    METRIC_CV_NOISE: _NORM2,
    METRIC_CV_BOUND: _NORM2,
    # an unbiased estimate of a squared norm: negative when the true value is near 0
    METRIC_CV_BIAS: Bound(-MAX_REPORTED_VALUE, MAX_REPORTED_VALUE),
}

#: The pre-train evaluation's metrics and their bounds (the example count's upper
#: bound is the server's max_num_examples, applied by :func:`pre_train_problem`).
PRE_TRAIN_METRICS: dict[str, Bound] = {
    METRIC_PRE_TRAIN_ACCURACY: Bound(0.0, 1.0),
    METRIC_PRE_TRAIN_LOSS: Bound(0.0, MAX_REPORTED_VALUE),
    METRIC_PRE_TRAIN_EXAMPLES: Bound(1.0, MAX_REPORTED_VALUE, integer=True),
}

#: Metrics that are measured together: a reply carries all of a group or none, except
#: the OPTIONAL names, which may be missing but never come without the rest.
GROUPS: tuple[tuple[str, ...], ...] = (
    (METRIC_CV_RESIDUAL, METRIC_CV_DELTA, METRIC_CV_NOISE, METRIC_CV_BOUND, METRIC_CV_BIAS),
    tuple(PRE_TRAIN_METRICS),
)
#: The noise bound needs the inner codec's omega, which EDEN does not claim; the bias
#: estimate is measured only when the codec asks for it (``bias_draws``).
OPTIONAL = frozenset({METRIC_CV_BOUND, METRIC_CV_BIAS})


def _group_problem(metrics: Mapping[str, object]) -> str:
    for group in GROUPS:
        present = [k for k in group if k in metrics]
        missing = [k for k in group if k not in metrics and k not in OPTIONAL]
        if present and missing:
            return f"carries {', '.join(present)} without {', '.join(missing)}"
    return ""


def own_metrics_problem(metrics: Mapping[str, object], max_examples: float) -> str:
    """What is wrong with a reply's fedcomp metrics and pre-train evaluation ("" when
    nothing is): an unknown fedcomp name, an incomplete group, or a value that is not
    a finite number in its range (the pre-train example count at most
    ``max_examples``)."""
    problem = _group_problem(metrics)
    if problem:
        return problem
    for name, value in metrics.items():
        bound = OWN_METRICS.get(name) or PRE_TRAIN_METRICS.get(name)
        if bound is None:
            if name.startswith(OWN_PREFIX):
                return f"unknown fedcomp metric {name!r:.80}"
            continue
        if name == METRIC_PRE_TRAIN_EXAMPLES:
            bound = Bound(bound.low, max_examples, integer=True)
        problem = bound.problem(name, value)
        if problem:
            return problem
    return ""
