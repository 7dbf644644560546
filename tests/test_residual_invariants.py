"""The residual protocol's client half and the server's mirror store, each checked
against its definition (fedcomp.controlvariates).

Client: on the covered tensors the payload is Q(delta - h) with the round's seed, the
reconstruction h + decode(q) is within one quantization step of delta, the new h is
h + alpha decode(q), and the reported statistics are ||delta - h||^2, ||delta||^2,
||decode(q) - (delta - h)||^2 and omega ||delta - h||^2, each summed over the covered
tensors; a full-precision resync sends delta exactly and sets h = delta; the other
tensors travel as the policy says. The sync mode follows the client's state. Server:
the store persists in its directory, and mismatches ask for a resync. Expected values
are computed here in float64 from the float32 inputs; each tolerance is the float32
rounding the code's own float32 steps may add.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcomp.codecs import make_codec
from fedcomp.codecs.base import decode_bytes
from fedcomp.codecs.policy import TensorPolicy
from fedcomp.codecs.residual import (
    SYNC_FULL,
    SYNC_NORMAL,
    SYNC_RESTART,
    ResidualMemory,
    state_checksum,
)
from fedcomp.controlvariates import (
    ControlVariateServer,
    Mirror,
    MirrorStore,
    ResyncRequired,
    choose_sync,
    covered_tensors,
    encode_residual,
)
from fedcomp.flower.round_records import residual_summary
from fedcomp.keys import METRIC_CV_BOUND, METRIC_CV_DELTA, METRIC_CV_NOISE, METRIC_CV_RESIDUAL
from fedcomp.own_metrics import own_metrics_problem
from fedcomp.results_file import RoundCounts

BITS, BLOCK = 4, 64
#: float32's unit roundoff: one float32 operation's relative error.
U = 2.0**-24
POLICY = TensorPolicy(min_numel=256)
FP32 = make_codec("fp32")
#: Two compressed tensors of different sizes (one not a multiple of the block) and two
#: that travel raw (too small; an integer counter).
SHAPES = {"w1": (300,), "w2": (16, 40), "bias": (10,)}
COVERED = {"w1", "w2"}


def _memory() -> ResidualMemory:
    memory = make_codec("residual", inner="uniform", bits=BITS, block=BLOCK)
    assert isinstance(memory, ResidualMemory)
    return memory


def _omega(numel: int) -> float:
    """Uniform quantization's variance factor, from its definition: per coordinate the
    error variance is at most step^2 / 4 with step = 2 max|x| / (2^b - 1), so
    E||Q(x) - x||^2 <= min(block, n) / (2^b - 1)^2 ||x||^2."""
    return min(BLOCK, numel) / (2**BITS - 1) ** 2


def _round(seed: int = 0):
    """A round's deltas, seeds and a nonzero control variate on the covered tensors
    (h near delta, as after a few rounds: ||delta - h|| well below ||delta||)."""
    gen = torch.Generator().manual_seed(seed)
    deltas = {n: 0.05 * torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    deltas["count"] = torch.tensor(7, dtype=torch.int64)
    h = {
        n: (0.8 * deltas[n] + 0.01 * torch.randn(SHAPES[n], generator=gen)).numpy() for n in COVERED
    }
    seeds = {n: 1000 + 17 * i for i, n in enumerate(deltas)}
    return deltas, seeds, h


def _f64(x: torch.Tensor | np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def test_the_policy_covers_exactly_the_compressed_tensors() -> None:
    deltas, _, _ = _round()
    assert covered_tensors(deltas, POLICY, _memory().inner) == COVERED


def test_the_payload_is_q_of_delta_minus_h_and_reconstructs_delta_within_a_step() -> None:
    memory = _memory()
    deltas, seeds, h = _round()
    payloads, pending, _ = encode_residual(
        memory, POLICY, deltas, seeds, h, COVERED, full=False, fp32=FP32
    )
    assert set(payloads) == set(deltas) and set(pending) == COVERED
    for name in COVERED:
        r = deltas[name] - torch.from_numpy(h[name])  # delta - h, in float32
        assert bytes(payloads[name]) == bytes(memory.inner.encode(r, seed=seeds[name]))
        r_hat = decode_bytes(payloads[name]).numpy()
        # Stochastic rounding moves each coordinate by less than one step of its block's
        # grid, 2 max|r| / (2^b - 1): h + r_hat is that close to delta (and encoding
        # delta itself, or forgetting h, would be off by about |h|).
        r64 = _f64(deltas[name]) - _f64(h[name])
        flat = r64.reshape(-1)
        amax = np.repeat(
            [np.abs(flat[i : i + BLOCK]).max() for i in range(0, flat.size, BLOCK)], BLOCK
        )[: flat.size]
        step = 2 * amax / (2**BITS - 1)
        # Plus float32 rounding: of delta - h, of the block's scale and of the decoder's
        # two operations, each at most U max|r| (16 U max|r| leaves room).
        error = np.abs((_f64(h[name]) + _f64(r_hat)).reshape(-1) - _f64(deltas[name]).reshape(-1))
        assert np.all(error <= step + 16 * U * amax)
        assert np.abs(_f64(h[name])).max() > 4 * step.max()  # so forgetting h would fail
        # The new h: h + alpha r_hat, alpha = 1 / (1 + omega), in float32 (two roundings
        # and alpha's own).
        alpha = 1.0 / (1.0 + _omega(r.numel()))
        expected = _f64(h[name]) + alpha * _f64(r_hat)
        tol = 4 * U * (np.abs(_f64(h[name])) + alpha * np.abs(_f64(r_hat)))
        assert pending[name].dtype == np.float32
        assert np.all(np.abs(_f64(pending[name]) - expected) <= tol)
    for name in ("bias", "count"):  # raw: the exact bytes, whatever h or the seed
        assert torch.equal(decode_bytes(payloads[name]), deltas[name])


def test_the_statistics_are_their_definitions_summed_over_the_covered_tensors() -> None:
    memory = _memory()
    deltas, seeds, h = _round(seed=1)
    payloads, _, stats = encode_residual(
        memory, POLICY, deltas, seeds, h, COVERED, full=False, fp32=FP32
    )
    residual = delta2 = noise = noise_tol = bound = 0.0
    for name in COVERED:
        d = _f64(deltas[name]).reshape(-1)
        r = d - _f64(h[name]).reshape(-1)
        e = _f64(decode_bytes(payloads[name])).reshape(-1) - r
        residual += float(r @ r)
        delta2 += float(d @ d)
        noise += float(e @ e)
        # The code's r is delta - h rounded to float32, and r_hat - r is rounded to float32
        # too: its e is off by at most b = U |r| + U (|e| + U |r|), its e^2 by 2 |e| b + b^2.
        b = U * np.abs(r) + U * (np.abs(e) + U * np.abs(r))
        noise_tol += float(np.sum(2 * np.abs(e) * b + b**2))
        bound += _omega(d.size) * float(r @ r)
    # Nothing here is zero, and the four differ: an all-zero or swapped report fails.
    assert 0 < noise < residual < delta2 and bound > noise
    assert stats[METRIC_CV_RESIDUAL] == pytest.approx(residual, rel=3 * U, abs=0)
    assert stats[METRIC_CV_DELTA] == pytest.approx(
        delta2, rel=1e-12, abs=0
    )  # float32 inputs, exact
    assert abs(stats[METRIC_CV_NOISE] - noise) <= noise_tol + 1e-12 * noise
    assert stats[METRIC_CV_BOUND] == pytest.approx(bound, rel=3 * U, abs=0)


def test_an_inner_codec_without_omega_states_no_bound_and_the_server_accepts_that() -> None:
    """Residual around subsample(EDEN): the three measured statistics as defined, no
    noise bound (EDEN claims no omega: a bound of inf would be refused, and any finite
    one would be made up), and the server's metric check accepts the group without it
    but never the bound without the group."""
    inner = {"name": "subsample", "inner": "eden", "fraction": 0.5, "block": 256}
    memory = make_codec("residual", inner=inner, alpha=0.2)
    deltas, seeds, h = _round(seed=3)
    payloads, _, stats = encode_residual(
        memory, POLICY, deltas, seeds, h, COVERED, full=False, fp32=FP32
    )
    residual = noise = 0.0
    for name in COVERED:
        r = _f64(deltas[name]).reshape(-1) - _f64(h[name]).reshape(-1)
        e = _f64(decode_bytes(payloads[name])).reshape(-1) - r
        residual, noise = residual + float(r @ r), noise + float(e @ e)
    assert METRIC_CV_BOUND not in stats
    assert stats[METRIC_CV_RESIDUAL] == pytest.approx(residual, rel=1e-6)
    assert stats[METRIC_CV_NOISE] == pytest.approx(noise, rel=1e-5)
    assert own_metrics_problem(stats, 1e9) == ""
    assert "without" in own_metrics_problem({METRIC_CV_BOUND: 1.0}, 1e9)
    assert "without" in own_metrics_problem({METRIC_CV_RESIDUAL: 1.0, METRIC_CV_BOUND: 1.0}, 1e9)


def test_the_round_summary_averages_the_coded_replies_with_or_without_a_bound() -> None:
    """residual_summary: means over the replies that coded a residual (compression
    noise > 0), not over resyncs (noise 0); the bound's mean over the replies that state
    one, None when none does (an inner codec without omega)."""

    class _Store:
        def nbytes(self) -> int:
            return 0

    class _CV:
        store = _Store()

    coded = [
        {"cv-residual-norm2": 1.0, "cv-delta-norm2": 4.0, "cv-noise-norm2": 0.5},
        {"cv-residual-norm2": 3.0, "cv-delta-norm2": 4.0, "cv-noise-norm2": 1.5},
    ]
    resync = {"cv-residual-norm2": 9.0, "cv-delta-norm2": 9.0, "cv-noise-norm2": 0.0}
    summary = residual_summary(_CV(), RoundCounts(), [*coded, resync])
    assert summary["residual_over_delta"] == pytest.approx((1.0 + 3.0) / (4.0 + 4.0))
    assert summary["noise_norm2_mean"] == pytest.approx(1.0)
    assert summary["noise_bound_mean"] is None
    bounded = [{**r, "cv-noise-bound": 2.0 * r["cv-noise-norm2"]} for r in coded]
    summary = residual_summary(_CV(), RoundCounts(), [*bounded, {**resync, "cv-noise-bound": 0.0}])
    assert summary["noise_bound_mean"] == pytest.approx(2.0)


def test_a_full_precision_resync_sends_delta_exactly_and_sets_h_to_it() -> None:
    """full=True (a requested resync, or bootstrap='fp32'): the covered tensors travel
    in fp32 whatever h was, h becomes delta (alpha = 1), and the residual reported is
    delta itself, with no compression noise."""
    memory = _memory()
    deltas, seeds, h = _round(seed=2)
    payloads, pending, stats = encode_residual(
        memory, POLICY, deltas, seeds, h, COVERED, full=True, fp32=FP32
    )
    assert set(pending) == COVERED
    delta2 = 0.0
    for name in COVERED:
        assert bytes(payloads[name]) == bytes(FP32.encode(deltas[name], seed=seeds[name]))
        assert torch.equal(decode_bytes(payloads[name]), deltas[name])
        assert pending[name].dtype == np.float32
        assert np.array_equal(pending[name], deltas[name].numpy())
        delta2 += float(_f64(deltas[name]).reshape(-1) @ _f64(deltas[name]).reshape(-1))
    assert delta2 > 0
    assert stats[METRIC_CV_DELTA] == pytest.approx(delta2, rel=1e-12, abs=0)
    assert stats[METRIC_CV_RESIDUAL] == pytest.approx(delta2, rel=1e-12, abs=0)
    assert stats[METRIC_CV_NOISE] == 0.0 and stats[METRIC_CV_BOUND] == 0.0


def test_a_tensor_outside_the_covered_set_travels_as_the_policy_says_with_its_seed() -> None:
    """The mod covers every tensor the policy compresses (so the others travel raw),
    but the contract is for any covered set: an uncovered tensor is encoded by
    ``policy.codec_for`` with the round's seed, and never against h."""
    memory = _memory()
    deltas, seeds, h = _round(seed=3)
    payloads, pending, _ = encode_residual(
        memory, POLICY, deltas, seeds, h, {"w2"}, full=False, fp32=FP32
    )
    assert set(pending) == {"w2"}
    codec = POLICY.codec_for(deltas["w1"], memory.inner)
    assert codec is memory.inner  # w1 is compressed, not covered
    assert bytes(payloads["w1"]) == bytes(codec.encode(deltas["w1"], seed=seeds["w1"]))
    # The seed matters for this codec: another seed gives other bytes.
    assert bytes(payloads["w1"]) != bytes(codec.encode(deltas["w1"], seed=seeds["w1"] + 1))


