"""Stable client ids, both halves: what reproducible randomness and server state are
keyed on.

Flower's node ids are random per run, so they never key anything that must be
reproducible. A node's stable id is its node config's ``stable-id`` when set, else its
``partition-id`` (what simulation and the deployment launcher set). The client half
reads it from the Context (:func:`stable_id_of`); the server half learns each node's id
at first contact and maps between the two (:class:`StableIds`).
"""

from __future__ import annotations

import logging
import time

from flwr.app import ConfigRecord, Context, Error, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from fedcomp.failures import RunFailed, short_reason
from fedcomp.flower.accounting import count
from fedcomp.keys import (
    KEY_HANDLES,
    KEY_PROTOCOL,
    KEY_QUERY,
    KEY_STABLE_ID,
    NODE_CONFIG_PARTITION_ID,
    NODE_CONFIG_STABLE_ID,
    PROTOCOL_VERSION,
    QUERY_IDENTITY,
    RECORD_IDENTITY,
)
from fedcomp.traffic import Kind, Traffic

# --- client half ---------------------------------------------------------------------


def stable_id_of(context: Context) -> int:
    """The stable id of the node running this ClientApp.

    Raises
    ------
    ValueError
        When the node config names neither a stable id nor a partition id.
    """
    node_config = context.node_config
    for key in (NODE_CONFIG_STABLE_ID, NODE_CONFIG_PARTITION_ID):
        if key in node_config:
            value = node_config[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"node config {key}={value!r} is not a non-negative integer")
            return value
    raise ValueError(
        f"node config has neither '{NODE_CONFIG_STABLE_ID}' nor '{NODE_CONFIG_PARTITION_ID}'; "
        'start the SuperNode with --node-config "partition-id=<i> num-partitions=<n>"'
    )


def partition_id_of(context: Context) -> int:
    """The data partition this node trains on (``partition-id``)."""
    value = context.node_config.get(NODE_CONFIG_PARTITION_ID)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"node config {NODE_CONFIG_PARTITION_ID}={value!r} is not a valid partition id"
        )
    return value


def is_identity_message(msg: Message) -> bool:
    """True for the server's first-contact identity message (a TRAIN message)."""
    if msg.metadata.message_type != MessageType.TRAIN or not msg.has_content():
        return False
    return any(c.get(KEY_QUERY) == QUERY_IDENTITY for c in msg.content.config_records.values())


def identity_reply(msg: Message, context: Context, handles: str) -> Message:
    """The mod's answer to an identity message: the stable id, the protocol and the
    message kinds the mod handles (an error naming the node config when there is no
    stable id). The app's train handler is not called."""
    try:
        stable_id = stable_id_of(context)
    except ValueError as exc:
        return Message(
            Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=f"CompressionMod: {exc}"),
            reply_to=msg,
        )
    identity = ConfigRecord(
        {KEY_STABLE_ID: stable_id, KEY_PROTOCOL: PROTOCOL_VERSION, KEY_HANDLES: handles}
    )
    return Message(RecordDict({RECORD_IDENTITY: identity}), reply_to=msg)


# --- server half ---------------------------------------------------------------------


class NoIdentity(RunFailed):
    """No connected node answered the identity message: the run cannot sample anyone."""


log = logging.getLogger(__name__)


