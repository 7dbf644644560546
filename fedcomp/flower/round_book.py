"""The run's round records: each round closed into its record and line, the run judged at its end.

:class:`RoundBook` holds the records (``results.json``'s rounds) and the initial
model's evaluation, turns a finished round's counts into its record
(fedcomp.flower.round_records), flags a loss that grew (fedcomp.flower.outcome), logs the
round line and calls the ``on_round`` observer; it stops a run whose first rounds
refused every reply, and at the end of the run it fails a run that learned nothing,
diverged or ended no better than it started.
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Any

from flwr.app import MetricRecord

from fedcomp.failures import RunFailed
from fedcomp.flower.outcome import (
    DIVERGING_FACTOR,
    LOSS_FLAG_FACTOR,
    best_loss,
    client_initial_and_final,
    fail_if_diverged,
    fail_if_not_learning,
    fail_if_nothing_learned,
    fail_if_refusing_everything,
    fail_if_stuck_diverged,
    likely_causes,
    loss_growth,
    not_following,
    not_learning,
)
from fedcomp.flower.round_records import bare_record, client_rows, log_line, round_record
from fedcomp.flower.round_state import RoundState
from fedcomp.observers import Reporting

log = logging.getLogger("fedcomp.flower.strategy")  # one logger for the wrapper's lines


class RoundBook:
    """Round records and the initial evaluation, with the run's end-of-run checks.

    ``codec_json`` is the codec spec the clients were sent (recorded per round and
    named in a failed run's advice); ``cv`` the residual mirrors, whose statistics
    the records carry.
    """

    def __init__(self, reporting: Reporting, codec_json: str, cv: Any = None) -> None:
        self.reporting = reporting
        self.codec_json = codec_json
        self.cv = cv
        self.rounds: list[dict[str, Any]] = []
        self.initial_evaluation: dict[str, float] | None = None
        self.num_rounds = 0

    def close(self, server_round: int, central: MetricRecord | None, state: RoundState | None):
        """Record the round's central evaluation (round 0: the initial model's) with
        the round's counts, log its line and tell the observer."""
        central_dict = dict(central) if central is not None else {}
        nonfinite = sorted(
            k for k, v in central_dict.items() if isinstance(v, float) and not math.isfinite(v)
        )
        for key in nonfinite:  # recorded as unavailable, and the run fails at its end
            central_dict[key] = None
        if server_round == 0:
            self._initial(central_dict)
            return
        if state is None or state.number != server_round:
            return
        try:
            record = round_record(
                server_round,
                central_dict,
                state.record,
                client_rows(state.per_client, state.traffic),
                round_s=time.perf_counter() - state.t_start,
                codec_spec=json.loads(self.codec_json),
                tensor_codecs=state.tensor_codecs,
                cv=self.cv,
                traffic=state.traffic,
            )
        except Exception as exc:  # the round's bookkeeping never ends the run
            log.error("round %d: its record could not be built", server_round, exc_info=exc)
            record = bare_record(server_round, central_dict, state.record, exc)
        if nonfinite:
            record["nonfinite_metrics"] = nonfinite
        self._flag_losses(record)
        self.rounds.append(record)
        self._log(record)
        if self.reporting.on_round is not None:
            try:
                self.reporting.on_round(record)
            except Exception as exc:  # an observer (a checkpoint, a display) failing
                log.error("round %d: the on_round observer failed", server_round, exc_info=exc)
        fail_if_refusing_everything(self.rounds)  # after the checkpoint: results are kept
        fail_if_stuck_diverged(self.rounds)

    def _initial(self, central: dict[str, Any]) -> None:
        self.initial_evaluation = central
        if central:
            log.info(
                "round 0/%d | accuracy %.4f loss %.4f (initial model)",
                self.num_rounds,
                central.get("accuracy", float("nan")),
                central.get("loss", float("nan")),
            )

    def last_loss(self) -> float | None:
        """The server's loss after the last recorded round (the clients' federated
        loss when the server does not evaluate; None before any)."""
        if not self.rounds:
            return (self.initial_evaluation or {}).get("loss")
        last = self.rounds[-1]
        loss = last.get("loss")
        return loss if loss is not None else last.get("client_loss")

    def _loss_reference(self) -> float | None:
        """The loss a diverging run is measured against: the initial model's, else the
        first recorded round's."""
        initial = (self.initial_evaluation or {}).get("loss")
        if isinstance(initial, float) and math.isfinite(initial):
            return initial
        return next((r["loss"] for r in self.rounds if r.get("loss") is not None), None)

    def _flag_losses(self, record: dict[str, Any]) -> None:
        growth = loss_growth(record["loss"], self._loss_reference())
        if growth is not None and growth >= DIVERGING_FACTOR:
            record["loss_growth"] = growth
        above_best = loss_growth(
            record["loss"], best_loss((self.initial_evaluation or {}).get("loss"), self.rounds)
        )
        if above_best is not None and above_best >= LOSS_FLAG_FACTOR:
            record["loss_above_best"] = above_best

    def _log(self, record: dict[str, Any]) -> None:
        line = log_line(record, self.num_rounds)
        if record.get("nonfinite_metrics"):
            bad = ", ".join(record["nonfinite_metrics"])
            log.error("%s | DIVERGED: central %s not finite", line, bad)
        elif "loss_growth" in record:
            log.error("%s | DIVERGING: loss %.0fx the initial one", line, record["loss_growth"])
        elif record["replied"] == 0:
            log.warning("%s | NO REPLY ACCEPTED: the model did not change", line)
        elif "loss_above_best" in record:
            log.warning("%s | LOSS %.1fx ITS BEST SO FAR", line, record["loss_above_best"])
        else:
            log.info(line)

    def judge(self, first: int, strategy_name: str) -> None:
        """Fail the run (RunFailed) if its rounds from index ``first`` on learned
        nothing or diverged, or, with the learning check on, if its model ended no
        better than it started."""
        causes = likely_causes(self.codec_json, strategy_name, self.rounds)
        fail_if_nothing_learned(self.rounds[first:])
        fail_if_diverged(self.rounds[first:], causes)
        if not self.reporting.learning_check:
            return
        margin = self.reporting.learning_margin
        if self.initial_evaluation:
            fail_if_not_learning(self.initial_evaluation, self.rounds, margin, causes)
            return
        # No central evaluation: the clients' own evaluation of the initial model when
        # they report one, and in any case whether the model followed their updates.
        pair = client_initial_and_final(self.rounds)
        why = not_learning(*pair, margin) if pair is not None else None
        if why is not None:
            raise RunFailed(
                f"the model did not learn: by the clients' own evaluation, its {why}. {causes}"
            )
        why = not_following(self.rounds[first:])
        if why is not None:
            raise RunFailed(f"the model did not learn: {why}. {causes}")

    def state_dict(self) -> dict[str, Any]:
        return {
            "rounds": list(self.rounds),
            "initial_evaluation": self.initial_evaluation,
            "completed_round": self.rounds[-1]["round"] if self.rounds else 0,
        }

    def load_state_dict(self, state: dict[str, Any]) -> int:
        """Restore the records; return the last completed round."""
        self.rounds = list(state["rounds"])
        self.initial_evaluation = state["initial_evaluation"]
        return int(state["completed_round"])


def print_through_flower() -> None:
    """A plain Flower app configures only Flower's logger: when nothing would print
    fedcomp's round lines, print them with Flower's own console handlers (an app
    that configured logging itself keeps its configuration)."""
    ours = logging.getLogger("fedcomp")
    if ours.hasHandlers():
        return
    for handler in logging.getLogger("flwr").handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.INFO)
