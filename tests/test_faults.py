"""Fault injection (clients.faults) and bounded influence, through the real mod and
wrapper in-process: every fault kind becomes a counted failure and training carries on,
control variates stay synchronized, and reported weights are capped."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, RecordDict

from clients.client_app import make_client_app
from clients.faults import KINDS, draw_fault
from experiments.inprocess import InProcessGrid, Spy, initial_arrays
from fedcomp.failures import RunFailed
from fedcomp.flower.options import IdentityOptions, ServerOptions
from fedcomp.flower.outcome import (
    EARLY_REFUSAL_ROUNDS,
    fail_if_refusing_everything,
    fail_if_stuck_diverged,
)
from fedcomp.flower.reply_format import metrics_of, replace_metrics, reply_header
from fedcomp.flower.strategy import CompressedStrategy
from fedcomp.influence import Influence
from fedcomp.keys import KEY_NUM_EXAMPLES, KEY_PAYLOADS, RECORD_HEADER
from fedcomp.settings import settings_from_dict, validate
from strategies.inner import make_inner_strategy
from strategies.server_app import client_task
from tests.test_residual_protocol import _assert_mirrors_match
from tests.test_residual_protocol import run_rounds as _rounds

N = 4


def _setup(codec, faults=None, weight_cap=0.0, inner_mods=None, tamper=None, norm_cap=0.0):
    settings = settings_from_dict(
        {
            "num_clients": N,
            "fraction_evaluate": 0.0,
            "codec": codec,
            "faults": faults or {},
            "train": {"local_epochs": 1},
        }
    )
    grid = InProcessGrid(make_client_app(inner_mods=inner_mods), N, tamper=tamper)
    strategy = CompressedStrategy(
        make_inner_strategy({"name": "fedavg"}, N, fraction_evaluate=0.0),
        codec=settings.codec,
        run_seed=settings.seed,
        options=ServerOptions(
            task=client_task(settings),
            influence=Influence(weight_cap=weight_cap, norm_cap=norm_cap),
            identity=IdentityOptions(timeout=5),
        ),
    )
    return settings, grid, strategy


@pytest.mark.parametrize("kind", KINDS)
def test_each_fault_kind_is_a_counted_failure_and_the_model_is_kept(kind):
    settings, grid, strategy = _setup({"name": "uniform", "bits": 4}, faults={kind: 1.0})
    initial = initial_arrays(settings)
    with pytest.raises(
        RunFailed,
        match=f"no reply was accepted.*{kind if kind != 'corrupt_payload' else 'malformed'} {N}",
    ):
        _rounds(strategy, grid, initial, [1])  # a run that learned nothing fails loudly
    out = strategy.last_arrays
    record = strategy.rounds[0]
    assert record["replied"] == 0 and record["failures"] == N
    counted = "rejected_reply" if kind == "corrupt_payload" else kind
    assert record["faults"] == {counted: N}
    assert all(np.array_equal(out[k].numpy(), initial[k].numpy()) for k in initial.keys())


def _round_record(replied: int, refused: int) -> dict:
    return {"replied": replied, "rejected": {"bad_metrics": refused} if refused else {}}


@pytest.mark.parametrize("rounds", [2, 3, 4])
@pytest.mark.parametrize("pattern", range(16))
def test_the_run_stops_exactly_when_its_first_three_rounds_refused_everything(rounds, pattern):
    # Each round: accepted a reply or not, refused one or not (bits of the pattern).
    flags = [((pattern >> (2 * i)) & 1, (pattern >> (2 * i + 1)) & 1) for i in range(rounds)]
    records = [_round_record(replied=a, refused=2 * r) for a, r in [*flags, *[(0, 1)] * 4][:rounds]]
    stops = rounds == EARLY_REFUSAL_ROUNDS and all(
        not r["replied"] and r["rejected"] for r in records
    )
    if stops:
        expected = rf"first {rounds} rounds was refused \(bad_metrics {2 * rounds}\)"
        with pytest.raises(RunFailed, match=expected):
            fail_if_refusing_everything(records)
    else:
        fail_if_refusing_everything(records)


def test_a_run_whose_every_reply_is_refused_stops_after_three_rounds_with_its_records():
    settings, grid, strategy = _setup(
        {"name": "uniform", "bits": 4}, faults={"corrupt_payload": 1.0}
    )
    with pytest.raises(RunFailed, match="every reply of the first 3 rounds was refused"):
        _rounds(strategy, grid, initial_arrays(settings), range(1, 9))
    assert [r["round"] for r in strategy.rounds] == [1, 2, 3]
    assert all(r["replied"] == 0 and sum(r["rejected"].values()) == N for r in strategy.rounds)


def test_rounds_without_any_reply_do_not_stop_the_run_early():
    # Clients that never answer (a deployment waiting for its devices) are not refusals:
    # the run goes on to its end, where it fails for having learned nothing.
    settings, grid, strategy = _setup({"name": "uniform", "bits": 4}, tamper=lambda *a: None)
    with pytest.raises(RunFailed, match="no reply was accepted in any of the 4 round"):
        _rounds(strategy, grid, initial_arrays(settings), range(1, 5))


def test_faults_are_reproducible_and_follow_the_rates():
    rates = {"drop_reply": 0.1, "crash_client": 0.05, "corrupt_payload": 0.05, "nan_update": 0.1}
    draws = [draw_fault(rates, 3, r, sid) for r in range(1, 201) for sid in range(50)]
    assert draws == [draw_fault(rates, 3, r, sid) for r in range(1, 201) for sid in range(50)]
    for kind, rate in rates.items():
        freq = draws.count(kind) / len(draws)
        assert abs(freq - rate) < 4 * np.sqrt(rate * (1 - rate) / len(draws))


def test_training_carries_on_and_control_variates_stay_synchronized_under_faults():
    codec = {"name": "residual", "inner": "uniform", "bits": 2, "block": 64}
    faults = {"drop_reply": 0.15, "crash_client": 0.1, "corrupt_payload": 0.1, "nan_update": 0.1}
    settings, grid, strategy = _setup(codec, faults=faults)
    _rounds(strategy, grid, initial_arrays(settings), range(1, 9))
    injected = sum(sum(r["faults"].values()) for r in strategy.rounds)
    # exactly the faults the public draw assigns to (round, stable id), computed here
    drawn = [draw_fault(faults, settings.seed, r, sid) for r in range(1, 9) for sid in range(N)]
    assert injected == sum(kind is not None for kind in drawn) > 0
    assert sum(r["replied"] for r in strategy.rounds) + injected == 8 * N
    assert _assert_mirrors_match(strategy, grid) >= N - 1


def test_a_huge_claimed_weight_is_capped_at_a_multiple_of_the_lower_median():
    def claim_huge(pid, reply, instruction):
        header = None if reply.has_error() else reply.content.config_records.get(RECORD_HEADER)
        if pid == 2 and header is not None and KEY_PAYLOADS in header:  # a train reply
            metrics = metrics_of(reply_header(reply.content))
            metrics[KEY_NUM_EXAMPLES] = 1e9
            replace_metrics(reply.content, metrics)
            return Message(reply.content, reply_to=instruction)
        return reply

    spy = Spy()
    settings, grid, strategy = _setup(
        {"name": "fp32"}, weight_cap=3.0, inner_mods=[spy], tamper=claim_huge
    )
    initial = initial_arrays(settings)
    out = _rounds(strategy, grid, initial, [1])
    assert strategy.rounds[0]["capped"] == 1
    weights = np.array([spy.weight[i] for i in range(N)], dtype=np.float64)
    claims = sorted([*np.delete(weights, 2), 1e9])
    weights[2] = 3.0 * claims[(N - 1) // 2]  # the cap: 3 x the lower median claim
    for name in initial.keys():
        locals64 = np.stack([spy.local[i][name].astype(np.float64) for i in range(N)])
        expected = np.tensordot(weights / weights.sum(), locals64, axes=1)
        got = out[name].numpy().astype(np.float64)
        scale = np.abs(locals64).max(axis=0) + 1e-30
        assert np.all(np.abs(got - expected) <= 1e-5 * scale), name


def test_bad_fault_and_cap_settings_name_the_key():
    with pytest.raises(ValueError, match=r"faults\.drop_reply"):
        validate(settings_from_dict({"faults": {"drop_reply": 1.5}}))
    with pytest.raises(ValueError, match="sum to at most 1"):
        validate(settings_from_dict({"faults": {"drop_reply": 0.6, "nan_update": 0.6}}))
    with pytest.raises(ValueError, match=r"aggregation\.weight_cap"):
        validate(settings_from_dict({"aggregation": {"weight_cap": 0.5}}))


def test_an_absurd_update_is_clipped_to_a_multiple_of_the_reference_norm():
    def blow_up(msg, ctxt, call_next):
        reply = call_next(msg, ctxt)
        if int(ctxt.node_config["partition-id"]) != 1 or reply.has_error():
            return reply
        start = next(iter(msg.content.array_records.values()))
        arrays = reply.content["arrays"]
        scaled = {
            k: Array(
                np.asarray(start[k].numpy())
                + 1000 * (np.asarray(arrays[k].numpy()) - np.asarray(start[k].numpy()))
            )
            for k in arrays.keys()
        }
        content = RecordDict(dict(reply.content.items()))
        content["arrays"] = ArrayRecord(scaled)
        return Message(content, reply_to=msg)

    spy = Spy()
    settings, grid, strategy = _setup({"name": "fp32"}, inner_mods=[spy, blow_up], norm_cap=2.0)
    initial = initial_arrays(settings)
    out = _rounds(strategy, grid, initial, [1])
    assert strategy.rounds[0]["clipped"] == 1
    start = {k: initial[k].numpy().astype(np.float64) for k in initial.keys()}
    deltas = [{k: spy.local[i][k].astype(np.float64) - start[k] for k in start} for i in range(N)]
    norms = [np.sqrt(sum(np.sum(v**2) for v in d.values())) for d in deltas]
    cap = 2.0 * sorted(norms)[(N - 1) // 2]  # the lower median (influence.reference_norm)
    assert norms[1] > cap
    deltas[1] = {k: v * cap / norms[1] for k, v in deltas[1].items()}
    weights = np.array([spy.weight[i] for i in range(N)])
    for name in start:
        expected = (
            start[name]
            + sum(w * d[name] for w, d in zip(weights, deltas, strict=True)) / weights.sum()
        )
        got = out[name].numpy().astype(np.float64)
        assert np.allclose(got, expected, rtol=1e-5, atol=1e-6), name


def test_a_fault_kind_is_the_servers_own_draw_not_the_clients_text():
    """Issue 41, finding 8: an error reply whose reason claims an injected fault is
    counted as that fault only when the run's own fault injection drew it for that
    client and round (fedcomp.injected); otherwise it is an error_reply."""
    from flwr.app import Error

    from experiments.inprocess import set_task_identity
    from fedcomp.flower.rejection import count_error_reply
    from fedcomp.flower.round_state import RoundState
    from fedcomp.injected import draw_fault
    from fedcomp.keys import FAULT_REASON_PREFIX

    set_task_identity()
    rates = {"crash_client": 0.5}
    drawn = {sid: draw_fault(rates, 0, 1, sid) for sid in range(12)}
    assert set(drawn.values()) == {"crash_client", None}  # both cases occur
    state = RoundState(number=1, t_start=0.0)
    for sid, expected in drawn.items():
        instruction = Message(RecordDict({}), dst_node_id=1, message_type="train")
        reason = FAULT_REASON_PREFIX + "crash_client"
        msg = Message(Error(code=0, reason=reason), reply_to=instruction)
        count_error_reply(state, sid, msg, expected)
    crashes = sum(kind == "crash_client" for kind in drawn.values())
    assert state.record.faults == {"crash_client": crashes, "error_reply": 12 - crashes}


@pytest.mark.parametrize("pattern", range(64))
def test_a_diverged_model_no_reply_can_move_stops_the_run(pattern: int) -> None:
    """Five rounds, each non-finite or not and changing the model or not (bits of the
    pattern, the last three rounds free): the run stops exactly when its last three
    rounds are all non-finite and changed nothing."""
    flags = [((pattern >> i) & 1, (pattern >> (i + 3)) & 1) for i in range(3)]
    records = [
        {"round": 1, "replied": 4, "nonfinite_metrics": ["loss"]},
        {"round": 2, "replied": 4},
    ]
    for i, (nonfinite, changed) in enumerate(flags):
        record = {"round": 3 + i, "replied": 4 if changed else 0}
        if nonfinite:
            record["nonfinite_metrics"] = ["loss", "accuracy"]
        records.append(record)
    stops = all(n and not c for n, c in flags)
    if stops:
        with pytest.raises(RunFailed, match="non-finite at round 3, and none of the last 3"):
            fail_if_stuck_diverged(records)
    else:
        fail_if_stuck_diverged(records)
    fail_if_stuck_diverged(records[:2])  # fewer rounds than the wait: never
    dead = {"replied": 0, "nonfinite_metrics": ["loss"]}
    fail_if_stuck_diverged([{**dead, "round": 1}, {**dead, "round": 2}])  # two of three
