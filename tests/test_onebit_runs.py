"""The run-sum decoders: run boundaries, prefix sums, and the estimate they give.

The one-bit decoder sums each query's answers over cyclic runs of clients instead of
visiting every answer: from prefix sums in NumPy (fedcomp/onebit/decode_runs.py), or
slot by slot in compiled code (fedcomp/onebit/decode_compiled.py, when Numba is
installed). These tests hold both to the per-answer decoder (fedcomp/onebit/decode.py),
which still serves median of means.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from experiments.memory import address_space_cap
from fedcomp import compiled
from fedcomp.onebit import OneBitCode, decode_compiled
from fedcomp.onebit import code as onebit_code
from fedcomp.onebit.decode import decode_joint, localize
from fedcomp.onebit.decode_runs import decode_runs
from fedcomp.onebit.public import SlotLookup, client_slots, coordinate_draws
from fedcomp.onebit.queries import build_query_set, make_geometry
from fedcomp.onebit.ranges import ClientPrefix, run_starts, weight_runs


@pytest.mark.parametrize("n,b,lam", [(3, 1, 1e4), (7, 2, 100.0), (50, 1, 100.0), (16, 4, 1e3)])
def test_run_boundaries_agree_with_the_slot_lookup_on_every_slot(n, b, lam):
    qs = build_query_set(make_geometry(lam), num_clients=n, bits=b)
    lookup = SlotLookup(qs.cuts)
    # Few clients and a wide range put several cuts in one slot: the searched case.
    count = 20_000
    offsets, _ = coordinate_draws(5, 0, count, n)
    starts = run_starts(lookup, offsets)
    slots = np.arange(n * b)[:, None]
    q = lookup(np.broadcast_to(slots, (n * b, count)), offsets[None, :])
    inside = (starts[q, np.arange(count)] <= slots) & (slots < starts[q + 1, np.arange(count)])
    assert inside.all()
    assert np.all(np.diff(starts, axis=0) >= 0) and starts[0].max() == 0
    assert np.all(starts[-1] == n * b)
    if n == 3:
        assert lookup.deep.any()  # the case is exercised


@pytest.mark.parametrize("b", [1, 3])
def test_prefix_runs_equal_the_sum_over_each_runs_clients(b):
    n, count = 11, 500
    rng = np.random.default_rng(b)
    qs = build_query_set(make_geometry(100.0), num_clients=n, bits=b)
    offsets, shifts = coordinate_draws(9, 0, count, n)
    starts = run_starts(SlotLookup(qs.cuts), offsets)
    rows = np.array([0, 2, 3, 7, 10])  # the others did not reply
    values = rng.uniform(size=(b, rows.size, count))
    weights = rng.uniform(1, 2, rows.size)
    got = ClientPrefix(values, rows, n, np.float64).runs(starts, shifts)
    twice = np.zeros(2 * n + 1)
    twice[rows + 1] = weights
    twice[rows + 1 + n] = weights
    got_w = weight_runs(np.cumsum(twice), starts, shifts, b)
    # Brute force: walk every slot to its client and plane.
    dense = np.zeros((b, n, count))
    dense[:, rows] = values
    w_dense = np.zeros(n)
    w_dense[rows] = weights
    slots = client_slots(np.arange(n).reshape(-1, 1), shifts, n, b)  # (n, count, b)
    lookup = SlotLookup(qs.cuts)
    q = lookup(slots, offsets[:, None])
    want = np.zeros((qs.num_queries, count))
    want_w = np.zeros((qs.num_queries, count))
    for i in range(n):
        for j in range(b):
            np.add.at(want, (q[i, :, j], np.arange(count)), dense[j, i])
            np.add.at(want_w, (q[i, :, j], np.arange(count)), w_dense[i])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-12, atol=1e-12)


#: The decoders of one group: the per-answer reference first.
DECODERS = {"per-answer": decode_joint, "numpy runs": decode_runs}
if decode_compiled.installed():
    DECODERS["compiled"] = decode_compiled.decode_compiled


def _all(code, x, *, n, indices, weights=None, side=None, seed=3):
    """Every decoder's (mean, diagnostics) on the same replies, reference first."""
    payloads = [
        bytes(
            code.encode(torch.from_numpy(x[r]), client_index=i, num_clients=n, seed=seed, tau=1.0)
        )
        for r, i in enumerate(indices)
    ]
    results = []
    for decoder in DECODERS.values():
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(onebit_code, "decode_one_group", decoder)
            results.append(
                code.decode(
                    payloads,
                    client_indices=list(indices),
                    num_clients=n,
                    seed=seed,
                    tau=1.0,
                    shape=(x.shape[1],),
                    weights=weights,
                    side_center=side,
                )
            )
    return results


