"""What a resumed run needs from the wrapper, gathered from its parts as plain data.

:class:`ServerCheckpoint` asks each stateful part for its state and gives it back:
the inner strategy (through fedcomp.flower.inner_state's adapters; an unsupported
class is refused by name), the acknowledgements, the uplink's mirrors, tree
statistics, one-bit state and reference norm, the round records, and the downlink's
x_hat with its versions and history. Public randomness needs no state. What each
client holds is not saved: a resumed run is a new Flower run, with an empty
Context.state on every node. fedcomp.checkpoint writes the result to disk.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.serverapp.strategy import Strategy

from fedcomp.flower.holdings import ClientHoldings
from fedcomp.flower.inner_state import inner_state_dict, load_inner_state_dict
from fedcomp.flower.replica import ReplicaSender
from fedcomp.flower.round_book import RoundBook
from fedcomp.flower.uplink import Uplink


class ServerCheckpoint:
    """The wrapper's state across rounds, from and into its parts."""

    def __init__(
        self, inner: Strategy, clients: ClientHoldings, uplink: Uplink, book: RoundBook
    ) -> None:
        self.inner, self.clients, self.uplink, self.book = inner, clients, uplink, book
        #: The last round a loaded checkpoint holds (0: a new run).
        self.completed_round = 0

    def state_dict(self, replicas: ReplicaSender | None) -> dict[str, Any]:
        return {
            "accepted_round": dict(self.clients.accepted_round),
            **self.uplink.state_dict(),
            "inner": inner_state_dict(self.inner),
            **self.book.state_dict(),
            "broadcast": replicas.server.state_dict() if replicas else None,
        }

    def load_state_dict(
        self,
        state: Mapping[str, Any],
        replicas: ReplicaSender | None,
        *,
        clients_kept_state: bool = False,
    ) -> None:
        load_inner_state_dict(self.inner, state["inner"])
        self.completed_round = self.book.load_state_dict(dict(state))
        self.clients.accepted_round = {int(k): int(v) for k, v in state["accepted_round"].items()}
        self.uplink.load_state_dict(state)
        if replicas is not None and state.get("broadcast") is not None:
            replicas.server.load_state_dict(state["broadcast"])
            if not clients_kept_state:
                # A new Flower run: Context.state is empty. With the clients' states
                # kept in files, each client still holds its replica; one that does
                # not answers the next step with an error and is then sent x_hat.
                self.clients.forget_all_replicas()
