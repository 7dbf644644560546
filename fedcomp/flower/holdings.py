"""What the server knows each client holds, in one place.

A client is known by its stable id (learned at first contact, fedcomp.flower.identity).
Beyond it the server tracks what decides the next instruction's shape: the message
kinds the client's mod handles (declared in reply headers), whether it holds the run
settings (fedcomp.flower.shared_settings), which downlink replica it holds
(fedcomp.flower.replica), and the last round whose reply was accepted (the
acknowledgement that lets the client commit the state that reply produced).

A node that disconnects or reconnects under a new node id is assumed to hold nothing;
an error reply makes its settings and replica unknown.
"""

from __future__ import annotations

import logging

from flwr.app import Message
from flwr.serverapp import Grid

from fedcomp.flower.identity import DEFAULT_REPLY_TIMEOUT, StableIds
from fedcomp.flower.replica import ReplicaSender
from fedcomp.flower.reply_format import reply_header
from fedcomp.flower.shared_settings import SharedSettings
from fedcomp.keys import KEY_HANDLES
from fedcomp.traffic import Traffic

log = logging.getLogger("fedcomp.flower.strategy")  # one logger for the wrapper's lines


class ClientHoldings:
    """Stable ids, declared message kinds, held settings, replicas and acks.

    ``reply_timeout`` and ``bind_keys`` are :class:`~fedcomp.flower.identity.StableIds`'s.
    """

    def __init__(
        self,
        shared: SharedSettings,
        replicas: ReplicaSender | None,
        *,
        reply_timeout: float = DEFAULT_REPLY_TIMEOUT,
        bind_keys: bool = False,
    ) -> None:
        self.ids = StableIds(reply_timeout=reply_timeout, bind_keys=bind_keys)
        self.shared = shared
        self.replicas = replicas
        #: The message kinds each client's mod said it handles.
        self.handles: dict[int, frozenset[str]] = {}
        #: Last round whose reply each client had accepted (the ack).
        self.accepted_round: dict[int, int] = {}
        #: Identity failures already reported in a round record, by kind.
        self._failures_seen: dict[object, int] = {}

    def handles_kind(self, stable_id: int, kind: str) -> bool:
        """Whether the client's mod declared it rebuilds ``kind`` instructions."""
        return kind in self.handles.get(stable_id, ())

    def ack_round(self, stable_id: int) -> int:
        return self.accepted_round.get(stable_id, -1)

    def refresh(self, grid: Grid, *, expected: int, timeout: float, traffic: Traffic) -> None:
        """Learn the stable ids of newly connected nodes (the messages are counted in
        ``traffic``); a restarted node is assumed to hold nothing."""
        self.ids.refresh(grid, expected=expected, timeout=timeout, traffic=traffic)
        for sid in sorted(self.ids.moved):
            self.forget(sid)
        self.ids.moved.clear()
        self.handles.update(self.ids.handles)  # declared at first contact
        self.ids.handles.clear()

    def new_identity_failures(self) -> dict[str, int]:
        """Identity exchanges that failed since the last call, by kind."""
        total = dict(self.ids.failures)
        new = {str(k): v - self._failures_seen.get(k, 0) for k, v in total.items()}
        self._failures_seen = total
        return {k: v for k, v in new.items() if v}

    def forget(self, stable_id: int) -> None:
        """The client holds nothing the server sent it (a wiped or restarted node)."""
        self.shared.forget(stable_id)
        self.handles.pop(stable_id, None)
        if self.replicas is not None:
            self.replicas.server.forget(stable_id)

    def note_replies(self, replies: list[Message]) -> None:
        """What each reply's header says its client holds; an error reply makes the
        settings and the replica unknown."""
        for msg in replies:
            sid = self.ids.stable_of(msg.metadata.src_node_id)
            if sid is None:
                continue
            try:
                self._note_reply(sid, msg)
            except Exception as exc:  # one client's odd header is that client's problem
                log.warning("client %d: reply header not understood (%r): holds nothing", sid, exc)
                self.forget(sid)

    def _note_reply(self, sid: int, msg: Message) -> None:
        """What one reply's header says its client holds."""
        if self.replicas is not None:
            self.replicas.note_reply(sid, msg)
        if msg.has_error():
            self.shared.forget(sid)
            return
        header = reply_header(msg.content)
        self.shared.note_reply(sid, header)
        if header is not None and KEY_HANDLES in header:
            self.handles[sid] = frozenset(str(header[KEY_HANDLES]).split(","))

    def forget_all_replicas(self) -> None:
        """A resumed run is a new Flower run: every client's Context.state starts
        empty, so the first instructions carry the replica in full."""
        if self.replicas is not None:
            self.replicas.server.confirmed.clear()
