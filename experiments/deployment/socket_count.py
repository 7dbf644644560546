"""Count every byte the SuperNodes exchange with the SuperLink: a TCP proxy on the Fleet API.

The launcher points the SuperNodes at this proxy instead of the SuperLink's Fleet API
(``deployment.socket_count``). Each connection's bytes are counted as they pass, in
both directions, and split into HTTP/1.1 calls: Flower's SuperNode speaks protobuf
over HTTP (one POST per Fleet call, ``flwr.supercore.protobuf.client``), so each call is
a request head and body and a response head and body. The proxy parses the bodies
with Flower's own protobuf classes and describes each call as
:mod:`experiments.deployment.tap` does (which messages and objects it moved), adding
what the call cost at the socket. Over TLS the bytes cannot be split: the connection
is counted whole and marked ``opaque``.

Every byte counted is attributed: per connection, the sum of the calls' heads and
bodies plus any unparsed remainder equals the bytes that passed (``check_totals``).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from experiments.deployment.tap import describe

#: The longest request or response head the parser accepts (Flower's are ~300 B).
MAX_HEAD = 64 * 1024


def _fleet_types() -> dict[str, tuple[str, type, type]]:
    """URL path -> (Fleet method, request class, response class), as flwr 1.42 calls them."""
    from flwr.proto import fab_pb2, fleet_pb2, heartbeat_pb2, message_pb2, run_pb2

    f, m = fleet_pb2, message_pb2
    table = {
        "register-node": ("RegisterNode", f.RegisterNodeFleetRequest, f.RegisterNodeFleetResponse),
        "activate-node": ("ActivateNode", f.ActivateNodeRequest, f.ActivateNodeResponse),
        "deactivate-node": ("DeactivateNode", f.DeactivateNodeRequest, f.DeactivateNodeResponse),
        "unregister-node": (
            "UnregisterNode",
            f.UnregisterNodeFleetRequest,
            f.UnregisterNodeFleetResponse,
        ),
        "send-node-heartbeat": (
            "SendNodeHeartbeat",
            heartbeat_pb2.SendNodeHeartbeatRequest,
            heartbeat_pb2.SendNodeHeartbeatResponse,
        ),
        "pull-messages": ("PullMessages", f.PullMessagesRequest, f.PullMessagesResponse),
        "push-messages": ("PushMessages", f.PushMessagesRequest, f.PushMessagesResponse),
        "get-run": ("GetRun", run_pb2.GetRunRequest, run_pb2.GetRunResponse),
        "get-fab": ("GetFab", fab_pb2.GetFabRequest, fab_pb2.GetFabResponse),
        "push-object": ("PushObject", m.PushObjectRequest, m.PushObjectResponse),
        "pull-object": ("PullObject", m.PullObjectRequest, m.PullObjectResponse),
        "confirm-message-received": (
            "ConfirmMessageReceived",
            m.ConfirmMessageReceivedRequest,
            m.ConfirmMessageReceivedResponse,
        ),
    }
    return {f"/v1/fleet/{k}": v for k, v in table.items()}


class HttpFramingError(ValueError):
    """The bytes are not HTTP/1.1 this parser understands (TLS, HTTP/2, a torn stream)."""


@dataclass
class HttpPart:
    """One request or response as it crossed: head bytes, body bytes, the body itself."""

    start_line: str
    head_bytes: int
    body: bytes
    status: int = 0


class HttpSplitter:
    """Split one direction of an HTTP/1.1 connection into requests or responses.

    ``feed`` takes bytes as they arrive and returns the parts completed by them. Bodies
    are framed by ``Content-Length`` or chunked transfer coding; chunk framing is
    counted in the head bytes, so a part's ``head_bytes + len(body)`` is exactly the
    bytes it took on the wire.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._head: tuple[str, int, dict[str, str]] | None = None
        self.unparsed = 0  # bytes held for an incomplete part

    def feed(self, data: bytes) -> list[HttpPart]:
        self._buf.extend(data)
        done = []
        while (part := self._next()) is not None:
            done.append(part)
        # A part under way holds its head (already parsed) and what came of its body.
        self.unparsed = len(self._buf) + (self._head[1] if self._head is not None else 0)
        return done

    def _next(self) -> HttpPart | None:
        if self._head is None:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > MAX_HEAD:
                    raise HttpFramingError(f"no end of head within {MAX_HEAD} bytes")
                return None
            self._head = _parse_head(bytes(self._buf[: end + 4]))
            del self._buf[: end + 4]
        start, head_len, headers = self._head
        if headers.get("transfer-encoding", "").lower() == "chunked":
            framed = _dechunk(self._buf)
            if framed is None:
                return None
            body, used = framed
            extra = used - len(body)
        else:
            length = int(headers.get("content-length", "0"))
            if len(self._buf) < length:
                return None
            body, used, extra = bytes(self._buf[:length]), length, 0
        del self._buf[:used]
        self._head = None
        status = int(start.split()[1]) if start.startswith("HTTP/") else 0
        return HttpPart(start, head_len + extra, body, status)


