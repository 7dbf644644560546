"""ef21 (EF21, EF21-SGDM): the client and server halves against the algorithm's
definition, the contraction it relies on, and the codecs that claim to be contractions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord

from fedcomp.codecs import TensorPolicy, codec_names, make_codec, make_codec_from_spec
from fedcomp.codecs.ef21 import MOMENTUM_SUFFIX, momentum_average
from fedcomp.flower.families import family_of
from fedcomp.flower.families.base import Instruction
from fedcomp.flower.memory_state import MemoryState
from fedcomp.flower.reply_format import payloads_of, reply_content, reply_header
from fedcomp.flower.round_state import RoundState
from fedcomp.flower.validation import uplink_headers
from fedcomp.keys import KEY_ACK_ROUND
from fedcomp.settings import settings_from_dict, validate

FP32 = make_codec_from_spec({"name": "fp32"})
SHAPE = (40, 30)


def _client(codec, family, memory, deltas, round_: int, acked: int):
    """The mod's half: encode and stage (committed when a later round acks it)."""
    instruction = Instruction(
        config=ConfigRecord({KEY_ACK_ROUND: acked}),
        codec=codec,
        policy=TensorPolicy(min_numel=16),
        stable_id=3,
        round=round_,
        run_seed=5,
        global_record=ArrayRecord({}),
    )
    encoded = family.encode(instruction, deltas, lambda: memory, FP32)
    memory.stage(round_, encoded.pending, encoded.pending_version)
    return encoded


def _round(codec, family, half, memory, deltas, round_: int, acked: int):
    """One reply through both halves: the server's estimate and the client's reply."""
    encoded = _client(codec, family, memory, deltas, round_, acked)
    header = reply_header(reply_content(encoded.header, encoded.payloads, MetricRecord()))
    state = RoundState(number=round_, t_start=0.0)
    state.global_arrays = {n: np.zeros(tuple(d.shape), np.float32) for n, d in deltas.items()}
    rule = uplink_headers(state.global_arrays, 5, round_, 3)
    update = half.decode(payloads_of(header, list(deltas), rule), header, 3, state)
    half.commit(update.pending)
    return update.deltas, encoded


def _topk(x: np.ndarray, k: int) -> np.ndarray:
    out = np.zeros_like(x)
    flat = x.reshape(-1)
    keep = np.argsort(-np.abs(flat), kind="stable")[:k]
    out.reshape(-1)[keep] = flat[keep]
    return out


@pytest.mark.parametrize("eta", [1.0, 0.3])
def test_both_halves_follow_ef21_sgdm_round_by_round(eta: float) -> None:
    """v <- (1 - eta) v + eta delta, g <- g + topk(v - g), the server's update is g:
    computed here in float64 from the definition, against what the halves do (the
    server's update equals the client's staged g bit for bit)."""
    codec = make_codec_from_spec(
        {"name": "ef21", "inner": "topk", "fraction": 0.1, "momentum": eta}
    )
    family = family_of(codec)
    half = family.server(TensorPolicy(min_numel=16), 5, None)
    memory = MemoryState()
    rng = np.random.default_rng(1)
    k = math.ceil(0.1 * SHAPE[0] * SHAPE[1])
    v = g = None
    for r in range(1, 7):
        delta = rng.standard_normal(SHAPE).astype(np.float32) + 2.0  # a common drift
        estimate, encoded = _round(
            codec, family, half, memory, {"w": torch.from_numpy(delta)}, r, r - 1
        )
        v = delta.astype(np.float64) if v is None else (1 - eta) * v + eta * delta
        g = (np.zeros(SHAPE) if g is None else g) + _topk(v - (0 if g is None else g), k)
        assert np.array_equal(estimate["w"], encoded.pending["w"])
        np.testing.assert_allclose(estimate["w"], g, rtol=0, atol=1e-5)
        if eta == 1.0:
            assert set(encoded.pending) == {"w"}  # no momentum state to keep
        else:
            np.testing.assert_allclose(encoded.pending["w" + MOMENTUM_SUFFIX], v, atol=1e-5)


