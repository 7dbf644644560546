"""FetchSGD's count sketch: the draws, the sketch and its unsketch against their
definitions (linearity, unbiased rows with the count sketch's variance, heavy hitters
recovered exactly), the compiled path against NumPy's, the server's step against a
loop written from the paper's Algorithm 1, and both halves in a Flower round."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord

from fedcomp import compiled
from fedcomp.codecs import (
    PayloadError,
    TensorPolicy,
    decode_bytes,
    make_codec,
    sketch_compiled,
)
from fedcomp.codecs import sketch as sk
from fedcomp.codecs.wire import SpecMismatch
from fedcomp.failures import Failure
from fedcomp.flower.families import family_of
from fedcomp.flower.families.base import Instruction
from fedcomp.flower.families.sketch import SketchState, fetchsgd_step, mean_sketch
from fedcomp.flower.reply_format import payloads_of, reply_content, reply_header
from fedcomp.flower.round_state import RoundState
from fedcomp.flower.validation import ReplyError, uplink_headers
from fedcomp.settings import settings_from_dict, validate

RUN_SEED = 7


def _definition(x: np.ndarray, seed: int, rows: int, cols: int) -> np.ndarray:
    """S[j, h_j(i)] += s_j(i) x_i, one coordinate at a time."""
    at, signs = sk.slots(seed, rows, cols, np.arange(x.size))
    table = np.zeros(rows * cols)
    for j in range(rows):
        for i in range(x.size):
            table[at[j, i]] += signs[j, i] * float(x[i])
    return table.reshape(rows, cols)


# --------------------------------------------------------------------------- the draws


def test_buckets_are_uniform_signs_balanced_and_rows_independent() -> None:
    n, rows, cols = 60_000, 3, 40
    at, signs = sk.slots(11, rows, cols, np.arange(n))
    buckets = at - (np.arange(rows) * cols)[:, None]
    assert buckets.min() >= 0 and buckets.max() < cols
    expected = n / cols
    for j in range(rows):
        counts = np.bincount(buckets[j], minlength=cols)
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < cols - 1 + 5 * math.sqrt(2 * (cols - 1))  # df 39: mean + 5 sd
        assert abs(signs[j].mean()) < 5 / math.sqrt(n)
    # rows 0 and 1 (and a sign against a bucket): joint counts against independence
    for a, b, k in ((buckets[0] % 8, buckets[1] % 8, 64), (buckets[2] % 8, signs[0] > 0, 16)):
        joint = np.bincount(a * (k // 8) + b, minlength=k)
        chi2 = float(((joint - n / k) ** 2 / (n / k)).sum())
        assert chi2 < k - 1 + 5 * math.sqrt(2 * (k - 1))
    again, _ = sk.slots(11, rows, cols, np.arange(n))
    other, _ = sk.slots(12, rows, cols, np.arange(n))
    assert np.array_equal(at, again) and (at != other).mean() > 0.9


def test_the_seed_is_the_runs_and_the_tensors_only() -> None:
    assert sk.sketch_seed(3, "w") == sk.sketch_seed(3, "w")
    assert len({sk.sketch_seed(3, "w"), sk.sketch_seed(4, "w"), sk.sketch_seed(3, "v")}) == 3


# ---------------------------------------------------------------- sketch and unsketch


@pytest.mark.parametrize("rows, cols", [(1, 7), (4, 9), (5, 3)])
def test_the_sketch_is_its_definition_and_linear(rows: int, cols: int) -> None:
    rng = np.random.default_rng(rows)
    x, y = rng.standard_normal(300), rng.standard_normal(300)
    table = sk.count_sketch(x, sk.draws(5, 300, rows, cols))
    assert np.allclose(table, _definition(x, 5, rows, cols), rtol=0, atol=1e-12)
    combined = sk.count_sketch(2.5 * x - 0.5 * y, sk.draws(5, 300, rows, cols))
    parts = 2.5 * table - 0.5 * sk.count_sketch(y, sk.draws(5, 300, rows, cols))
    bound = 1e-13 * (np.abs(x).sum() * 2.5 + np.abs(y).sum() * 0.5)
    assert np.abs(combined - parts).max() <= bound


def test_each_row_estimate_is_unbiased_with_the_count_sketch_variance() -> None:
    """Over the draws, s_j(i) S[j, h_j(i)] = x_i + sum_{l != i} s_j(i) s_j(l) x_l
    1{h_j(l) = h_j(i)}: mean x_i, variance sum_{l != i} x_l^2 / c (pairwise
    independent buckets and signs). Checked over 3,000 seeds."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(40) * np.linspace(0.1, 3, 40)
    cols, seeds = 8, 3000
    est = np.stack(
        [
            sk.row_estimates(sk.count_sketch(x, d := sk.draws(s, 40, 2, cols)), d)
            for s in range(seeds)
        ]
    )
    variance = ((x**2).sum() - x**2) / cols
    for j in range(2):
        z = (est[:, j].mean(axis=0) - x) / np.sqrt(variance / seeds)
        assert np.abs(z).max() < 4.5  # 80 coordinates
        ratio = est[:, j].var(axis=0) / variance
        assert (np.abs(ratio - 1) < 0.2).all()  # sd of a variance at 3,000 draws: 2.6%-6%


