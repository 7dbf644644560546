"""adaptive: EDEN's widths chosen per tensor under a reply's bit budget: the allocation
against its definition (within budget, no improving move), the payload against EDEN's,
and the server holding every reply to the budget."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord

from fedcomp.budgets import LossSchedule, weight_budgets
from fedcomp.codecs import PayloadError, TensorPolicy, decode_bytes, make_codec, parse_payload
from fedcomp.codecs.adaptive import allocate_bits, eden_nmse
from fedcomp.codecs.base import inner_seed
from fedcomp.codecs.wire import SpecMismatch
from fedcomp.failures import Failure
from fedcomp.flower.families import family_of
from fedcomp.flower.families.base import Instruction
from fedcomp.flower.families.stateless import BudgetRound, check_budget
from fedcomp.flower.reply_format import payloads_of, reply_content, reply_header
from fedcomp.flower.round_state import RoundState
from fedcomp.flower.validation import ReplyError, sent_payloads, uplink_headers
from fedcomp.keys import KEY_BIT_BUDGET
from fedcomp.settings import settings_from_dict, validate

CHOICES = (1, 2, 3, 4)


def _objective(widths, sizes, energies) -> tuple[float, float]:
    err = sum(eden_nmse(widths[n]) * energies[n] for n in sizes)
    return err, sum(widths[n] * sizes[n] for n in sizes)


def _instances():
    rng = np.random.default_rng(0)
    for case in range(40):
        count = int(rng.integers(1, 6))
        sizes = {f"t{i}": int(rng.integers(1, 4000)) for i in range(count)}
        energies = {n: float(rng.lognormal(0, 3)) * sizes[n] for n in sizes}
        if case % 7 == 0:
            energies["t0"] = 0.0  # a tensor that did not move
        budget = float(rng.uniform(1, 4))
        yield sizes, energies, budget


@pytest.mark.parametrize("sizes, energies, budget", list(_instances()))
def test_the_allocation_fits_the_budget_and_admits_no_improving_move(
    sizes, energies, budget
) -> None:
    """Definition: sum b_t n_t <= budget sum n_t, and no change of one tensor's width
    by one step, alone or against another tensor's opposite step, that still fits
    lowers sum nu(b_t) E_t. Checked here by enumerating every such move."""
    widths = allocate_bits(sizes, energies, budget, CHOICES, eden_nmse)
    cap = budget * sum(sizes.values())
    err, cost = _objective(widths, sizes, energies)
    assert set(widths.values()) <= set(CHOICES) and cost <= cap
    names = list(sizes)
    for up, down in itertools.product(names, [None, *names]):
        if up == down or widths[up] == CHOICES[-1] or (down and widths[down] == CHOICES[0]):
            continue
        moved = dict(widths)
        moved[up] = CHOICES[CHOICES.index(widths[up]) + 1]
        if down is not None:
            moved[down] = CHOICES[CHOICES.index(widths[down]) - 1]
        e, c = _objective(moved, sizes, energies)
        assert not (c <= cap and e < err * (1 - 1e-9) - 1e-12), (widths, moved)


def test_more_energy_per_coordinate_never_gets_fewer_bits() -> None:
    sizes = {n: 1000 for n in "abcdef"}
    energies = {n: 10.0**i for i, n in enumerate("abcdef")}
    for budget in (1.0, 1.5, 2.2, 3.0, 4.0):
        widths = allocate_bits(sizes, energies, budget, CHOICES, eden_nmse)
        assert [widths[n] for n in "abcdef"] == sorted(widths[n] for n in "abcdef")
    assert set(allocate_bits(sizes, energies, 4.0, CHOICES, eden_nmse).values()) == {4}
    assert set(allocate_bits(sizes, energies, 1.0, CHOICES, eden_nmse).values()) == {1}


@pytest.mark.parametrize("bits", CHOICES)
def test_a_payload_is_eden_at_its_width(bits: int) -> None:
    """The decoded tensor is EDEN's, at the width chosen, of the flattened tensor with
    the inner seed; the payload names that width and passes the spec's check."""
    codec = make_codec("adaptive", bits=2.5)
    x = torch.randn(12, 50)
    payload = codec.encode_at(x, bits, seed=9)
    eden = make_codec("eden", bits=bits)
    want = eden.decode(eden.encode(x.reshape(-1), seed=inner_seed(9))).reshape(12, 50)
    assert torch.equal(decode_bytes(bytes(payload)), want)
    assert codec.width_of(parse_payload(bytes(payload))) == bits
    codec.check_payload(parse_payload(bytes(payload)))