def test_with_an_unbiased_codec_the_update_is_the_mirror_moved_by_alpha() -> None:
    """ef21 around random-k: g <- g + alpha decode(q), alpha = 1 / (1 + omega), and the
    server's update is g (residual's would be g + decode(q))."""
    from fedcomp.codecs import decode_bytes

    codec = make_codec_from_spec({"name": "ef21", "inner": "randk", "fraction": 0.2})
    family = family_of(codec)
    half = family.server(TensorPolicy(min_numel=16), 5, None)
    memory = MemoryState()
    alpha = codec.alpha_for(SHAPE[0] * SHAPE[1])
    assert alpha < 0.5
    rng = np.random.default_rng(6)
    g = np.zeros(SHAPE)
    for r in range(1, 4):
        delta = rng.standard_normal(SHAPE).astype(np.float32)
        estimate, encoded = _round(
            codec, family, half, memory, {"w": torch.from_numpy(delta)}, r, r - 1
        )
        g = g + alpha * decode_bytes(encoded.payloads["w"]).double().numpy()
        np.testing.assert_allclose(estimate["w"], g, atol=1e-5)


def test_the_estimate_contracts_towards_a_fixed_update() -> None:
    """With a fixed update and a contraction C, ||delta - g_t||^2 <= (1 - d)^t
    ||delta||^2 (EF21's Lemma; top-k's d = k / n), and g_t reaches delta exactly once
    every coordinate was sent."""
    codec = make_codec_from_spec({"name": "ef21", "inner": "topk", "fraction": 0.25})
    family = family_of(codec)
    half = family.server(TensorPolicy(min_numel=16), 5, None)
    memory = MemoryState()
    delta = np.random.default_rng(2).standard_normal(SHAPE).astype(np.float32)
    norm2 = float(np.square(delta, dtype=np.float64).sum())
    for t in range(1, 5):
        estimate, _ = _round(codec, family, half, memory, {"w": torch.from_numpy(delta)}, t, t - 1)
        err2 = float(np.square(delta - estimate["w"], dtype=np.float64).sum())
        assert err2 <= (1 - 0.25) ** t * norm2 * (1 + 1e-6)
    assert np.array_equal(estimate["w"], delta)  # 4 rounds of a quarter each


def test_an_unacknowledged_reply_leaves_the_momentum_where_it_was() -> None:
    """A lost reply is not acknowledged: the next round starts from the committed v
    and g (both the server's mirror and the client agree on g)."""
    codec = make_codec_from_spec(
        {"name": "ef21", "inner": "topk", "fraction": 0.5, "momentum": 0.5}
    )
    family = family_of(codec)
    half = family.server(TensorPolicy(min_numel=16), 5, None)
    memory = MemoryState()
    d1, d2, d3 = (np.full(SHAPE, c, np.float32) for c in (1.0, 5.0, 3.0))
    _round(codec, family, half, memory, {"w": torch.from_numpy(d1)}, 1, 0)
    # round 2's reply is lost: the client staged it, the server never saw it, so
    # round 3's instruction still acknowledges round 1
    lost = _client(codec, family, memory, {"w": torch.from_numpy(d2)}, 2, 1)
    estimate, encoded = _round(codec, family, half, memory, {"w": torch.from_numpy(d3)}, 3, 1)
    # v = 0.5 d1 + 0.5 d3 (round 2 never happened for the server)
    np.testing.assert_allclose(encoded.pending["w" + MOMENTUM_SUFFIX], 2.0)
    assert not np.allclose(lost.pending["w" + MOMENTUM_SUFFIX], 2.0)
    assert np.array_equal(estimate["w"], encoded.pending["w"])


def test_residual_keeps_its_unbiased_estimate() -> None:
    """The same protocol with residual: the update is h + decode(q), not the mirror."""
    codec = make_codec_from_spec({"name": "residual", "inner": "randk", "fraction": 0.5})
    family = family_of(codec)
    half = family.server(TensorPolicy(min_numel=16), 5, None)
    delta = np.random.default_rng(3).standard_normal(SHAPE).astype(np.float32)
    estimate, encoded = _round(
        codec, family, half, MemoryState(), {"w": torch.from_numpy(delta)}, 1, 0
    )
    alpha = codec.alpha_for(delta.size)
    np.testing.assert_allclose(encoded.pending["w"], alpha * estimate["w"], rtol=1e-6)
    assert not np.allclose(estimate["w"], encoded.pending["w"])