@pytest.mark.parametrize("rows", [3, 4, 5])
def test_coordinates_alone_in_most_rows_are_recovered_exactly(rows: int) -> None:
    """The median of the rows is x_i when x_i shares its bucket with no other nonzero
    coordinate in more than half the rows (those rows give x_i exactly)."""
    rng = np.random.default_rng(rows)
    n, cols = 5000, 300
    x = np.zeros(n)
    support = rng.choice(n, 30, replace=False)
    x[support] = rng.standard_normal(30) * 10
    d = sk.draws(9, n, rows, cols)
    estimate = sk.unsketch_draws(sk.count_sketch(x, d), d)
    others = np.zeros((rows, n), dtype=int)  # nonzeros other than i in i's bucket
    for j in range(rows):
        load = np.bincount(d.slots[j], weights=(x != 0).astype(float), minlength=rows * cols)
        others[j] = load[d.slots[j]] - (x != 0)
    alone = (others == 0).sum(axis=0) > rows / 2
    assert alone.sum() > 0.9 * n and alone[support].sum() >= 25
    assert np.array_equal(estimate[alone], x[alone])


@pytest.mark.skipif(not compiled.installed(), reason="the compiled path needs Numba")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_compiled_path_is_numpys_to_the_bit(rows: int, dtype) -> None:
    rng = np.random.default_rng(rows)
    n, cols = 70_001, 1_000
    x = (rng.standard_normal(n) * rng.lognormal(0, 2, n)).astype(dtype)
    d = sk.draws(13, n, rows, cols)
    table = sk.count_sketch(x, d)
    assert np.array_equal(sketch_compiled.sketch(x, sk.row_keys(13, rows), cols), table)
    assert np.array_equal(
        sketch_compiled.unsketch(table, sk.row_keys(13, rows), n), sk.unsketch_draws(table, d)
    )


# --------------------------------------------------------------------------- the codec


def test_payload_is_the_documented_layout_and_decodes_to_the_unsketch() -> None:
    x = torch.randn(37, 29, generator=torch.Generator().manual_seed(1))
    for dtype, itemsize in (("float32", 4), ("bf16", 2)):
        codec = make_codec("sketch", fraction=0.2, rows=3, dtype=dtype)
        payload = codec.encode(x, seed=5)
        cols = math.ceil(0.2 * x.numel() / 3)
        assert len(bytes(payload)) == 16 + 8 + 6 + 3 * cols * itemsize
        table = _definition(x.reshape(-1).double().numpy(), 5, 3, cols)
        wire = torch.from_numpy(table).to(codec_dtype := sk.VALUE_DTYPES[dtype]).double()
        assert np.array_equal(type(codec).read_table(payload), wire.numpy())
        expected = np.median(sk.row_estimates(wire.numpy(), sk.draws(5, x.numel(), 3, cols)), 0)
        got = decode_bytes(bytes(payload))
        assert got.dtype == x.dtype and torch.equal(
            got.reshape(-1), torch.from_numpy(expected).float()
        )
        assert codec_dtype.itemsize == itemsize
        assert codec.nominal_bits(x.numel()) == 3 * cols * itemsize * 8 / x.numel()


def _overwrite(payload, offset: int, fmt: str, value) -> bytes:
    import struct

    buf = bytearray(bytes(payload))
    struct.pack_into(fmt, buf, 16 + 8 + offset, value)  # a matrix: the body at 24
    return bytes(buf)


@pytest.mark.parametrize(
    "offset, fmt, value, message",
    [
        (0, "<B", 0, "0 rows"),
        (0, "<B", 16, "16 rows"),
        (1, "<B", 4, "value dtype code 4"),
        (2, "<I", 10_000, "sketch of 1073 coordinates"),
        (2, "<I", 300, "body is"),
    ],
)
def test_malformed_sketches_are_payload_errors(offset, fmt, value, message) -> None:
    x = torch.randn(37, 29, generator=torch.Generator().manual_seed(1))
    buf = _overwrite(
        make_codec("sketch", fraction=0.2, rows=3).encode(x, seed=5), offset, fmt, value
    )
    with pytest.raises(PayloadError, match=message):
        decode_bytes(buf)


