"""Object counts of real messages and their fp32 reference, and the framing model
(experiments/framing.py) that turns objects, messages and bytes into socket bytes."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from experiments.inprocess import InProcessGrid, initial_arrays
from fedcomp.settings import settings_from_dict
from tests.test_traffic import _kind
from tests.test_traffic import _run as _traffic_run


def array_record_objects(  # Flower's chunking rule, written out here
    data_bytes: Sequence[int], chunk_size: int = FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE
) -> int:
    """Objects of an ArrayRecord holding one Array per entry of ``data_bytes`` (each
    Array's data length): the record, each Array, and each Array's chunks, Flower
    slicing ``Array.data`` every ``chunk_size`` bytes (``Array.slice_array``).

    Counts every chunk: an upper bound when two chunks are identical (Flower sends
    those once), which needs identical data (e.g. all-zero arrays).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size}: must be > 0 bytes")
    if any(n < 0 for n in data_bytes):
        raise ValueError(f"data_bytes={list(data_bytes)}: array sizes must be >= 0")
    return 1 + sum(1 + math.ceil(n / chunk_size) for n in data_bytes)


# --- object counts ------------------------------------------------------------------


def _run(codec: dict, **overrides) -> tuple[dict, InProcessGrid]:
    """test_traffic's two-round run, on 4 clients."""
    return _traffic_run(codec, **{"num_clients": 4, **overrides})


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
    """The fp32 reference is what plain Flower sends on the same schedule: every
    message fedcomp leaves as it is counts itself; a train reply counts the app's own
    reply (Message, RecordDict, the model's ArrayRecord with an Array and its chunks
    per tensor, the MetricRecord), computed here from the model's sizes."""
    fp32, _ = runs["fp32"]
    compressed, _ = runs[name]
    sizes = [len(a.data) for a in initial_arrays(settings_from_dict({"num_clients": 4})).values()]
    plain_reply = 3 + array_record_objects(sizes)
    for a, b in zip(fp32["rounds"], compressed["rounds"], strict=True):
        for kind, counts in a["traffic"].items():
            if kind == "train_reply":
                assert counts["fp32_objects"] == counts["messages"] * plain_reply
                assert counts["objects"] == counts["messages"] * 3  # protocol 2: compact
            else:  # under fp32 every other message is its own reference ...
                assert counts["fp32_objects"] == counts["objects"], kind
            # ... and the compressed run's reference is the same, object for object
            # (the same schedule, the same tensors).
            assert b["traffic"][kind]["fp32_objects"] == counts["fp32_objects"], kind


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


# --- the framing model ----------------------------------------------------------------


def _call(rpc: str, up: int, down: int, **extra) -> dict:
    """One socket-log row: ``up``/``down`` bytes split into a head and a body."""
    return {
        "rpc": rpc,
        "up_head": 800,
        "up_body": up - 800,
        "down_head": 100,
        "down_body": down - 100,
        "t": 0.0,
        "conn": 0,
        **extra,
    }


def _message(n: int) -> dict:
    return {"id": "m", "type": "train", "group": "1", "reply_to": "", "objects": ["o"] * n}


def _hand_made_log() -> list[dict]:
    """Pull: message call 1000 + 50/object in its tree, object call 900 + content,
    receipt 950. Push: message call 1200 + 80/object, object call 1000 + content.
    Plus idle calls, which the call fit leaves out."""
    rows = []
    for n in (2, 5):
        rows.append(_call("PullMessages", 900, 100 + 50 * n, messages=[_message(n)]))
        rows.append(_call("PushMessages", 1000 + 80 * n, 200, messages=[_message(n)]))
    for content in (10, 300, 7000):
        rows.append(_call("PullObject", 890, 110 + content, content=content, object="o"))
        rows.append(_call("PushObject", 900 + content, 100, content=content, object="o"))
    rows.append(_call("ConfirmMessageReceived", 850, 100, object="m", content=0))
    rows.append(_call("PullMessages", 900, 100, messages=[]))  # a poll: idle
    rows.append(_call("SendNodeHeartbeat", 880, 130))
    return rows


