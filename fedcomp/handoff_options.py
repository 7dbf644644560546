"""How decoded client updates reach the inner Flower strategy: one settings object.

``Aggregation`` groups what the wrapper needs to choose its hand-off once, at
construction (docs/trees.md, docs/residual.md):

- ``handoff``: ``per_client`` hands the inner strategy one dense reply per client, in
  stable-id order (any strategy); ``pre_aggregated`` hands it one reply holding the
  weighted mean, summed by fedcomp (mean-based strategies; needed by joint codes and
  reduction trees).
- ``trees``: the reduction tree of the pre-aggregated mode (default: a float32 running
  sum in stable-id order).
- ``mirror_dir``: residual memory only, a directory for the server's mirrors of the
  clients' control variates (one file per client) instead of memory.

The combination rules (which strategy, codec and tree options go together) are
``fedcomp.rules.check_server_options``, shared with the check that runs before Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fedcomp.trees.aggregate import TreeConfig


@dataclass(frozen=True)
class Aggregation:
    """The hand-off, the reduction tree and where residual mirrors live."""

    handoff: str = "per_client"
    trees: TreeConfig = field(default_factory=TreeConfig)
    mirror_dir: str | None = None

    @property
    def pre_aggregated(self) -> bool:
        return self.handoff == "pre_aggregated"