def test_another_sketch_shape_is_a_spec_mismatch_naming_the_field() -> None:
    x = torch.randn(1000)
    payload = make_codec("sketch", fraction=0.2, rows=4).encode(x, seed=5)
    for spec, field in (
        ({"rows": 5}, "rows"),
        ({"fraction": 0.1, "rows": 4}, "columns"),
        ({"rows": 4, "dtype": "bf16"}, "value dtype"),
    ):
        with pytest.raises(SpecMismatch, match=field):
            make_codec("sketch", **{"fraction": 0.2, **spec}).check_payload(payload)


@pytest.mark.parametrize(
    "codec, message",
    [
        ({"name": "sketch", "fraction": 0}, r"fraction must be in \(0, 1\]"),
        ({"name": "sketch", "fraction": 1.5}, r"fraction must be in \(0, 1\]"),
        ({"name": "sketch", "keep": 0.0}, r"keep must be in \(0, 1\]"),
        ({"name": "sketch", "momentum": 1.0}, r"momentum must be in \[0, 1\)"),
        ({"name": "sketch", "rows": 0}, r"rows must be an integer in \[1, 15\]"),
        ({"name": "sketch", "dtype": "float16"}, "dtype must be one of float32, bf16"),
        ({"name": "sketch", "entropy": "zstd"}, "entropy does not apply"),
        ({"name": "ef", "inner": "sketch"}, "not a memory or a summed code"),
        ({"name": "subsample", "inner": "sketch", "fraction": 0.5}, "summed code"),
    ],
)
def test_a_bad_sketch_setting_fails_before_the_run(codec, message) -> None:
    with pytest.raises(ValueError, match=rf"^invalid setting codec.*{message}"):
        validate(settings_from_dict({"codec": codec, "aggregation": {"handoff": "pre_aggregated"}}))


def test_a_sketch_needs_the_pre_aggregated_handoff_and_stays_off_the_downlink() -> None:
    with pytest.raises(ValueError, match=r"^invalid setting aggregation.handoff='per_client'"):
        validate(settings_from_dict({"codec": {"name": "sketch"}}))
    with pytest.raises(ValueError, match=r"^invalid setting downlink\.name='sketch'"):
        validate(settings_from_dict({"downlink": {"name": "sketch"}}))


# ---------------------------------------------------------------- the server's step


def _reference_step(tables, sizes, mom, err, rho, keep, seed_of):
    """FetchSGD's Algorithm 1, lines 9-15, one coordinate at a time (the zeroing form)."""
    est = {}
    for name, s in tables.items():
        mom[name] = rho * mom.get(name, np.zeros_like(s)) + s
        err[name] = err.get(name, np.zeros_like(s)) + mom[name]
        rows, cols = s.shape
        at, signs = sk.slots(seed_of(name), rows, cols, np.arange(sizes[name]))
        flat = err[name].reshape(-1)
        est[name] = np.array(
            [
                np.median([signs[j, i] * flat[at[j, i]] for j in range(rows)])
                for i in range(sizes[name])
            ]
        )
    everything = [(name, i) for name in tables for i in range(sizes[name])]
    k = max(1, math.ceil(keep * len(everything)))
    # the k largest magnitudes; ties to the first in model order
    order = sorted(
        range(len(everything)), key=lambda p: (-abs(est[everything[p][0]][everything[p][1]]), p)
    )
    out = {name: np.zeros(sizes[name]) for name in tables}
    for name, i in (everything[p] for p in order[:k]):
        out[name][i] = est[name][i]
        rows, cols = tables[name].shape
        at, _ = sk.slots(seed_of(name), rows, cols, np.array([i]))
        for state in (mom, err):
            state[name].reshape(-1)[at[:, 0]] = 0.0
    return out


def test_the_step_is_fetchsgds_algorithm_over_three_rounds() -> None:
    rng = np.random.default_rng(4)
    sizes = {"w": 400, "v": 150}
    state, mom, err = SketchState(), {}, {}
    for _ in range(3):
        tables = {"w": rng.standard_normal((3, 30)), "v": rng.standard_normal((3, 12)) * 2}
        got, stats = fetchsgd_step(tables, sizes, state, rho=0.6, keep=0.05, run_seed=RUN_SEED)
        want = _reference_step(
            tables, sizes, mom, err, 0.6, 0.05, lambda n: sk.sketch_seed(RUN_SEED, n)
        )
        for name in sizes:
            assert np.array_equal(got[name], want[name])
            assert np.array_equal(state.error[name], err[name])
            assert np.array_equal(state.momentum[name], mom[name])
        assert stats["sketch_kept"] == math.ceil(0.05 * 550)
        assert sum(np.count_nonzero(g) for g in got.values()) == stats["sketch_kept"]