def test_a_width_outside_the_choices_is_a_spec_mismatch() -> None:
    payload = make_codec("adaptive", bits=3.0).encode_at(torch.randn(300), 4, seed=1)
    with pytest.raises(SpecMismatch, match="width 4 is not one of the allowed"):
        make_codec("adaptive", bits=1.5, choices=[1, 2]).check_payload(payload)
    with pytest.raises(PayloadError):  # an inner payload that is not EDEN's
        make_codec("adaptive").check_payload(
            type(payload)(payload.header, bytes([make_codec("fp32").codec_id]) + b"\0" * 16)
        )


def _reply(codec, widths_override=None, sent_budget=None):
    family = family_of(codec)
    if widths_override is not None:
        codec.allocate = lambda deltas, budget=None: dict.fromkeys(deltas, widths_override)
    rng = np.random.default_rng(3)
    deltas = {
        "w": torch.from_numpy(rng.standard_normal((64, 40)).astype(np.float32) * 3),
        "v": torch.from_numpy(rng.standard_normal((30, 20)).astype(np.float32) * 0.1),
        "b": torch.from_numpy(rng.standard_normal(8).astype(np.float32)),  # raw
    }
    encoded = family.encode(_instruction(codec, None), deltas, lambda: None, make_codec("fp32"))
    header = reply_header(reply_content(encoded.header, encoded.payloads, MetricRecord()))
    state = RoundState(number=2, t_start=0.0)
    state.global_arrays = {n: np.zeros(tuple(d.shape), np.float32) for n, d in deltas.items()}
    if sent_budget is not None:  # what the server sent this client this round
        state.plan = BudgetRound({4: sent_budget})
    payloads = payloads_of(header, list(deltas), uplink_headers(state.global_arrays, 7, 2, 4))
    half = family.server(TensorPolicy(min_numel=16), 7, None)
    return encoded, half.decode(payloads, header, 4, state)


def test_both_halves_agree_and_the_reply_keeps_its_budget() -> None:
    codec = make_codec("adaptive", bits=2.7)
    encoded, update = _reply(codec)
    widths = {n: codec.width_of(parse_payload(encoded.payloads[n])) for n in ("w", "v")}
    assert widths["w"] > widths["v"]  # 900x the energy per coordinate
    assert (widths["w"] * 2560 + widths["v"] * 600) <= 2.7 * (2560 + 600)
    for n in ("w", "v", "b"):
        assert np.array_equal(update.deltas[n], decode_bytes(encoded.payloads[n]).numpy())


def test_a_reply_over_its_budget_is_refused_as_a_spec_mismatch() -> None:
    with pytest.raises(ReplyError, match=r"over its budget of 1\.5") as info:
        _reply(make_codec("adaptive", bits=1.5), widths_override=2)
    assert info.value.kind == Failure.SPEC_MISMATCH
    check_budget(make_codec("adaptive", bits=2.0), {})  # nothing compressed: nothing spent
    # within the codec's bits but over the budget the server sent this client
    _reply(make_codec("adaptive", bits=3.0, clients="weights"), widths_override=2)
    with pytest.raises(ReplyError, match=r"over its budget of 1\.5") as info:
        _reply(make_codec("adaptive", bits=3.0, clients="weights"), 2, sent_budget=1.5)
    assert info.value.kind == Failure.SPEC_MISMATCH


@pytest.mark.parametrize(
    "codec, message",
    [
        ({"name": "adaptive", "bits": 0.5}, r"bits \(the budget\) must be in \[1, 4\]"),
        ({"name": "adaptive", "bits": 3.5, "choices": [1, 2]}, r"must be in \[1, 2\]"),
        ({"name": "adaptive", "choices": [2, 1]}, "increasing distinct integers"),
        ({"name": "adaptive", "choices": [1, 5]}, "increasing distinct integers"),
        ({"name": "adaptive", "choices": []}, "increasing distinct integers"),
    ],
)
def test_a_bad_adaptive_setting_fails_before_the_run(codec, message) -> None:
    with pytest.raises(ValueError, match=rf"^invalid setting codec.*{message}"):
        validate(settings_from_dict({"codec": codec}))


def test_the_downlink_refuses_adaptive_widths() -> None:
    """A broadcast step encodes tensors one by one: a reply-level choice has no place."""
    with pytest.raises(ValueError, match=r"^invalid setting downlink\.name='adaptive'"):
        validate(settings_from_dict({"downlink": {"name": "adaptive"}}))


# ------------------------------------------- budgets over the rounds and the clients