def test_the_fit_recovers_a_hand_made_logs_parameters() -> None:
    from experiments.framing import PULL, PUSH, call_samples, fit_calls

    samples = call_samples(_hand_made_log())
    assert len(samples.objects[PULL]) == len(samples.objects[PUSH]) == 3
    assert samples.confirms == [950]
    pull, push = fit_calls(samples)
    # per message: the message call's intercept (+ the receipt when pulled); per object:
    # the object call's intercept + the tree's growth; per byte: the content's slope.
    assert pull.per_message == pytest.approx(1000 + 950)
    assert pull.per_object == pytest.approx(1000 + 50)
    assert push.per_message == pytest.approx(1200)
    assert push.per_object == pytest.approx(1000 + 80)
    assert pull.per_byte == pytest.approx(1.0) and push.per_byte == pytest.approx(1.0)
    # A message of 3 objects and 500 object bytes, pulled, costs its calls exactly.
    calls = (1000 + 50 * 3) + 3 * 1000 + 500 + 950
    assert pull.cost(1, 3, 500) == pytest.approx(calls)


def test_a_fit_without_two_different_sizes_says_so() -> None:
    from experiments.framing import call_samples, fit_calls

    rows = [r for r in _hand_made_log() if r["rpc"] != "PullObject" or r["content"] == 10]
    with pytest.raises(ValueError, match="pull object calls: 1 call"):
        fit_calls(call_samples(rows))


def test_a_rounds_modelled_bytes_add_its_kinds_and_a_wait_per_pulled_message() -> None:
    from experiments.framing import Direction, FramingModel, round_socket_bytes, run_socket_bytes

    model = FramingModel(Direction(2000, 1000, 1.0), Direction(1500, 1100, 1.0), 100.0)
    traffic = {
        "train_instruction": {
            "messages": 2,
            "objects": 8,
            "wire_bytes": 3000,
            "fp32_objects": 20,
            "fp32_wire_bytes": 90000,
        },
        "train_reply": {  # one of the two clients did not reply: pushes != waits
            "messages": 1,
            "objects": 10,
            "wire_bytes": 5000,
            "fp32_objects": 20,
            "fp32_wire_bytes": 90000,
        },
    }
    record = {"round": 1, "traffic": traffic, "round_s": 10.0}
    pulled = 2 * 2000 + 8 * 1000 + 3000
    pushed = 1 * 1500 + 10 * 1100 + 5000
    idle = 100.0 * 2  # the two pulled instructions each ended a wait
    assert round_socket_bytes(model, record) == pytest.approx(pulled + pushed + idle)
    fp32 = 2 * 2000 + 20 * 1000 + 90000 + 1 * 1500 + 20 * 1100 + 90000 + idle
    assert round_socket_bytes(model, record, fp32=True) == pytest.approx(fp32)
    results = {"config": {"num_clients": 3}, "rounds": [record, {**record, "round": 2}]}
    assert run_socket_bytes(model, results) == {
        "socket_bytes": round(2 * (pulled + pushed + idle)),
        "fp32_socket_bytes": round(2 * fp32),
    }
    # A file written before objects were counted: the model has nothing to say.
    old = {k: {f: v for f, v in c.items() if "objects" not in f} for k, c in traffic.items()}
    assert round_socket_bytes(model, {**record, "traffic": old}) is None


def test_kinds_travel_the_way_flower_moves_them() -> None:
    from experiments.framing import PULL, PUSH, FramingModel, direction_of

    assert direction_of("train_reply") == direction_of("identity_reply") == PUSH
    assert direction_of("evaluate_instruction") == direction_of("identity_query") == PULL
    with pytest.raises(ValueError, match="'gossip'"):
        direction_of("gossip")
    with pytest.raises(ValueError, match="idle_per_wait"):
        FramingModel.from_json(
            {
                "pull": {"per_message": 1, "per_object": 1, "per_byte": 1},
                "push": {"per_message": 1, "per_object": 1, "per_byte": 1},
            }
        )


def test_the_committed_model_reads_and_has_the_framing_of_http_calls() -> None:
    """experiments/results/framing_model.json loads, and its parameters are what HTTP
    calls cost: an object byte is a byte, an object a call with ~1 KB of headers."""
    from experiments.framing import load_model

    model = load_model()
    assert 0.99 < model.pull.per_byte < 1.01 and 0.99 < model.push.per_byte < 1.01
    # Every call carries ~1 KB of HTTP headers: so does every object.
    assert 900 < model.pull.per_object < 1500 and 900 < model.push.per_object < 1500


# --- results.json: the new fields ----------------------------------------------------


