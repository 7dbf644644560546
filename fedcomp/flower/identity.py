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

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedcomp.flower.accounting import count
from fedcomp.keys import (
    KEY_QUERY,
    KEY_STABLE_ID,
    NODE_CONFIG_PARTITION_ID,
    NODE_CONFIG_STABLE_ID,
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


# --- server half ---------------------------------------------------------------------

log = logging.getLogger(__name__)


class StableIds:
    """Bidirectional map between Flower node ids (random per run) and stable ids."""

    def __init__(self) -> None:
        self._by_node: dict[int, int] = {}
        self._by_stable: dict[int, int] = {}
        #: Stable ids whose node disconnected or reconnected under a new node id since
        #: the caller last drained this set: a restarted node may have lost its state.
        self.moved: set[int] = set()

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
        unknown = sorted(connected - set(self._by_node))
        if not unknown:
            return
        query = RecordDict({"config": ConfigRecord({KEY_QUERY: QUERY_IDENTITY})})
        messages = [Message(query, dst_node_id=n, message_type=MessageType.QUERY) for n in unknown]
        remaining = max(deadline - time.monotonic(), 1.0)
        if traffic is not None:
            for msg in messages:
                count(traffic, Kind.IDENTITY_QUERY, msg, client=None)
        for reply in grid.send_and_receive(messages, timeout=remaining):
            node_id = reply.metadata.src_node_id
            if traffic is not None:
                count(traffic, Kind.IDENTITY_REPLY, reply, client=None)
            if reply.has_error():
                log.warning("identity query to node %d failed: %s", node_id, reply.error.reason)
                continue
            try:
                stable_id = int(reply.content[RECORD_IDENTITY][KEY_STABLE_ID])
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("node %d sent a malformed identity reply: %r", node_id, exc)
                continue
            self.add(node_id, stable_id)
        log.info("stable ids known for %d of %d connected nodes", len(self), len(connected))
