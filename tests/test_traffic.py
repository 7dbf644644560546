"""Every message of a round is counted, by kind, with the bytes the real messages have.

The whole job runs in-process (the repository's ClientApp and ServerApp code, real
Flower messages); the test measures every message the grid carried on its own and
compares with what results.json says, round by round and kind by kind."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from flwr.app import MessageType

from clients.client_app import make_client_app
from experiments.inprocess import InProcessGrid
from fedcomp.codecs.wire import HEADER_FIXED_BYTES
from fedcomp.results_file import build_results, round_sum
from fedcomp.settings import settings_from_dict
from fedcomp.traffic import Kind
from strategies.server_app import run_server

_KIND = {
    (MessageType.TRAIN, False): Kind.TRAIN_INSTRUCTION,
    (MessageType.TRAIN, True): Kind.TRAIN_REPLY,
    (MessageType.EVALUATE, False): Kind.EVALUATE_INSTRUCTION,
    (MessageType.EVALUATE, True): Kind.EVALUATE_REPLY,
    ("identity", False): Kind.IDENTITY_QUERY,
    ("identity", True): Kind.IDENTITY_REPLY,
}


def _kind(msg, reply: bool) -> Kind:
    """Identity messages are train messages of their own (no round, no model)."""
    first_contact = not msg.metadata.group_id.isdigit()
    return _KIND[("identity" if first_contact else msg.metadata.message_type, reply)]


def _measured(grid: InProcessGrid) -> dict[int, dict[str, list[int]]]:
    """Round -> kind -> the bytes every message pushed through the in-process
    transport (Flower's own object deflation, then inflation on the other side).
    Identity messages precede round 1 (a static set of nodes); the rest carry their
    round."""
    out: dict[int, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for replies, messages, sizes in (
        (False, grid.sent, grid.sent_bytes),
        (True, grid.replies, grid.received_bytes),
    ):
        for msg, size in zip(messages, sizes, strict=True):
            kind = _kind(msg, replies)
            group = msg.metadata.group_id
            out[int(group) if group.isdigit() else 1][str(kind)].append(size)
    return out


def _run(codec: dict, inner_mods=None, **overrides) -> tuple[dict, InProcessGrid]:
    settings = settings_from_dict(
        {
            "num_clients": 6,
            "num_rounds": 2,
            "fraction_train": 0.5,
            "fraction_evaluate": 0.5,
            "codec": codec,
            **overrides,
        }
    )
    grid = InProcessGrid(make_client_app(inner_mods=inner_mods), settings.num_clients)
    return run_server(grid, settings), grid


@pytest.mark.parametrize(
    "codec", [{"name": "fp32"}, {"name": "uniform", "bits": 2}], ids=["fp32", "uniform2"]
)
def test_every_message_kind_is_counted_with_its_real_size(codec: dict) -> None:
    results, grid = _run(codec)
    measured = _measured(grid)
    for record in results["rounds"]:
        seen = measured[record["round"]]
        counted = record["traffic"]
        assert set(counted) == set(seen)
        for kind, sizes in seen.items():
            assert counted[kind]["messages"] == len(sizes)
            assert counted[kind]["wire_bytes"] == sum(sizes), kind
        assert record["total_wire_bytes"] == sum(sum(s) for s in seen.values())
        train = sum(seen[str(Kind.TRAIN_INSTRUCTION)]) + sum(seen[str(Kind.TRAIN_REPLY)])
        assert record["train_wire_bytes"] == train
        # The old fields keep their meaning: train instructions down, train replies up.
        assert record["downlink_wire_bytes"] == sum(seen[str(Kind.TRAIN_INSTRUCTION)])
        assert record["uplink_wire_bytes"] == sum(seen[str(Kind.TRAIN_REPLY)])
        # Per client: each client's rows add up to the round's counts per kind.
        for kind in (Kind.TRAIN_INSTRUCTION, Kind.EVALUATE_INSTRUCTION, Kind.EVALUATE_REPLY):
            per_client = sum(r["wire_bytes_by_kind"].get(kind, 0) for r in record["per_client"])
            assert per_client == sum(seen[str(kind)])
    # Evaluate traffic is real traffic: each round sent half the clients the model.
    assert all(r["traffic"][Kind.EVALUATE_INSTRUCTION]["messages"] == 3 for r in results["rounds"])


def test_fp32_reference_is_the_same_schedule_measured_under_fp32() -> None:
    fp32, _ = _run({"name": "fp32"})
    two_bit, _ = _run({"name": "uniform", "bits": 2})
    for a, b in zip(fp32["rounds"], two_bit["rounds"], strict=True):
        # The references differ from the sizes sent by exactly the decoded replies'
        # measured fp32 sizes (the app's own reply, as plain Flower sends it): every
        # other message is its own reference. Even the fp32 codec saves a little: its
        # reply is one record, not an Array and a chunk per tensor.
        for run in (a, b):
            saved = sum(
                r["fp32_wire_bytes"] - r["uplink_wire_bytes"]
                for r in run["per_client"]
                if "fp32_wire_bytes" in r
            )
            assert run["fp32_total_wire_bytes"] - run["total_wire_bytes"] == saved > 0
        # Both runs' references are what plain Flower sends on the same schedule, up to
        # the few bytes of per-message metadata (codec names, timestamps) that differ.
        assert abs(b["fp32_total_wire_bytes"] - a["fp32_total_wire_bytes"]) < 64 * sum(
            c["messages"] for c in a["traffic"].values()
        )
    s = two_bit["summary"]
    assert s["total_wire_bytes"] == sum(r["total_wire_bytes"] for r in two_bit["rounds"])
    assert s["total_ratio_vs_fp32"] == pytest.approx(
        s["fp32_total_wire_bytes"] / s["total_wire_bytes"]
    )
    # Uplink-only compression cannot cut the total by more than the uplink's share.
    assert 1.0 < s["total_ratio_vs_fp32"] < s["train_ratio_vs_fp32"] < s["ratio_vs_fp32_wire"]


def test_files_without_the_traffic_fields_read_as_unavailable() -> None:
    results, _ = _run({"name": "fp32"}, num_rounds=1)
    old_round = {
        k: v
        for k, v in results["rounds"][0].items()
        if k not in ("traffic", "total_wire_bytes", "fp32_total_wire_bytes")
        and not k.endswith("train_wire_bytes")
    }
    rebuilt = build_results(results["config"], [old_round], wall_s=1.0)
    assert round_sum(rebuilt["rounds"], "total_wire_bytes") is None
    assert rebuilt["summary"]["total_ratio_vs_fp32"] is None
    assert rebuilt["summary"]["total_wire_bytes"] is None


def test_the_summary_counts_rounds_that_accepted_no_reply() -> None:
    results, _ = _run({"name": "fp32"})
    assert results["summary"]["rounds_without_accepted_reply"] == 0
    stalled = [dict(results["rounds"][0]), {**results["rounds"][1], "replied": 0}]
    rebuilt = build_results(results["config"], stalled, wall_s=1.0)
    assert rebuilt["summary"]["rounds_without_accepted_reply"] == 1


def test_the_server_computes_each_replys_fp32_reference_as_plain_flower_sends_it() -> None:
    """Issue 41, finding 8: the fp32 reference of a train reply is the server's own
    computation (fedcomp.flower.reference), no longer a size the client reports (one
    lying client made a run report a ratio of 6.2e8): from the global model's layout
    and the reply's metrics it gives exactly the wire bytes, objects and fp32 codec
    bytes of the app's own reply, measured here on what the project's app returned."""
    from flwr.app import MetricRecord

    from fedcomp.codecs import TensorPolicy, make_codec
    from fedcomp.codecs.policy import encode_all
    from fedcomp.flower.accounting import wire_and_objects
    from fedcomp.flower.reference import ReplyReference

    seen = []

    def plain(msg, ctxt, call_next):  # the app's own reply, before the mod
        reply = call_next(msg, ctxt)
        if msg.metadata.message_type == "train" and not reply.has_error():
            received = next(iter(msg.content.array_records.values()))
            seen.append(({k: v.numpy() for k, v in received.items()}, reply.content))
        return reply

    _run({"name": "uniform", "bits": 2}, num_rounds=1, inner_mods=[plain])
    assert seen
    policy = TensorPolicy()
    for model, content in seen:
        reference = ReplyReference(model, policy)
        metrics = next(iter(content.metric_records.values()))
        assert reference.content(MetricRecord(dict(metrics))) == wire_and_objects(content)
        trained = {k: torch.from_numpy(v.numpy()) for k, v in content["arrays"].items()}
        fp32 = encode_all(make_codec("fp32"), policy, trained, dict.fromkeys(trained, 0))
        # as a message of protocol 4 carries them: each a compact entry (one header byte)
        assert reference.codec_bytes == sum(
            len(p) - HEADER_FIXED_BYTES - 4 * trained[n].dim() + 1 for n, p in fp32.items()
        )


def test_the_reference_gives_equal_tensors_distinct_values() -> None:
    """Flower sends identical objects once: a reference built from a model whose two
    biases are equal (zeros at initialization) would count one Array and one chunk too
    few. The reference weighs what trained (distinct) tensors weigh."""
    import numpy as np
    from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

    from fedcomp.codecs import TensorPolicy
    from fedcomp.flower.accounting import wire_and_objects
    from fedcomp.flower.reference import ReplyReference

    initial = {"w": np.zeros((4, 3), np.float32), "b1": np.zeros(3, np.float32)}
    initial["b2"] = np.zeros(3, np.float32)
    rng = np.random.default_rng(0)
    trained = {k: rng.normal(size=v.shape).astype(v.dtype) for k, v in initial.items()}
    metrics = MetricRecord({"num-examples": 10, "train_loss": 0.25})
    content = RecordDict(
        {"arrays": ArrayRecord({k: Array(v) for k, v in trained.items()}), "metrics": metrics}
    )
    assert ReplyReference(initial, TensorPolicy()).content(metrics) == wire_and_objects(content)