def _results_with_socket() -> dict:
    import copy

    from fedcomp.results_file import build_results
    from tests.test_data_models import _round

    rnd = copy.deepcopy(_round(1))
    rnd["traffic"] = {
        "train_reply": {
            "messages": 1,
            "record_bytes": 9,
            "wire_bytes": 20,
            "fp32_wire_bytes": 50,
            "objects": 4,
            "fp32_objects": 4,
        }
    }
    results = build_results({"seed": 0}, [rnd], wall_s=1.0)
    results["socket"] = {
        "counted_nodes": 1,
        "connections": 1,
        "opaque_connections": 0,
        "calls": 3,
        "total_bytes": 1000,
        "setup_bytes": 300,
        "setup_calls": {},
        "teardown_bytes": 0,
        "unattributed_bytes": 0,
        "rounds": [{"round": 1, "socket_bytes": 700, "idle_bytes": 50, "calls": 3, "kinds": {}}],
        "fp32_reference_socket_bytes": 9000,
        "fp32_reference_method": "model",
    }
    return results


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (
            lambda r: r["socket"].pop("fp32_reference_method"),
            "fp32_reference_socket_bytes without fp32_reference_method",
        ),
        (
            lambda r: r["socket"].pop("fp32_reference_socket_bytes"),
            "fp32_reference_method without fp32_reference_socket_bytes",
        ),
        (
            lambda r: r["socket"].update(fp32_reference_socket_bytes=9000.5),
            r"socket\.fp32_reference_socket_bytes: 9000\.5",
        ),
        (lambda r: r["socket"].update(fp32_reference_method="guess"), "'guess'"),
        (
            lambda r: r["rounds"][0]["traffic"]["train_reply"].pop("fp32_objects"),
            r"train_reply: objects without fp32_objects",
        ),
        (
            lambda r: r["rounds"][0]["traffic"]["train_reply"].update(objects="4"),
            r"traffic\.train_reply\.objects: '4'",
        ),
        (
            lambda r: r["rounds"][0]["traffic"]["train_reply"].pop("wire_bytes"),
            r"train_reply: missing field\(s\) wire_bytes",
        ),
    ],
)
def test_the_schema_rejects_a_missing_or_wrong_typed_new_field(mutate, needle: str) -> None:
    from fedcomp.results_file import ResultsError, validate_results

    results = _results_with_socket()
    assert validate_results(results)["socket"]["fp32_reference_socket_bytes"] == 9000
    mutate(results)
    with pytest.raises(ResultsError, match=needle):
        validate_results(results)


def test_files_without_the_new_fields_still_read() -> None:
    from fedcomp.results_file import validate_results

    results = _results_with_socket()
    for key in ("fp32_reference_socket_bytes", "fp32_reference_method"):
        results["socket"].pop(key)
    for key in ("objects", "fp32_objects"):
        results["rounds"][0]["traffic"]["train_reply"].pop(key)
    assert validate_results(results)["rounds"][0]["traffic"]["train_reply"]["messages"] == 1


# --- the report and the leaderboard ---------------------------------------------------


def _hand_run(codec: str, objects: int, wire: int, accuracies: list[float], socket=None) -> dict:
    """A run of train messages only: ``objects`` and ``wire`` per kind per round, the
    fp32 reference 10 objects and 1000 B per kind."""
    rounds = []
    for i, acc in enumerate(accuracies, 1):
        traffic = {
            k: {
                "messages": 1,
                "record_bytes": 0,
                "wire_bytes": wire,
                "fp32_wire_bytes": 1000,
                "objects": objects,
                "fp32_objects": 10,
            }
            for k in ("train_instruction", "train_reply")
        }
        rounds.append(
            {
                "round": i,
                "accuracy": acc,
                "traffic": traffic,
                "round_s": 1.0,
                "total_wire_bytes": 2 * wire,
                "uplink_wire_bytes": wire,
            }
        )
    run = {
        "config": {"num_clients": 1, "codec": {"name": codec}, "downlink": {"name": "fp32"}},
        "summary": {"final_accuracy": accuracies[-1], "wall_s": 1.0},
        "rounds": rounds,
    }
    if socket is not None:
        run["socket"] = {
            "counted_nodes": 1,
            "opaque_connections": 0,
            "rounds": [{"round": i + 1, "socket_bytes": b} for i, b in enumerate(socket)],
        }
    return run


