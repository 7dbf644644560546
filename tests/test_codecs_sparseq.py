"""sparseq: the sampled selection is the exact top-k, the index section is the smallest
of the four forms, the kept values are within one quantization step, and every bad
index section is refused before anything beyond the tensor is allocated."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
import zstandard

from experiments.memory import address_space_cap
from fedcomp.codecs import PayloadError, decode_bytes, make_codec
from fedcomp.codecs.packing import encode_varints
from fedcomp.codecs.sparse_quantized import (
    BITMAP,
    GAPS,
    SAMPLE,
    ZSTD_BITMAP,
    ZSTD_GAPS,
    select_topk,
)

INPUTS = {
    "gaussian": lambda n: torch.randn(n, generator=torch.Generator().manual_seed(1)),
    "student_t": lambda n: torch.from_numpy(
        np.random.default_rng(2).standard_t(1.5, size=n).astype(np.float32)
    ),
    "sparse": lambda n: (
        torch.randn(n, generator=torch.Generator().manual_seed(3))
        * (torch.rand(n, generator=torch.Generator().manual_seed(4)) < 0.05)
    ),
}


@pytest.mark.parametrize("kind", sorted(INPUTS))
@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.1])
def test_the_sampled_selection_is_the_exact_top_k(kind: str, fraction: float) -> None:
    n = 8 * SAMPLE + 123
    x = INPUTS[kind](n)
    k = math.ceil(fraction * n)
    got = select_topk(x, k, seed=5)
    # the exact top-k by magnitude, ties broken any way: compare the selected energy
    # and the k-th magnitude, which ties cannot change
    exact = torch.topk(x.abs(), k).values
    assert got.numel() == k and torch.all(got[1:] > got[:-1])
    assert float(x[got].abs().min()) == float(exact.min())
    assert math.isclose(float(x[got].square().sum()), float(exact.square().sum()), rel_tol=1e-6)


def _forms(idx: np.ndarray, n: int) -> dict[int, int]:
    """The size of each index form, computed here from the definitions."""
    mask = np.zeros(n, dtype=bool)
    mask[idx] = True
    bitmap = np.packbits(mask).tobytes()
    gaps = encode_varints(np.diff(idx, prepend=-1) - 1)
    zstd = zstandard.ZstdCompressor(level=3, write_content_size=True)
    return {
        BITMAP: len(bitmap),
        GAPS: len(gaps),
        ZSTD_BITMAP: len(zstd.compress(bitmap)),
        ZSTD_GAPS: len(zstd.compress(gaps)),
    }


@pytest.mark.parametrize(("n", "fraction"), [(300, 0.5), (5000, 0.2), (100_000, 0.01)])
def test_the_index_section_is_the_smallest_form_and_values_are_within_a_step(n, fraction):
    x = INPUTS["student_t"](n)
    codec = make_codec("sparseq", fraction=fraction, bits=4, block=64)
    payload = bytes(codec.encode(x, seed=7))
    fmt, _, _, _, k, index_bytes = struct.unpack_from("<BBHIQQ", payload, 16 + 4)
    idx = np.sort(torch.topk(x.abs(), k).indices.numpy())
    sizes = _forms(idx, n)
    assert index_bytes == sizes[fmt] == min(sizes.values())
    y = decode_bytes(payload)
    support = torch.nonzero(y).reshape(-1)
    assert set(support.tolist()) <= set(idx.tolist())
    # each kept value is stochastically rounded on its block's grid: error < one step
    values = x[torch.from_numpy(idx)]
    for start in range(0, k, 64):
        part = values[start : start + 64]
        step = 2 * float(part.abs().max()) / 15
        err = (y[torch.from_numpy(idx[start : start + 64])] - part).abs()
        assert float(err.max()) <= step * (1 + 1e-5)


def _payload(fmt: int, k: int, index: bytes, n: int = 1000) -> bytes:
    good = bytes(make_codec("sparseq", k=k, bits=2).encode(torch.randn(n), seed=1))
    head = 16 + 4
    _, _, _, _, _, old_index = struct.unpack_from("<BBHIQQ", good, head)
    values = good[head + 24 + old_index :]
    return good[:head] + struct.pack("<BBHIQQ", fmt, 0, 0, 0, k, len(index)) + index + values


@pytest.mark.parametrize(
    ("fmt", "index", "needle"),
    [
        (BITMAP, np.packbits(np.eye(1, 1000, 3, dtype=bool)[0]).tobytes(), "holds 1 indices"),
        (BITMAP, b"\xff" * 125, "holds 1000 indices"),
        (BITMAP, b"\x00" * 124, "bitmap of 124 bytes"),
        (GAPS, encode_varints(np.array([998, 5, 0, 0, 0])), "beyond the tensor"),
        (ZSTD_GAPS, b"not a frame", "zstd"),
    ],
)
def test_bad_index_sections_are_payload_errors(fmt: int, index: bytes, needle: str) -> None:
    with pytest.raises(PayloadError, match=needle):
        decode_bytes(_payload(fmt, 5, index))


def test_a_compressed_index_section_cannot_inflate_beyond_its_bound() -> None:
    """A 50 MB frame of zeros (1.5 kB compressed) as the bitmap of 100,000 coordinates:
    refused from its declared size, before inflating, under a 64 MiB address cap."""
    bomb = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(50_000_000))
    with address_space_cap(64 << 20), pytest.raises(PayloadError, match="at most"):
        decode_bytes(_payload(ZSTD_BITMAP, 5, bomb, n=100_000))


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"fraction": 0.0}, "fraction"),
        ({"fraction": 0.1, "k": 3}, "exactly one"),
        ({"bits": 9}, "bits"),
        ({"selection": "approximate"}, "selection"),
    ],
)
def test_bad_sparseq_settings_are_refused(params: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        make_codec("sparseq", **params)
