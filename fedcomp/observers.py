"""What the wrapper reports besides its round records: one settings object.

``Reporting`` groups the optional observers of a run and the names the round line
reads from the clients' aggregated evaluation metrics. Every aggregated metric is
recorded in the round's ``client_metrics`` whatever these names are; they only choose
what the round line (and the ``client_accuracy``/``client_loss`` fields) show.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

#: Flower's quickstarts report eval_acc/eval_loss, other apps accuracy/loss: the first
#: name present is shown.
ACCURACY_KEYS = ("eval_acc", "accuracy", "eval_accuracy", "acc")
LOSS_KEYS = ("eval_loss", "loss")
#: A run must end at least five accuracy points above its initial model, and its loss
#: below the initial, to count as learning: a model stuck at one class of ten moves
#: from about 0.06 to 0.10 (FedMedian on sparse updates did exactly that, loss flat).
LEARNING_MARGIN = 0.05


@dataclass(frozen=True)
class Reporting:
    """Observers of a run and the client metric names the round line shows.

    on_round: called with each finished round's record (the results.json round shape).
    update_probe: diagnostics, ``probe(round, global_arrays, new_arrays, stable_ids)``
    returns numbers recorded as the round's ``diagnostics`` (fedcomp.diagnostics).
    accuracy_keys, loss_keys: aggregated client-evaluation metric names, first present
    wins.
    learning_check: whether a run whose model ends no better than it started fails at
    its end (``RunFailed``); it needs central evaluation (an ``evaluate_fn``).
    learning_margin: the accuracy a run must gain over its initial model to count as
    learning (absolute, e.g. 0.05 = five points); its central loss must also end below
    the initial loss.
    """

    on_round: Callable[[dict[str, Any]], None] | None = None
    update_probe: Callable[..., Mapping[str, float]] | None = None
    accuracy_keys: tuple[str, ...] = ACCURACY_KEYS
    loss_keys: tuple[str, ...] = LOSS_KEYS
    learning_check: bool = True
    learning_margin: float = LEARNING_MARGIN

    def __post_init__(self) -> None:
        if not 0 <= self.learning_margin < 1:
            raise ValueError(
                f"invalid setting learning_margin={self.learning_margin!r}: must be in [0, 1)"
            )
        for name in ("accuracy_keys", "loss_keys"):
            keys = getattr(self, name)
            if isinstance(keys, str) or not all(isinstance(k, str) and k for k in keys):
                raise ValueError(
                    f"invalid setting {name}={keys!r}: a tuple of metric names, e.g. "
                    f"{getattr(type(self), name)!r}"
                )