def test_the_state_survives_a_checkpoint() -> None:
    rng = np.random.default_rng(5)
    sizes = {"w": 300}
    tables = [{"w": rng.standard_normal((5, 10))} for _ in range(3)]
    straight = SketchState()
    for t in tables:
        expected, _ = fetchsgd_step(t, sizes, straight, rho=0.9, keep=0.1, run_seed=1)
    resumed = SketchState()
    for t in tables[:2]:
        fetchsgd_step(t, sizes, resumed, rho=0.9, keep=0.1, run_seed=1)
    restored = SketchState()
    restored.load_state_dict(json.loads(json.dumps(resumed.state_dict())))
    got, _ = fetchsgd_step(tables[2], sizes, restored, rho=0.9, keep=0.1, run_seed=1)
    assert np.array_equal(got["w"], expected["w"])


def test_the_mean_sketch_is_the_weighted_mean_in_any_order() -> None:
    rng = np.random.default_rng(6)
    replies = [(sid, float(rng.integers(1, 50)), rng.standard_normal((3, 7))) for sid in range(9)]
    mean = mean_sketch(replies)
    total = sum(w for _, w, _ in replies)
    reference = sum(w * t for _, w, t in replies) / total
    assert np.abs(mean - reference).max() < 1e-14 * 9
    for order in (replies[::-1], replies[3:] + replies[:3]):
        assert np.array_equal(mean_sketch(order), mean)


# --------------------------------------------------------------- both halves of a reply


def _reply(codec, deltas, policy, tamper=None):
    family = family_of(codec)
    instruction = Instruction(
        config=ConfigRecord({}),
        codec=codec,
        policy=policy,
        stable_id=4,
        round=2,
        run_seed=RUN_SEED,
        global_record=ArrayRecord({}),
    )
    encoded = family.encode(instruction, deltas, lambda: None, make_codec("fp32"))
    if tamper is not None:
        encoded.payloads = tamper(encoded.payloads)
    header = reply_header(reply_content(encoded.header, encoded.payloads, MetricRecord()))
    state = RoundState(number=2, t_start=0.0)
    state.global_arrays = {n: np.zeros(tuple(d.shape), np.float32) for n, d in deltas.items()}
    rule = uplink_headers(state.global_arrays, RUN_SEED, 2, 4)
    payloads = payloads_of(header, list(deltas), rule)
    return encoded, family.server(policy, RUN_SEED, None).decode(payloads, header, 4, state)


def _deltas():
    rng = np.random.default_rng(3)
    return {
        "w": torch.from_numpy(rng.standard_normal((64, 40)).astype(np.float32)),
        "b": torch.from_numpy(rng.standard_normal(8).astype(np.float32)),  # raw
    }


def test_the_client_sketches_with_the_runs_draws_and_the_server_reads_them() -> None:
    codec, deltas = make_codec("sketch", fraction=0.25, rows=3), _deltas()
    _, update = _reply(codec, deltas, TensorPolicy(min_numel=16))
    assert update.codecs == {"w": "sketch", "b": "raw"}
    assert np.array_equal(update.deltas["b"], deltas["b"].numpy()) and "w" not in update.deltas
    cols = math.ceil(0.25 * 2560 / 3)
    table = update.joint["w"]  # the checked table, as the server sums it
    seed = sk.sketch_seed(RUN_SEED, "w")
    assert np.array_equal(
        table,
        _definition(deltas["w"].reshape(-1).numpy(), seed, 3, cols)
        .astype(np.float32)
        .astype(np.float64),
    )


def _with(name: str, make):
    def tamper(payloads):
        return {**payloads, name: make(payloads[name])}

    return tamper


@pytest.mark.parametrize(
    "tamper, kind, message",
    [
        (
            _with(
                "w",
                lambda p: bytes(
                    make_codec("sketch", fraction=0.5, rows=3).encode(
                        torch.ones(64, 40), seed=sk.sketch_seed(RUN_SEED, "w")
                    )
                ),
            ),
            Failure.SPEC_MISMATCH,
            "columns",
        ),
        (
            _with("w", lambda p: p[:-4] + np.float32(np.nan).tobytes()),
            Failure.NONFINITE,
            "non-finite",
        ),
        (
            _with(
                "w",
                lambda p: bytes(
                    make_codec("sketch", fraction=0.25, rows=4).encode(
                        torch.ones(64, 40), seed=sk.sketch_seed(RUN_SEED, "w")
                    )
                ),
            ),
            Failure.SPEC_MISMATCH,
            "rows",
        ),
    ],
)
def test_a_bad_sketch_is_that_clients_failure_naming_it(tamper, kind, message) -> None:
    with pytest.raises(ReplyError, match=message) as info:
        _reply(
            make_codec("sketch", fraction=0.25, rows=3),
            _deltas(),
            TensorPolicy(min_numel=16),
            tamper,
        )
    assert info.value.kind == kind


