"""Hostile clients against the real wrapper, in-process: 10 honest clients and 3 hostile
ones in one round, through the strategy's own start loop.

Each hostile behaviour must (1) leave the aggregate bit-identical to the round in which
the hostile clients' replies were lost, (2) be counted as a failure of its own kind,
once per hostile reply, with a log line naming the kind, and (3) keep the server's
peak memory while aggregating within a bound stated here (measured as the kernel's
peak RSS, under an address-space cap so that a regression fails instead of swapping).
The same holds for the one-bit joint path and the residual protocol.
"""

from __future__ import annotations

import functools
import logging
import math

import pytest

from experiments.hostile import (
    HONEST,
    HOSTILE,
    ONEBIT,
    RESIDUAL,
    SCENARIOS,
    UNIFORM,
    N,
    PeakNotMeasurable,
    _map_payloads,
    extra_metric,
    max_everything,
    nan_metric,
    onebit_bomb,
    residual_liars,
    run_round,
    same_arrays,
    twice,
    two_metric_records,
    wrong_round,
)
from fedcomp.failures import Failure
from fedcomp.keys import (
    METRIC_CV_BOUND,
    METRIC_CV_DELTA,
    METRIC_CV_RESIDUAL,
    METRIC_PRE_TRAIN_EXAMPLES,
    METRIC_PRE_TRAIN_LOSS,
    METRIC_STATE_BYTES,
)
from tests.test_residual_protocol import _assert_mirrors_match

#: Server memory hostile replies may add to the peak of aggregating the round without
#: them (allocator noise; the decoded updates are 0.4 MB each). The block bomb alone
#: asked for 8.6 GB per reply.
PEAK_SLACK = 48 << 20
#: And the per-client path's whole peak above the RSS when aggregation starts: the
#: decoded updates and the hand-over of 13 x 0.4 MB plus allocator slack.
PEAK_BOUND = 96 << 20


def test_a_peak_that_cannot_be_reset_fails_loudly_instead_of_measuring_zero(monkeypatch):
    """Where /proc/self/clear_refs cannot be written the high-water mark is the
    process's lifetime peak: peak - base would be 0 and every bound below would pass."""
    monkeypatch.setattr("experiments.hostile.reset_peak_rss", lambda: False)
    with pytest.raises(PeakNotMeasurable, match="clear_refs"):
        run_round(UNIFORM, None)


@pytest.fixture(scope="module")
def lost_round():
    """The round in which the hostile clients' replies never arrive."""
    strategy, result, peak = run_round(UNIFORM, None)
    assert strategy.rounds[0]["replied"] == len(HONEST)
    return result.arrays, peak


@pytest.mark.parametrize(("behaviour", "kind", "per_client"), SCENARIOS, ids=lambda v: str(v))
def test_hostile_replies_are_failures_of_their_kind_and_change_nothing(
    behaviour, kind, per_client, lost_round, caplog
):
    caplog.set_level(logging.WARNING, logger="fedcomp.flower.strategy")
    strategy, result, peak = run_round(UNIFORM, behaviour)
    record = strategy.rounds[0]
    rejected = len(HOSTILE) * per_client
    assert record["replied"] == len(HONEST)
    assert record["rejected"] == {kind: rejected}
    assert record["failures"] == rejected
    assert sum(f"[{kind}]" in m for m in caplog.messages) == rejected
    lost_arrays, lost_peak = lost_round
    assert same_arrays(result.arrays, lost_arrays)
    assert peak < min(PEAK_BOUND, lost_peak + PEAK_SLACK), f"{peak / 2**20:.1f} MiB"


def test_a_decoder_bug_is_that_clients_failure_only(lost_round, caplog, monkeypatch):
    """Whatever a decoder raises (here a RuntimeError, as torch's allocator raises) is
    counted as an unexpected failure of that client, logged with its traceback."""
    from fedcomp.codecs.quantizers import UniformCodec

    original = UniformCodec.decode_payload.__func__

    def flaky(cls, payload):
        if payload.header.seed == 0 and bytes(payload.body[-1:]) == b"\xff":
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return original(cls, payload)

    def mark(pid, reply, instruction):
        return _map_payloads(reply, instruction, lambda name, buf: buf.__setitem__(-1, 0xFF))

    monkeypatch.setattr(UniformCodec, "decode_payload", classmethod(flaky))
    caplog.set_level(logging.ERROR, logger="fedcomp.flower.strategy")
    strategy, result, _ = run_round(UNIFORM, mark)
    record = strategy.rounds[0]
    assert record["rejected"].get(Failure.UNEXPECTED, 0) >= len(HOSTILE)
    assert any(r.exc_info for r in caplog.records)
    if record["replied"] == len(HONEST):  # honest payloads rarely end in 0xff
        assert same_arrays(result.arrays, lost_round[0])