def test_the_leaderboard_ranks_socket_bytes_to_target_modelled_and_measured(monkeypatch) -> None:
    import experiments.leaderboard as lb
    from experiments.framing import Direction, FramingModel

    # 100 B per message, 10 per object, 1 per byte, 5 per node and round: a round's socket
    # bytes are 2 * (100 + 10 * objects + wire) + 5.
    model = FramingModel(Direction(100, 10, 1.0), Direction(100, 10, 1.0), 5.0)
    monkeypatch.setattr(lb, "load_model", lambda: model)
    fedavg = _hand_run("fp32", 10, 1000, [0.5, 0.9], socket=[2500, 2600])
    small = _hand_run("uniform", 3, 50, [0.5, 0.7, 0.95])  # a simulation: nothing measured
    entries = {e["recipe"]: e for e in lb.rank_recipes([fedavg, small])}
    per_round = {"fp32": 2 * (100 + 100 + 1000) + 5, "uniform": 2 * (100 + 30 + 50) + 5}
    ref = 2 * per_round["fp32"]  # FedAvg reaches 0.89 in round 2
    mine = 3 * per_round["uniform"]  # the compressed recipe in round 3
    e = entries["up uniform / down fp32"]
    assert e["socket_model_to_target"] == mine
    assert e["socket_model_ratio"] == pytest.approx(ref / mine)
    assert e["socket_measured_to_target"] is None and e["socket_measured_ratio"] is None
    f = entries["up fp32 / down fp32"]
    assert f["socket_measured_to_target"] == 2500 + 2600 and f["socket_measured_ratio"] == 1.0
    text = lb.leaderboard([fedavg, small])
    assert "socket (model) MB to target" in text and "modelled from the run's fp32" in text


def test_fedprox_in_fp32_is_a_recipe_and_not_the_fedavg_reference(monkeypatch) -> None:
    """The strategy is part of a recipe: FedProx's fp32 runs neither set the target (FedAvg's
    mean final accuracy minus a point) nor count as the best compressed recipe; any other
    setting that differs between runs is still refused."""
    import experiments.leaderboard as lb
    from experiments.framing import Direction, FramingModel

    model = FramingModel(Direction(100, 10, 1.0), Direction(100, 10, 1.0), 5.0)
    monkeypatch.setattr(lb, "load_model", lambda: model)
    fedavg = _hand_run("fp32", 10, 1000, [0.5, 0.9])
    fedavg["config"]["strategy"] = {"name": "fedavg"}
    fedprox = _hand_run("fp32", 10, 1000, [0.5, 0.6, 0.95])
    fedprox["config"]["strategy"] = {"name": "fedprox", "proximal_mu": 0.01}
    small = _hand_run("uniform", 3, 50, [0.5, 0.95])
    small["config"]["strategy"] = {"name": "fedavg"}
    entries = {e["recipe"]: e for e in lb.rank_recipes([fedavg, fedprox, small])}
    prox = entries["up fp32 / down fp32, strategy fedprox(proximal_mu=0.01)"]
    assert not prox["fedavg"] and not prox["compressed"]
    assert prox["target"] == pytest.approx(0.9 - 0.01)  # (0.9 + 0.95) / 2 if it counted
    assert prox["total_to_target"] == 3 * 2 * 1000 and prox["total_ratio"] == pytest.approx(2 / 3)
    assert entries["up fp32 / down fp32"]["fedavg"]
    text = lb.leaderboard([fedavg, fedprox, small])
    assert "Best recipe reaching the target in every seed: up uniform / down fp32," in text
    only_fp32 = lb.leaderboard([fedavg, fedprox])
    assert "No compressed recipe reached the target in every seed." in only_fp32
    fedprox["config"]["num_clients"] = 2
    with pytest.raises(ValueError, match="num_clients"):
        lb.rank_recipes([fedavg, fedprox])


def test_the_report_shows_socket_bytes_modelled_and_measured_with_their_fp32_ratios() -> None:
    from experiments.framing import Direction, FramingModel, socket_summary

    model = FramingModel(Direction(100, 10, 1.0), Direction(100, 10, 1.0), 5.0)
    run = _hand_run("uniform", 3, 50, [0.5, 0.7], socket=[400, 420])
    s = socket_summary(run, model)
    fp32_round = 2 * (100 + 10 * 10 + 1000) + 5  # the fp32 reference's counts
    assert s["socket_model"] == 2 * (2 * (100 + 30 + 50) + 5)
    assert s["socket_measured"] == 820
    assert s["socket_model_ratio"] == pytest.approx(2 * fp32_round / s["socket_model"])
    assert s["socket_measured_ratio"] == pytest.approx(2 * fp32_round / 820)
    # A deployment's written reference is the one its measured ratio refers to.
    run["socket"]["fp32_reference_socket_bytes"] = 8200
    assert socket_summary(run, model)["socket_measured_ratio"] == pytest.approx(10.0)


