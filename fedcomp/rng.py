"""Public randomness: seeds derived from (run seed, round, stable client id, name).

Every random draw in fedcomp comes from a generator seeded here, never from the
clock, global RNG state or Flower's per-run random node ids. The derivation is a
keyed hash, so client and server processes compute the same seed independently.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import torch

_DOMAIN = b"fedcomp.rng.v1"


def derive_seed(run_seed: int, *parts: int | str) -> int:
    """Return a 63-bit seed from the run seed and a path of ints and strings.

    Parameters
    ----------
    run_seed : int
        The run's seed (non-negative).
    *parts : int or str
        The path that names the draw, e.g. ``(round, stable_id, tensor_name)``.
        Ints and strings are tagged, so ``1`` and ``"1"`` give different seeds.

    Returns
    -------
    int
        A seed in ``[0, 2**63)``, usable by numpy and torch generators.
    """
    if run_seed < 0:
        raise ValueError(f"run_seed must be non-negative, got {run_seed!r}")
    h = hashlib.blake2b(digest_size=8, key=_DOMAIN)
    h.update(struct.pack("<Q", run_seed))
    for part in parts:
        if isinstance(part, bool) or not isinstance(part, int | str):
            raise TypeError(f"seed path parts must be int or str, got {part!r}")
        if isinstance(part, int):
            h.update(b"i" + struct.pack("<q", part))
        else:
            data = part.encode("utf-8")
            h.update(b"s" + struct.pack("<I", len(data)) + data)
    return int.from_bytes(h.digest(), "little") >> 1


def numpy_generator(run_seed: int, *parts: int | str) -> np.random.Generator:
    """A counter-based numpy generator (Philox) for the given seed path."""
    return np.random.Generator(np.random.Philox(derive_seed(run_seed, *parts)))


def torch_generator(run_seed: int, *parts: int | str) -> torch.Generator:
    """A CPU torch generator for the given seed path."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(derive_seed(run_seed, *parts))
    return gen
