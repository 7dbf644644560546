"""The inner Flower strategy, called so that its failure costs one round, never the run.

Flower's strategies raise on replies they did not expect (FedAvg on inconsistent
metric keys, a user's strategy on anything); an exception out of the wrapper's
Strategy methods would end the ServerApp. :class:`InnerCalls` logs the failure with
its traceback and tells the caller, which records it (``inner_failed``) and keeps the
model.
"""

from __future__ import annotations

import logging

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

log = logging.getLogger("fedcomp.flower.strategy")  # one logger for the wrapper's lines


class InnerCalls:
    """Calls into ``strategy``, each returning ``None`` where it raised."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy

    def configure(
        self, method: str, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> list[Message] | None:
        """The inner strategy's instruction templates (``configure_train`` or
        ``configure_evaluate``); None: it failed, nothing is sent."""
        try:
            return list(getattr(self.strategy, method)(server_round, arrays, config, grid))
        except Exception as exc:
            self._log(server_round, method, "nothing is sent", exc)
            return None

    def aggregate_train(
        self, server_round: int, replies: list[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None] | None:
        """The inner strategy's aggregate; None: it failed, the model is kept."""
        try:
            return self.strategy.aggregate_train(server_round, replies)
        except Exception as exc:
            self._log(server_round, "aggregate_train", "the model is kept", exc)
            return None

    def aggregate_evaluate(self, server_round: int, replies: list[Message]) -> MetricRecord | None:
        """Aggregated client metrics; None when the inner strategy failed (evaluation
        is a report: it must not end the run)."""
        try:
            return self.strategy.aggregate_evaluate(server_round, replies)
        except Exception as exc:
            log.error("round %d: client evaluation not aggregated: %s", server_round, exc)
            return None

    def _log(self, server_round: int, method: str, outcome: str, exc: Exception) -> None:
        name = type(self.strategy).__name__
        log.error(
            "round %d: the inner strategy %s failed in %s (%s: %s); %s",
            *(server_round, name, method, type(exc).__name__, exc, outcome),
            exc_info=exc,
        )