@pytest.mark.parametrize(
    ("behaviour", "kind", "per_client"),
    [
        (onebit_bomb, Failure.SPEC_MISMATCH, 1),
        (max_everything, Failure.MALFORMED, 1),
        (wrong_round, Failure.WRONG_ROUND, 1),
        (twice, Failure.DUPLICATE, 2),
    ],
    ids=lambda v: str(v),
)
def test_the_joint_path_rejects_hostile_replies_like_lost_ones(behaviour, kind, per_client):
    _, lost, lost_peak = run_round(ONEBIT, None, handoff="pre_aggregated")
    strategy, result, peak = run_round(ONEBIT, behaviour, handoff="pre_aggregated")
    record = strategy.rounds[0]
    assert record["replied"] == len(HONEST)
    assert record["rejected"] == {kind: len(HOSTILE) * per_client}
    assert same_arrays(result.arrays, lost.arrays)
    assert peak < lost_peak + PEAK_SLACK, f"{peak / 2**20:.1f} vs {lost_peak / 2**20:.1f} MiB"


def test_residual_liars_never_move_a_mirror_nor_the_model():
    checked = []
    _, lost, _ = run_round(RESIDUAL, None, rounds=2)
    strategy, result, _ = run_round(
        RESIDUAL,
        residual_liars,
        rounds=2,
        on_grid=lambda grid, strategy: checked.append(_assert_mirrors_match(strategy, grid)),
    )
    record = strategy.rounds[1]
    assert record["rejected"] == {Failure.RESYNC: 2, Failure.OUTLIER: 1}
    assert strategy.uplink.cv.resync_requested == {10, 12}
    assert same_arrays(result.arrays, lost.arrays)
    # Every mirror equals its client's state: the honest ones at round 2's (accepted,
    # pending on the client until the next ack), the liars' at round 1's.
    assert checked == [N]
    assert all(strategy.uplink.cv.store.get(sid).version == 1 for sid in HOSTILE)


@pytest.mark.parametrize(
    "behaviour",
    [extra_metric, nan_metric, two_metric_records, twice],
    ids=lambda b: b.__name__,
)
def test_hostile_evaluate_replies_are_set_aside_and_the_run_goes_on(behaviour, caplog):
    """Flower's aggregation raises on inconsistent evaluate replies (which ended the
    ServerApp): they are set aside, logged, and the metrics are the honest clients'."""
    caplog.set_level(logging.WARNING, logger="fedcomp.flower.strategy")
    lost, _, _ = run_round(UNIFORM, None, evaluate=True)
    strategy, _, _ = run_round(UNIFORM, behaviour, evaluate=True)
    got, want = strategy.rounds[0], lost.rounds[0]
    assert got["client_metrics"] == want["client_metrics"] != {}
    assert got["client_accuracy"] == want["client_accuracy"] is not None
    assert sum("evaluate reply of client" in m for m in caplog.messages) >= len(HOSTILE)


def test_a_run_that_accepted_no_reply_fails_loudly(caplog):
    """Every reply without the mod's header (as from a ClientApp without
    CompressionMod): each round line is a warning, and start() raises, naming why."""
    from flwr.app import Message, RecordDict

    from experiments.hostile import _hostile
    from fedcomp.keys import RECORD_HEADER

    def no_mod(pid, reply, instruction):
        content = RecordDict({k: v for k, v in reply.content.items() if k != RECORD_HEADER})
        return Message(content, reply_to=instruction)

    caplog.set_level(logging.WARNING, logger="fedcomp.flower.strategy")
    tamper = _hostile(no_mod)
    every = N * 2  # all 13 clients, 2 rounds
    with pytest.raises(RuntimeError, match=rf"in any of the 2 .*missing_mod {every}\b"):
        run_round(UNIFORM, None, rounds=2, tamper=lambda pid, r, i: tamper(pid % 3 + 10, r, i))
    assert sum("NO REPLY ACCEPTED" in m for m in caplog.messages) == 2


