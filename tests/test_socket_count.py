"""The byte-counting proxy's accounting (experiments/deployment/socket_count.py), offline.

The proxy splits each direction of a connection into HTTP/1.1 requests and responses;
every byte that passes must land in exactly one call's head or body (or be reported
as unparsed), however the bytes are cut into reads. The end-to-end comparison with a
real deployment is in tests/test_deployment.py.
"""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import numpy as np
import pytest

from experiments.deployment.socket_count import (
    CountingProxy,
    HttpFramingError,
    HttpSplitter,
    check_totals,
    read_socket_log,
    socket_section,
    summarise_socket,
)


def _request(path: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:1\r\ncontent-type: application/protobuf\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


def _chunked_response(chunks: list[bytes]) -> bytes:
    out = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    for c in (c for c in chunks if c):  # an empty chunk would end the body
        out += f"{len(c):x}\r\n".encode() + c + b"\r\n"
    return out + b"0\r\n\r\n"


def _cut(data: bytes, rng: np.random.Generator) -> list[bytes]:
    """``data`` in random pieces (TCP delivers what it likes)."""
    cuts = sorted(rng.choice(np.arange(1, len(data)), size=min(7, len(data) - 1), replace=False))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


@pytest.mark.parametrize("seed", range(5))
def test_every_byte_lands_in_one_part_however_the_stream_is_cut(seed: int) -> None:
    rng = np.random.default_rng(seed)
    bodies = [bytes(rng.integers(0, 256, size=n, dtype=np.uint8)) for n in (0, 1, 300, 5000)]
    stream = b"".join(_request("/v1/fleet/push-object", b) for b in bodies)
    splitter = HttpSplitter()
    parts = [p for piece in _cut(stream, rng) for p in splitter.feed(piece)]
    assert [p.body for p in parts] == bodies
    assert sum(p.head_bytes + len(p.body) for p in parts) == len(stream)
    assert splitter.unparsed == 0


def test_chunk_framing_is_counted_as_head_and_the_payload_as_body() -> None:
    chunks = [b"abc", b"x" * 70]
    data = _chunked_response(chunks)
    (part,) = HttpSplitter().feed(data)
    assert part.body == b"".join(chunks)
    assert part.status == 200
    assert part.head_bytes + len(part.body) == len(data)


def test_an_incomplete_part_is_unparsed_until_its_last_byte_arrives() -> None:
    data = _request("/v1/fleet/pull-object", b"y" * 10)
    splitter = HttpSplitter()
    assert splitter.feed(data[:-1]) == []
    assert splitter.unparsed == len(data) - 1
    (part,) = splitter.feed(data[-1:])
    assert (part.body, splitter.unparsed) == (b"y" * 10, 0)


@pytest.mark.parametrize(
    "data",
    [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40 + b"\r\n\r\n",  # TLS hello
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # HTTP/2 preface
        b"POST / HTTP/1.1\r\ncontent-length: -3\r\n\r\n",
    ],
    ids=["tls", "http2", "bad-length"],
)
def test_bytes_that_are_not_http1_are_refused(data: bytes) -> None:
    with pytest.raises(HttpFramingError):
        HttpSplitter().feed(data)


def _call(t: float, rpc: str, cost: tuple[int, int, int, int], **extra) -> dict:
    up_head, up_body, down_head, down_body = cost
    return {
        "conn": 0,
        "t": t,
        "path": "/v1/fleet/x",
        "status": 200,
        "rpc": rpc,
        "up_head": up_head,
        "up_body": up_body,
        "down_head": down_head,
        "down_body": down_body,
        **extra,
    }


def _msg(mid: str, kind: str, group: str, objects: list[str]) -> dict:
    return {"id": mid, "type": kind, "group": group, "reply_to": "", "objects": objects}


def test_rounds_take_their_messages_and_idle_calls_and_the_run_its_constants() -> None:
    """Attribution by definition: a message's push/pull, objects and receipt are its
    round's; idle calls go to the round of the latest message before them; everything
    before the first message is set-up; the parts add up to every call's bytes."""
    rows = [
        _call(0.1, "RegisterNode", (10, 5, 10, 5)),
        _call(0.2, "GetFab", (10, 5, 10, 900)),
        _call(0.3, "PullMessages", (10, 5, 10, 0)),  # before any message: set-up
        _call(
            1.0, "PullMessages", (10, 5, 10, 50), messages=[_msg("m1", "train", "1", ["a", "b"])]
        ),
        _call(1.1, "PullObject", (10, 64, 10, 300), object="a", content=200),
        _call(1.2, "PullObject", (10, 64, 10, 100), object="b", content=30),
        _call(1.3, "ConfirmMessageReceived", (10, 70, 10, 0), object="a", content=0),
        _call(1.5, "SendNodeHeartbeat", (10, 8, 10, 2)),  # idle in round 1
        _call(2.0, "PushMessages", (10, 60, 10, 5), messages=[_msg("r1", "train", "1", ["c"])]),
        _call(2.1, "PushObject", (10, 500, 10, 1), object="c", content=420),
        _call(3.0, "PullMessages", (10, 5, 10, 40), messages=[_msg("m2", "train", "2", ["d"])]),
        _call(3.1, "PullObject", (10, 64, 10, 90), object="d", content=70),
        _call(3.5, "PullMessages", (10, 5, 10, 0)),  # idle in round 2
        _call(4.0, "DeactivateNode", (10, 5, 10, 0)),
    ]
    out = summarise_socket(rows)
    cost = [sum(r[k] for k in ("up_head", "up_body", "down_head", "down_body")) for r in rows]
    assert out["setup"] == cost[0] + cost[1] + cost[2]
    assert out["teardown"] == cost[13]
    r1, r2 = out["rounds"][1], out["rounds"][2]
    assert r1["kinds"]["train_instruction"] == {
        "messages": 1,
        "object_bytes": 230,
        "socket_bytes": cost[3] + cost[4] + cost[5] + cost[6],
    }
    assert r1["kinds"]["train_reply"] == {
        "messages": 1,
        "object_bytes": 420,
        "socket_bytes": cost[8] + cost[9],
    }
    assert r1["idle"] == cost[7]
    assert r2["idle"] == cost[12]
    assert r2["total"] == cost[10] + cost[11] + cost[12]
    assert out["setup"] + out["teardown"] + r1["total"] + r2["total"] == sum(cost)
    assert r1["calls"] + r2["calls"] + 4 == len(rows)


def test_the_framing_fit_sees_exactly_the_calls_a_round_gives_its_messages() -> None:
    """experiments/framing.py fits on message calls, object calls and receipts; the
    idle calls it leaves out are the rounds' idle bytes: together they are the rounds'
    socket bytes, so the model's terms cover each call of a round once."""
    from experiments.framing import PULL, PUSH, call_samples

    rows = [
        _call(
            1.0, "PullMessages", (10, 5, 10, 50), messages=[_msg("m1", "train", "1", ["m1", "a"])]
        ),
        _call(1.1, "PullObject", (10, 64, 10, 300), object="a", content=200),
        _call(1.3, "ConfirmMessageReceived", (10, 70, 10, 0), object="m1", content=0),
        _call(1.5, "SendNodeHeartbeat", (10, 8, 10, 2)),
        _call(2.0, "PushMessages", (10, 60, 10, 5), messages=[_msg("r1", "train", "1", ["c"])]),
        _call(2.1, "PushObject", (10, 500, 10, 1), object="c", content=420),
        _call(2.5, "PullMessages", (10, 5, 10, 0)),
    ]
    r1 = summarise_socket(rows)["rounds"][1]
    samples = call_samples(rows)
    fitted = (
        sum(b for _, b in samples.objects[PULL] + samples.objects[PUSH])
        + sum(b for _, b in samples.messages[PULL] + samples.messages[PUSH])
        + sum(samples.confirms)
    )
    assert fitted + r1["idle"] == r1["total"]
    assert samples.objects[PULL] == [(200, 384)] and samples.confirms == [90]


def test_a_call_moving_several_messages_splits_its_bytes_exactly() -> None:
    msgs = [_msg(f"m{i}", "evaluate", "3", [f"o{i}"]) for i in range(3)]
    out = summarise_socket([_call(1.0, "PullMessages", (1, 3, 1, 6), messages=msgs)])
    kind = out["rounds"][3]["kinds"]["evaluate_instruction"]
    assert kind["messages"] == 3
    assert kind["socket_bytes"] == 11


def test_totals_that_do_not_add_up_name_the_connection() -> None:
    rows = [_call(1.0, "GetRun", (100, 20, 90, 40))]
    ok = [{"connection": 0, "up_bytes": 120, "down_bytes": 130, "unparsed_up": 0,
           "unparsed_down": 0}]  # fmt: skip
    assert check_totals(rows, ok) == 250
    bad = [{**ok[0], "down_bytes": 131}]
    with pytest.raises(ValueError, match=r"^connection 0: calls account for 120 B up and 130 B"):
        check_totals(rows, bad)


def _echo_http_server() -> tuple[socket.socket, threading.Thread]:
    """A one-connection HTTP/1.1 server answering each request with its body reversed."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        splitter = HttpSplitter()
        with conn:
            while data := conn.recv(7):  # small reads: parts arrive in pieces
                for part in splitter.feed(data):
                    body = part.body[::-1]
                    conn.sendall(_chunked_response([body[:3], body[3:]]))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server, thread


def test_the_proxy_counts_every_byte_both_ways_and_logs_each_call(tmp_path: Path) -> None:
    server, thread = _echo_http_server()
    log = tmp_path / "socket.jsonl"
    proxy = CountingProxy(server.getsockname()[:2], log)
    port = proxy.start()
    bodies = [b"hello world", b"", b"z" * 100_000]
    sent = received = 0
    with socket.create_connection(("127.0.0.1", port)) as client:
        for body in bodies:
            req = _request("/v1/fleet/unknown", body)
            client.sendall(req)
            sent += len(req)
            splitter, parts = HttpSplitter(), []
            while not parts:
                chunk = client.recv(65536)
                received += len(chunk)
                parts = splitter.feed(chunk)
            assert parts[0].body == body[::-1]
    thread.join(timeout=10)
    proxy.stop()
    server.close()
    rows, conns = read_socket_log(log)
    assert [(r["up_body"], r["down_body"]) for r in rows] == [(len(b), len(b)) for b in bodies]
    assert sum(c["up_bytes"] for c in conns) == sent
    assert sum(c["down_bytes"] for c in conns) == received
    assert check_totals(rows, conns) == sent + received
    section = socket_section(log, counted_nodes=1)
    # No Fleet messages here: the first calls are "set-up" by definition.
    assert section["total_bytes"] == section["setup_bytes"] == sent + received
    assert section["unattributed_bytes"] == 0
    assert json.loads(log.read_text().splitlines()[0])["path"] == "/v1/fleet/unknown"


def test_a_request_cut_off_by_the_end_of_the_run_is_counted_unparsed(tmp_path: Path) -> None:
    """A poll the SuperLink never answered (it stopped first) is no call, but its
    bytes crossed: they are the connection's unparsed bytes, and the totals close."""
    from experiments.deployment.socket_count import SocketCounter

    counter = SocketCounter(tmp_path / "socket.jsonl")
    conn = counter.open()
    answered, cut = _request("/v1/fleet/x", b"ab"), _request("/v1/fleet/x", b"cde")
    counter.count(conn, answered, upward=True)
    reply = b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nz"
    counter.count(conn, reply, upward=False)
    counter.count(conn, cut, upward=True)
    counter.close()
    rows, conns = read_socket_log(tmp_path / "socket.jsonl")
    assert len(rows) == 1 and conns[0]["unanswered"] == 1
    assert conns[0]["unparsed_up"] == len(cut)
    assert check_totals(rows, conns) == len(answered) + len(reply) + len(cut)