# ------------------------------------------------------------------ a Flower round


def _sketch_round(order=None):
    from tests.test_pipeline_inprocess import N, one_round

    codec = {"name": "sketch", "fraction": 0.05, "rows": 3, "keep": 0.02}
    settings = settings_from_dict(
        {"num_clients": N, "num_rounds": 1, "fraction_evaluate": 0.0, "codec": codec}
    )
    kwargs = {} if order is None else {"order": order}
    return settings, *one_round(settings, handoff="pre_aggregated", **kwargs)


def test_a_flower_round_applies_fetchsgds_step_to_the_clients_sketches() -> None:
    """The new model against one computed here from the clients' trained models: each
    client's float32 update sketched with the run's draws, the tables in float32, their
    weighted mean, one FetchSGD step from zero state; raw tensors averaged."""
    from tests.test_pipeline_inprocess import _initial

    settings, arrays, strategy, _, spy = _sketch_round()
    record = strategy.rounds[0]
    assert record["replied"] == len(spy.local) and record["failures"] == 0
    codec = make_codec("sketch", fraction=0.05, rows=3, keep=0.02)
    initial = {k: np.asarray(v.numpy()) for k, v in _initial(settings).items()}
    sketched = [n for n, c in record["codec"]["per_tensor"].items() if c == "sketch"]
    assert sketched and len(sketched) < len(initial)
    weights = np.array([spy.weight[p] for p in sorted(spy.local)])
    deltas = {p: {n: spy.local[p][n] - initial[n] for n in initial} for p in sorted(spy.local)}
    tables, sizes = {}, {}
    for name in sketched:
        n, cols = initial[name].size, codec.columns(initial[name].size)
        seed = sk.sketch_seed(settings.seed, name)
        per_client = [
            sk.count_sketch(d[name].reshape(-1), sk.draws(seed, n, 3, cols))
            .astype(np.float32)
            .astype(np.float64)
            for d in deltas.values()
        ]
        tables[name] = np.tensordot(weights / weights.sum(), np.stack(per_client), axes=1)
        sizes[name] = n
    update, stats = fetchsgd_step(
        tables, sizes, SketchState(), rho=0.0, keep=0.02, run_seed=settings.seed
    )
    assert record["codec"]["joint"]["sketch_kept"] == stats["sketch_kept"]
    for name in initial:
        if name in sketched:
            want = initial[name] + update[name].reshape(initial[name].shape).astype(np.float32)
            assert np.count_nonzero(arrays[name] != initial[name]) <= stats["sketch_kept"]
        else:
            want = (
                np.tensordot(
                    weights / weights.sum(),
                    np.stack([d[name].astype(np.float64) for d in deltas.values()]),
                    axes=1,
                )
                + initial[name]
            )
        bound = 1e-6 * (np.abs(want).max() + 1e-30)
        assert np.abs(arrays[name] - want).max() <= bound, name


def test_a_flower_round_is_the_same_in_any_reply_order() -> None:
    _, first, *_ = _sketch_round()
    _, reversed_, *_ = _sketch_round(order=lambda r: r[::-1])
    assert all(np.array_equal(first[k], reversed_[k]) for k in first)


def test_the_draw_cache_keeps_its_budget(monkeypatch) -> None:
    """Draws are cached up to DRAW_CACHE_BYTES; one larger than the budget is never kept."""
    monkeypatch.setattr(sk, "DRAW_CACHE_BYTES", 9 * 3 * 1000 * 2)  # two of the small ones
    sk._CACHE.clear()
    for seed in range(4):
        assert sk.draws(seed, 1000, 3, 10) is sk.draws(seed, 1000, 3, 10)
    assert len(sk._CACHE) == 2
    big = sk.draws(99, 5000, 3, 10)
    assert big.slots.shape == (3, 5000) and (99, 5000, 3, 10) not in sk._CACHE
    total = sum(d.slots.nbytes + d.signs.nbytes for d in sk._CACHE.values())
    assert total <= sk.DRAW_CACHE_BYTES
    sk._CACHE.clear()
