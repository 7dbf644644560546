"""Drive the real ClientApp and CompressedStrategy in one process, without Ray.

``InProcessGrid`` implements the two Grid methods the strategy uses; each message
is handled by the real ClientApp (mods included) with a per-node Context that
persists across rounds, as Flower's runtimes do. Replies can be tampered with,
dropped or reordered, to test the server's validation and order independence.
It serves the tests and the benchmarks that need real client updates without Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
from flwr.app import ArrayRecord, Context, Error, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.supercore.inflatable.inflatable_object import (
    get_all_nested_objects,
    no_object_id_recompute,
)
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from flwr.supercore.task_identity import TaskIdentity

from fedcomp.flower.identity import is_identity_message
from fedcomp.keys import KEY_NUM_EXAMPLES
from fedcomp.models import build_model
from fedcomp.settings import Settings

#: Flower-like random node ids (deliberately unrelated to the partition ids).
NODE_IDS = [
    7_340_981_223,
    91_022_334,
    5_551_212,
    123_456_789_012,
    42_424_242,
    8_000_001,
    3_141_592_653,
    2_718_281,
    1_618_033,
    99_999_991,
    11_235_813,
    27_182_818,
    14_142_135,
    17_320_508,
]


def set_task_identity() -> None:
    TaskIdentity.run_id = 1
    TaskIdentity.node_id = 0
    TaskIdentity.task_id = 0


#: (partition id, reply, the instruction it answers) -> new reply, None to drop it, or a
#: list of replies (a client that answers twice).
Tamper = Callable[[int, Message, Message], Message | list[Message] | None]


class InProcessGrid:
    """A Grid whose nodes run ``client_app`` in this process."""

    def __init__(
        self,
        client_app: ClientApp,
        num_nodes: int,
        *,
        tamper: Tamper | None = None,
        order: Callable[[list[Message]], list[Message]] | None = None,
        node_ids: list[int] | None = None,
    ) -> None:
        node_ids = list(node_ids or NODE_IDS)
        if num_nodes > len(node_ids):
            raise ValueError(f"at most {len(node_ids)} in-process nodes")
        self.app = client_app
        self.contexts = {
            node_id: Context(
                run_id=1,
                node_id=node_id,
                node_config={"partition-id": pid, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config={},
            )
            for pid, node_id in enumerate(node_ids[:num_nodes])
        }
        self.tamper = tamper
        self.order = order
        self.sent: list[Message] = []
        self.replies: list[Message] = []
        #: Bytes each sent message and each received reply pushed through the transport
        #: (parallel to ``sent`` and ``replies``).
        self.sent_bytes: list[int] = []
        self.received_bytes: list[int] = []

    def restart_node(self, node_id: int, new_node_id: int) -> None:
        """A node restarts as a new device: a new Flower node id, the same partition
        and stable id, and an empty Context.state."""
        old = self.contexts.pop(node_id)
        self.contexts[new_node_id] = Context(
            run_id=old.run_id,
            node_id=new_node_id,
            node_config=dict(old.node_config),
            state=RecordDict(),
            run_config={},
        )

    def partition_of(self, node_id: int) -> int:
        return int(self.contexts[node_id].node_config["partition-id"])

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        replies = []
        for msg in messages:
            self.sent.append(msg)
            node_id = msg.metadata.dst_node_id
            delivered = self._transport(msg, self.sent_bytes)
            try:
                reply = self.app(delivered, self.contexts[node_id])
            except Exception as exc:  # a ClientApp exception becomes an error reply
                reply = Message(
                    Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=repr(exc)),
                    reply_to=msg,
                )
            # Tampering targets round messages, not the first-contact identity exchange.
            if self.tamper is not None and not is_identity_message(msg):
                reply = self.tamper(self.partition_of(node_id), reply, msg)
                if reply is None:
                    continue
            replies.extend(reply if isinstance(reply, list) else [reply])
        if self.order is not None:
            replies = self.order(replies)
        replies = [self._transport(r, self.received_bytes) for r in replies]
        self.replies.extend(replies)
        return replies

    @staticmethod
    def _transport(msg: Message, pushed: list[int]) -> Message:
        """The message as the other side gets it: deflated into Flower's objects and
        inflated again (its own copy, so a mod that rebuilds a message's content does
        not change what the server sent); the bytes pushed are appended to ``pushed``
        (identical objects once, as Flower pushes them). Object ids are computed once
        per object, in Flower's own context for pushing a message."""
        with no_object_id_recompute():
            contents = {oid: o.deflate() for oid, o in get_all_nested_objects(msg).items()}
            root = msg.object_id
        pushed.append(sum(len(c) for c in contents.values()))
        return inflate_object_from_contents(root, contents)


class Spy:
    """An inner mod recording each client's dense trained model and weight."""

    def __init__(self) -> None:
        self.local: dict[int, dict[str, np.ndarray]] = {}
        self.weight: dict[int, float] = {}

    def __call__(self, msg, ctxt, call_next):
        reply = call_next(msg, ctxt)
        if msg.metadata.message_type == MessageType.TRAIN and not reply.has_error():
            pid = int(ctxt.node_config["partition-id"])
            arrays = next(iter(reply.content.array_records.values()))
            self.local[pid] = {k: np.array(v.numpy()) for k, v in arrays.items()}
            self.weight[pid] = float(reply.content["metrics"][KEY_NUM_EXAMPLES])
        return reply


def initial_arrays(settings: Settings) -> ArrayRecord:
    """The seeded initial model of a run, as Flower arrays."""
    model = build_model(settings.model, settings.dataset.name, settings.seed)
    return ArrayRecord(model.state_dict())
