"""The wrapper's options beyond the codecs: one object, so the wrapper's signature stays short.

``CompressedStrategy(inner, codec=..., downlink=..., run_seed=..., options=ServerOptions(...),
reporting=...)``: how decoded updates reach the inner strategy and how far one client
may move them (``aggregation``, ``influence``), what the clients are told besides the
codec (``policy``, ``task``), and how stable ids are learned (``identity``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedcomp.codecs import TensorPolicy
from fedcomp.flower.identity import DEFAULT_REPLY_TIMEOUT
from fedcomp.flower.instructions import Sampling
from fedcomp.handoff_options import Aggregation
from fedcomp.influence import Influence
from fedcomp.rules import check_server_options


@dataclass(frozen=True)
class IdentityOptions:
    """How the wrapper learns each node's stable id (fedcomp.flower.identity).

    timeout: seconds to wait for the inner strategy's ``min_available_nodes`` nodes.
    reply_timeout: seconds a round waits for identity replies (a node that misses it is
        asked again after 1, 2, 4, ... rounds).
    bind_keys: bind each stable id to its first SuperNode's public key (with SuperNode
        authentication only; docs/deployment.md).
    """

    timeout: float = 600.0
    reply_timeout: float = DEFAULT_REPLY_TIMEOUT
    bind_keys: bool = False


@dataclass(frozen=True)
class ServerOptions:
    """Everything the wrapper is told besides the inner strategy and the codecs.

    aggregation: the hand-off (``per_client`` or ``pre_aggregated``), the reduction tree
        and the residual mirrors' directory (default: per client, in memory).
    influence: bounds on one client's influence (weight cap, norm cap, outlier factor,
        largest example count; fedcomp.influence).
    policy: which tensors travel raw; sent to the clients (None: each mod's own, except
        for joint codes, where the server's default is sent so both halves agree).
    task: settings the app's ClientApp needs, sent until each client holds them.
    identity: how stable ids are learned.
    """

    aggregation: Aggregation = field(default_factory=Aggregation)
    influence: Influence = field(default_factory=Influence)
    policy: TensorPolicy | None = None
    task: Mapping[str, Any] | None = None
    identity: IdentityOptions = field(default_factory=IdentityOptions)

    def __post_init__(self) -> None:
        # None means "the default", as it does for the wrapper's own optional arguments.
        for name, default in (
            ("aggregation", Aggregation),
            ("influence", Influence),
            ("identity", IdentityOptions),
        ):
            if getattr(self, name) is None:
                object.__setattr__(self, name, default())

    def check(self, codec_name: str, strategy_name: str, sampling: Sampling) -> None:
        """The same rules, and messages, as the settings check before Ray starts
        (fedcomp.rules): which hand-off, codec, strategy and bounds go together."""
        agg, influence = self.aggregation, self.influence
        check_server_options(
            codec_name=codec_name,
            handoff=agg.handoff,
            strategy_name=strategy_name.lower(),
            trees=agg.trees,
            fraction_train=sampling.fraction_train,
            fraction_evaluate=sampling.fraction_evaluate,
            influence=influence,
        )
