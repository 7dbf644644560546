"""Bounded influence under the defaults, and no silent failure.

What one client can do to the model with the default settings (fedcomp.influence): its
update is clipped to ``norm_cap`` x the round's reference norm (the lower median of the
update norms) whatever weight it claims, a claimed weight beyond ``max_num_examples`` is
a rejected reply, and a round whose total weight is not finite hands nothing over. The
bounds below are computed in each test from the honest clients' own updates.
"""

from __future__ import annotations

import functools
import logging
import math
import struct
import subprocess
import sys

import numpy as np
import pytest
from flwr.app import MetricRecord, RecordDict

from experiments.attacks import Attack, AttackMod
from experiments.hostile import (
    HONEST,
    HOSTILE,
    UNIFORM,
    N,
    _body_offset,
    _map_payloads,
    _metrics,
    run_round,
)
from fedcomp.failures import Failure, RunFailed
from fedcomp.flower.outcome import best_loss, fail_if_not_learning, not_learning
from fedcomp.flower.reply_format import reply_content
from fedcomp.flower.validation import ReplyError, check_reply
from fedcomp.influence import (
    MAX_NUM_EXAMPLES,
    Influence,
    clip_scales,
    outliers,
    reference_norm,
    rejection_reference,
    total_weight_is_finite,
)
from fedcomp.keys import (
    KEY_NUM_EXAMPLES,
    KEY_PROTOCOL,
    KEY_ROUND,
    KEY_STABLE_ID,
    PROTOCOL_VERSION,
)
from fedcomp.rules import check_learnable, codec_chain

# --------------------------------------------------------------------- the pure rules