@pytest.mark.parametrize("bootstrap", ["zero", "fp32"])
def test_the_sync_mode_follows_the_clients_state(bootstrap: str) -> None:
    """A client restarts (from h = 0, or with a full-precision resync under
    bootstrap='fp32') whenever its h cannot be the server's mirror: no version, another
    tensor set (one more or one fewer, at any version), or another shape."""
    restart = SYNC_FULL if bootstrap == "fp32" else SYNC_RESTART
    shapes = {"a": (4,), "b": (2, 3)}
    h = {"a": np.zeros(4, np.float32), "b": np.zeros((2, 3), np.float32)}

    def sync(version, h, covered, asked=False):
        return choose_sync(
            version=version,
            h=h,
            covered=covered,
            shapes=shapes,
            resync_asked=asked,
            bootstrap=bootstrap,
        )

    assert sync(3, h, {"a", "b"}) == SYNC_NORMAL
    assert sync(3, h, {"a", "b"}, asked=True) == SYNC_FULL  # the server asked: fp32
    assert sync(0, h, {"a", "b"}) == restart
    assert sync(3, {"a": h["a"]}, {"a", "b"}) == restart  # a tensor came under the cv
    assert sync(3, h, {"a"}) == restart  # a tensor left it
    assert sync(3, {"a": h["a"], "b": np.zeros(6, np.float32)}, {"a", "b"}) == restart
    assert sync(0, h, {"a"}, asked=True) == SYNC_FULL