@pytest.mark.parametrize("seed", range(8))
def test_weight_budgets_minimize_the_weighted_error_at_the_mean_budget(seed: int) -> None:
    """Definition (EDEN's curve nu(b) = 4^-b): b minimizes sum_i p_i^2 4^-b_i over
    low <= b_i <= high with mean_i b_i = B. Checked: the mean is B, the bounds hold,
    and no mean-keeping move between two clients that stays within the bounds lowers
    the objective (without clamps: b_i - b_j = log2(p_i / p_j))."""
    rng = np.random.default_rng(seed)
    weights = {sid: float(rng.lognormal(0, 1.0)) for sid in range(int(rng.integers(2, 9)))}
    low, high = (-20.0, 20.0) if seed % 2 else (1.0, 3.0)  # odd seeds: never clamped
    mean = 2.0 if seed % 2 else float(rng.uniform(low, high))
    budgets = weight_budgets(mean, weights, low, high)
    values = np.array([budgets[s] for s in weights])
    p = np.array(list(weights.values()))
    assert abs(values.mean() - mean) < 1e-9 and values.min() >= low and values.max() <= high
    if seed % 2:  # far bounds: no clamp
        assert np.allclose(values - values.mean(), np.log2(p) - np.log2(p).mean())

    def objective(b):
        return float(np.sum(p**2 * 4.0 ** (-b)))

    for i, j in itertools.permutations(range(len(p)), 2):
        for step in (1e-3, 0.1):
            moved = values.copy()
            moved[i] += step
            moved[j] -= step
            if moved[i] <= high and moved[j] >= low:
                assert objective(moved) >= objective(values) - 1e-12
    assert weight_budgets(1.0, weights, 1.0, 3.0) == dict.fromkeys(weights, 1.0)
    assert weight_budgets(2.0, {}, 1.0, 4.0) == {}


def test_the_loss_schedule_adds_a_bit_after_patience_rounds_without_a_new_best() -> None:
    schedule = LossSchedule(start=1.0, cap=3.0, patience=2)
    losses = [2.0, 1.5, 1.6, 1.55, 1.4, 1.45, 1.5, 1.6, 1.7, 1.8, 1.9, 2.0]
    budgets = [schedule.observe(r, loss) for r, loss in enumerate(losses, start=2)]
    # new bests at rounds 2, 3, 6; two rounds without: +1 at round 5, round 8, then capped
    assert budgets == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0]
    assert schedule.observe(13, 0.1) == 3.0 and schedule.observe(13, 5.0) == 3.0  # once
    assert schedule.observe(14, None) == 3.0
    copy = LossSchedule(start=1.0, cap=3.0, patience=2)
    copy.load_state_dict(json.loads(json.dumps(schedule.state_dict())))
    assert copy == schedule


def _instruction(codec, plan):
    return Instruction(
        config=ConfigRecord({}),
        codec=codec,
        policy=TensorPolicy(min_numel=16),
        stable_id=4,
        round=2,
        run_seed=7,
        global_record=ArrayRecord({}),
        plan=plan,
    )


def test_the_client_spends_the_budget_it_was_sent_and_the_server_holds_it_there() -> None:
    codec = make_codec("adaptive", bits=3.0, clients="weights")
    family = family_of(codec)
    assert family.read_plan(None, ConfigRecord({KEY_BIT_BUDGET: 1.25}), None) == 1.25
    assert family.read_plan(None, ConfigRecord({}), None) is None
    with pytest.raises(ValueError, match=r"budget 3\.5 is not in \[1, 3\.0\]"):
        family.read_plan(None, ConfigRecord({KEY_BIT_BUDGET: 3.5}), None)
    rng = np.random.default_rng(3)
    deltas = {
        "w": torch.from_numpy(rng.standard_normal((64, 40)).astype(np.float32) * 3),
        "v": torch.from_numpy(rng.standard_normal((30, 20)).astype(np.float32) * 0.1),
    }
    for budget in (1.0, 1.6, 3.0):
        encoded = family.encode(_instruction(codec, budget), deltas, lambda: None, None)
        spent = sum(
            codec.width_of(parse_payload(p)) * d.numel()
            for p, d in zip(encoded.payloads.values(), deltas.values(), strict=True)
        )
        assert spent <= budget * 3160
        state = RoundState(number=2, t_start=0.0)
        state.plan = BudgetRound({4: budget})
        payloads = {n: memoryview(p) for n, p in encoded.payloads.items()}
        check_budget(codec, payloads, state.plan.budgets[4])
        if budget < 3.0:  # the codec's own bits is not what this client was sent
            wide = family.encode(_instruction(codec, 3.0), deltas, lambda: None, None)
            with pytest.raises(ReplyError, match=f"over its budget of {budget:g}"):
                check_budget(codec, wide.payloads, budget)


