"""Residual compression (the pure maths and the server's mirrors): unbiased
reconstruction, the alpha limit, h tracking the update, the seed paper's noise bound,
and mirrors that stay bit-identical to the clients' control variates."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from fedcomp.codecs import make_codec
from fedcomp.codecs.residual import (
    SYNC_FULL,
    SYNC_NORMAL,
    SYNC_RESTART,
    ResidualMemory,
    apply_residual,
    state_checksum,
)
from fedcomp.controlvariates import ControlVariateServer, Mirror, MirrorStore, ResyncRequired


def _residual(**params) -> ResidualMemory:
    memory = make_codec("residual", **params)
    assert isinstance(memory, ResidualMemory)
    return memory


def _accept(
    server: ControlVariateServer, stable_id: int, decoded: dict, **protocol
) -> dict[str, np.ndarray]:
    """What the wrapper does with an accepted reply: prepare the update, then commit
    the mirror it leads to."""
    ghat, pending = server.prepare(stable_id, decoded, **protocol)
    server.commit(pending)
    return ghat


def _rounding_variance(r: np.ndarray, *, bits: int, block: int) -> float:
    """E||Q(r) - r||^2 of stochastic uniform rounding, from its definition: per block a
    grid of step 2 max|r| / (2^b - 1) from -max|r|, a coordinate at fractional
    position f on it has variance step^2 f (1 - f)."""
    total = 0.0
    for i in range(0, r.size, block):
        part = r[i : i + block].astype(np.float64)
        scale = np.abs(part).max()
        if scale == 0:
            continue
        step = 2 * scale / (2**bits - 1)
        t = (part + scale) / step
        f = t - np.floor(t)
        total += float(np.sum(step**2 * f * (1 - f)))
    return total


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"inner": "sign"}, "not unbiased"),
        ({"inner": "topk", "fraction": 0.1}, "not unbiased"),
        ({"inner": "fp16"}, "not unbiased"),
        ({"inner": "eden", "bits": 1, "scale": "mse", "alpha": 0.2}, "not unbiased"),
        ({"inner": "eden", "bits": 1}, "claims no variance bound"),
        ({"inner": {"name": "subsample", "inner": "eden", "fraction": 0.25}}, "give alpha"),
        ({"inner": "ef"}, "inner"),
        ({"inner": "residual"}, "inner"),
        ({"inner": "uniform", "alpha": 0.0}, "alpha"),
        ({"inner": "uniform", "alpha": 1.5}, "alpha"),
    ],
)
def test_bad_inner_codecs_and_alphas_are_rejected(params: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        make_codec("residual", **params)


def test_default_alpha_is_the_convergence_limit_and_overrides_warn() -> None:
    memory = _residual(inner="uniform", bits=2, block=64)
    omega = memory.inner.variance_factor(1000)
    assert memory.alpha_for(1000) == pytest.approx(1 / (1 + omega))
    loud = _residual(inner="uniform", bits=2, block=64, alpha=0.9)
    with pytest.warns(UserWarning, match=r"convergence limit 1/\(1\+omega\)="):
        assert loud.alpha_for(1000) == 0.9
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _residual(inner="uniform", bits=8, alpha=0.5).alpha_for(1000)  # below the limit


def test_an_inner_codec_without_an_omega_takes_the_stated_alpha_and_tracks_delta() -> None:
    # subsample(EDEN) claims no omega: no default alpha and no limit to warn against;
    # the stated alpha is used on every tensor, and with it h still converges to a
    # fixed update (E||delta - h'||^2 = (1 - 2a + a^2 (1 + omega)) ||delta - h||^2 < it
    # for the measured omega of about 5.3 and a = 0.15).
    inner = {"name": "subsample", "inner": "eden", "fraction": 0.25, "block": 256}
    memory = make_codec("residual", inner=inner, alpha=0.15)
    assert memory.alpha_limit(4096) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert memory.alpha_for(4096) == 0.15
    delta = torch.randn(4096, generator=torch.Generator().manual_seed(2))
    h = None
    for t in range(30):
        _, r_hat = memory.encode(delta, h, seed=t)
        h = apply_residual(h, r_hat, memory.alpha_for(delta.numel()))
    remaining = float(((delta.numpy() - h) ** 2).sum()) / float((delta**2).sum())
    omega = 1.571 * 4 - 1
    predicted = (1 - 2 * 0.15 + 0.15**2 * (1 + omega)) ** 30
    assert remaining <= 2 * predicted


def test_reconstruction_is_unbiased() -> None:
    memory = _residual(inner="uniform", bits=2, block=32)
    gen = torch.Generator().manual_seed(0)
    delta = torch.randn(300, generator=gen)
    h = (torch.randn(300, generator=gen) * 0.5).numpy()
    draws, total, err = 400, np.zeros(300), 0.0
    for seed in range(draws):
        _, r_hat = memory.encode(delta, h, seed=seed)
        ghat = h + r_hat
        total += ghat
        err += float(((ghat - delta.numpy()) ** 2).sum())
    bias2 = float(((total / draws - delta.numpy()) ** 2).sum())
    assert bias2 <= 2.0 * (err / draws) / draws  # as in the codec tests: > 5 sigma margin


def test_h_tracks_a_fixed_update_at_the_predicted_rate() -> None:
    # With alpha = 1/(1+omega): E||delta - h'||^2 <= (1 - alpha) ||delta - h||^2.
    memory = _residual(inner="uniform", bits=1, block=16)
    delta = torch.randn(256, generator=torch.Generator().manual_seed(1))
    alpha = memory.alpha_for(delta.numel())
    rounds, trials = 12, 40
    finals = []
    for trial in range(trials):
        h = None
        for t in range(rounds):
            _, r_hat = memory.encode(delta, h, seed=1000 * trial + t)
            h = apply_residual(h, r_hat, alpha)
        finals.append(float(((delta.numpy() - h) ** 2).sum()))
    predicted = (1 - alpha) ** rounds * float((delta**2).sum())
    assert np.mean(finals) <= 1.2 * predicted
    assert np.mean(finals) < 0.5 * float((delta**2).sum())


def test_quadratic_federated_problem_noise_follows_the_residual() -> None:
    """Clients minimize 1/2 ||x - b_m||^2 (heterogeneous b_m) with residual-coded steps.

    Per round, the measured compression noise ||r_hat - r||^2 stays within omega ||r||^2
    (the seed paper's bound), and it shrinks with ||delta - h||^2 while ||delta||^2 stays
    large: the reason the method beats direct compression under heterogeneity."""
    rng = np.random.default_rng(2)
    clients, d, rounds, lr = 8, 512, 40, 0.5
    b = rng.standard_normal((clients, d)).astype(np.float32) * 3
    memory = _residual(inner="uniform", bits=2, block=64)
    server = ControlVariateServer(memory)
    x = np.zeros(d, dtype=np.float32)
    hs: list[np.ndarray | None] = [None] * clients
    versions = [0] * clients
    measured, expected, bounds, residual_share = [], [], [], []
    for t in range(rounds):
        updates = []
        for m in range(clients):
            delta = (-lr * (x - b[m])).astype(np.float32)
            if hs[m] is None:  # first contact: resync with the full update
                ghat = _accept(server, m, {"w": delta}, version=0, checksum="", sync=SYNC_FULL)
                hs[m], versions[m] = delta.copy(), 1
            else:
                r = delta - hs[m]
                payload, r_hat = memory.encode(torch.from_numpy(delta), hs[m], seed=97 * t + m)
                ghat = _accept(
                    server,
                    m,
                    {"w": memory.inner.decode(payload).numpy()},
                    version=versions[m],
                    checksum=state_checksum({"w": hs[m]}),
                    sync=SYNC_NORMAL,
                )["w"]
                measured.append(float(((r_hat - r) ** 2).sum()))
                expected.append(_rounding_variance(r, bits=2, block=64))
                bounds.append(memory.noise_bound(float((r**2).sum()), d))
                residual_share.append(float((r**2).sum()) / float((delta**2).sum()))
                hs[m] = apply_residual(hs[m], r_hat, memory.alpha_for(d))
                versions[m] += 1
                ghat = {"w": ghat}
            updates.append(ghat["w"] if isinstance(ghat, dict) else ghat)
        x = x + np.mean(updates, axis=0)
    # The residual's compression noise is the inner codec's variance ON THE RESIDUAL
    # (stochastic rounding: step^2 f (1 - f) per coordinate), within a Monte Carlo
    # tolerance from the spread of the per-encode ratios; the worst-case bound
    # omega ||r||^2 holds too, with room to spare.
    ratio = np.array(measured) / np.array(expected)
    assert abs(ratio.mean() - 1.0) <= 4 * ratio.std() / np.sqrt(ratio.size), ratio.mean()
    assert np.sum(measured) <= np.sum(bounds)
    # h tracks delta: the residual the codec sees is a small share of the update.
    assert np.mean(residual_share[-clients * 5 :]) < 0.25 * np.mean(residual_share[:clients])
    for m in range(clients):  # mirrors equal the clients' control variates, bit for bit
        mirror = server.store.get(m)
        assert mirror.version == versions[m] and np.array_equal(mirror.arrays["w"], hs[m])


def test_mismatches_ask_for_a_resync_and_decode_nothing() -> None:
    memory = _residual(inner="uniform", bits=4)
    server = ControlVariateServer(memory)
    h = {"w": np.ones(8, dtype=np.float32)}
    server.store.put(3, Mirror(5, h))
    for kwargs in (
        {"version": 4, "checksum": state_checksum(h)},
        {"version": 5, "checksum": "0" * 16},
    ):
        with pytest.raises(ResyncRequired, match="resync requested"):
            _accept(server, 3, {"w": np.zeros(8, np.float32)}, sync=SYNC_NORMAL, **kwargs)
        assert server.store.get(3).version == 5  # the mirror is untouched
    with pytest.raises(ResyncRequired, match="no control variate"):
        _accept(server, 9, {"w": np.zeros(8, np.float32)}, version=1, checksum="", sync=SYNC_NORMAL)
    assert server.resync_requested == {3, 9}
    _accept(server, 3, {"w": np.full(8, 2.0, np.float32)}, version=0, checksum="", sync=SYNC_FULL)
    assert server.resync_requested == {9}
    assert server.store.get(3).version == 1 and np.array_equal(
        server.store.get(3).arrays["w"], np.full(8, 2.0)
    )


@pytest.mark.parametrize("on_disk", [False, True])
def test_mirror_store_roundtrip_and_checkpoint(on_disk: bool, tmp_path) -> None:
    store = MirrorStore(tmp_path / "mirrors" if on_disk else None)
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.float32)}
    store.put(7, Mirror(3, arrays))
    store.put(2, Mirror(1, {"a": np.zeros((2, 3), np.float32), "b": np.zeros(4, np.float32)}))
    assert store.ids() == [2, 7] and store.nbytes() == 2 * (24 + 16)
    got = store.get(7)
    assert got.version == 3 and all(np.array_equal(got.arrays[k], arrays[k]) for k in arrays)
    other = MirrorStore(tmp_path / "other" if on_disk else None)
    other.load_state_dict(store.state_dict())
    assert other.ids() == [2, 7] and np.array_equal(other.get(7).arrays["a"], arrays["a"])
    store.drop(7)
    assert store.get(7) is None and store.ids() == [2]


def test_a_restart_decodes_against_zero_and_cannot_dodge_a_requested_resync() -> None:
    memory = _residual(inner="uniform", bits=4, block=8)
    server = ControlVariateServer(memory)
    r_hat = np.linspace(-1, 1, 16).astype(np.float32)
    ghat = _accept(server, 4, {"w": r_hat}, version=0, checksum="none", sync=SYNC_RESTART)
    assert np.array_equal(ghat["w"], r_hat)  # h = 0: the update is the decoded residual
    mirror = server.store.get(4)
    assert mirror.version == 1
    assert np.array_equal(mirror.arrays["w"], apply_residual(None, r_hat, memory.alpha_for(16)))
    server.resync_requested.add(4)
    with pytest.raises(ResyncRequired, match="full-precision"):
        _accept(server, 4, {"w": r_hat}, version=0, checksum="none", sync=SYNC_RESTART)
    with pytest.raises(ValueError, match="bootstrap"):
        make_codec("residual", inner="uniform", bootstrap="ones")