def _parse_head(head: bytes) -> tuple[str, int, dict[str, str]]:
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError as exc:  # pragma: no cover - latin-1 decodes any byte
        raise HttpFramingError(str(exc)) from exc
    lines = text.split("\r\n")
    start = lines[0]
    if not (start.startswith("HTTP/1.") or start.endswith((" HTTP/1.1", " HTTP/1.0"))):
        raise HttpFramingError(f"not an HTTP/1.x start line: {start[:40]!r}")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if "content-length" in headers and not headers["content-length"].isdigit():
        raise HttpFramingError(f"bad Content-Length {headers['content-length']!r}")
    return start, len(head), headers


def _dechunk(buf: bytearray) -> tuple[bytes, int] | None:
    """A complete chunked body at the start of ``buf``: (payload, bytes used) or None."""
    pos, body = 0, bytearray()
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size_text = bytes(buf[pos:eol]).split(b";")[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError as exc:
            raise HttpFramingError(f"bad chunk size {size_text[:20]!r}") from exc
        if size == 0:
            end = buf.find(b"\r\n\r\n", eol)  # the (usually empty) trailer section
            if end < 0:
                return None
            return bytes(body), end + 4
        if len(buf) < eol + 2 + size + 2:
            return None
        body.extend(buf[eol + 2 : eol + 2 + size])
        pos = eol + 2 + size + 2


@dataclass
class Connection:
    """One SuperNode connection's counts, with its two directions side by side."""

    index: int
    up_bytes: int = 0  # SuperNode -> SuperLink
    down_bytes: int = 0
    opaque: bool = False
    up: HttpSplitter = field(default_factory=HttpSplitter)
    down: HttpSplitter = field(default_factory=HttpSplitter)
    pending: deque = field(default_factory=deque)  # requests awaiting their responses


class SocketCounter:
    """The calls and byte totals of every proxied connection, written as JSON lines.

    Each call's row: ``conn``, ``t`` (seconds since the proxy started, at the response),
    ``path``, ``status``, ``up_head``, ``up_body``, ``down_head``, ``down_body`` (socket
    bytes) and, for a Fleet call with status 200, :func:`tap.describe`'s fields (``rpc``,
    the messages and objects it moved). At the end one ``connection`` row per connection
    with its totals and what could not be split into calls.
    """

    def __init__(self, log_path: Path) -> None:
        self._out = log_path.open("a", buffering=1)
        self._types = _fleet_types()
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self.connections: list[Connection] = []

    def open(self) -> Connection:
        with self._lock:
            conn = Connection(len(self.connections))
            self.connections.append(conn)
            return conn

    def count(self, conn: Connection, data: bytes, upward: bool) -> None:
        if upward:
            conn.up_bytes += len(data)
        else:
            conn.down_bytes += len(data)
        if conn.opaque:
            return
        try:
            if upward:
                conn.pending.extend(conn.up.feed(data))
            else:
                for response in conn.down.feed(data):
                    self._call(conn, conn.pending.popleft(), response)
        except (HttpFramingError, IndexError):
            conn.opaque = True  # TLS or a protocol this parser does not follow

    def _call(self, conn: Connection, request: HttpPart, response: HttpPart) -> None:
        path = request.start_line.split()[1] if " " in request.start_line else ""
        row: dict[str, Any] = {
            "conn": conn.index,
            "t": round(time.monotonic() - self._t0, 4),
            "path": path,
            "status": response.status,
            "up_head": request.head_bytes,
            "up_body": len(request.body),
            "down_head": response.head_bytes,
            "down_body": len(response.body),
        }
        kind = self._types.get(path)
        if kind is not None and response.status == 200:
            rpc, req_cls, resp_cls = kind
            try:
                req, resp = req_cls.FromString(request.body), resp_cls.FromString(response.body)
                row.update(describe(rpc, req, resp))
            except Exception as exc:  # a body that is not its type: say so, count it anyway
                row["rpc"], row["error"] = rpc, f"{type(exc).__name__}: {exc}"
        self._write(row)

    def _write(self, row: dict[str, Any]) -> None:
        with self._lock:
            self._out.write(json.dumps(row) + "\n")

    def close(self) -> None:
        for c in self.connections:
            self._write(
                {
                    "connection": c.index,
                    "up_bytes": c.up_bytes,
                    "down_bytes": c.down_bytes,
                    "opaque": c.opaque,
                    # A request still awaiting its response when the run stopped (a
                    # poll cut off by the SuperLink's exit) is no call: unparsed.
                    "unparsed_up": c.up_bytes
                    if c.opaque
                    else c.up.unparsed + sum(p.head_bytes + len(p.body) for p in c.pending),
                    "unparsed_down": c.down_bytes if c.opaque else c.down.unparsed,
                    "unanswered": len(c.pending),
                }
            )
        self._out.close()


class CountingProxy:
    """A TCP proxy on ``127.0.0.1`` in a thread of its own, counting into a log.

    ``start()`` returns the port to point SuperNodes at; ``stop()`` closes every
    connection and writes the per-connection totals.
    """

    def __init__(self, target: tuple[str, int], log_path: Path, host: str = "127.0.0.1"):
        self.target, self.host = target, host
        self.counter = SocketCounter(log_path)
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> int:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)
        self.port = future.result(timeout=10)
        return self.port

    async def _serve(self) -> int:
        self._server = await asyncio.start_server(self._handle, self.host, 0)
        return self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.add(asyncio.current_task())  # type: ignore[arg-type]
        conn = self.counter.open()
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(
                self._pump(reader, up_writer, conn, upward=True),
                self._pump(up_reader, writer, conn, upward=False),
            )
        finally:
            for w in (writer, up_writer):
                w.close()
            self._tasks.discard(asyncio.current_task())  # type: ignore[arg-type]

    async def _pump(
        self,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        conn: Connection,
        *,
        upward: bool,
    ) -> None:
        try:
            while data := await src.read(65536):
                self.counter.count(conn, data, upward)
                dst.write(data)
                await dst.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            if dst.can_write_eof():
                try:
                    dst.write_eof()
                except OSError:
                    pass

    def stop(self) -> None:
        async def _close() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.sleep(0)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(_close(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self.counter.close()


# ---------------------------------------------------------------------------------
# from calls to rounds
# ---------------------------------------------------------------------------------

#: Calls that set a SuperNode up or take it down: per-run constants, not a round's.
SETUP_RPCS = ("RegisterNode", "ActivateNode", "GetRun", "GetFab")
TEARDOWN_RPCS = ("DeactivateNode", "UnregisterNode")


def read_socket_log(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(call rows, connection rows) of one proxy log."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "connection" not in r], [r for r in rows if "connection" in r]


def socket_bytes(row: dict[str, Any]) -> int:
    """What one call took on the wire, both directions, HTTP heads included."""
    return row["up_head"] + row["up_body"] + row["down_head"] + row["down_body"]


def message_kind(message: dict[str, Any], upward: bool) -> tuple[int | None, str]:
    """(round, kind) of a message the proxy saw: fedcomp's traffic names.

    Messages of a round carry the round as their group id; the identity exchange that
    precedes a node's first round does not (it is counted in round 1, as results.json
    does).
    """
    group = message["group"]
    first_contact = not group.isdigit()
    kind = "identity" if first_contact else message["type"]
    name = f"{kind}_{'reply' if upward else 'instruction'}"
    name = {"identity_instruction": "identity_query"}.get(name, name)
    return (1 if first_contact else int(group)), name


def summarise_socket(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Socket bytes per round and message kind, and the per-run constants apart.

    A call that moves a message (its push or pull, each of its objects, its receipt)
    is that message's; a poll that found nothing and a heartbeat are ``idle`` and
    belong to the round of the latest message moved before them (the round the
    SuperNodes are waiting in); set-up calls (registration, the run, the app) and
    calls before the first message are ``setup``, the SuperNodes' sign-off
    ``teardown``. Every call lands in exactly one place, so
    ``setup + teardown + sum(rounds' total)`` equals the calls' bytes.

    Returns ``{"setup": B, "teardown": B, "setup_calls": {rpc: B}, "rounds": {round:
    {"total": B, "idle": B, "calls": n, "kinds": {kind: {"messages": n,
    "object_bytes": B, "socket_bytes": B}}}}}``.
    """
    owner: dict[str, tuple[int, str]] = {}  # object id -> (round, kind) of its message
    out: dict[str, Any] = {"setup": 0, "teardown": 0, "setup_calls": {}, "rounds": {}}
    current: int | None = None

    def round_of(r: int) -> dict[str, Any]:
        return out["rounds"].setdefault(r, {"total": 0, "idle": 0, "calls": 0, "kinds": {}})

    for row in sorted(rows, key=lambda r: r["t"]):
        cost, rpc = socket_bytes(row), row.get("rpc", row["path"])
        messages = row.get("messages") or []
        if messages:
            share, rest = divmod(cost, len(messages))
            for i, m in enumerate(messages):
                r, kind = message_kind(m, upward=rpc == "PushMessages")
                current = r if current is None else max(current, r)
                k = round_of(r)["kinds"].setdefault(
                    kind, {"messages": 0, "object_bytes": 0, "socket_bytes": 0}
                )
                k["messages"] += 1
                k["socket_bytes"] += share + (rest if i == 0 else 0)
                round_of(r)["total"] += share + (rest if i == 0 else 0)
                round_of(r)["calls"] += 1 if i == 0 else 0
                for oid in m["objects"]:
                    owner[oid] = (r, kind)
        elif row.get("object") in owner:
            r, kind = owner[row["object"]]
            round_of(r)["kinds"][kind]["object_bytes"] += row.get("content", 0)
            round_of(r)["kinds"][kind]["socket_bytes"] += cost
            round_of(r)["total"] += cost
            round_of(r)["calls"] += 1
        elif rpc in TEARDOWN_RPCS:
            out["teardown"] += cost
        elif rpc in SETUP_RPCS or current is None:
            out["setup"] += cost
            out["setup_calls"][rpc] = out["setup_calls"].get(rpc, 0) + cost
        else:
            round_of(current)["idle"] += cost
            round_of(current)["total"] += cost
            round_of(current)["calls"] += 1
    out["rounds"] = dict(sorted(out["rounds"].items()))
    return out


def check_totals(rows: list[dict[str, Any]], connections: list[dict[str, Any]]) -> int:
    """The proxy's accounting closes: the calls' bytes are the connections' bytes.

    Returns the bytes that crossed; raises ``ValueError`` naming the connection whose
    bytes the calls do not add up to (what a parsing bug would leave behind).
    """
    total = 0
    for c in connections:
        calls = [r for r in rows if r["conn"] == c["connection"]]
        up = sum(r["up_head"] + r["up_body"] for r in calls) + c["unparsed_up"]
        down = sum(r["down_head"] + r["down_body"] for r in calls) + c["unparsed_down"]
        if (up, down) != (c["up_bytes"], c["down_bytes"]):
            raise ValueError(
                f"connection {c['connection']}: calls account for {up} B up and {down} B "
                f"down of {c['up_bytes']} B and {c['down_bytes']} B"
            )
        total += c["up_bytes"] + c["down_bytes"]
    return total


def socket_section(log_path: Path, counted_nodes: int) -> dict[str, Any]:
    """results.json's ``socket``: what the counted SuperNodes' connections carried.

    ``total_bytes`` (every byte, both ways) = ``setup_bytes`` + ``teardown_bytes`` +
    the rounds' ``socket_bytes`` + ``unattributed_bytes`` (bytes not split into calls:
    a TLS connection, or a call cut off by the end of the run).
    """
    rows, connections = read_socket_log(log_path)
    total = check_totals(rows, connections)
    summary = summarise_socket(rows)
    rounds = [
        {
            "round": r,
            "socket_bytes": v["total"],
            "idle_bytes": v["idle"],
            "calls": v["calls"],
            "kinds": v["kinds"],
        }
        for r, v in summary["rounds"].items()
    ]
    attributed = summary["setup"] + summary["teardown"] + sum(r["socket_bytes"] for r in rounds)
    return {
        "counted_nodes": counted_nodes,
        "connections": len(connections),
        "opaque_connections": sum(1 for c in connections if c["opaque"]),
        "calls": len(rows),
        "total_bytes": total,
        "setup_bytes": summary["setup"],
        "setup_calls": summary["setup_calls"],
        "teardown_bytes": summary["teardown"],
        "unattributed_bytes": total - attributed,
        "rounds": rounds,
    }