def _mirrors() -> dict[int, Mirror]:
    rng = np.random.default_rng(4)
    return {
        3: Mirror(5, {"a": rng.standard_normal((2, 3)).astype(np.float32)}),
        11: Mirror(
            1, {"a": rng.standard_normal((2, 3)).astype(np.float32), "b": np.ones(1, np.float32)}
        ),
    }


def _same(got: Mirror | None, want: Mirror) -> bool:
    return (
        got is not None
        and got.version == want.version
        and set(got.arrays) == set(want.arrays)
        and all(
            got.arrays[k].dtype == want.arrays[k].dtype
            and np.array_equal(got.arrays[k], want.arrays[k])
            for k in want.arrays
        )
    )


def test_a_store_reopened_over_its_directory_keeps_versions_values_and_dtypes(tmp_path) -> None:
    directory = tmp_path / "runs" / "mirrors"  # its parent does not exist yet
    store = MirrorStore(directory)
    mirrors = _mirrors()
    for sid, mirror in mirrors.items():
        store.put(sid, mirror)
    assert sorted(p.name for p in directory.iterdir()) == ["client-11.npz", "client-3.npz"]
    reopened = MirrorStore(directory)  # a resumed run, over the same directory
    assert reopened.ids() == [3, 11]
    assert all(_same(reopened.get(sid), m) for sid, m in mirrors.items())


