"""Property-based fuzzing of every decoder (a sample here; `make fuzz` runs 10^4 cases per
codec): random buffers and mutated valid payloads (truncated, extended, bit flips, wrong
header fields, huge claimed shapes, NaN/Inf scales) end in a decoded tensor or a
PayloadError, within bounded time, never another exception."""

from __future__ import annotations

import os
import struct
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedcomp.codecs import PayloadError, decode_bytes, make_codec

EXAMPLES = int(os.environ.get("FEDCOMP_FUZZ_EXAMPLES", "150"))
SPECS = [
    {"name": "raw"},
    {"name": "fp32"},
    {"name": "fp16"},
    {"name": "bf16"},
    {"name": "uniform", "bits": 3, "block": 16},
    {"name": "uniform", "bits": 8, "block": 64},
    {"name": "dither", "bits": 2, "block": 32},
    {"name": "qsgd", "levels": 5, "block": 32},
    {"name": "sign", "block": 16},
    {"name": "topk", "fraction": 0.2},
    {"name": "randk", "fraction": 0.3},
]


def _valid(spec: dict, seed: int) -> bytes:
    params = {k: v for k, v in spec.items() if k != "name"}
    x = torch.randn(7, 11, generator=torch.Generator().manual_seed(seed))
    if spec["name"] == "raw":
        x = torch.arange(24, dtype=torch.int64).reshape(4, 6)
    return bytes(make_codec(spec["name"], **params).encode(x, seed=seed))


LIMIT = 10_000  # what a server would pass: the size of the matching global tensor


def _decode_or_reject(buf: bytes) -> None:
    t0 = time.perf_counter()
    try:
        out = decode_bytes(buf, max_numel=LIMIT)
    except PayloadError:
        pass
    else:
        assert isinstance(out, torch.Tensor)
        assert out.numel() <= LIMIT  # an untrusted shape never allocates beyond the limit
    assert time.perf_counter() - t0 < 2.0


mutation = st.one_of(
    st.tuples(st.just("truncate"), st.integers(0, 10_000)),
    st.tuples(st.just("extend"), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("flip"), st.integers(0, 10_000), st.integers(0, 7)),
    st.tuples(st.just("u8"), st.integers(0, 15), st.integers(0, 255)),
    st.tuples(st.just("shape"), st.integers(0, 1), st.integers(0, 2**32 - 1)),
    st.tuples(
        st.just("float"),
        st.integers(0, 10_000),
        st.sampled_from([np.nan, np.inf, -np.inf, -1.0, 3.4e38]),
    ),
)


def _mutate(buf: bytes, op: tuple) -> bytes:
    out = bytearray(buf)
    kind = op[0]
    if not out and kind != "extend":
        return bytes(out)
    if kind == "truncate":
        return bytes(out[: op[1] % (len(out) + 1)])
    if kind == "extend":
        return bytes(out) + op[1]
    if kind == "flip":
        i = op[1] % len(out)
        out[i] ^= 1 << op[2]
    elif kind == "u8":
        out[op[1] % min(16, len(out))] = op[2]
    elif kind == "shape":
        offset = 16 + 4 * op[1]
        if offset + 4 <= len(out):
            struct.pack_into("<I", out, offset, op[2])
    elif kind == "float":
        i = op[1] % max(len(out) - 3, 1)
        out[i : i + 4] = np.array([op[2]], dtype="<f4").tobytes()[: len(out) - i]
    return bytes(out)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "-".join(str(v) for v in s.values()))
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 3), ops=st.lists(mutation, min_size=1, max_size=3))
def test_mutated_payloads_decode_or_fail_cleanly(spec: dict, seed: int, ops: list) -> None:
    """EXAMPLES cases per codec (10^4 in `make fuzz`)."""
    buf = _valid(spec, seed)
    for op in ops:
        buf = _mutate(buf, op)
    _decode_or_reject(buf)


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.binary(max_size=512))
def test_random_buffers_decode_or_fail_cleanly(buf: bytes) -> None:
    _decode_or_reject(buf)


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.binary(min_size=16, max_size=16), st.binary(max_size=256))
def test_random_bodies_behind_a_valid_magic(header: bytes, body: bytes) -> None:
    head = bytearray(header)
    head[0:2] = b"FC"
    head[2] = 1  # the current format version: the codecs' own parsers get exercised
    _decode_or_reject(bytes(head) + body)


_ONEBIT = None


def _onebit_plan():
    """A valid one-bit reply and the plan the server checks it against."""
    global _ONEBIT
    if _ONEBIT is None:
        from fedcomp.onebit import OneBitCode

        code = OneBitCode(bits=2, lam=10.0, block=16)
        x = torch.randn(7, 11, generator=torch.Generator().manual_seed(0))
        payload = bytes(code.encode(x, client_index=1, num_clients=3, seed=5, tau=0.5))
        _ONEBIT = (code, payload)
    return _ONEBIT


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(mutation, min_size=1, max_size=3))
def test_mutated_onebit_replies_are_accepted_or_rejected_cleanly(ops: list) -> None:
    """The joint code's per-reply check (the wrapper's gate before joint decoding):
    a mutated reply passes only if it still matches the public plan exactly, and then
    the decoder takes it; anything else is a PayloadError."""
    code, buf = _onebit_plan()
    for op in ops:
        buf = _mutate(buf, op)
    plan = {"client_index": 1, "num_clients": 3, "seed": 5, "tau": 0.5, "shape": (7, 11)}
    t0 = time.perf_counter()
    try:
        code.check(buf, **plan)
    except PayloadError:
        return
    mean = code.decode_mean(
        [buf], client_indices=[1], num_clients=3, seed=5, tau=0.5, shape=(7, 11)
    )
    assert mean.shape == (7, 11) and torch.isfinite(mean).all()
    assert time.perf_counter() - t0 < 2.0
