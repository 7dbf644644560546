"""Building the inner Flower strategy from a spec (``{"name": "fedadam", "eta": 0.01}``)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from flwr.serverapp.strategy import Strategy

from fedcomp.flower.inner_state import STATE_ATTRIBUTES
from fedcomp.settings import STRATEGIES

_CHECKPOINTED = {cls.__name__.lower(): cls for cls in STATE_ATTRIBUTES}
#: The strategy each name of fedcomp.settings.STRATEGIES builds: the Flower class of
#: that name, lowercased, among those fedcomp.flower.inner_state can checkpoint (a name
#: without one is a KeyError here, at import).
INNER_STRATEGIES: dict[str, type[Strategy]] = {name: _CHECKPOINTED[name] for name in STRATEGIES}

#: Sampling belongs to the wrapper (seeded, over stable ids): these are set here.
_MANAGED = {
    "fraction_train",
    "fraction_evaluate",
    "min_train_nodes",
    "min_evaluate_nodes",
    "min_available_nodes",
}


def make_inner_strategy(
    spec: Mapping[str, Any],
    num_nodes: int,
    *,
    fraction_train: float = 1.0,
    fraction_evaluate: float = 1.0,
) -> Strategy:
    """Build a Flower strategy from a spec; unknown names or parameters fail fast.

    The sampling settings go to the inner strategy, the one place the wrapper reads
    them from: the fractions, at least one node per round, and ``num_nodes`` to wait
    for before the first round.
    """
    if "name" not in spec:
        raise ValueError(f"strategy spec needs a 'name', got {dict(spec)!r}")
    name = str(spec["name"])
    if name not in INNER_STRATEGIES:
        raise ValueError(
            f"invalid setting strategy.name={name!r}: allowed: {', '.join(INNER_STRATEGIES)}"
        )
    cls = INNER_STRATEGIES[name]
    params = {k: v for k, v in spec.items() if k != "name"}
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
    bad = sorted(k for k in params if k not in accepted or k in _MANAGED)
    if bad:
        allowed = sorted(
            accepted - _MANAGED - {"train_metrics_aggr_fn", "evaluate_metrics_aggr_fn"}
        )
        raise ValueError(
            f"invalid setting(s) {', '.join('strategy.' + k for k in bad)} for {name}; "
            f"allowed: {', '.join(allowed)} (sampling is set by fraction_train/fraction_evaluate)"
        )
    return cls(
        fraction_train=fraction_train,
        fraction_evaluate=fraction_evaluate,
        min_train_nodes=1,
        min_evaluate_nodes=1,
        min_available_nodes=num_nodes,
        **params,
    )