def test_the_server_plans_budgets_from_weights_and_the_loss() -> None:
    codec = make_codec(
        "adaptive", bits=3.0, schedule="loss", start=1.0, patience=1, clients="weights"
    )
    half = family_of(codec).server(TensorPolicy(min_numel=16), 7, None)
    half.accepted(1, 100.0)
    half.accepted(2, 400.0)
    plans = []
    for number, loss in ((2, 1.0), (3, 1.2), (4, 1.3)):
        state = RoundState(number=number, t_start=0.0)
        state.previous_loss = loss
        half.plan(state, [1, 2, 3], TensorPolicy())
        plans.append(state.plan.budgets)
    # the unseen client 3 weighs the mean of the known ones, 250
    logs = {1: math.log2(100), 2: math.log2(400), 3: math.log2(250)}
    centre = sum(logs.values()) / 3

    # round 2: the start, 1 bit, the floor: every client at 1; round 3: no new best
    # with patience 1, one bit more, spread by weight: client 1 would get
    # 2 + log2(100) - centre < 1, so it is held at 1 and the other two share the rest
    assert 2.0 + logs[1] - centre < 1.0
    assert plans[0] == dict.fromkeys([1, 2, 3], 1.0)
    c = (3 * 2.0 - 1.0 - logs[2] - logs[3]) / 2
    assert plans[1] == pytest.approx({1: 1.0, 2: c + logs[2], 3: c + logs[3]})
    assert plans[2][2] == 3.0  # capped at bits
    restored = family_of(codec).server(TensorPolicy(min_numel=16), 7, None)
    restored.load_state_dict(json.loads(json.dumps(half.state_dict())))
    assert restored.schedule == half.schedule and restored.weights == half.weights


@pytest.mark.parametrize(
    "codec, message",
    [
        ({"name": "adaptive", "schedule": "cosine"}, "schedule must be fixed or loss"),
        ({"name": "adaptive", "clients": "links"}, "clients must be same or weights"),
        ({"name": "adaptive", "schedule": "loss", "patience": 0}, "patience must be an"),
        ({"name": "adaptive", "bits": 2, "schedule": "loss", "start": 3}, "above bits"),
        ({"name": "adaptive", "start": 0.5}, r"start must be in \[1, 4\]"),
    ],
)
def test_a_bad_budget_rule_fails_before_the_run(codec, message) -> None:
    with pytest.raises(ValueError, match=rf"^invalid setting codec.*{message}"):
        validate(settings_from_dict({"codec": codec}))


def test_a_flower_round_sends_each_client_its_budget_and_holds_the_reply_to_it() -> None:
    """The loss schedule's first budget, 1 bit, reaches every client through its
    instruction: the codec's own 3 bits would pay 3-bit EDEN on every tensor."""
    from tests.test_pipeline_inprocess import N, _initial, _train_only, one_round

    codec = {"name": "adaptive", "bits": 3.0, "schedule": "loss", "start": 1.0}
    settings = settings_from_dict(
        {"num_clients": N, "num_rounds": 1, "fraction_evaluate": 0.0, "codec": codec}
    )
    _, strategy, grid, _ = one_round(settings)
    record = strategy.rounds[0]
    assert record["replied"] == N and record["failures"] == 0
    assert record["codec"]["joint"] == {"budget_mean": 1.0, "budget_min": 1.0, "budget_max": 1.0}
    arrays = {k: np.asarray(v.numpy()) for k, v in _initial(settings).items()}
    made = make_codec(**codec)
    coded = [n for n, used in record["codec"]["per_tensor"].items() if used == "adaptive"]
    assert coded
    for reply in _train_only(grid.replies):
        payloads = sent_payloads(reply_header(reply.content), arrays, settings.seed)
        assert {made.width_of(parse_payload(payloads[n])) for n in coded} == {1}


def test_budgets_at_either_end_are_exactly_that_end() -> None:
    weights = {1: 1.0, 2: 50.0, 3: 0.02}
    assert weight_budgets(4.0, weights, 1.0, 4.0) == dict.fromkeys(weights, 4.0)
    assert weight_budgets(1.0, weights, 1.0, 4.0) == dict.fromkeys(weights, 1.0)
    with pytest.raises(ValueError, match=r"mean budget 4\.5 is not in \[1\.0, 4\.0\]"):
        weight_budgets(4.5, weights, 1.0, 4.0)