class StableIds:
    """Bidirectional map between Flower node ids (random per run) and stable ids."""

    def __init__(self) -> None:
        self._by_node: dict[int, int] = {}
        self._by_stable: dict[int, int] = {}
        #: Stable ids whose node disconnected or reconnected under a new node id since
        #: the caller last drained this set: a restarted node may have lost its state.
        self.moved: set[int] = set()
        #: Nodes refused for claiming a stable id another connected node holds.
        self.refused: set[int] = set()
        #: The message kinds each stable id's mod declared at first contact.
        self.handles: dict[int, frozenset[str]] = {}

    def __len__(self) -> int:
        return len(self._by_stable)

    def stable_ids(self) -> list[int]:
        """Known stable ids, sorted."""
        return sorted(self._by_stable)

    def stable_of(self, node_id: int) -> int | None:
        return self._by_node.get(node_id)

    def node_of(self, stable_id: int) -> int:
        return self._by_stable[stable_id]

    def add(self, node_id: int, stable_id: int) -> None:
        """Record a mapping; a stable id claimed by a new node moves to that node."""
        old_node = self._by_stable.get(stable_id)
        if old_node is not None and old_node != node_id:
            log.warning("stable id %d moved from node %d to node %d", stable_id, old_node, node_id)
            self._by_node.pop(old_node, None)
            self.moved.add(stable_id)
        self._by_node[node_id] = stable_id
        self._by_stable[stable_id] = node_id

    def forget_missing(self, connected: set[int]) -> None:
        """Drop nodes that are no longer connected (if one comes back, it is a restarted
        node: its stable id is reported in ``moved``)."""
        for node_id in [n for n in self._by_node if n not in connected]:
            stable_id = self._by_node.pop(node_id)
            self._by_stable.pop(stable_id, None)
            self.moved.add(stable_id)

    def refresh(
        self, grid: Grid, *, expected: int, timeout: float, traffic: Traffic | None = None
    ) -> None:
        """Wait for ``expected`` nodes, then query every node not yet known (the queries
        and replies are counted in ``traffic``).

        Raises
        ------
        TimeoutError
            When fewer than ``expected`` nodes connect within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while len(connected := set(grid.get_node_ids())) < expected:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {len(connected)} of {expected} nodes connected within {timeout:.0f} s"
                )
            time.sleep(0.5)
        self.forget_missing(connected)
        unknown = sorted(connected - set(self._by_node) - self.refused)
        if not unknown:
            return
        # A TRAIN message (a kind every app registers; Flower refuses a QUERY when the
        # app registered no query handler, before any mod runs) that the mod answers
        # itself, without calling the app's train handler.
        query = RecordDict(
            {"config": ConfigRecord({KEY_QUERY: QUERY_IDENTITY, KEY_PROTOCOL: PROTOCOL_VERSION})}
        )
        messages = [Message(query, dst_node_id=n, message_type=MessageType.TRAIN) for n in unknown]
        remaining = max(deadline - time.monotonic(), 1.0)
        if traffic is not None:
            for msg in messages:
                count(traffic, Kind.IDENTITY_QUERY, msg, client=None)
        failures: list[str] = []
        for reply in grid.send_and_receive(messages, timeout=remaining):
            node_id = reply.metadata.src_node_id
            if traffic is not None:
                count(traffic, Kind.IDENTITY_REPLY, reply, client=None)
            if reply.has_error():
                failures.append(short_reason(reply.error.reason))
                log.warning("identity message to node %d failed: %s", node_id, failures[-1])
                continue
            try:
                stable_id = int(reply.content[RECORD_IDENTITY][KEY_STABLE_ID])
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("node %d sent a malformed identity reply: %r", node_id, exc)
                continue
            holder = self._by_stable.get(stable_id)
            if holder is not None and holder != node_id and holder in connected:
                log.error(
                    "nodes %d and %d both claim stable id %d: node %d is refused (never "
                    "sampled); give each SuperNode its own --node-config "
                    '"partition-id=<i>" (or stable-id=<i>)',
                    holder,
                    node_id,
                    stable_id,
                    node_id,
                )
                self.refused.add(node_id)
                continue
            self.add(node_id, stable_id)
            handles = reply.content[RECORD_IDENTITY].get(KEY_HANDLES)
            if handles is not None:
                self.handles[stable_id] = frozenset(str(handles).split(","))
        log.info("stable ids known for %d of %d connected nodes", len(self), len(connected))
        if not self._by_node:
            raise NoIdentity(
                f"none of the {len(connected)} connected nodes answered fedcomp's identity "
                "message: the ClientApp needs fedcomp.flower.CompressionMod "
                "(ClientApp(mods=[CompressionMod()])) and each SuperNode a stable id "
                '(--node-config "partition-id=<i>"). First error: '
                + (failures[0] if failures else "no reply")
            )
