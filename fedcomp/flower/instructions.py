"""What each client is sent: Flower's sampling settings (read from the inner strategy),
seeded sampling over stable ids, and per-client configs."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp.strategy import Strategy

from fedcomp.codecs import TensorPolicy
from fedcomp.flower.families.base import RoundPlan
from fedcomp.flower.shared_settings import SharedSettings
from fedcomp.keys import (
    KEY_ACK_ROUND,
    KEY_CODEC,
    KEY_DOWNLINK_CODEC,
    KEY_EXPECTED_ID,
    KEY_POLICY,
    KEY_PROTOCOL,
    KEY_RESYNC,
    KEY_ROUND,
    KEY_RUN_SEED,
    KEY_TASK,
    PROTOCOL_VERSION,
)
from fedcomp.rng import numpy_generator


@dataclass(frozen=True)
class Sampling:
    """Flower's sampling settings, as the inner strategy holds them."""

    fraction_train: float = 1.0
    fraction_evaluate: float = 1.0
    min_train_nodes: int = 2
    min_evaluate_nodes: int = 2
    min_available_nodes: int = 2

    @classmethod
    def of(cls, strategy: Strategy) -> Sampling:
        """Read them from the strategy, or the strategy it wraps (Flower's DP
        wrappers), else Flower's defaults."""
        source: Any = strategy
        while source is not None and not hasattr(source, "fraction_train"):
            source = getattr(source, "strategy", None)
        if source is None:
            return cls()
        return cls(**{f.name: getattr(source, f.name) for f in fields(cls)})


def sample(
    stable_ids: list[int],
    fraction: float,
    run_seed: int,
    purpose: str,
    server_round: int,
    *,
    minimum: int = 1,
) -> list[int]:
    """``fraction`` of the known stable ids (at least ``minimum``, Flower's count:
    ``max(int(fraction * n), minimum)``), drawn from (run seed, purpose, round)."""
    if not stable_ids or fraction <= 0:
        return []
    k = min(len(stable_ids), max(1, minimum, int(fraction * len(stable_ids))))
    if k == len(stable_ids):
        return stable_ids
    rng = numpy_generator(run_seed, purpose, server_round)
    return sorted(int(i) for i in rng.choice(stable_ids, size=k, replace=False))


class Instructions:
    """Builds each client's instruction from the inner strategy's template message.

    FedAvg shares one RecordDict among all its messages; every client here gets its own
    config: the protocol fields, the codec spec, its acknowledgement, and the joint
    plan's per-client fields. The JSON of the codec, policy and task is made once.
    """

    def __init__(
        self,
        codec_spec: Mapping[str, Any],
        *,
        run_seed: int,
        policy: TensorPolicy | None,
        task: Mapping[str, Any] | None,
        downlink_codec: str | None = None,
    ) -> None:
        self.codec_json = json.dumps(dict(codec_spec), sort_keys=True)
        self.run_seed = run_seed
        values = {KEY_CODEC: self.codec_json}
        if policy is not None:
            values[KEY_POLICY] = json.dumps(dataclasses.asdict(policy), sort_keys=True)
        if task is not None:
            values[KEY_TASK] = json.dumps(dict(task), sort_keys=True)
        if downlink_codec is not None:  # what steps are checked against, every round
            values[KEY_DOWNLINK_CODEC] = downlink_codec
        #: The codec, policy, task and downlink codec JSON: sent until each client holds them.
        self.shared = SharedSettings(values)

    def build(
        self,
        template: list[Message],
        stable_ids: list[int],
        server_round: int,
        kind: str,
        *,
        node_of: Callable[[int], int],
        ack_round: Callable[[int], int],
        resync: Callable[[int], bool],
        plan: RoundPlan | None,
        restores: Callable[[int], bool],
    ) -> dict[int, Message]:
        """One message per stable id (train configs carry the codec fields; the run
        settings travel until the client holds them and ``restores`` them on this
        kind of message)."""
        base = template[0].content
        ((arrays_key, arrays),) = base.array_records.items()
        config_items = list(base.config_records.items())
        config_key, base_config = config_items[0] if config_items else ("config", ConfigRecord())
        messages = {}
        for sid in stable_ids:
            config = ConfigRecord(dict(base_config))
            config[KEY_PROTOCOL] = PROTOCOL_VERSION
            config[KEY_ROUND] = server_round
            config[KEY_RUN_SEED] = self.run_seed
            config[KEY_EXPECTED_ID] = sid
            self.shared.fill(config, sid, restores=restores(sid))
            if kind == MessageType.TRAIN:
                config[KEY_ACK_ROUND] = ack_round(sid)
                if resync(sid):
                    config[KEY_RESYNC] = 1
                for key, value in (plan.fields(sid) if plan is not None else {}).items():
                    config[key] = value
            content = RecordDict({arrays_key: arrays, config_key: config})
            messages[sid] = Message(
                content, dst_node_id=node_of(sid), message_type=kind, group_id=str(server_round)
            )
        return messages
