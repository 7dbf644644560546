"""The compiled quantizers (fedcomp.codecs.quantize_compiled) against the torch path:
the same uniform, dither and QSGD payloads, byte for byte, for every bit width, odd and
long blocks, a ragged end and several kernel chunks; a subtractive-dither payload it encodes decodes
with the dithers the server regenerates; NaN is refused on both paths; without Numba
or below the size the torch path runs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedcomp import compiled
from fedcomp.codecs import make_codec, quantize_compiled
from fedcomp.codecs.blocks import block_reduce

needs_numba = pytest.mark.skipif(not compiled.installed(), reason="the compiled path needs numba")


def _both_paths(codec, x: torch.Tensor, seed: int, monkeypatch: pytest.MonkeyPatch):
    """The codec's payload bytes on the torch path, then on the compiled one."""
    out = []
    for minimum in (1 << 62, 0):
        monkeypatch.setattr(quantize_compiled, "MIN_COMPILED", minimum)
        out.append(bytes(codec.encode(x, seed=seed)))
    return out


@needs_numba
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("block", [7, 256, 5000])
@pytest.mark.parametrize("name", ["uniform", "dither"])
def test_compiled_uniform_payloads_equal_the_torch_paths_byte_for_byte(
    name: str, bits: int, block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More coordinates than one kernel chunk (the dithers continue across chunks) and
    a length that is not a multiple of 8 (the last group packs zeros), on heavy-tailed
    values spread over decades (zero blocks included)."""
    n = quantize_compiled.CHUNK + 3 * 4096 + 5
    gen = np.random.default_rng(bits * block)
    x = torch.from_numpy((gen.standard_t(3, n) * np.geomspace(1e-3, 1e3, n)).astype(np.float32))
    x[100:400] = 0.0  # whole zero blocks (block 7 and 256): code levels / 2, scale 0
    x[600:800] = -0.0  # and of negative zeros (their scale is +0.0 on both paths)
    codec = make_codec(name, bits=bits, block=block)
    torch_bytes, compiled_bytes = _both_paths(codec, x, 11, monkeypatch)
    assert compiled_bytes == torch_bytes


@needs_numba
@pytest.mark.parametrize("levels", [1, 3, 16, 127])
@pytest.mark.parametrize("block", [7, 1024])
def test_compiled_qsgd_payloads_equal_the_torch_paths_byte_for_byte(
    levels: int, block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = quantize_compiled.CHUNK + 4096 + 3
    gen = np.random.default_rng(levels + block)
    x = torch.from_numpy((gen.standard_t(3, n) * np.geomspace(1e-3, 1e3, n)).astype(np.float32))
    x[:2048] = 0.0  # zero blocks: norm 0, code levels
    torch_bytes, compiled_bytes = _both_paths(
        make_codec("qsgd", levels=levels, block=block), x, 5, monkeypatch
    )
    assert compiled_bytes == torch_bytes


@needs_numba
def test_compiled_block_maxima_are_exact() -> None:
    x = torch.randn(70_001) * 10
    x[5] = -1e30
    for block in (1, 7, 256, 70_001, 100_000):
        got = quantize_compiled.block_amax(x.numpy(), block)
        assert np.array_equal(got, block_reduce(x, block, "amax").numpy())


@needs_numba
@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize(
    "spec", [{"name": "uniform", "bits": 2}, {"name": "dither", "bits": 2}, {"name": "qsgd"}]
)
def test_the_compiled_encoder_refuses_nan_and_inf(
    spec: dict, bad: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(quantize_compiled, "MIN_COMPILED", 0)
    x = torch.randn(10_000)
    x[7777] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        make_codec(**spec).encode(x, seed=1)


@needs_numba
def test_a_compiled_dither_payload_has_the_uniform_error_of_one_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server subtracts the dithers it regenerates from the seed: with the encoder's
    own draws the error of each coordinate is uniform on one step, so its mean square
    is step^2 / 12 (a misaligned draw would make it step^2 / 6)."""
    monkeypatch.setattr(quantize_compiled, "MIN_COMPILED", 0)
    n, block, bits = 200_000, 256, 2
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    codec = make_codec("dither", bits=bits, block=block)
    err = (codec.decode(codec.encode(x, seed=9)) - x).double()
    step = (2 * block_reduce(x, block, "amax") / (2**bits - 1)).double()
    ratio = err.view(-1, 1)[: n - n % block].view(-1, block) ** 2 / step[: n // block, None] ** 2
    mean = float(ratio.mean())
    # the mean of n uniform squares: 1/12, standard deviation 1/sqrt(180 n)
    assert abs(mean - 1 / 12) < 6 / math.sqrt(180 * n), mean


def test_without_numba_or_below_the_size_the_torch_path_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert not quantize_compiled.available(quantize_compiled.MIN_COMPILED - 1)
    monkeypatch.setitem(compiled._STATE, "numba", None)  # as without the fast extra
    assert not quantize_compiled.available(1 << 24)

    def unexpected(*args, **kwargs):
        raise AssertionError("the compiled path ran")

    monkeypatch.setattr(quantize_compiled, "dither_pack", unexpected)
    monkeypatch.setattr(quantize_compiled, "block_amax", unexpected)
    make_codec("qsgd").encode(torch.randn(1 << 16), seed=1)
    x = torch.randn(1 << 16)
    codec = make_codec("uniform", bits=4)
    assert float((codec.decode(codec.encode(x, seed=1)) - x).abs().max()) <= float(
        2 * x.abs().max() / 15
    )


_FIRST_CALL = """
import torch
torch.set_num_threads(1)
from fedcomp import compiled
from fedcomp.codecs import make_codec, quantize_compiled, rotation_compiled
quantize_compiled.MIN_COMPILED = rotation_compiled.MIN_COMPILED = 0
make_codec({spec}).encode(torch.randn(5000), seed=1)
assert torch.get_num_threads() == 1, torch.get_num_threads()
print(compiled.numba_module().threading_layer())
"""


@needs_numba
@pytest.mark.parametrize("spec", ["'uniform', bits=2", "'eden', bits=2", "'qsgd'"])
def test_the_first_compiled_call_starts_numbas_own_thread_pool(spec: str) -> None:
    """Whichever compiled kernel a process runs first, Numba's threads are its
    workqueue pool: its OpenMP layer would share libgomp with torch and reset torch's
    thread count. (A fresh process each: the layer is fixed at the first launch. The
    uniform encoder once entered its parallel region before compiling, and got OpenMP.)"""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _FIRST_CALL.format(spec=spec)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert out.stdout.strip() == "workqueue", out.stderr


_SIGNATURES = """
import torch
from fedcomp.codecs import decode_bytes, make_codec, quantize_compiled, rotation_compiled
quantize_compiled.MIN_COMPILED = rotation_compiled.MIN_COMPILED = 0
modules = (quantize_compiled, rotation_compiled)
before = {(m.__name__, k): len(f.signatures) for m in modules for k, f in m._kernels().items()}
assert all(before.values()), before  # compiled (or loaded) by _kernels() itself
specs = [
    dict(name="eden", bits=1), dict(name="eden", bits=3, scale="mse", rotations=1),
    dict(name="rotate", inner="qsgd", levels=3), dict(name="uniform", bits=8),
    dict(name="dither", bits=2), dict(name="qsgd"),
]
for spec in specs:
    codec = make_codec(**spec)
    buf = bytes(codec.encode(torch.randn(3000), seed=1))
    decode_bytes(buf)
    codec.decode(codec.encode(torch.randn(3000), seed=2))
after = {(m.__name__, k): len(f.signatures) for m in modules for k, f in m._kernels().items()}
assert after == before, (before, after)
print("ok")
"""


@needs_numba
def test_the_kernels_are_compiled_before_first_use_with_every_signature_used() -> None:
    """Numba compiles at a kernel's first call with given argument types. _kernels()
    runs each kernel once with the types the encoders and decoders pass (read-only
    signs and payload codes included), so no compilation happens later: not inside a
    parallel region, not under a memory cap, not past the address-space check. In a
    fresh process, so that no earlier test compiled a signature first."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _SIGNATURES], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_fedcomp_compiled_0_switches_every_compiled_path_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """For deployments that start a ClientApp process per message, where the 0.4 s of
    loading Numba outweighs what it saves; a value other than 0 or 1 is refused,
    naming the variable and what is allowed."""
    from fedcomp.codecs import rotation_compiled
    from fedcomp.onebit import OneBitCode, decode_compiled

    qs = OneBitCode(bits=1, lam=100.0).query_set(np.ones(1), 10)
    monkeypatch.setenv("FEDCOMP_COMPILED", "1")
    on = compiled.installed()
    assert quantize_compiled.available(1 << 24) == on == rotation_compiled.available(1 << 24)
    assert decode_compiled.available(qs) == on
    monkeypatch.setenv("FEDCOMP_COMPILED", "0")
    assert not compiled.installed()
    assert not quantize_compiled.available(1 << 24)
    assert not rotation_compiled.available(1 << 24)
    assert not decode_compiled.available(qs)
    monkeypatch.setenv("FEDCOMP_COMPILED", "yes")
    with pytest.raises(ValueError, match=r"FEDCOMP_COMPILED='yes'.*0 .*1"):
        compiled.installed()
