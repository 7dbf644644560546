"""Public randomness: seeds depend only on (run seed, path), in any process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fedcomp.rng import derive_seed, numpy_generator, torch_generator


def test_seed_is_deterministic_and_path_sensitive() -> None:
    base = derive_seed(7, 3, 12, "fc.weight")
    assert base == derive_seed(7, 3, 12, "fc.weight")
    variants = {
        derive_seed(8, 3, 12, "fc.weight"),
        derive_seed(7, 4, 12, "fc.weight"),
        derive_seed(7, 3, 13, "fc.weight"),
        derive_seed(7, 3, 12, "fc.bias"),
        derive_seed(7, 3, "12", "fc.weight"),  # ints and strings are tagged apart
        derive_seed(7, 3, 12),
    }
    assert base not in variants and len(variants) == 6
    assert 0 <= base < 2**63


def test_generators_reproduce_draws() -> None:
    assert (numpy_generator(1, "a").random(5) == numpy_generator(1, "a").random(5)).all()
    a = torch_generator(1, "a")
    b = torch_generator(1, "a")
    import torch

    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))


def test_same_seed_in_a_separate_process() -> None:
    code = "from fedcomp.rng import derive_seed; print(derive_seed(5, 2, 9, 'layer.0'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) == derive_seed(5, 2, 9, "layer.0")


def test_bad_seed_inputs() -> None:
    with pytest.raises(ValueError, match="run_seed"):
        derive_seed(-1)
    with pytest.raises(TypeError):
        derive_seed(1, 2.5)  # type: ignore[arg-type]
