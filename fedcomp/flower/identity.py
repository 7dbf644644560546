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
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from flwr.app import ConfigRecord, Context, Error, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from fedcomp.failures import RunFailed, short_reason
from fedcomp.flower.accounting import measure_and_record
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


#: Stable ids are below this (Flower carries config integers as signed 64-bit).
STABLE_ID_LIMIT = 2**63


def check_stable_id(value: Any, name: str) -> int:
    """``value`` when it is a plain int (not a bool) in [0, 2**63).

    Raises
    ------
    ValueError
        Naming ``name``, the value (shortened) and what is allowed.
    """
    if type(value) is int and 0 <= value < STABLE_ID_LIMIT:
        return value
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    raise ValueError(f"{name}={shown} ({type(value).__name__}) is not an integer in [0, 2**63)")


def stable_id_of(context: Context) -> int:
    """The stable id of the node running this ClientApp.

    Raises
    ------
    ValueError
        When the node config names neither a stable id nor a partition id, or the one
        it names is not an integer in [0, 2**63).
    """
    node_config = context.node_config
    for key in (NODE_CONFIG_STABLE_ID, NODE_CONFIG_PARTITION_ID):
        if key in node_config:
            return check_stable_id(node_config[key], f"node config {key}")
    raise ValueError(
        f"node config has neither '{NODE_CONFIG_STABLE_ID}' nor '{NODE_CONFIG_PARTITION_ID}'; "
        'start the SuperNode with --node-config "partition-id=<i> num-partitions=<n>"'
    )


def partition_id_of(context: Context) -> int:
    """The data partition this node trains on (``partition-id``)."""
    return check_stable_id(
        context.node_config.get(NODE_CONFIG_PARTITION_ID), f"node config {NODE_CONFIG_PARTITION_ID}"
    )


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


class IdentityFailure(StrEnum):
    """Why a node has no stable id yet (counted in :attr:`StableIds.failures`)."""

    #: No reply within the identity reply timeout.
    NO_REPLY = "no_reply"
    #: The node answered with a Flower Error (e.g. the mod found no stable id).
    ERROR_REPLY = "error_reply"
    #: A reply without the identity record or without a stable id in it.
    MALFORMED = "malformed"
    #: A stable id that is not a plain int in [0, 2**63).
    BAD_ID = "bad_id"
    #: A stable id another connected node holds.
    TAKEN = "taken"
    #: A stable id bound to another SuperNode's public key (``bind_keys``).
    WRONG_KEY = "wrong_key"
    #: ``bind_keys`` is set and the SuperLink reports no public key for the node.
    NO_KEY = "no_key"
    #: Anything else raised while handling the reply (a bug; logged with its traceback).
    UNEXPECTED = "unexpected"


#: Failures that refuse a node for what it claimed (listed in ``StableIds.refused``).
REFUSALS = frozenset({IdentityFailure.TAKEN, IdentityFailure.WRONG_KEY})

#: Seconds to wait for the identity replies of one refresh: short, because nodes that
#: do not answer in time are only asked again later (see :class:`StableIds`).
DEFAULT_REPLY_TIMEOUT = 30.0
#: Most refreshes (about one per round) a failed node waits before it is asked again.
MAX_BACKOFF = 16