@pytest.mark.parametrize(
    "n,b,center,refine,missing",
    [
        (40, 1, "inband", "deterministic", 0),
        (40, 2, "inband", "deterministic", 9),
        (25, 4, "previous", "deterministic", 0),
        (30, 1, "zero", "stochastic", 5),
        (60, 1, "inband", "stochastic", 0),
    ],
)
def test_run_sums_give_the_per_answer_decoders_estimate_bit_for_bit(n, b, center, refine, missing):
    rng = np.random.default_rng(n + b)
    d = 3000
    x = (40 + 3 * rng.standard_t(3, (n, d))).astype(np.float32)
    indices = sorted(rng.choice(n, n - missing, replace=False))
    code = OneBitCode(bits=b, lam=100.0, center=center, refine=refine)
    side = np.full(d, 38.0) if center == "previous" else None
    (old, r_old), *others = _all(code, x[indices], n=n, indices=indices, side=side)
    for new, r_new in others:
        # Unit weights: every sum is an integer count until the same final products.
        assert torch.equal(old, new)
        np.testing.assert_array_equal(r_old.mean, r_new.mean)
        np.testing.assert_array_equal(r_old.center, r_new.center)
        assert r_old.stopped_early == r_new.stopped_early


def test_run_sums_with_client_weights_agree_to_rounding():
    n, d = 45, 2000
    rng = np.random.default_rng(1)
    x = (rng.standard_t(3, (n, d)) - 20).astype(np.float32)
    indices = list(range(0, n, 1))[:40]
    weights = list(rng.uniform(0.5, 4, 40))
    weights[3] = 0.0  # a weightless reply still votes for the center
    code = OneBitCode(bits=1, lam=100.0)
    (old, r_old), *others = _all(code, x[:40], n=n, indices=indices, weights=weights)
    for new, r_new in others:
        np.testing.assert_array_equal(r_old.center, r_new.center)
        # Different summation orders of the same float64 terms: the estimates agree
        # to a few ulps of the terms (|terms| <= L_J / pi_q * w), far below one tau.
        np.testing.assert_allclose(new.numpy(), old.numpy(), rtol=0, atol=1e-5)


@pytest.mark.skipif(not decode_compiled.installed(), reason="the compiled decoder needs numba")
def test_compiled_decoder_computes_many_votes_in_place_to_the_last_bit_of_arctan2():
    # 34 votes per LOC query exceed the vote table (VOTE_TABLE_SIDE): the compiled
    # decoder then takes the C library's arctan2, which may differ from NumPy's
    # vectorized one in the last bit; the centers, hence the means, differ by at
    # most a few ulps of the largest period.
    n, d = 500, 1500
    rng = np.random.default_rng(4)
    x = (5 + rng.standard_t(3, (n, d))).astype(np.float32)
    code = OneBitCode(bits=1, lam=10.0, loc_votes=34.0)
    qs = code.query_set(np.ones(1), n)
    assert qs.counts[: qs.num_loc].min() > decode_compiled.VOTE_TABLE_SIDE
    decoders = list(DECODERS)
    (_, r_old), *others = _all(code, x, n=n, indices=range(n))
    tolerance = 4 * np.spacing(max(qs.geometry.periods))
    for name, (_, r_new) in zip(decoders[1:], others, strict=True):
        assert r_old.stopped_early == r_new.stopped_early
        if name == "compiled":
            np.testing.assert_allclose(r_new.center, r_old.center, rtol=0, atol=tolerance)
            np.testing.assert_allclose(r_new.mean, r_old.mean, rtol=0, atol=tolerance)
        else:
            np.testing.assert_array_equal(r_new.mean, r_old.mean)


def test_vote_table_is_the_numpy_localizers_snap():
    # The table replaces the arctan2 of decode.localize: each entry is the fraction
    # of the period that localize snaps a coordinate with those votes to.
    side, period = 7, 64.0
    table = decode_compiled.vote_table(side, 0.3)
    for ones0, n0, ones1, n1 in [(0, 1, 1, 1), (3, 5, 1, 4), (2, 4, 2, 4), (6, 6, 0, 5)]:
        sums = np.array([[ones0], [ones1]])
        counts = np.array([[n0], [n1]])
        center, stopped = localize(sums, counts, np.zeros(1), (period,), 0.3)
        entry = table[((ones0 * side + n0) * side + ones1) * side + n1]
        if stopped[0]:
            assert np.isnan(entry)
        else:
            # localize snaps the start 0 to the copy of y nearest it: y or y - P.
            y = period * entry
            assert center[0] == y + period * np.round((0 - y) / period)
    assert np.isnan(table[((3 * side + 2) * side + 1) * side + 1])  # 3 ones of 2 answers


