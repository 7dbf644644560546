"""Payload mutations for fuzzing (tests/test_fuzz_decoders.py, bench_reliability).

An operation is a tuple: ("truncate", n), ("extend", bytes), ("flip", i, bit),
("u8", i, value) in the fixed header, ("shape", dim, value), ("u32", offset, value) for
a body field (bits, block, levels, k, lengths), ("float", i, value) for a scale.
"""

from __future__ import annotations

import struct

import numpy as np

#: The float values a "float" mutation writes.
FLOATS = (np.nan, np.inf, -np.inf, -1.0, 3.4e38)


def mutate(buf: bytes, op: tuple) -> bytes:
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
    elif kind == "u32":  # a body field (bits, block, levels, k, lengths) overwritten
        if op[1] + 4 <= len(out):
            struct.pack_into("<I", out, op[1], op[2])
    elif kind == "float":
        i = op[1] % max(len(out) - 3, 1)
        out[i : i + 4] = np.array([op[2]], dtype="<f4").tobytes()[: len(out) - i]
    return bytes(out)


def random_ops(rng: np.random.Generator) -> list[tuple]:
    """One to three mutations drawn with ``rng`` (the benchmark's non-hypothesis fuzz)."""
    ops = []
    for _ in range(int(rng.integers(1, 4))):
        kind = str(rng.choice(["truncate", "extend", "flip", "u8", "shape", "u32", "float"]))
        if kind == "truncate":
            ops.append((kind, int(rng.integers(0, 10_000))))
        elif kind == "extend":
            ops.append((kind, rng.bytes(int(rng.integers(1, 65)))))
        elif kind == "flip":
            ops.append((kind, int(rng.integers(0, 10_000)), int(rng.integers(0, 8))))
        elif kind == "u8":
            ops.append((kind, int(rng.integers(0, 16)), int(rng.integers(0, 256))))
        elif kind == "shape":
            ops.append((kind, int(rng.integers(0, 2)), int(rng.integers(0, 2**32))))
        elif kind == "u32":
            ops.append((kind, int(rng.integers(0, 41)), int(rng.integers(0, 2**32))))
        else:
            ops.append((kind, int(rng.integers(0, 10_000)), float(rng.choice(FLOATS))))
    return ops
