"""Server-side reduction of decoded client updates (pure numpy, no flwr).

The reduction-tree issue generalizes this to variance-aware trees and low precision;
for now it is Flower's FedAvg weighting done in a FIXED order (the caller passes the
updates sorted by stable client id), so the result never depends on reply order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch


def weighted_mean(
    updates: Sequence[Mapping[str, np.ndarray] | Callable[[], Mapping[str, np.ndarray]]],
    weights: Sequence[float],
) -> dict[str, np.ndarray]:
    """sum_i (w_i / W) x_i per tensor, accumulated in the tensors' own dtype, in order.

    An update may be given as a function that returns it: it is then called when its
    turn comes and not kept, so only the running sum and one update are alive (the
    streaming hand-off); the arithmetic is the same either way.

    Like Flower's ``aggregate_arrayrecords`` (factor w_i / W first, then a running
    sum), but each step ``acc + factor * x`` is one fused torch pass instead of a
    product and a sum: one memory pass per client, and one rounding per step where
    Flower has two. With one update the result is that update, exactly.
    Integer tensors (counters such as ``num_batches_tracked``) are averaged in float64
    and rounded back to their dtype, where Flower would silently turn them into floats.

    Raises
    ------
    ValueError
        On no updates, mismatched lengths, or weights that are not positive and finite.
    """
    if not updates:
        raise ValueError("weighted_mean needs at least one update")
    if len(updates) != len(weights):
        raise ValueError(f"{len(updates)} updates but {len(weights)} weights")
    if any(not np.isfinite(w) or w <= 0 for w in weights):
        raise ValueError(f"weights must be positive and finite, got {list(weights)!r}")
    mean = RunningMean(float(sum(weights)))
    for given, weight in zip(updates, weights, strict=True):
        mean.add(given() if callable(given) else given, weight)
    return mean.result()


class RunningMean:
    """The running sum of :func:`weighted_mean`, one update at a time, with the total
    weight ``W`` known in advance: ``add`` each update in order, then ``result``.

    The same operations in the same order as ``weighted_mean``, so the two agree to
    the last bit; the wrapper uses it to sum updates while it first decodes them.
    """

    def __init__(self, total: float) -> None:
        self.total = total
        self.sums: dict[str, torch.Tensor] = {}
        self.dtypes: dict[str, np.dtype] = {}

    def add(self, update: Mapping[str, np.ndarray], weight: float) -> None:
        """``acc += (weight / W) * update``, per tensor, in one fused pass."""
        factor = weight / self.total
        for name, value in update.items():
            self.dtypes.setdefault(name, value.dtype)
            x = torch.from_numpy(value if value.flags.c_contiguous else value.copy())
            if value.dtype.kind != "f":
                x = x.to(torch.float64)
            if name in self.sums:
                self.sums[name].add_(x, alpha=factor)
            else:
                self.sums[name] = x * factor

    def result(self) -> dict[str, np.ndarray]:
        """The mean per tensor; integer tensors rounded back to their dtype."""
        return {
            name: value.numpy()
            if self.dtypes[name].kind == "f"
            else np.rint(value.numpy()).astype(self.dtypes[name])
            for name, value in self.sums.items()
        }
