"""Object counts of real messages and their fp32 reference, and the framing model
(experiments/framing.py) that turns objects, messages and bytes into socket bytes."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from clients.client_app import make_client_app
from experiments.inprocess import InProcessGrid, initial_arrays
from fedcomp.flower.accounting import array_record_objects, packed_record_objects
from fedcomp.flower.encoding import payload_content
from fedcomp.settings import settings_from_dict
from strategies.server_app import run_server
from tests.test_traffic import _kind

# --- object counts ------------------------------------------------------------------


def _run(codec: dict, **overrides) -> tuple[dict, InProcessGrid]:
    settings = settings_from_dict(
        {
            "num_clients": 4,
            "num_rounds": 2,
            "fraction_train": 0.5,
            "fraction_evaluate": 0.5,
            "codec": codec,
            **overrides,
        }
    )
    grid = InProcessGrid(make_client_app(), settings.num_clients)
    return run_server(grid, settings), grid


def _objects_by_round(grid: InProcessGrid) -> dict[int, dict[str, int]]:
    """Round -> kind -> Flower objects of every message the grid carried, counted here."""
    out: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for reply, messages in ((False, grid.sent), (True, grid.replies)):
        for msg in messages:
            group = msg.metadata.group_id
            kind = str(_kind(msg, reply))
            out[int(group) if group.isdigit() else 1][kind] += len(get_all_nested_objects(msg))
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[dict, InProcessGrid]]:
    return {
        "fp32": _run({"name": "fp32"}),
        "uniform2": _run({"name": "uniform", "bits": 2}),
        # Replica steps replace the model in instructions: their fp32 reference is the
        # instruction before the steps went in.
        "uniform2_down8": _run(
            {"name": "uniform", "bits": 2}, downlink={"name": "uniform", "bits": 8}
        ),
    }


@pytest.mark.parametrize("name", ["fp32", "uniform2", "uniform2_down8"])
def test_each_kinds_objects_are_those_of_the_real_messages(runs, name: str) -> None:
    results, grid = runs[name]
    seen = _objects_by_round(grid)
    for record in results["rounds"]:
        counted = {k: v["objects"] for k, v in record["traffic"].items()}
        assert counted == dict(seen[record["round"]])
        assert all(v > 0 for v in counted.values())


@pytest.mark.parametrize("name", ["uniform2", "uniform2_down8"])
def test_fp32_objects_are_the_fp32_runs_objects(runs, name: str) -> None:
    fp32, _ = runs["fp32"]
    compressed, _ = runs[name]
    for a, b in zip(fp32["rounds"], compressed["rounds"], strict=True):
        for kind, counts in a["traffic"].items():
            # Under fp32 every message is its own reference ...
            assert counts["fp32_objects"] == counts["objects"]
            # ... and the compressed run's reference is what fp32 really sent, object
            # for object (the same schedule, the same tensors).
            assert b["traffic"][kind]["fp32_objects"] == counts["objects"], kind


def test_array_record_objects_follow_flowers_chunking() -> None:
    """A plain-Flower train reply (the model's arrays and metrics) has the objects the
    chunking rule says: Message, RecordDict, ArrayRecord, an Array + chunks per tensor,
    and the MetricRecord."""
    settings = settings_from_dict({"num_clients": 2})
    arrays = initial_arrays(settings)
    msg = Message(
        RecordDict({"arrays": arrays, "metrics": MetricRecord({"loss": 0.5})}),
        dst_node_id=1,
        message_type="train",
    )
    sizes = [len(a.data) for a in arrays.values()]
    assert len(get_all_nested_objects(msg)) == array_record_objects(sizes) + 3
    # Larger than a chunk: Flower slices Array.data every FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE.
    big = Array(np.arange(FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE // 4 + 5, dtype=np.float32))
    chunks = math.ceil(len(big.data) / FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE)
    assert chunks == 2
    record = ArrayRecord({"w": big})
    assert len(get_all_nested_objects(record)) == array_record_objects([len(big.data)]) == 4
    assert array_record_objects([10, 10], chunk_size=4) == 1 + 2 * (1 + 3)
    with pytest.raises(ValueError, match="chunk_size=0"):
        array_record_objects([1], chunk_size=0)


def test_packed_record_objects_count_a_real_fp32_payload_record() -> None:
    rng = np.random.default_rng(0)
    payloads = {f"t{i}": rng.bytes(n) for i, n in enumerate([400, 12, 9000])}
    content = payload_content(payloads)
    # The RecordDict itself aside: the record, its Arrays and their chunks.
    expected = len(get_all_nested_objects(content)) - 1
    assert packed_record_objects(3, sum(len(b) for b in payloads.values())) == expected == 7
    # Above a chunk: at least one chunk per tensor and per chunk_size bytes.
    assert packed_record_objects(2, 10, chunk_size=4) == 1 + 2 + 3
    assert packed_record_objects(4, 10, chunk_size=4) == 1 + 4 + 4
    with pytest.raises(ValueError, match="tensors=-1"):
        packed_record_objects(-1, 0)