@pytest.mark.parametrize("on_disk", [False, True])
def test_dropping_an_id_the_store_does_not_hold_changes_nothing(on_disk: bool, tmp_path) -> None:
    store = MirrorStore(tmp_path / "m" if on_disk else None)
    mirror = _mirrors()[3]
    store.put(3, mirror)
    store.drop(8)
    store.drop(8)
    assert store.ids() == [3] and _same(store.get(3), mirror)


@pytest.mark.parametrize("on_disk", [False, True])
def test_loading_a_checkpoint_replaces_the_mirrors_with_float32_ones(
    on_disk: bool, tmp_path
) -> None:
    """A store that already holds mirrors ends with exactly the checkpoint's; its
    arrays are float32 (what both sides' arithmetic and the checksum assume) whatever
    the checkpoint's arrays were."""
    store = MirrorStore(tmp_path / "m" if on_disk else None)
    for sid, mirror in _mirrors().items():
        store.put(sid, mirror)
    wide = np.array([0.1, -2.5e-8, 3.0], dtype=np.float64)  # not float32-representable
    store.load_state_dict(
        {"11": {"version": 4, "arrays": {"a": wide}}, "20": {"version": 1, "arrays": {"a": [0.5]}}}
    )
    assert store.ids() == [11, 20]
    got = store.get(11)
    assert got.version == 4 and got.arrays["a"].dtype == np.float32
    assert np.array_equal(got.arrays["a"], wide.astype(np.float32))
    assert store.get(20).arrays["a"].dtype == np.float32