@pytest.mark.skipif(not decode_compiled.installed(), reason="the compiled decoder needs numba")
@pytest.mark.parametrize("b,missing", [(1, 0), (3, 4)])
def test_compiled_decoder_over_many_chunks_equals_the_reference(monkeypatch, b, missing):
    # Chunks of 1,024 coordinates: the chunk offsets, their bytes and their public
    # draws (positions first + i) are all exercised, with a ragged last chunk.
    monkeypatch.setattr(decode_compiled, "COMPILED_CHUNK_BYTES", 1)
    n, d = 12, 4 * 1024 + 77
    rng = np.random.default_rng(b)
    x = (7 + rng.standard_t(3, (n, d))).astype(np.float32)
    indices = sorted(rng.choice(n, n - missing, replace=False))
    code = OneBitCode(bits=b, lam=100.0)
    (old, r_old), *others = _all(code, x[indices], n=n, indices=indices)
    (new, r_new) = others[list(DECODERS).index("compiled") - 1]
    assert torch.equal(old, new)
    np.testing.assert_array_equal(r_old.center, r_new.center)


def test_decoder_choice_falls_back_to_numpy_where_the_compiled_one_cannot_run(monkeypatch):
    rng = np.random.default_rng(0)
    x = (5 + rng.standard_t(3, (10, 400))).astype(np.float32)

    def decode(code):
        payloads = [
            code.encode(torch.from_numpy(x[i]), client_index=i, num_clients=10, seed=1, tau=1.0)
            for i in range(10)
        ]
        kwargs = {"client_indices": list(range(10)), "num_clients": 10, "seed": 1, "tau": 1.0}
        chosen = code.decode_mean(payloads, **kwargs)
        with monkeypatch.context() as patch:
            patch.setattr(onebit_code, "decode_one_group", decode_joint)
            return chosen, code.decode_mean(payloads, **kwargs)

    # A scale that is not a power of two would make the compiled remainders inexact:
    # the NumPy decoder runs, and gives the per-answer decoder's estimate.
    odd = OneBitCode(bits=1, lam=100.0, a0=6.0)
    assert not decode_compiled.available(odd.query_set(np.ones(1), 10))
    got, want = decode(odd)
    assert torch.equal(got, want)
    code = OneBitCode(bits=1, lam=100.0)
    qs = code.query_set(np.ones(1), 10)
    assert decode_compiled.available(qs) == decode_compiled.installed()
    monkeypatch.setitem(compiled._STATE, "numba", None)  # as without the fast extra
    assert not decode_compiled.available(qs)
    with pytest.raises(RuntimeError, match="numba"):
        decode_compiled.decode_compiled(
            None, qs, numel=1, seed=0, start=None, localize_center=True, min_resultant=0.3
        )
    got, want = decode(code)
    assert torch.equal(got, want)


def test_no_compilation_under_a_tight_address_space_limit(monkeypatch, caplog):
    # Numba's compiler never finishes with 256 MB of address space left (measured):
    # under such a ulimit -v the NumPy decoder runs instead, with a warning.
    qs = OneBitCode(bits=1, lam=100.0).query_set(np.ones(1), 10)
    monkeypatch.setattr(decode_compiled.KERNELS, "compiled", None)
    monkeypatch.delitem(compiled._STATE, "warned", raising=False)
    with address_space_cap(64 << 20):
        assert not decode_compiled.available(qs)
    assert "address-space limit" in caplog.text
    assert decode_compiled.available(qs) == decode_compiled.installed()


@pytest.mark.skipif(not decode_compiled.installed(), reason="the compiled decoder needs numba")
def test_the_compiled_decoder_leaves_torchs_thread_count_alone():
    # Numba's OpenMP layer shares libgomp with torch: starting it reset torch's thread
    # count (1 read back as 2). The decoder uses Numba's own thread pool instead.
    code = OneBitCode(bits=1, lam=100.0)
    x = np.random.default_rng(0).standard_normal((4, 3000)).astype(np.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        (_, reference), *others = _all(code, x, n=4, indices=range(4))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert decode_compiled.numba.threading_layer() == "workqueue"
    for _, result in others:
        np.testing.assert_array_equal(result.mean, reference.mean)