@pytest.mark.parametrize("n", [2, 3, 4, 5, 13, 200])
def test_the_reference_norm_is_the_lower_median_and_hostile_norms_cannot_lift_it(n):
    rng = np.random.default_rng(n)
    honest = list(rng.uniform(0.5, 2.0, n - n // 2))
    ranked = sorted(honest)
    # The ceil(n/2)-th smallest honest norm: what at most n // 2 hostile ones can reach.
    ceiling = ranked[math.ceil(n / 2) - 1]
    for hostile in ([1e30] * (n // 2), [0.0] * (n // 2), list(rng.uniform(0, 1e9, n // 2))):
        norms = list(rng.permutation(honest + hostile))
        assert reference_norm(norms) == sorted(norms)[(n - 1) // 2]
        assert reference_norm(norms) <= ceiling
    assert reference_norm([3.0]) is None and reference_norm([]) is None


def test_clipping_brings_every_norm_within_the_cap_and_leaves_the_others_alone():
    rng = np.random.default_rng(0)
    norms = list(rng.lognormal(0, 2, 41))
    factor = 3.0
    cap = factor * sorted(norms)[20]
    scales = clip_scales(norms, factor, reference_norm(norms))
    for norm, scale in zip(norms, scales, strict=True):
        assert norm * scale <= cap * (1 + 1e-12)
        assert (scale == 1.0) == (norm <= cap)
        if norm > cap:
            assert norm * scale == pytest.approx(cap, rel=1e-12)
    # One update alone is measured against the last round's reference.
    assert clip_scales([50.0], factor, 2.0) == [pytest.approx(6.0 / 50.0)]
    assert clip_scales([50.0], factor, None) == [1.0]
    assert clip_scales(norms, 0.0, 1.0) == [1.0] * 41  # off


def test_outliers_are_beyond_the_factor_times_the_upper_median():
    assert outliers([1.0, 1.0, 1001.0], 1000.0) == [False, False, True]
    assert outliers([1.0, 1.0, 1000.0], 1000.0) == [False, False, False]  # the bound is in
    # Two replies: the reference is the larger norm, so neither is rejected (the large
    # one is clipped to norm_cap x the smaller instead: clip_scales).
    assert outliers([1.0, 1001.0], 1000.0) == [False, False]
    assert outliers([5.0], 1000.0) == [False]
    # Two replies do have a reference (the larger norm): below a factor of 1 it binds.
    assert rejection_reference([1.0, 4.0]) == 4.0 and rejection_reference([4.0]) is None
    assert outliers([1.0, 4.0], 0.5) == [False, True]


@pytest.mark.parametrize("n", [2, 3, 4, 7, 10])
def test_half_the_clients_sending_tiny_updates_cannot_get_an_honest_one_rejected(n):
    """With up to n // 2 hostile replies of any tiny norm (zero included), the rejection
    reference stays at or above the smallest honest norm, so an honest update is
    rejected only if it is beyond the factor times another honest norm."""
    rng = np.random.default_rng(n)
    honest = list(rng.uniform(0.5, 2.0, size=n - n // 2))
    for tiny in (0.0, 1e-30, 1e-6):
        norms = honest + [tiny] * (n // 2)
        reference = rejection_reference(norms)
        assert reference == sorted(norms)[n // 2]
        assert reference >= min(honest)
        assert outliers(norms, 1000.0) == [False] * n
    # ... while a strict minority of huge norms is still rejected.
    if n >= 3:
        norms = honest + [1e12] * ((n - 1) // 2)
        flags = outliers(norms, 1000.0)
        assert flags == [False] * len(honest) + [True] * ((n - 1) // 2)


def test_the_total_weight_must_be_finite_and_positive():
    assert total_weight_is_finite([1.0, MAX_NUM_EXAMPLES])
    assert not total_weight_is_finite([1e308, 1e308])
    assert not total_weight_is_finite([0.0])


def _content(weight, **metrics) -> RecordDict:
    return reply_content(
        {KEY_PROTOCOL: PROTOCOL_VERSION, KEY_STABLE_ID: 3, KEY_ROUND: 1},
        {},
        MetricRecord({KEY_NUM_EXAMPLES: weight, **metrics}),
    )


def test_num_examples_is_checked_at_its_bounds():
    bound = Influence().max_num_examples
    assert check_reply(_content(bound), 3, 1, []).weight == bound
    assert check_reply(_content(1), 3, 1, []).weight == 1.0
    for bad in (np.nextafter(bound, math.inf), 0, -1, math.inf, math.nan, 1e308):
        with pytest.raises(ReplyError) as info:
            check_reply(_content(bad), 3, 1, [])
        assert info.value.kind is Failure.BAD_WEIGHT
    assert check_reply(_content(50.0), 3, 1, [], max_weight=50.0).weight == 50.0
    with pytest.raises(ReplyError):
        check_reply(_content(51.0), 3, 1, [], max_weight=50.0)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, [1.0, 2.0], [0.5]])
def test_train_metrics_must_be_finite_numbers(value):
    with pytest.raises(ReplyError) as info:
        check_reply(_content(10, train_loss=value), 3, 1, [])
    assert info.value.kind is Failure.BAD_METRICS
    assert check_reply(_content(10, train_loss=1e30), 3, 1, []).weight == 10.0


# ------------------------------------------------------------------- one round, in-process


def _capture_inner(strategy_replies):
    """An inner FedAvg that records the dense replies it is handed."""
    from flwr.serverapp.strategy import FedAvg

    class Recording(FedAvg):
        def aggregate_train(self, server_round, replies):
            replies = list(replies)
            strategy_replies.extend(replies)
            return super().aggregate_train(server_round, replies)

    return Recording(fraction_evaluate=0.0)


def _step(result, global_arrays) -> float:
    return math.sqrt(
        sum(
            float(np.sum((np.asarray(result[k].numpy(), np.float64) - v) ** 2))
            for k, v in global_arrays.items()
            if v.dtype.kind == "f"
        )
    )


@functools.cache
def _honest_norms(num_clients: int, hostile: tuple[int, ...]) -> tuple[float, ...]:
    """The update norms of the round's replies when every client is honest (the same
    round for every case of a client count: the clients train the same way)."""
    handed = []
    strategy, _, _ = run_round(
        UNIFORM, None, num_clients=num_clients, hostile=hostile, inner=_capture_inner(handed)
    )
    global_arrays = strategy._initial_for_tests  # set by the _keep_initial fixture
    return tuple(_step(m.content["arrays"], global_arrays) for m in handed)


def _scaled(factor, weight=None):
    """Every quantized block's scale multiplied by ``factor`` (and the weight claimed)."""

    def behaviour(pid, reply, instruction):
        def change(name, buf):
            if buf[3] == 4:  # uniform: u8 bits, u8 0, u32 block, then float32 scales
                body = _body_offset(buf)
                numel = int(np.prod(struct.unpack_from(f"<{buf[5]}I", buf, 16)))
                blocks = -(-numel // 256)
                scales = struct.unpack_from(f"<{blocks}f", buf, body + 6)
                struct.pack_into(f"<{blocks}f", buf, body + 6, *[s * factor for s in scales])

        reply = _map_payloads(reply, instruction, change)
        if weight is not None:
            reply = _metrics(reply, instruction, lambda m: m.__setitem__(KEY_NUM_EXAMPLES, weight))
        return reply

    return behaviour


@pytest.fixture(autouse=True)
def _keep_initial(monkeypatch):
    """Let the tests read the round's global model from the strategy."""
    from fedcomp.flower.strategy import CompressedStrategy

    original = CompressedStrategy.configure_train

    def configure_train(self, server_round, arrays, config, grid):
        self._initial_for_tests = {k: np.asarray(v.numpy()) for k, v in arrays.items()}
        return original(self, server_round, arrays, config, grid)

    monkeypatch.setattr(CompressedStrategy, "configure_train", configure_train)


@pytest.mark.parametrize(
    ("num_clients", "factor", "claim"),
    [
        (N, 500.0, MAX_NUM_EXAMPLES),  # 1e9 examples, an update 500x its honest one
        (N, -100.0, MAX_NUM_EXAMPLES),  # reversed: clipped, then held
        (N, -100.0, None),  # reversed at an honest weight
        (2, 1e6, None),  # two clients, after a clean round (before it: the model kept)
        (2, -100.0, MAX_NUM_EXAMPLES),
    ],
    ids=["13-heavy-x500", "13-heavy-reversed", "13-reversed", "2-clients-x1e6", "2-reversed"],
)
def test_one_client_contributes_at_most_the_trust_region_whatever_it_sends(
    num_clients, factor, claim
):
    """Issue 41, finding 3: whatever weight it claims and whichever way it pushes, one
    client's contribution to the mean (its share times its update, as the inner
    strategy gets them) is at most hypot(max(against, along), side) times the
    region's scale max(C, consensus_floor x r) (C recorded as consensus_ratio x r), and its
    weight at most weight_cap x the lower median claim, or it was rejected as an
    outlier. Without the bounds the same client's contribution is far beyond that: the
    test can fail."""
    rules = Influence()
    reach = math.hypot(max(rules.push_against, rules.push_along), rules.push_side)
    # With two clients the attack starts in round 2: in round 1 nothing tells the
    # halves apart and the model is kept (test_half_the_clients_near_zero_...).
    rounds = 2 if num_clients == 2 else 1
    attack = Attack("test", factor, claim, start=rounds)
    hostile = num_clients - 1

    def contribution(influence):
        handed = []
        strategy, _, _ = run_round(
            UNIFORM,
            None,
            num_clients=num_clients,
            hostile=(),
            rounds=rounds,
            influence=influence,
            inner=_capture_inner(handed),
            client_mods=[AttackMod(attack, {hostile})],
        )
        handed = handed[-num_clients:]  # the attacked round's
        record = strategy.rounds[-1]
        if record["rejected"].get(Failure.OUTLIER):
            return 0.0, [], record
        g = strategy._initial_for_tests
        weights = [float(m.content["metrics"][KEY_NUM_EXAMPLES]) for m in handed]
        # Replies reach the inner strategy in stable-id order; the hostile one is last.
        step = _step(handed[-1].content["arrays"], g)
        return weights[-1] / sum(weights) * step, weights, record

    size, weights, record = contribution(None)
    c = None
    if weights:  # the region's scale: max(C, consensus_floor x r)
        c = max(record["consensus_ratio"], rules.consensus_floor) * record["reference_norm"]
        assert 0 < size <= reach * c * (1 + 1e-5), (size, reach * c)
        assert weights[-1] <= rules.weight_cap * sorted(weights)[(len(weights) - 1) // 2]
        assert hostile in {i for ids in record["bounded"].values() for i in ids}
    off = Influence(
        weight_cap=0.0,
        norm_cap=0.0,
        reject_factor=0.0,
        push_against=0.0,
        push_along=0.0,
        push_side=0.0,
        escalation=False,
    )
    unbounded, _, off_record = contribution(off)
    # The consensus norm is at most the reference norm: without a defended round to
    # read it from (the client was rejected), the bound is taken at its largest.
    bound = reach * (c if c is not None else off_record["reference_norm"])
    assert unbounded > bound


def test_the_default_bounds_do_not_bind_on_an_honest_round():
    strategy, honest, _ = run_round(UNIFORM, None)
    record = strategy.rounds[0]
    assert (record["capped"], record["clipped"], record["held"]) == (0, 0, 0)
    assert "bounded" not in record and "strikes" not in record
    off = Influence(weight_cap=0.0, norm_cap=0.0, push_against=0.0, push_along=0.0, push_side=0.0)
    _, unbounded, _ = run_round(UNIFORM, None, influence=off)
    for name in honest.arrays.keys():
        assert np.array_equal(honest.arrays[name].numpy(), unbounded.arrays[name].numpy())


@pytest.mark.parametrize("handoff", ["per_client", "pre_aggregated"])
def test_a_failing_inner_strategy_fails_the_round_not_the_run(handoff, caplog):
    from flwr.serverapp.strategy import FedAvg

    def broken(self, server_round, replies):
        raise KeyError("inner strategy bug")

    # Named FedAvg: the pre-aggregated hand-off accepts mean-based strategies by name.
    Broken = type("FedAvg", (FedAvg,), {"aggregate_train": broken})
    caplog.set_level(logging.ERROR, logger="fedcomp.flower.strategy")
    inner = Broken(fraction_evaluate=0.0)
    # Every round failed: the run ends with RunFailed naming why, not a traceback.
    with pytest.raises(
        RunFailed, match=r"every round was discarded.*of the 2 round.*inner_failed 2"
    ):
        run_round(UNIFORM, None, handoff=handoff, inner=inner, rounds=2)
    assert sum("failed in aggregate_train" in m for m in caplog.messages) == 2
    # One failed round among good ones fails that round only: the model is kept there.
    failing = {2}

    def sometimes(self, server_round, replies):
        if server_round in failing:
            raise KeyError("inner strategy bug")
        return FedAvg.aggregate_train(self, server_round, replies)

    Flaky = type("FedAvg", (FedAvg,), {"aggregate_train": sometimes})
    strategy, result, _ = run_round(
        UNIFORM, None, handoff=handoff, inner=Flaky(fraction_evaluate=0.0), rounds=2
    )
    assert [r.get("inner_failed") for r in strategy.rounds] == [None, 1]
    for name, value in strategy._initial_for_tests.items():  # round 2 kept round 1's model
        assert np.array_equal(result.arrays[name].numpy(), value)


@pytest.mark.parametrize("handoff", ["per_client", "pre_aggregated"])
def test_train_metric_misfits_are_set_aside_in_both_modes(handoff):
    strategy, _, _ = run_round(
        UNIFORM,
        lambda pid, r, i: _metrics(r, i, lambda m: m.__setitem__("surprise", 1.0)),
        handoff=handoff,
    )
    assert strategy.rounds[0]["rejected"] == {Failure.BAD_METRICS: len(HOSTILE)}
    assert strategy.rounds[0]["replied"] == len(HONEST)


def test_a_tie_between_metric_key_sets_sets_every_reply_aside():
    """Two clients, one with one more metric name: neither is a majority, and a client
    choosing its names must not win a tie (with two clients it would be alone)."""
    strategy, _, _ = run_round(
        UNIFORM,
        lambda pid, r, i: _metrics(r, i, lambda m: m.__setitem__("a", 1.0)),
        num_clients=2,
        hostile=(1,),
        rounds=2,
    )
    assert strategy.rounds[1]["rejected"] == {Failure.BAD_METRICS: 2}
    assert strategy.rounds[1]["replied"] == 0


# ------------------------------------------------------------------ no silent failure


def test_not_learning_is_judged_from_the_definition():
    initial = {"loss": 2.30, "accuracy": 0.056}
    assert not_learning(initial, {"loss": 0.5, "accuracy": 0.9}, 0.05) is None
    # FedMedian on sparse updates: accuracy at one class of ten, loss flat.
    why = not_learning(initial, {"loss": 2.311, "accuracy": 0.1003}, 0.05)
    assert "accuracy" in why and "loss" in why
    assert "loss" in not_learning(initial, {"loss": 67.4, "accuracy": 0.114}, 0.05)
    # Boundaries: the loss must be strictly below, the accuracy at least the margin up.
    edge = {"loss": np.nextafter(2.30, 0.0), "accuracy": 0.056 + 0.05}
    assert not_learning(initial, edge, 0.05) is None
    flat = {**edge, "loss": 2.30}
    assert not_learning(initial, flat, 0.05) == "central loss 2.3 is not below the initial 2.3"
    short = {**edge, "accuracy": np.nextafter(edge["accuracy"], 0.0)}
    assert not_learning(initial, short, 0.05) == (
        f"accuracy {short['accuracy']:.4f} is not 0.05 above the initial 0.0560"
    )
    assert not_learning({}, {"loss": 9.0}, 0.05) is None  # nothing to judge
    with pytest.raises(RunFailed, match=r"did not learn.*round 4.*my cause"):
        fail_if_not_learning(
            initial, [{"round": 4, "loss": 67.4, "accuracy": 0.114}], 0.05, "my cause"
        )


def test_the_best_loss_so_far_includes_the_initial_model():
    rounds = [{"loss": 1.5}, {"loss": None}, {"loss": 0.7}, {"loss": math.inf}]
    assert best_loss(2.3, rounds) == 0.7
    assert best_loss(None, []) is None


def test_a_run_that_does_not_learn_fails_and_flags_its_loss(caplog):
    """A central evaluation whose loss rises (initial 2.3, then 1.0, 5.0, 9.0): the
    round lines of rounds 2 and 3 say LOSS 5.0x and 9.0x ITS BEST, and start() raises
    RunFailed."""
    from fedcomp.flower.strategy import CompressedStrategy

    losses = iter([2.3, 1.0, 5.0, 9.0])
    original = CompressedStrategy.start

    def start(self, **kwargs):
        def evaluate_fn(server_round, arrays):
            return MetricRecord({"loss": next(losses), "accuracy": 0.1})

        return original(self, **kwargs, evaluate_fn=evaluate_fn)

    caplog.set_level(logging.WARNING, logger="fedcomp.flower.strategy")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CompressedStrategy, "start", start)
        with pytest.raises(RunFailed, match="did not learn"):
            run_round(UNIFORM, None, rounds=3)
    flagged = [m for m in caplog.messages if "ITS BEST SO FAR" in m]
    assert len(flagged) == 2 and "LOSS 5.0x" in flagged[0] and "LOSS 9.0x" in flagged[1]


@pytest.mark.parametrize(
    ("codec", "strategy"),
    [
        ({"name": "ef", "inner": "topk", "fraction": 0.01}, "fedmedian"),
        ({"name": "topk", "fraction": 0.01}, "fedtrimmedavg"),
        ({"name": "randk", "fraction": 0.01}, "fedmedian"),
        ({"name": "dgc", "inner": "sparseq", "fraction": 0.01}, "fedmedian"),
        ({"name": "subsample", "inner": "eden", "fraction": 0.1}, "fedmedian"),
        (
            {
                "name": "residual",
                "inner": {"name": "subsample", "inner": "uniform", "fraction": 0.1},
            },
            "fedtrimmedavg",
        ),
    ],
)
def test_sparse_codecs_under_a_coordinatewise_median_are_refused(codec, strategy):
    with pytest.raises(ValueError, match=f"invalid setting strategy.name='{strategy}'.*regime"):
        check_learnable(codec, strategy, regime_check=True)
    with pytest.raises(ValueError, match=r"\(codec " + " around ".join(codec_chain(codec))):
        check_learnable(codec, strategy, regime_check=True)
    check_learnable(codec, strategy, regime_check=False)  # the override
    check_learnable(codec, "fedavg", regime_check=True)
    check_learnable({"name": "uniform", "bits": 8}, strategy, regime_check=True)


def test_a_bad_setting_is_one_line_and_exit_status_2(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.run",
            "aggregation.chunk_size=1024",
            "num_rounds=1",
            f"hydra.run.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == [lines[0]] and lines[0].startswith(
        "error: invalid setting aggregation.chunk_size=1024: "
    ), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_a_bad_identity_reply_is_counted_in_the_next_round_record(monkeypatch):
    """A node answering its identity message with a float id has no stable id (it is
    never sampled); its failures are counted, by kind, in round 1's record."""
    import fedcomp.flower.identity as identity

    honest_id = identity.stable_id_of

    def float_for_one(context):
        sid = honest_id(context)
        return float(sid) + 0.5 if sid == HOSTILE[0] else sid

    monkeypatch.setattr(identity, "stable_id_of", float_for_one)
    strategy, _, _ = run_round(UNIFORM, None, tamper=lambda pid, r, i: r)
    # Asked at first contact (start) and again at round 1's refresh (backoff 1).
    assert strategy.rounds[0]["identity_failures"] == {"bad_id": 2}
    assert strategy.rounds[0]["selected"] == N - 1 == strategy.rounds[0]["replied"]


def test_a_failing_inner_configure_skips_the_round_not_the_run(caplog):
    from flwr.serverapp.strategy import FedAvg

    def configure(self, server_round, arrays, config, grid):
        if server_round == 1:
            raise RuntimeError("inner configure bug")
        return FedAvg.configure_train(self, server_round, arrays, config, grid)

    Flaky = type("FedAvg", (FedAvg,), {"configure_train": configure})
    caplog.set_level(logging.ERROR, logger="fedcomp.flower.strategy")
    strategy, _, _ = run_round(
        UNIFORM, None, inner=Flaky(fraction_evaluate=0.0), rounds=2, tamper=lambda p, r, i: r
    )
    assert any("failed in configure_train" in m for m in caplog.messages)
    assert strategy.rounds[-1]["round"] == 2 and strategy.rounds[-1]["replied"] == N


def test_the_num_examples_bound_setting_is_checked_at_its_ends():
    from fedcomp.settings import settings_from_dict, validate

    def settings(value):
        return validate(settings_from_dict({"aggregation": {"max_num_examples": value}}))

    assert settings(1.0).aggregation.max_num_examples == 1.0
    assert settings(1e15).aggregation.max_num_examples == 1e15
    for bad in (0.0, np.nextafter(1.0, 0.0), np.nextafter(1e15, math.inf), math.nan):
        with pytest.raises(ValueError, match=r"aggregation\.max_num_examples"):
            settings(float(bad))


# ------------------------------------------- issue 41, findings 4 and 5: stalls, collapse


def _half_near_zero(num_clients, start):
    hostile = set(range(num_clients - num_clients // 2, num_clients))
    return [AttackMod(Attack("half near zero", 1e-6, hostile="half", start=start), hostile)]


@pytest.mark.parametrize("num_clients", [12, 2], ids=["12", "2"])
def test_half_the_clients_cannot_clip_the_other_half_after_a_clean_round(num_clients):
    """Finding 5: half the clients sending near-zero updates pulled the lower-median
    reference to ~0 and every honest update was clipped to nothing, every round. After
    a clean round the reference falls back to it: no honest update is clipped, the
    round is marked, and the model moves."""
    strategy, _, _ = run_round(
        UNIFORM,
        None,
        num_clients=num_clients,
        hostile=(),
        rounds=3,
        client_mods=_half_near_zero(num_clients, start=2),
    )
    clean, *attacked = strategy.rounds
    assert "reference_fallback" not in clean
    honest = set(range(num_clients - num_clients // 2))
    for record in attacked:
        assert record["reference_fallback"] == 1 and record["reference_norm"] > 0
        assert not honest & set(record.get("bounded", {}).get("clipped", []))
        assert record["step_norm"] > 0.1 * record["reference_norm"]


def test_half_the_clients_near_zero_from_the_first_round_keep_the_model():
    """With no clean round to fall back on, nothing tells the near-zero half from the
    other: the round is not handed over (the model is kept), no client takes strikes,
    and a reference of 0 never switches clipping off."""
    strategy, _, _ = run_round(
        UNIFORM, None, num_clients=4, hostile=(), rounds=2, client_mods=_half_near_zero(4, 1)
    )
    for record in strategy.rounds:
        assert record["reference_fallback"] == 1 and record["replied"] == 4
        assert record["step_norm"] is None  # no aggregate: the model kept
        assert "strikes" not in record


def test_a_run_without_central_evaluation_that_does_not_follow_its_clients_fails():
    """Finding 4: without an evaluate_fn, one client claiming 10^9 examples with a
    near-zero update stalled the model and the run returned normally (every round
    "changed the model"). With the weight cap off (the old defaults) that run now fails,
    its steps below 1% of its clients' typical update; under the defaults the claim is
    capped and the model follows the others."""
    stall = [AttackMod(Attack("near zero, claims 1e9", 1e-6, MAX_NUM_EXAMPLES), {3})]
    with pytest.raises(RunFailed, match=r"did not follow the updates"):
        run_round(
            UNIFORM,
            None,
            num_clients=4,
            hostile=(),
            rounds=3,
            client_mods=stall,
            influence=Influence(weight_cap=0.0),
        )
    strategy, _, _ = run_round(
        UNIFORM, None, num_clients=4, hostile=(), rounds=3, client_mods=stall
    )
    assert all(r["step_norm"] > 0.1 * r["reference_norm"] for r in strategy.rounds)


def test_the_codec_chain_follows_inner_names_and_whole_inner_specs() -> None:
    assert codec_chain({"name": "topk", "fraction": 0.1}) == ["topk"]
    assert codec_chain({"name": "ef", "inner": "topk"}) == ["ef", "topk"]
    nested = {"name": "residual", "inner": {"name": "subsample", "inner": "uniform"}}
    assert codec_chain(nested) == ["residual", "subsample", "uniform"]