def test_a_decoded_replys_fp32_objects_replace_its_content() -> None:
    """The server's correction of a train reply's fp32 objects: its content's objects
    out, those of the app's own content (measured by the client) in."""
    from fedcomp.traffic import Kind, Traffic

    counts_before = Traffic()
    counts_before.add(Kind.TRAIN_REPLY, record_bytes=0, wire_bytes=500, objects=3)
    counts_before.correct_fp32(Kind.TRAIN_REPLY, 500, 900, objects=(2, 16))
    counts = counts_before.by_kind[str(Kind.TRAIN_REPLY)]
    assert (counts.objects, counts.fp32_objects) == (3, 3 - 2 + 16)
    assert (counts.wire_bytes, counts.fp32_wire_bytes) == (500, 900)
    assert counts_before.objects() == 3 and counts_before.objects(fp32=True) == 17


def test_the_converged_leaderboard_targets_fedavgs_last_rounds_and_scores_either_model(
    monkeypatch,
) -> None:
    """Issue 42: the target is FedAvg's mean accuracy over its last ``window`` rounds
    minus a point (its converged accuracy, not its noisy final round), and the score is
    the server's model or, declared as such, the clients' replica."""
    import experiments.leaderboard as lb
    from experiments.framing import Direction, FramingModel

    model = FramingModel(Direction(100, 10, 1.0), Direction(100, 10, 1.0), 5.0)
    monkeypatch.setattr(lb, "load_model", lambda: model)
    fedavg = _hand_run("fp32", 10, 1000, [0.5, 0.80, 0.90, 0.84])  # last two: 0.87
    small = _hand_run("uniform", 3, 50, [0.5, 0.6, 0.86, 0.7])
    for rnd, replica in zip(small["rounds"], [0.5, 0.87, 0.6, 0.9], strict=True):
        rnd["replica_accuracy"] = replica
    final = {e["recipe"]: e for e in lb.rank_recipes([fedavg, small])}
    assert final["up fp32 / down fp32"]["target"] == pytest.approx(0.84 - 0.01)
    assert final["up uniform / down fp32"]["total_to_target"] == 3 * 2 * 50  # 0.86 in round 3
    converged = {e["recipe"]: e for e in lb.rank_recipes([fedavg, small], window=2)}
    entry = converged["up uniform / down fp32"]
    assert entry["target"] == pytest.approx((0.90 + 0.84) / 2 - 0.01)
    assert entry["total_to_target"] == 3 * 2 * 50
    replica = {e["recipe"]: e for e in lb.rank_recipes([fedavg, small], window=2, score="replica")}
    assert replica["up uniform / down fp32"]["total_to_target"] == 2 * 2 * 50  # 0.87 in round 2
    assert replica["up fp32 / down fp32"]["total_to_target"] == 3 * 2 * 1000  # its own: 0.90
    text = lb.leaderboard([fedavg, small], window=2)
    assert "accuracy over its last 2 rounds minus 0.01 = 0.8600, reached by the server's" in text


def test_the_horizon_rule_finds_where_a_curve_stops_gaining_half_a_point() -> None:
    """experiments.horizon: m(t) the 20-round trailing mean; the plateau is the first t
    with m(t + 50) - m(t) < 0.005, computed here on a curve built to flatten at 120."""
    from experiments.horizon import plateau_round, trailing_mean

    rounds = np.arange(1, 301)
    curve = np.where(rounds < 120, 0.5 + 0.4 * rounds / 120, 0.9)
    m = trailing_mean(curve)
    assert m[19] == pytest.approx(curve[:20].mean()) and m[0] == curve[0]
    expected = next(t + 1 for t in range(19, 250) if m[t + 50] - m[t] < 0.005)
    assert plateau_round(curve) == expected
    # the trailing mean reaches within half a point of the flat level 0.9 a few rounds
    # after the curve does (its window still holds the last rising rounds)
    assert 120 < expected < 140
    assert plateau_round(0.5 + 0.4 * rounds / 300) is None  # still gaining 0.67 points per 50