class IdentityRefused(ValueError):
    """One node's identity reply, refused (its failure only)."""

    def __init__(self, message: str, kind: IdentityFailure, claimed: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        #: The stable id a TAKEN node claimed: it is asked again once the id is free.
        self.claimed = claimed


@dataclass
class Retry:
    """When a node without a stable id is asked again."""

    #: Consecutive failed identity exchanges.
    failures: int
    #: The refresh (count of :meth:`StableIds.refresh` calls) from which it is due.
    due: int
    kind: IdentityFailure
    #: For a TAKEN node, the id it claimed: it is due as soon as that id is free.
    claimed: int | None = None


log = logging.getLogger(__name__)


def claimed_stable_id(reply: Message) -> int:
    """The stable id an identity reply claims.

    Raises
    ------
    IdentityRefused
        ERROR_REPLY for an error reply, MALFORMED without the identity record or the
        stable id, BAD_ID for a value that is not a plain int in [0, 2**63).
    """
    if reply.has_error():
        raise IdentityRefused(short_reason(reply.error.reason), IdentityFailure.ERROR_REPLY)
    record = reply.content.config_records.get(RECORD_IDENTITY)
    if record is None or KEY_STABLE_ID not in record:
        raise IdentityRefused(
            f"no '{RECORD_IDENTITY}' record with '{KEY_STABLE_ID}' in the reply",
            IdentityFailure.MALFORMED,
        )
    try:
        return check_stable_id(record[KEY_STABLE_ID], KEY_STABLE_ID)
    except ValueError as exc:
        raise IdentityRefused(str(exc), IdentityFailure.BAD_ID) from exc


def declared_handles(reply: Message) -> frozenset[str] | None:
    """The message kinds the reply says the node's mod handles (None: not declared)."""
    handles = reply.content.config_records[RECORD_IDENTITY].get(KEY_HANDLES)
    return None if handles is None else frozenset(str(handles).split(","))


def backoff(failures: int) -> int:
    """Refreshes to skip after ``failures`` consecutive failures: 1, 2, 4, ... capped."""
    return min(2 ** (failures - 1), MAX_BACKOFF)


class StableIds:
    """Bidirectional map between Flower node ids (random per run) and stable ids.

    Ids are first come, first served (trust on first use): a node may take any stable
    id no connected node holds, and an id is free again once its holder disconnects.
    With ``bind_keys`` a stable id is also bound to the public key of the SuperNode
    that first took it (from the SuperLink's node info, which SuperNode authentication
    vouches for) and another key is refused it for the rest of the run.

    A node whose identity exchange fails (no reply within ``reply_timeout``, an error, a
    bad id, an id taken) is asked again after 1, 2, 4, ... refreshes (at most
    :data:`MAX_BACKOFF`); a node refused an id another node holds is also asked again
    as soon as that id is free (a restarted node whose old node id the SuperLink still
    listed).

    Parameters
    ----------
    reply_timeout : float
        Seconds one refresh waits for the identity replies (not for nodes to connect).
    bind_keys : bool
        Bind each stable id to its first holder's public key (use with
        ``--enable-supernode-auth``: without it a SuperNode's key is new each start).
    """

    def __init__(
        self, *, reply_timeout: float = DEFAULT_REPLY_TIMEOUT, bind_keys: bool = False
    ) -> None:
        if not reply_timeout > 0:
            raise ValueError(f"reply_timeout={reply_timeout!r} must be > 0 seconds")
        self.reply_timeout = reply_timeout
        self.bind_keys = bind_keys
        self._by_node: dict[int, int] = {}
        self._by_stable: dict[int, int] = {}
        #: Stable ids whose node disconnected or reconnected under a new node id since
        #: the caller last drained this set: a restarted node may have lost its state.
        self.moved: set[int] = set()
        #: Connected nodes refused for the id they claimed (TAKEN or WRONG_KEY).
        self.refused: set[int] = set()
        #: The message kinds each stable id's mod declared at first contact.
        self.handles: dict[int, frozenset[str]] = {}
        #: Failed identity exchanges of the run, by kind.
        self.failures: Counter[IdentityFailure] = Counter()
        #: Connected nodes without a stable id: when they are asked again.
        self.retries: dict[int, Retry] = {}
        #: The public key each stable id is bound to, and the stable id each key is
        #: bound to: one to one (``bind_keys``).
        self.keys: dict[int, bytes] = {}
        self.holders: dict[bytes, int] = {}
        self._refreshes = 0
        #: Whether any node ever held a stable id (else the run cannot start: NoIdentity).
        self._ever_known = False

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
        self._ever_known = True

    def forget_missing(self, connected: set[int]) -> None:
        """Drop nodes that are no longer connected: their stable ids are free again (if
        one comes back, it is a restarted node: its stable id is reported in ``moved``)."""
        for node_id in [n for n in self._by_node if n not in connected]:
            stable_id = self._by_node.pop(node_id)
            self._by_stable.pop(stable_id, None)
            self.moved.add(stable_id)
        for node_id in [n for n in self.retries if n not in connected]:
            del self.retries[node_id]
        self.refused &= connected

    def refresh(
        self, grid: Grid, *, expected: int, timeout: float, traffic: Traffic | None = None
    ) -> None:
        """Wait for ``expected`` nodes, then query every node without a stable id that
        is due (the queries and replies are counted in ``traffic``). What one node
        answers, or fails to answer within ``reply_timeout`` (``timeout`` while fewer
        than ``expected`` nodes have stable ids), is its failure only.

        Raises
        ------
        TimeoutError
            When fewer than ``expected`` nodes connect within ``timeout`` seconds.
        NoIdentity
            When nodes were asked and none has ever had a stable id in this run (the
            ClientApp lacks the mod, or no node has a usable stable id); later, a
            round without known nodes is the round's problem, not an exception.
        """
        connected = wait_for_nodes(grid, expected, timeout)
        self.forget_missing(connected)
        self._refreshes += 1
        due = self._due(connected)
        if not due:
            return
        keys = node_keys(grid) if self.bind_keys else {}
        # Until ``expected`` nodes have stable ids the run cannot sample them: that
        # exchange may take the long wait (20 SuperNodes starting a ClientApp process
        # each on a loaded 2-core machine took more than 30 s). Afterwards a silent node
        # costs at most the short reply timeout, with backoff.
        wait = self.reply_timeout if len(self) >= expected else max(timeout, self.reply_timeout)
        replies = ask_identity(grid, due, wait, traffic)
        errors = self._take_replies(replies, set(due), keys, connected)
        log.info("stable ids known for %d of %d connected nodes", len(self), len(connected))
        if not self._ever_known:
            raise NoIdentity(
                f"none of the {len(connected)} connected nodes answered fedcomp's identity "
                "message: the ClientApp needs fedcomp.flower.CompressionMod "
                "(ClientApp(mods=[CompressionMod()])) and each SuperNode a stable id "
                '(--node-config "partition-id=<i>"). First error: '
                + (errors[0] if errors else "no reply")
            )

    def _due(self, connected: set[int]) -> list[int]:
        """Nodes without a stable id to ask now: new ones, those whose backoff is over,
        and refused ones whose claimed id is free again."""
        due = []
        for node_id in sorted(connected - set(self._by_node)):
            retry = self.retries.get(node_id)
            if (
                retry is None
                or retry.due <= self._refreshes
                or (retry.claimed is not None and retry.claimed not in self._by_stable)
            ):
                due.append(node_id)
        return due

    def _take_replies(
        self, replies: list[Message], asked: set[int], keys: dict[int, bytes], connected: set[int]
    ) -> list[str]:
        """Take each asked node's first reply (in node id order, so that two new nodes
        claiming one id resolve the same way whatever the arrival order); every node
        without a usable reply fails. Returns the failures' reasons."""
        errors: list[str] = []
        answered: set[int] = set()
        for reply in sorted(replies, key=lambda r: r.metadata.src_node_id):
            node_id = reply.metadata.src_node_id
            if node_id not in asked or node_id in answered:
                log.warning("identity reply from node %d ignored: not asked or a repeat", node_id)
                continue
            answered.add(node_id)
            try:
                self._take(node_id, reply, keys, connected)
            except IdentityRefused as exc:
                errors.append(str(exc))
                self._fail(node_id, exc.kind, str(exc), exc.claimed)
            except Exception as exc:  # one node's reply never ends a round
                log.exception("identity reply from node %d: unexpected error", node_id)
                errors.append(repr(exc))
                self._fail(node_id, IdentityFailure.UNEXPECTED, repr(exc))
        for node_id in sorted(asked - answered):
            self._fail(
                node_id, IdentityFailure.NO_REPLY, f"no reply within {self.reply_timeout:g} s"
            )
        return errors

    def _take(
        self, node_id: int, reply: Message, keys: dict[int, bytes], connected: set[int]
    ) -> None:
        """Give ``node_id`` the stable id its reply claims, or raise IdentityRefused."""
        stable_id = claimed_stable_id(reply)
        holder = self._by_stable.get(stable_id)
        if holder is not None and holder != node_id and holder in connected:
            raise IdentityRefused(
                f"nodes {holder} and {node_id} both claim stable id {stable_id} (node "
                f"{holder} holds it); give each SuperNode its own --node-config "
                '"partition-id=<i>" (or stable-id=<i>)',
                IdentityFailure.TAKEN,
                claimed=stable_id,
            )
        if self.bind_keys:
            self._check_key(stable_id, keys.get(node_id, b""))
        handles = declared_handles(reply)
        self.add(node_id, stable_id)
        self.retries.pop(node_id, None)
        self.refused.discard(node_id)
        if handles is not None:
            self.handles[stable_id] = handles

    def _check_key(self, stable_id: int, key: bytes) -> None:
        """Bind ``stable_id`` to ``key`` on first use; refuse any other key later."""
        if not key:
            raise IdentityRefused(
                "the SuperLink reports no public key for this node (bind_keys needs "
                "SuperNode authentication: --enable-supernode-auth)",
                IdentityFailure.NO_KEY,
            )
        holder = self.holders.get(key)
        if holder is not None and holder != stable_id:
            # One key, one id: a registered device reconnecting under new node ids
            # must not bind every free id it claims and lock the real devices out.
            raise IdentityRefused(
                f"this SuperNode's public key is bound to stable id {holder}, not {stable_id}",
                IdentityFailure.WRONG_KEY,
            )
        bound = self.keys.setdefault(stable_id, key)
        if bound != key:
            raise IdentityRefused(
                f"stable id {stable_id} is bound to another SuperNode's public key",
                IdentityFailure.WRONG_KEY,
            )
        self.holders[key] = stable_id

    def _fail(
        self, node_id: int, kind: IdentityFailure, reason: str, claimed: int | None = None
    ) -> None:
        """Count and log one node's failed identity exchange; schedule its next one."""
        self.failures[kind] += 1
        retry = self.retries.get(node_id)
        failures = 1 if retry is None else retry.failures + 1
        wait = backoff(failures)
        self.retries[node_id] = Retry(failures, self._refreshes + wait, kind, claimed)
        if kind in REFUSALS:
            self.refused.add(node_id)
            log.error("node %d refused (%s): %s; asked again later", node_id, kind, reason)
        else:
            log.warning(
                "identity of node %d failed (%s): %s; asked again in %d refresh(es)",
                node_id,
                kind,
                reason,
                wait,
            )


def wait_for_nodes(grid: Grid, expected: int, timeout: float) -> set[int]:
    """The connected node ids, once at least ``expected`` are connected.

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
    return connected


def node_keys(grid: Grid) -> dict[int, bytes]:
    """Each connected node's public key as the SuperLink registered it (Flower's
    ``Grid.get_nodes``; the Fleet API checks every request's signature against it)."""
    return {int(info.node_id): bytes(info.public_key) for info in grid.get_nodes()}


def ask_identity(
    grid: Grid, nodes: list[int], timeout: float, traffic: Traffic | None
) -> list[Message]:
    """Send the identity message to ``nodes``; the replies that came within
    ``timeout`` seconds (all counted in ``traffic``)."""
    # A TRAIN message (a kind every app registers; Flower refuses a QUERY when the
    # app registered no query handler, before any mod runs) that the mod answers
    # itself, without calling the app's train handler.
    query = RecordDict(
        {"config": ConfigRecord({KEY_QUERY: QUERY_IDENTITY, KEY_PROTOCOL: PROTOCOL_VERSION})}
    )
    messages = [Message(query, dst_node_id=n, message_type=MessageType.TRAIN) for n in nodes]
    if traffic is not None:
        for msg in messages:
            measure_and_record(traffic, Kind.IDENTITY_QUERY, msg, client=None)
    replies = list(grid.send_and_receive(messages, timeout=timeout))
    if traffic is not None:
        for reply in replies:
            measure_and_record(traffic, Kind.IDENTITY_REPLY, reply, client=None)
    return replies
