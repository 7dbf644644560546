"""PowerSGD: one power iteration recovers a matrix of rank <= r exactly, warm starts
converge to the best rank-r approximation (SVD, computed here), error feedback loses
nothing over rounds, the bytes are r (rows + cols) floats, and bad payloads fail."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from clients.client_app import make_client_app
from experiments.inprocess import InProcessGrid
from fedcomp.codecs import PayloadError, TensorPolicy, decode_bytes, make_codec
from fedcomp.codecs.lowrank import Q_SUFFIX, LowRankCodec
from fedcomp.codecs.wire import SpecMismatch
from fedcomp.flower.memory_state import load_memory
from fedcomp.settings import settings_from_dict
from strategies.server_app import run_server


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_a_matrix_of_rank_r_is_recovered_from_any_seed(rank: int) -> None:
    m = torch.randn(30, rank, generator=_gen(1)) @ torch.randn(rank, 50, generator=_gen(2))
    codec = make_codec("lowrank", rank=rank)
    for seed in (0, 7):
        y = decode_bytes(bytes(codec.encode(m, seed=seed)))
        assert torch.allclose(y, m, atol=1e-4 * float(m.abs().max()))


def test_warm_starts_converge_to_the_best_rank_r_approximation() -> None:
    """Feeding the same matrix with a warm-started Q is subspace iteration: the error
    falls to the SVD's optimum ||M - M_r||_F (the tail singular values)."""
    gen = np.random.default_rng(3)
    u, _ = np.linalg.qr(gen.standard_normal((40, 40)))
    v, _ = np.linalg.qr(gen.standard_normal((60, 40)))
    s = 2.0 ** -np.arange(40)  # a clear spectral gap at every rank
    m = torch.from_numpy((u * s) @ v.T).float()
    optimum = float(np.sqrt(np.sum(s[2:] ** 2)))
    codec = LowRankCodec(rank=2)
    q = torch.randn(60, 2, generator=_gen(4))
    errors = []
    for _ in range(8):
        payload, q = codec.encode_with(m, q)
        errors.append(float((decode_bytes(bytes(payload)) - m).norm()))
    assert errors[-1] <= optimum * 1.01 < errors[0]


def test_error_feedback_telescopes_over_rounds() -> None:
    """sum of decoded payloads + the final error = sum of the updates (nothing lost)."""
    memory = make_codec("powersgd", rank=1)
    policy = TensorPolicy(min_numel=16)
    carried: dict[str, np.ndarray] = {}
    sent = torch.zeros(20, 35, dtype=torch.float64)
    total = torch.zeros(20, 35, dtype=torch.float64)
    for rnd in range(5):
        delta = torch.randn(20, 35, generator=_gen(10 + rnd))
        payloads, carried, _ = memory.encode_round(policy, {"w": delta}, {"w": rnd}, carried, rnd)
        sent += decode_bytes(payloads["w"]).double()
        total += delta.double()
        assert carried["w" + Q_SUFFIX].shape == (35, 1)
    assert torch.allclose(sent + torch.from_numpy(carried["w"]).double(), total, atol=1e-4)


@pytest.mark.parametrize(
    ("shape", "dense"), [((64, 3, 3, 3), False), ((100,), True), ((4, 4), True)]
)
def test_bytes_are_rank_times_rows_plus_cols_or_dense(shape, dense) -> None:
    x = torch.randn(*shape, generator=_gen(5))
    rows, cols = (shape[0], x.numel() // shape[0]) if len(shape) > 1 else (1, shape[0])
    payload = bytes(make_codec("lowrank", rank=2).encode(x, seed=1))
    values = rows * cols if dense else 2 * (rows + cols)
    assert len(payload) == 16 + 4 * len(shape) + 12 + 4 * values
    assert struct.unpack_from("<B", payload, 16 + 4 * len(shape) + 1)[0] == int(dense)


def _tamper(payload: bytes, ndim: int, **fields) -> bytes:
    head = 16 + 4 * ndim
    rank, mode, _, rows, cols = struct.unpack_from("<BBHII", payload, head)
    values = {"rank": rank, "mode": mode, "rows": rows, "cols": cols, **fields}
    packed = struct.pack(
        "<BBHII", values["rank"], values["mode"], 0, values["rows"], values["cols"]
    )
    return payload[:head] + packed + payload[head + 12 :]


@pytest.mark.parametrize(
    ("fields", "error", "needle"),
    [
        ({"rank": 0}, PayloadError, "rank"),
        ({"rank": 65}, PayloadError, "rank"),
        ({"rows": 32}, SpecMismatch, "matrix shape"),
        ({"mode": 2}, PayloadError, "mode"),
        ({"rank": 3}, PayloadError, "body"),
    ],
)
def test_bad_payloads_fail_naming_the_field(fields, error, needle) -> None:
    x = torch.randn(64, 27, generator=_gen(6))
    payload = bytes(make_codec("lowrank", rank=2).encode(x, seed=1))
    with pytest.raises(error, match=needle):
        decode_bytes(_tamper(payload, 2, **fields))


def test_the_server_refuses_another_rank() -> None:
    x = torch.randn(64, 27, generator=_gen(7))
    asked = make_codec("lowrank", rank=2)
    with pytest.raises(SpecMismatch, match="rank"):
        asked.check_payload(make_codec("lowrank", rank=4).encode(x, seed=1))


@pytest.mark.parametrize("rank", [0, 65, 1.5])
def test_bad_ranks_are_refused(rank) -> None:
    with pytest.raises(ValueError, match="rank"):
        make_codec("powersgd", rank=rank)


def test_powersgd_through_the_wrapper_keeps_q_and_the_error_per_client() -> None:
    n = 4
    settings = settings_from_dict(
        {
            "num_clients": n,
            "num_rounds": 2,
            "fraction_evaluate": 0.0,
            "codec": {"name": "powersgd", "rank": 2},
            "train": {"local_epochs": 1},
        }
    )
    grid = InProcessGrid(make_client_app(), n)
    results = run_server(grid, settings)
    assert [r["replied"] for r in results["rounds"]] == [n, n]
    assert results["rounds"][-1]["codec"]["ratio_vs_fp32_codec"] > 5
    memory = load_memory(next(iter(grid.contexts.values())).state)
    assert any(k.endswith(Q_SUFFIX) for k in {*memory.committed, *memory.pending})
