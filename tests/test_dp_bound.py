"""docs/codecs.md's column "keeps a DP clipping bound": a client that clips its update
to norm C before encoding still sends at most C after decoding, for the codecs that
claim it (exactly, or up to the stated rounding), and the codecs that do not claim it
can exceed it, within the per-block bound the table states."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedcomp.codecs import decode_bytes, make_codec


def _inputs() -> list[torch.Tensor]:
    gen = np.random.default_rng(0)
    return [
        torch.from_numpy(gen.standard_normal((37, 29)).astype(np.float32)),
        torch.from_numpy(gen.standard_t(1.5, size=(64, 50)).astype(np.float32)),
        torch.from_numpy((gen.random(3000) < 0.1) * gen.standard_normal(3000)).float(),
    ]


def _norm(x: torch.Tensor) -> float:
    return float(x.double().norm())


@pytest.mark.parametrize(
    ("spec", "slack"),
    [
        ({"name": "fp32"}, 0.0),
        ({"name": "fp16"}, 2.0**-11),
        ({"name": "bf16"}, 2.0**-8),
        ({"name": "sign", "block": 64}, 1e-6),
        ({"name": "topk", "fraction": 0.1}, 0.0),
        ({"name": "lowrank", "rank": 2}, 1e-5),  # P P^T M: an orthogonal projection
    ],
    ids=lambda v: v["name"] if isinstance(v, dict) else str(v),
)
def test_codecs_that_claim_it_never_raise_the_norm(spec: dict, slack: float) -> None:
    codec = make_codec(**spec)
    for x in _inputs():
        for seed in range(5):
            y = decode_bytes(bytes(codec.encode(x, seed=seed)))
            assert _norm(y) <= _norm(x) * (1 + slack) + 1e-12, spec


@pytest.mark.parametrize(
    "spec",
    [
        {"name": "uniform", "bits": 2, "block": 64},
        {"name": "dither", "bits": 1, "block": 64},
        {"name": "qsgd", "levels": 1, "block": 64},
    ],
    ids=lambda v: v["name"],
)
def test_stochastic_quantizers_can_raise_it_but_within_sqrt_block_max_per_block(spec) -> None:
    codec = make_codec(**spec)
    x = _inputs()[1].reshape(-1)
    raised = 0
    for seed in range(20):
        y = decode_bytes(bytes(codec.encode(x, seed=seed))).reshape(-1)
        raised += _norm(y) > _norm(x)
        for start in range(0, x.numel(), 64):
            part, out = x[start : start + 64], y[start : start + 64]
            scale = float(part.abs().max()) if spec["name"] != "qsgd" else _norm(part)
            if spec["name"] == "dither":  # subtractive dither: half a step beyond the range
                scale *= 1 + 1 / (2 ** spec["bits"] - 1)
            assert _norm(out) <= math.sqrt(part.numel()) * scale * (1 + 1e-5) + 1e-12
    assert raised > 0  # the column's "no": it happens