def test_an_unknown_sync_mode_or_other_tensor_names_ask_for_a_resync() -> None:
    server = ControlVariateServer(_memory())
    mirror = Mirror(5, {"a": np.ones(4, np.float32), "b": np.full(3, 2.0, np.float32)})
    server.store.put(3, mirror)
    checksum = state_checksum(mirror.arrays)  # right version and checksum: names only
    for decoded in (
        {"a": np.zeros(4, np.float32)},  # one tensor fewer
        {**mirror.arrays, "c": np.zeros(2, np.float32)},  # one more
    ):
        with pytest.raises(ResyncRequired, match="tensor names differ"):
            server.prepare(3, decoded, version=5, checksum=checksum, sync=SYNC_NORMAL)
    assert server.resync_requested == {3}
    with pytest.raises(ResyncRequired, match="unknown sync mode"):
        server.prepare(6, {"a": np.zeros(4, np.float32)}, version=0, checksum="none", sync=7)
    assert server.resync_requested == {3, 6}
    assert _same(server.store.get(3), mirror) and server.store.get(6) is None


def test_a_server_restored_from_its_state_has_its_mirrors_and_resync_requests() -> None:
    """A resumed run's server decodes a normal reply against the restored mirror, and a
    client asked for a resync before the stop is still refused a restart."""
    memory = _memory()
    server = ControlVariateServer(memory)
    mirrors = _mirrors()
    for sid, mirror in mirrors.items():
        server.store.put(sid, mirror)
    server.resync_requested = {6, 11}
    state = server.state_dict()
    saved = mirrors[3].arrays["a"].copy()
    mirrors[3].arrays["a"] += 1.0  # the state is a copy, not a view of the live mirrors
    restored = ControlVariateServer(memory)
    restored.store.put(40, mirrors[3])  # whatever it held before is replaced
    restored.load_state_dict(state)
    assert restored.store.ids() == [3, 11] and restored.resync_requested == {6, 11}
    assert _same(restored.store.get(11), mirrors[11])
    h = restored.store.get(3).arrays["a"]
    assert np.array_equal(h, saved)
    r_hat = np.full((2, 3), 0.25, np.float32)
    ghat, pending = restored.prepare(
        3, {"a": r_hat}, version=5, checksum=state_checksum({"a": h}), sync=SYNC_NORMAL
    )
    restored.commit(pending)
    assert np.array_equal(ghat["a"], h + r_hat) and restored.store.get(3).version == 6
    with pytest.raises(ResyncRequired, match="full-precision"):
        restored.prepare(6, {"a": r_hat}, version=0, checksum="none", sync=SYNC_RESTART)
