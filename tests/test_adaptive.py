"""adaptive: EDEN's widths chosen per tensor under a reply's bit budget: the allocation
against its definition (within budget, no improving move), the payload against EDEN's,
and the server holding every reply to the budget."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord

from fedcomp.codecs import PayloadError, TensorPolicy, decode_bytes, make_codec, parse_payload
from fedcomp.codecs.adaptive import allocate_bits, eden_nmse
from fedcomp.codecs.base import inner_seed
from fedcomp.codecs.wire import SpecMismatch
from fedcomp.failures import Failure
from fedcomp.flower.families import family_of
from fedcomp.flower.families.base import Instruction
from fedcomp.flower.families.stateless import check_budget
from fedcomp.flower.reply_format import payloads_of, reply_content, reply_header
from fedcomp.flower.round_state import RoundState
from fedcomp.flower.validation import ReplyError, uplink_headers
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


def _reply(codec, widths_override=None):
    family = family_of(codec)
    if widths_override is not None:
        codec.allocate = lambda deltas: dict.fromkeys(deltas, widths_override)
    rng = np.random.default_rng(3)
    deltas = {
        "w": torch.from_numpy(rng.standard_normal((64, 40)).astype(np.float32) * 3),
        "v": torch.from_numpy(rng.standard_normal((30, 20)).astype(np.float32) * 0.1),
        "b": torch.from_numpy(rng.standard_normal(8).astype(np.float32)),  # raw
    }
    instruction = Instruction(
        config=ConfigRecord({}),
        codec=codec,
        policy=TensorPolicy(min_numel=16),
        stable_id=4,
        round=2,
        run_seed=7,
        global_record=ArrayRecord({}),
    )
    encoded = family.encode(instruction, deltas, lambda: None, make_codec("fp32"))
    header = reply_header(reply_content(encoded.header, encoded.payloads, MetricRecord()))
    state = RoundState(number=2, t_start=0.0)
    state.global_arrays = {n: np.zeros(tuple(d.shape), np.float32) for n, d in deltas.items()}
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
