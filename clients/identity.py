"""A client's stable id: what reproducible randomness and server state are keyed on.

Flower's node ids are random per run, so they never key anything that must be
reproducible. The stable id is the node config's ``stable-id`` when set, else its
``partition-id`` (what simulation and our deployment launcher set).
"""

from __future__ import annotations

from flwr.app import Context

from fedcomp.keys import NODE_CONFIG_PARTITION_ID, NODE_CONFIG_STABLE_ID


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
