"""A SuperNode that writes down every Fleet API call it makes: what crossed the network.

    python -m experiments.deployment.tap LOG.jsonl [flower-supernode arguments ...]

Flower's SuperNode talks to the SuperLink's Fleet API in protobuf over HTTP
(``FleetHttpClient``, one POST per call). This wrapper patches the one function every
call goes through and appends a JSON line per call: the method, the request and
response body sizes, and what the call carried (the messages pulled or pushed, with
their type, group and object ids; each object pulled or pushed with its id and
content size). The launcher starts SuperNodes through it with
``deployment.supernodes.transport_log=true``; :func:`summarise` turns the lines into
bytes per message, which the tests compare with what fedcomp counted.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

_FLEET = "/flwr.proto.Fleet/"
#: Calls that move one object of a message (or confirm its receipt): the message's cost.
_OBJECT_CALLS = ("PullObject", "PushObject", "ConfirmMessageReceived")


def _tree_ids(tree: Any) -> list[str]:
    """Object ids of a message's object tree (the message itself first)."""
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        out.append(node.object_id)
        stack.extend(node.children)
    return out


def _messages(protos: Iterable[Any], trees: Iterable[Any]) -> list[dict[str, Any]]:
    return [
        {
            "id": m.metadata.message_id,
            "type": m.metadata.message_type,
            "group": m.metadata.group_id,
            "reply_to": m.metadata.reply_to_message_id,
            "objects": _tree_ids(t),
        }
        for m, t in zip(protos, trees, strict=True)
    ]


def describe(rpc: str, request: Any, response: Any) -> dict[str, Any]:
    """One call as a JSON-able row: sizes are the HTTP bodies' (serialized protobuf)."""
    row: dict[str, Any] = {
        "rpc": rpc,
        "request": request.ByteSize(),
        "response": response.ByteSize(),
    }
    if rpc == "PullMessages":
        row["messages"] = _messages(response.messages_list, response.message_object_trees)
    elif rpc == "PushMessages":
        row["messages"] = _messages(request.messages_list, request.message_object_trees)
        row["to_push"] = list(response.objects_to_push)
    elif rpc == "PullObject":
        row["object"], row["content"] = request.object_id, len(response.object_content)
    elif rpc == "PushObject":
        row["object"], row["content"] = request.object_id, len(request.object_content)
    elif rpc == "ConfirmMessageReceived":  # the receipt of a pulled message: its cost too
        row["object"], row["content"] = request.message_object_id, 0
    return row


def install(log_path: Path) -> None:
    """Patch Flower's protobuf-over-HTTP client to log every Fleet call to ``log_path``."""
    from flwr.supercore.protobuf.client import ProtobufClient

    original = ProtobufClient._unary_unary
    out = log_path.open("a", buffering=1)  # line-buffered: a killed node keeps its lines

    def tapped(self: Any, *, rpc_method: str, request: Any, **kwargs: Any) -> Any:
        response = original(self, rpc_method=rpc_method, request=request, **kwargs)
        if rpc_method.startswith(_FLEET):
            row = describe(rpc_method.removeprefix(_FLEET), request, response)
            out.write(json.dumps(row) + "\n")
        return response

    ProtobufClient._unary_unary = tapped  # type: ignore[method-assign]


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Bytes per message from one SuperNode's log.

    Returns ``messages``: message id -> {direction ("down" pulled, "up" pushed), type,
    group, objects (ids in the tree), object_bytes (the contents that crossed, which
    is what fedcomp's wire bytes count), body_bytes (every HTTP body of the calls
    that moved it: its share of Pull/PushMessages and its object calls), skipped (ids
    the SuperLink already had and did not ask for)}; and ``other_body_bytes``: the
    calls that moved no message (heartbeats, empty polls, registration, the app).
    """
    messages: dict[str, dict[str, Any]] = {}
    owner: dict[str, str] = {}  # object id -> the message whose transfer is under way
    other = 0
    for row in rows:
        rpc = row["rpc"]
        if rpc in ("PullMessages", "PushMessages") and row.get("messages"):
            direction = "down" if rpc == "PullMessages" else "up"
            share = (row["request"] + row["response"]) / len(row["messages"])
            for m in row["messages"]:
                asked = set(row.get("to_push", m["objects"]))
                messages[m["id"]] = {
                    **m,
                    "direction": direction,
                    "object_bytes": 0,
                    "body_bytes": share,
                    "skipped": [o for o in m["objects"] if o not in asked],
                }
                for oid in m["objects"]:
                    owner[oid] = m["id"]
        elif rpc in _OBJECT_CALLS and row["object"] in owner:
            entry = messages[owner[row["object"]]]
            entry["object_bytes"] += row["content"]
            entry["body_bytes"] += row["request"] + row["response"]
        else:
            other += row["request"] + row["response"]
    return {"messages": messages, "other_body_bytes": other}


def main(argv: list[str]) -> int:
    log_path, rest = Path(argv[0]), argv[1:]
    install(log_path)
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *rest]
    return flower_supernode() or 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