def _contractive_codecs():
    specs = [{"name": n} for n in codec_names()]
    specs += [
        {"name": "eden", "bits": b, "scale": "mse", "rotations": r} for b in (1, 2) for r in (1, 2)
    ]
    specs += [{"name": "topk", "k": 1}, {"name": "sign", "block": 7}]
    specs += [
        {"name": "uniform", "bits": 2, "entropy": "zstd"},
        {"name": "bf16", "entropy": "zstd"},
    ]
    out = []
    for spec in specs:
        try:
            codec = make_codec_from_spec(spec)
        except (ValueError, TypeError):
            continue  # needs parameters (subsample, rotate): not a claim made here
        if codec.contractive:
            out.append(pytest.param(codec, id=str(spec)))
    return out


@pytest.mark.parametrize("codec", _contractive_codecs())
def test_every_contractive_claim_holds(codec) -> None:
    """E||C(x) - x||^2 < ||x||^2 on Gaussian, heavy-tailed, one-spike, constant and
    tiny inputs (deterministic codecs: every draw; a mean over 20 seeds otherwise)."""
    rng = np.random.default_rng(4)
    inputs = {
        "gauss": rng.standard_normal(3000),
        "cauchy": rng.standard_cauchy(3000),
        "spike": np.eye(1, 3000, 17)[0] * 3.0,
        "constant": np.full(3000, -0.7),
        "tiny": rng.standard_normal(3000) * 1e-30,
    }
    for label, x in inputs.items():
        t = torch.from_numpy(x.astype(np.float32))
        norm2 = float(torch.sum(t.double() ** 2))
        errs = [
            float(torch.sum((codec.decode(codec.encode(t, seed=s)).double() - t.double()) ** 2))
            for s in range(20)
        ]
        assert np.mean(errs) < norm2 * (1 - 1e-6), (label, np.mean(errs) / norm2)


@pytest.mark.parametrize(
    "codec, message",
    [
        ({"name": "ef21", "inner": "topk", "momentum": 0}, "momentum must be in"),
        ({"name": "ef21", "inner": "topk", "momentum": 1.5}, "momentum must be in"),
        ({"name": "ef21", "inner": "topk", "momentum": float("nan")}, r"\.momentum=nan: must be"),
        ({"name": "ef21", "inner": "topk", "momentum": True}, "momentum must be in"),
        ({"name": "ef21", "inner": "sparseq"}, "neither contractive nor unbiased"),
        ({"name": "ef21", "inner": "topk", "alpha": 0}, "alpha must be in"),
    ],
)
def test_a_bad_ef21_setting_fails_before_the_run_naming_the_key(codec, message) -> None:
    with pytest.raises(ValueError, match=rf"^invalid setting codec.*{message}"):
        validate(settings_from_dict({"codec": codec}))


def test_ef21_takes_an_unbiased_codec_at_its_contracting_step() -> None:
    codec = make_codec("ef21", inner="randk", fraction=0.25)
    n = 1000
    assert codec.alpha_for(n) == pytest.approx(1 / (1 + codec.inner.variance_factor(n)))
    assert make_codec("ef21", inner="topk", fraction=0.1).alpha_for(n) == 1.0


def test_the_momentum_keeps_the_models_dtype() -> None:
    """A float64 model's payloads claim float64: v is computed in float32, given back in
    the update's dtype (and an update alone, eta 1 or first contact, is untouched)."""
    delta = torch.randn(5, 3, dtype=torch.float64)
    previous = np.ones((5, 3), np.float32)
    v = momentum_average(previous, delta, 0.25)
    assert v.dtype == torch.float64
    torch.testing.assert_close(v, (0.75 + 0.25 * delta.float()).double())
    for alone in (momentum_average(None, delta, 0.25), momentum_average(previous, delta, 1.0)):
        assert alone.dtype == torch.float64 and torch.equal(alone, delta)