def test_a_header_the_server_cannot_note_is_that_clients_problem(monkeypatch, caplog):
    """Whatever noting a reply's header raises (here injected for the hostile clients)
    costs that client what the server knew it holds, and the round goes on."""
    from fedcomp.flower.shared_settings import SharedSettings

    original = SharedSettings.note_reply

    def fragile(self, client, header):
        if client in HOSTILE:
            raise TypeError("unexpected header value")
        return original(self, client, header)

    monkeypatch.setattr(SharedSettings, "note_reply", fragile)
    caplog.set_level(logging.WARNING, logger="fedcomp.flower.strategy")
    strategy, _, _ = run_round(UNIFORM, None, tamper=lambda pid, r, i: r)
    assert strategy.rounds[0]["replied"] == N
    assert sum("reply header not understood" in m for m in caplog.messages) == len(HOSTILE)
    assert not any(sid in strategy.clients.shared.held for sid in HOSTILE)


# --- issue 41: what a client says about itself ------------------------------------


def _metric(name, value):
    """A train reply with fedcomp metric ``name`` set to ``value`` (None: removed)."""
    from experiments.hostile import _metrics

    def change(metrics):
        if value is None:
            del metrics[name]
        else:
            metrics[name] = value

    return lambda pid, reply, instruction: _metrics(reply, instruction, change)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (METRIC_CV_RESIDUAL, None),  # finding 1: the bound without the residual it bounds
        (METRIC_CV_BOUND, math.nan),
        (METRIC_CV_DELTA, -1.0),
        ("fedcomp.made-up", 1.0),
        (METRIC_STATE_BYTES, 2.5),
    ],
    ids=["cv-group-incomplete", "cv-nan", "cv-negative", "unknown-own-name", "bytes-not-integer"],
)
def test_fedcomps_own_metrics_are_checked_like_any_field(name, value, caplog):
    """Issue 41, finding 1: in a residual run the hostile clients send fedcomp's own
    metrics incomplete, non-finite, out of range or unknown: each reply is its
    sender's bad_metrics failure, the run goes on, and the round's residual summary
    is the honest clients' (it indexed a missing key and ended the ServerApp)."""
    strategy, _, _ = run_round(RESIDUAL, _metric(name, value), rounds=2)
    record = strategy.rounds[1]
    assert record["rejected"] == {Failure.BAD_METRICS: len(HOSTILE)}
    lost = _residual_round_without_the_hostile_clients()
    assert record["codec"]["residual_norm2_mean"] == lost["codec"]["residual_norm2_mean"]


@functools.cache
def _residual_round_without_the_hostile_clients() -> dict:
    lost, _, _ = run_round(RESIDUAL, None, rounds=2)
    return lost.rounds[1]


def test_a_pre_train_evaluation_at_the_edge_of_its_range_keeps_every_record_finite(tmp_path):
    """Issue 41, finding 2: with evaluation inside the train round, hostile clients
    report pre-train loss 1e300 over 1e9 examples (both inside the accepted ranges):
    their weight is capped like a train weight and the mean is taken with normalized
    weights, so the round's client loss stays finite and results.json is written."""
    from experiments.attacks import run as run_job
    from fedcomp.results_file import load_results
    from fedcomp.settings import settings_from_dict

    settings = settings_from_dict(
        {
            "num_clients": 4,
            "num_rounds": 2,
            "fraction_evaluate": 0.0,
            "evaluate_in_train": True,
            "train": {"local_epochs": 1},
            "progress": "off",
        }
    )

    class Lie:
        def __call__(self, msg, ctxt, call_next):
            reply = call_next(msg, ctxt)
            if int(ctxt.node_config["partition-id"]) == 3 and not reply.has_error():
                metrics = next(iter(reply.content.metric_records.values()))
                metrics[METRIC_PRE_TRAIN_LOSS] = 1e300
                metrics[METRIC_PRE_TRAIN_EXAMPLES] = 1e9
            return reply

    rounds = run_job(settings, None, client_mods=[Lie()], results_dir=tmp_path)
    results = load_results(tmp_path / "results.json")
    for rnd in results["rounds"]:
        assert rnd["client_eval"] == "pre-train"
        assert math.isfinite(rnd["client_loss"])
    assert [r["replied"] for r in rounds] == [4, 4]


