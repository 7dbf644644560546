"""Stable ids: only plain ints in [0, 2**63) are taken, anything one node answers (or
does not) is its own failure, silent nodes are asked again with backoff under a short
timeout of their own, ids are free again when their holder leaves, and with
``bind_keys`` an id stays with the public key that first took it."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.proto.node_pb2 import NodeInfo  # pylint: disable=no-name-in-module

from fedcomp.flower import identity
from fedcomp.flower.identity import (
    MAX_BACKOFF,
    IdentityFailure,
    NoIdentity,
    StableIds,
    identity_reply,
    stable_id_of,
)

#: One node's answer to the identity message: a reply, None for no reply, or several.
from fedcomp.flower.options import IdentityOptions, ServerOptions
from fedcomp.keys import KEY_HANDLES, KEY_STABLE_ID, RECORD_IDENTITY

Answer = Callable[[Message], Message | list[Message] | None]

REPLY_TIMEOUT = 7.0  # distinct from WAIT, so the tests see which one a wait used
WAIT = 600.0


def claims(value: object) -> Answer:
    """A node answering that its stable id is ``value`` (whatever its type)."""

    def answer(msg: Message) -> Message:
        record = ConfigRecord({KEY_STABLE_ID: value, KEY_HANDLES: "train,evaluate"})
        return Message(RecordDict({RECORD_IDENTITY: record}), reply_to=msg)

    return answer


def silent(msg: Message) -> None:
    return None


class FakeGrid:
    """The Grid methods StableIds uses; records each send_and_receive call."""

    def __init__(self, nodes: dict[int, Answer], keys: dict[int, bytes] | None = None) -> None:
        self.nodes = dict(nodes)
        self.keys = dict(keys or {})
        #: (node ids asked, timeout) per send_and_receive call.
        self.calls: list[tuple[list[int], float | None]] = []
        self.reverse = False

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)

    def get_nodes(self) -> list[NodeInfo]:
        return [NodeInfo(node_id=n, public_key=self.keys.get(n, b"")) for n in self.nodes]

    def send_and_receive(self, messages, *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        self.calls.append(([m.metadata.dst_node_id for m in messages], timeout))
        replies: list[Message] = []
        for msg in messages:
            reply = self.nodes[msg.metadata.dst_node_id](msg)
            replies.extend([] if reply is None else reply if isinstance(reply, list) else [reply])
        return replies[::-1] if self.reverse else replies


def refresh(ids: StableIds, grid: FakeGrid) -> None:
    ids.refresh(grid, expected=1, timeout=WAIT)


def asked_in_last_call(grid: FakeGrid, node_id: int, calls_before: int) -> bool:
    return any(node_id in asked for asked, _ in grid.calls[calls_before:])


BAD_IDS = [
    float("inf"),
    float("nan"),
    "18446744073709551616",
    -1,
    3.9,
    7.0,
    " 7 ",
    "7",
    b"8",
    True,
    False,
    "9" * 4000,
    2**63,
    2**64,
    -(2**63),
]


@pytest.mark.parametrize("bad", BAD_IDS, ids=lambda v: f"{type(v).__name__}:{str(v)[:12]}")
def test_a_bad_stable_id_is_that_nodes_counted_failure_only(bad, caplog) -> None:
    """Anything but a plain int in [0, 2**63) is refused: logged with the node id,
    counted as bad_id, the node gets no id; the honest node beside it is unaffected."""
    grid = FakeGrid({101: claims(0), 202: claims(bad)})
    ids = StableIds(reply_timeout=REPLY_TIMEOUT)
    caplog.set_level(logging.WARNING, logger="fedcomp.flower.identity")
    refresh(ids, grid)
    assert ids.stable_ids() == [0]
    assert ids.stable_of(202) is None
    assert ids.failures == {IdentityFailure.BAD_ID: 1}
    assert ids.retries[202].kind == IdentityFailure.BAD_ID
    assert any("node 202" in m and "bad_id" in m for m in caplog.messages)


@pytest.mark.parametrize("edge", [0, 2**63 - 1])
def test_the_boundary_ids_are_taken(edge: int) -> None:
    grid = FakeGrid({101: claims(edge)})
    ids = StableIds(reply_timeout=REPLY_TIMEOUT)
    refresh(ids, grid)
    assert ids.stable_ids() == [edge]
    assert ids.node_of(edge) == 101
    assert ids.handles[edge] == frozenset({"train", "evaluate"})
    assert not ids.failures


def test_error_and_malformed_replies_are_counted_by_kind() -> None:
    def error(msg: Message) -> Message:
        return Message(Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason="no id"), reply_to=msg)

    def empty(msg: Message) -> Message:
        return Message(RecordDict({"other": ConfigRecord({"x": 1})}), reply_to=msg)

    grid = FakeGrid({1: claims(5), 2: error, 3: empty, 4: silent})
    ids = StableIds(reply_timeout=REPLY_TIMEOUT)
    refresh(ids, grid)
    assert ids.stable_ids() == [5]
    assert ids.failures == {
        IdentityFailure.ERROR_REPLY: 1,
        IdentityFailure.MALFORMED: 1,
        IdentityFailure.NO_REPLY: 1,
    }
    assert {n: r.kind for n, r in ids.retries.items()} == {
        2: IdentityFailure.ERROR_REPLY,
        3: IdentityFailure.MALFORMED,
        4: IdentityFailure.NO_REPLY,
    }


def test_an_exception_while_taking_one_reply_is_that_nodes_failure(monkeypatch, caplog) -> None:
    """Whatever raises while one node's reply is handled (a bug) is logged with the
    node id and counted as unexpected; the other nodes still get their ids."""
    real = identity.declared_handles

    def explode_for_node_2(reply: Message) -> frozenset[str] | None:
        if reply.metadata.src_node_id == 2:
            raise OverflowError("planted")
        return real(reply)

    monkeypatch.setattr(identity, "declared_handles", explode_for_node_2)
    grid = FakeGrid({1: claims(10), 2: claims(20), 3: claims(30)})
    ids = StableIds(reply_timeout=REPLY_TIMEOUT)
    caplog.set_level(logging.WARNING, logger="fedcomp.flower.identity")
    refresh(ids, grid)
    assert ids.stable_ids() == [10, 30]
    assert ids.failures == {IdentityFailure.UNEXPECTED: 1}
    assert any("node 2" in m and "planted" in m for m in caplog.messages)


def test_only_bad_replies_end_the_run_with_no_identity() -> None:
    grid = FakeGrid({1: claims(-1), 2: claims("3")})
    with pytest.raises(NoIdentity, match=r"First error: .*not an integer in \[0, 2\*\*63\)"):
        refresh(StableIds(reply_timeout=REPLY_TIMEOUT), grid)


def expected_asks(refreshes: int) -> list[int]:
    """The refreshes (1-based) at which a node that never answers is asked: first at
    once, then after 1, 2, 4, ... refreshes, at most MAX_BACKOFF apart."""
    asks, at, failures = [], 1, 0
    while at <= refreshes:
        asks.append(at)
        failures += 1
        at += min(2 ** (failures - 1), MAX_BACKOFF)
    return asks


def test_a_silent_node_is_asked_with_backoff_under_the_short_timeout() -> None:
    """A node that never answers costs one short wait now and then, not one every
    round: the refreshes it is asked at follow the backoff, each wait once the run has
    its ``expected`` nodes is the reply timeout (the first exchange, before any node has
    an id, may take the wait for nodes), and refreshes with nothing due send nothing."""
    refreshes = 60
    grid = FakeGrid({1: claims(0), 2: silent})
    ids = StableIds(reply_timeout=REPLY_TIMEOUT)
    asked_at = []
    for r in range(1, refreshes + 1):
        before = len(grid.calls)
        refresh(ids, grid)
        if asked_in_last_call(grid, 2, before):
            asked_at.append(r)
    assert asked_at == expected_asks(refreshes)
    assert len(asked_at) < refreshes / 2
    assert len(grid.calls) == len(asked_at)  # node 1 was asked with node 2's first ask
    assert grid.calls[0][1] == WAIT  # no id known yet: the run cannot start without one
    assert {timeout for _, timeout in grid.calls[1:]} == {REPLY_TIMEOUT}
    assert ids.failures[IdentityFailure.NO_REPLY] == len(asked_at)
    assert ids.stable_ids() == [0]


def test_a_node_that_answers_late_gets_its_id_at_its_next_ask() -> None:
    grid = FakeGrid({1: claims(0), 2: silent})
    ids = StableIds(reply_timeout=REPLY_TIMEOUT)
    for _ in range(3):  # asked at refreshes 1 and 2; the next ask is at 4
        refresh(ids, grid)
    grid.nodes[2] = claims(1)
    refresh(ids, grid)  # refresh 4
    assert ids.stable_ids() == [0, 1]
    assert 2 not in ids.retries


def test_the_default_reply_timeout_is_short_and_the_strategy_passes_its_own() -> None:
    from flwr.serverapp.strategy import FedAvg

    from fedcomp.flower.strategy import CompressedStrategy

    assert StableIds().reply_timeout <= 30
    strategy = CompressedStrategy(
        FedAvg(),
        codec={"name": "fp32"},
        options=ServerOptions(identity=IdentityOptions(reply_timeout=3.5, bind_keys=True)),
    )
    assert strategy.clients.ids.reply_timeout == 3.5
    assert strategy.clients.ids.bind_keys
    with pytest.raises(ValueError, match="reply_timeout=0"):
        StableIds(reply_timeout=0)


def test_an_impostors_id_is_free_again_when_it_leaves() -> None:
    """An impostor takes id 0 first; the honest node claiming 0 is refused while the
    impostor is connected, and gets 0 at the first refresh after the impostor left
    (0 is reported moved: the server resets what it kept for 0)."""
    impostor, honest = 11, 22
    grid = FakeGrid({impostor: claims(0)})
    ids = StableIds(reply_timeout=REPLY_TIMEOUT)
    refresh(ids, grid)
    grid.nodes[honest] = claims(0)
    for _ in range(4):  # refused every time it is asked while the impostor is there
        refresh(ids, grid)
        assert ids.node_of(0) == impostor
        assert ids.refused == {honest}
    assert ids.retries[honest].failures >= 2  # backing off: not due at the next refresh
    assert ids.retries[honest].due > 6
    ids.moved.clear()
    del grid.nodes[impostor]
    before = len(grid.calls)
    refresh(ids, grid)  # refresh 6: asked because 0 is free, backoff or not
    # No node holds an id now (fewer than ``expected``): the long wait applies.
    assert grid.calls[before:] == [([honest], WAIT)]
    assert ids.node_of(0) == honest
    assert ids.refused == set()
    assert ids.moved == {0}
    assert ids.failures == {IdentityFailure.TAKEN: 3}  # asked at refreshes 2, 3 and 5


def test_a_restarted_node_is_refused_then_accepted_once_its_old_node_id_is_gone() -> None:
    old, new = 5, 6
    grid = FakeGrid({old: claims(3)})
    ids = StableIds(reply_timeout=REPLY_TIMEOUT)
    refresh(ids, grid)
    grid.nodes[new] = claims(3)  # the restarted node, while the SuperLink lists the old
    refresh(ids, grid)
    assert ids.refused == {new}
    assert ids.stable_of(new) is None
    del grid.nodes[old]
    refresh(ids, grid)
    assert ids.node_of(3) == new
    assert ids.refused == set()
    assert ids.retries == {}


def test_two_new_nodes_claiming_one_id_resolve_by_node_id_not_arrival() -> None:
    for reverse in (False, True):
        grid = FakeGrid({40: claims(1), 30: claims(1)})
        grid.reverse = reverse
        ids = StableIds(reply_timeout=REPLY_TIMEOUT)
        refresh(ids, grid)
        assert ids.node_of(1) == 30
        assert ids.refused == {40}


def test_replies_from_nodes_not_asked_and_repeats_are_ignored() -> None:
    """Only an asked node's first reply counts: a second one, and one from a node that
    was not asked this time (node 1, which holds 0), change nothing."""

    def twice_and_a_stray(msg: Message) -> list[Message]:
        to_node_1 = Message(RecordDict({}), dst_node_id=1, message_type="train")
        return [claims(1)(msg), claims(2)(msg), claims(9)(to_node_1)]

    grid = FakeGrid({1: claims(0)})
    ids = StableIds(reply_timeout=REPLY_TIMEOUT)
    refresh(ids, grid)
    grid.nodes[2] = twice_and_a_stray
    refresh(ids, grid)
    assert ids.stable_ids() == [0, 1]
    assert (ids.node_of(0), ids.node_of(1)) == (1, 2)


def test_bound_keys_keep_an_id_with_its_first_key() -> None:
    """With bind_keys, id 0 stays with key A: another key is refused even after A's
    node left, and A's node coming back under a new node id takes 0 again. Without
    bind_keys the same sequence hands 0 to the other key (trust on first use)."""
    key_a, key_b = b"-----KEY A-----", b"-----KEY B-----"
    for bind in (True, False):
        grid = FakeGrid({1: claims(0)}, keys={1: key_a})
        ids = StableIds(reply_timeout=REPLY_TIMEOUT, bind_keys=bind)
        refresh(ids, grid)
        del grid.nodes[1]
        grid.nodes[2], grid.keys[2] = claims(0), key_b
        refresh(ids, grid)
        if not bind:
            assert ids.node_of(0) == 2
            continue
        assert ids.stable_ids() == []
        assert ids.failures == {IdentityFailure.WRONG_KEY: 1}
        assert ids.refused == {2}
        grid.nodes[3], grid.keys[3] = claims(0), key_a
        refresh(ids, grid)
        assert ids.node_of(0) == 3
        assert ids.keys == {0: key_a}


def test_bound_keys_refuse_a_node_without_a_key() -> None:
    grid = FakeGrid({1: claims(0), 2: claims(1)}, keys={1: b"key"})
    ids = StableIds(reply_timeout=REPLY_TIMEOUT, bind_keys=True)
    refresh(ids, grid)
    assert ids.stable_ids() == [0]
    assert ids.failures == {IdentityFailure.NO_KEY: 1}


# --- client half ---------------------------------------------------------------------


def _context(node_config: dict) -> Context:
    return Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config={})


@pytest.mark.parametrize("edge", [0, 2**63 - 1])
def test_the_client_reports_boundary_ids(edge: int) -> None:
    assert stable_id_of(_context({"stable-id": edge})) == edge


@pytest.mark.parametrize("bad", [2**63, -1, True, 3.0, "3"])
def test_the_client_refuses_ids_out_of_range_naming_them(bad) -> None:
    """The node config's id must be what the server takes: refused naming the key and
    the range, and the identity message is answered with an error, not a bad id."""
    with pytest.raises(ValueError, match=r"stable-id=.* is not an integer in \[0, 2\*\*63\)"):
        stable_id_of(_context({"stable-id": bad, "partition-id": 0}))
    query = Message(RecordDict({}), dst_node_id=1, message_type="train")
    reply = identity_reply(query, _context({"stable-id": bad}), "train")
    assert reply.has_error()
    assert "2**63" in reply.error.reason


def test_one_key_holds_one_stable_id() -> None:
    """Issue 41, finding 6: with bind_keys, a registered device (key A, holding id 0)
    reconnecting under new node ids and claiming the free ids 1 and 2 is refused
    them (wrong_key), so the real devices (keys B and C) still take 1 and 2. The
    binding is one to one both ways: ids -> keys and keys -> ids."""
    key_a, key_b, key_c = b"-----KEY A-----", b"-----KEY B-----", b"-----KEY C-----"
    grid = FakeGrid({1: claims(0)}, keys={1: key_a})
    ids = StableIds(reply_timeout=REPLY_TIMEOUT, bind_keys=True)
    refresh(ids, grid)
    grid.nodes[5], grid.keys[5] = claims(1), key_a
    grid.nodes[6], grid.keys[6] = claims(2), key_a
    refresh(ids, grid)
    assert ids.stable_ids() == [0]
    assert ids.failures == {IdentityFailure.WRONG_KEY: 2}
    assert ids.refused == {5, 6}
    del grid.nodes[5], grid.nodes[6]
    grid.nodes[7], grid.keys[7] = claims(1), key_b
    grid.nodes[8], grid.keys[8] = claims(2), key_c
    refresh(ids, grid)
    assert (ids.node_of(1), ids.node_of(2)) == (7, 8)
    assert ids.keys == {0: key_a, 1: key_b, 2: key_c}
    assert ids.holders == {key_a: 0, key_b: 1, key_c: 2}
