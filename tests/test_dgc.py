"""The dgc memory: with its additions off it IS error feedback (bit for bit); each
addition does what docs/codecs.md says (momentum correction and masking, clipping, the
warm-up schedule), computed here independently; and client and server agree on every
warm-up round through the real mod and wrapper."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from clients.client_app import make_client_app
from experiments.inprocess import InProcessGrid
from fedcomp.codecs import TensorPolicy, decode_bytes, make_codec
from fedcomp.codecs.dgc import MOMENTUM_SUFFIX
from fedcomp.codecs.memory import encode_with_feedback
from fedcomp.settings import settings_from_dict
from strategies.server_app import run_server

INNER = {"inner": "sparseq", "fraction": 0.05, "bits": 4, "block": 64}


def _deltas(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(40, 30, generator=gen), "b": torch.randn(7, generator=gen)}


def test_without_its_additions_dgc_is_error_feedback_bit_for_bit() -> None:
    dgc = make_codec("dgc", momentum=0.0, **INNER)
    ef = make_codec("ef", **INNER)
    policy = TensorPolicy(min_numel=16)
    carried_dgc: dict[str, np.ndarray] = {}
    carried_ef: dict[str, np.ndarray] = {}
    for rnd in range(1, 4):
        deltas, seeds = _deltas(rnd), {"w": 11 * rnd, "b": 13 * rnd}
        p1, carried_dgc, _ = dgc.encode_round(policy, deltas, seeds, carried_dgc, rnd)
        p2, carried_ef = encode_with_feedback(ef, policy, deltas, seeds, carried_ef)
        assert p1 == p2
        assert np.array_equal(carried_dgc["w"], carried_ef["w"])


def test_momentum_correction_and_factor_masking_follow_their_definitions() -> None:
    m = 0.9
    memory = make_codec("dgc", momentum=m, **INNER)
    u = torch.randn(1200, generator=torch.Generator().manual_seed(1))
    v = torch.randn(1200, generator=torch.Generator().manual_seed(2))
    delta = torch.randn(1200, generator=torch.Generator().manual_seed(3))
    payload, new_v, new_u, encoded = memory.encode_tensor(delta, v, u, seed=5, server_round=9)
    sent = decode_bytes(bytes(payload))
    want_u = m * u + delta
    want_v = v + want_u
    assert torch.allclose(encoded, want_v)
    assert torch.allclose(new_v, want_v - sent)
    assert torch.equal(new_u, torch.where(sent != 0, torch.zeros_like(want_u), want_u))
    assert int((sent != 0).sum()) == math.ceil(0.05 * 1200)  # the sparsifier's k


def test_clipping_bounds_the_accumulated_update_by_this_rounds_norm() -> None:
    memory = make_codec("dgc", momentum=0.9, clip=1.5, **INNER)
    delta = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    big = 50 * torch.randn(1000, generator=torch.Generator().manual_seed(5))
    encoded = memory.encode_tensor(delta, big, big, seed=1, server_round=3).encoded
    assert float(encoded.norm()) <= 1.5 * float(delta.norm()) * (1 + 1e-6)
    unclipped = (
        make_codec("dgc", momentum=0.9, **INNER)
        .encode_tensor(delta, big, big, seed=1, server_round=3)
        .encoded
    )
    assert float(unclipped.norm()) > 10 * float(delta.norm())


def test_the_warm_up_falls_geometrically_from_its_start_to_the_target() -> None:
    memory = make_codec("dgc", warmup_rounds=4, warmup_start=0.25, **INNER)
    shares = [memory.fraction_for_round(r) for r in range(1, 7)]
    assert shares[0] == pytest.approx(0.25) and shares[4:] == [0.05, 0.05]
    ratios = [b / a for a, b in itertools.pairwise(shares[:5])]
    assert ratios == pytest.approx([(0.05 / 0.25) ** 0.25] * 4)
    assert memory.inner_for_round(1).spec()["fraction"] == pytest.approx(0.25)
    assert memory.inner_for_round(5) is memory.inner


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"momentum": 1.0}, "momentum"),
        ({"clip": -1.0}, "clip"),
        ({"warmup_rounds": -2}, "warmup_rounds"),
        ({"warmup_start": 0.0}, "warmup_start"),
    ],
)
def test_bad_dgc_settings_are_refused(params: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        make_codec("dgc", **INNER, **params)


def test_warm_up_rounds_are_accepted_by_the_server_and_the_state_is_kept() -> None:
    """Through the real mod and wrapper: every reply of every warm-up round passes the
    server's check of k (which changes by round), and each client keeps u and v."""
    n = 4
    settings = settings_from_dict(
        {
            "num_clients": n,
            "num_rounds": 3,
            "fraction_evaluate": 0.0,
            "codec": {"name": "dgc", **INNER, "warmup_rounds": 2, "warmup_start": 0.5},
            "train": {"local_epochs": 1},
        }
    )
    grid = InProcessGrid(make_client_app(), n)
    results = run_server(grid, settings)
    assert [r["replied"] for r in results["rounds"]] == [n, n, n]
    bytes_by_round = [r["uplink_codec_bytes"] for r in results["rounds"]]
    assert bytes_by_round[0] > bytes_by_round[1] > bytes_by_round[2]  # the warm-up
    from fedcomp.flower.memory_state import load_memory

    memory = load_memory(next(iter(grid.contexts.values())).state)
    names = set(memory.committed) | set(memory.pending)
    assert any(k.endswith(MOMENTUM_SUFFIX) for k in names)