def test_an_evaluate_count_cannot_set_the_aggregated_metrics():
    """Issue 41, finding 8: one client claiming 1e300 evaluated examples is refused
    (bad weight); one claiming 1e9 is capped at 4 x the lower median count, so the
    aggregated accuracy stays within the honest clients' reach."""
    from experiments.hostile import _metrics

    def claim(count):
        def behaviour(pid, reply, instruction):
            def change(m):
                m["num-examples"] = count
                m["eval_acc"] = 0.0

            return _metrics(reply, instruction, change)

        return behaviour

    honest, _, _ = run_round(UNIFORM, None, evaluate=True)
    strategy, _, _ = run_round(UNIFORM, claim(1e300), evaluate=True)
    assert strategy.rounds[0]["client_accuracy"] == honest.rounds[0]["client_accuracy"]
    strategy, _, _ = run_round(UNIFORM, claim(1e9), evaluate=True)
    got = strategy.rounds[0]["client_accuracy"]
    # Three hostile clients at 0.0 with at most 4 x the lower median count each: the
    # honest ones still hold at least 10 / (10 + 3 x 4 x ...) of the weight.
    assert got > 0.3 * honest.rounds[0]["client_accuracy"]


def test_an_error_in_a_rounds_bookkeeping_never_leaves_start(monkeypatch, caplog):
    """Issue 41, finding 1: whatever building a round's record raises (here planted),
    the round is recorded bare (its evaluation, its reply counts and the error) and the
    run goes on; a failing on_round observer is logged, not raised."""
    from fedcomp.flower import round_book

    def broken(*args, **kwargs):
        raise KeyError("cv-residual-norm2")

    monkeypatch.setattr(round_book, "round_record", broken)
    caplog.set_level(logging.ERROR, logger="fedcomp.flower.strategy")
    strategy, _, _ = run_round(UNIFORM, None, hostile=(), rounds=2)
    assert [r["round"] for r in strategy.rounds] == [1, 2]
    assert all("KeyError" in r["record_error"] and r["replied"] == N for r in strategy.rounds)
    assert sum("could not be built" in m for m in caplog.messages) == 2


def test_a_run_that_fails_writes_its_results_and_says_why(monkeypatch, tmp_path):
    """A run ended by anything (here a planted bug in round 2's aggregation) still writes
    results.json, with the rounds it has and a failure naming the exception."""
    from experiments.attacks import job, run
    from fedcomp.flower.strategy import CompressedStrategy
    from fedcomp.results_file import load_results

    real = CompressedStrategy.aggregate_train

    def fails_in_round_2(self, server_round, replies):
        if server_round == 2:
            raise ZeroDivisionError("planted")
        return real(self, server_round, replies)

    monkeypatch.setattr(CompressedStrategy, "aggregate_train", fails_in_round_2)
    with pytest.raises(ZeroDivisionError):
        run(job(4, 0, 3), None, results_dir=tmp_path)
    results = load_results(tmp_path / "results.json")
    assert [r["round"] for r in results["rounds"]] == [1]
    assert results["failure"] == {"kind": "ZeroDivisionError", "message": "planted"}


def test_what_a_refused_reply_names_is_truncated_in_the_log(caplog):
    """Issue 41, finding 8: a refused metric set was logged with every name (2 MB of
    names, a 2 MB log line per round). Every echo of a client's text is truncated."""
    from experiments.hostile import _metrics

    names = {f"metric-{i:05d}-" + "x" * 200: 1.0 for i in range(2000)}  # about 0.4 MB
    caplog.set_level(logging.WARNING, logger="fedcomp.flower.strategy")
    strategy, _, _ = run_round(UNIFORM, lambda pid, r, i: _metrics(r, i, lambda m: m.update(names)))
    assert strategy.rounds[0]["rejected"] == {Failure.BAD_METRICS: len(HOSTILE)}
    lines = [m for m in caplog.messages if "rejected reply" in m]
    assert len(lines) == len(HOSTILE) and max(len(m) for m in lines) < 1000


def test_a_failed_run_names_the_clients_the_bounds_kept_cutting():
    """RunFailed names the clients the influence bounds cut in most rounds, with how
    often each bound did, before the codec's likely causes."""
    from fedcomp.flower.outcome import likely_causes

    rounds = [{"bounded": {"clipped": [9], "held": [9, 2]}} for _ in range(4)]
    rounds += [{"bounded": {"capped": [4]}}]
    text = likely_causes('{"name": "fp32"}', "FedAvg", rounds)
    assert "client 9 (clipped in 4 rounds, held in 4 rounds)" in text
    assert "client 2 (held in 4 rounds)" in text and "client 4" not in text
    assert "influence bounds" in text
    assert "influence" not in likely_causes('{"name": "fp32"}', "FedAvg", rounds[4:] * 1 + [{}] * 4)
