"""Distributed mean estimation at equal bits: the one-bit code against the baselines.

    python -m experiments.bench_dme [--dim 256] [--reps 3] [--out FILE.md] [--quick]

No Flower: n clients hold ``x_ik = mu_k + tau * t_df`` (mu_k uniform in [-lambda,
lambda], tau = 1); each method sends about b bits per coordinate per client, and the
server estimates the mean. For every (n, b, df, lambda / tau) the table gives the MSE
of the estimate against the exact mean of the clients' values (units of tau^2), split
into bias^2 and variance over ``reps`` independent public draws on the same data, and
the bits per coordinate each method really put on the wire (``8 * len(payload) /
numel``, scales included, the fixed per-message header excluded).

Methods:
- ``onebit``: fedcomp.onebit.OneBitCode, center inband (and, on a subset, previous,
  zero and the stochastic refinement); tau known (the scale of the noise).
- ``dither``: uniform with subtractive dither on the fixed range [-R, R],
  R = lambda + 8 tau (the dither is public, the server subtracts it): the strongest
  baseline; error variance Delta^2 / 12 with Delta = 2R / (2^b - 1); values beyond R clip.
- ``uniform``: stochastic (unbiased) rounding on the same fixed range, private dither.
- ``qsgd``: fedcomp's QSGD, 2^(b-1) - 1 levels, one L2 norm per client (b >= 2).
- ``sign``: fedcomp's scaled signSGD (one bit + one mean |x| per client).
- ``eden``: fedcomp's EDEN (two randomized Hadamard rotations, b <= 4 bits, unbiased
  scale): error proportional to each client's ||x||^2, whatever its distribution.
- ``fp32``: the reference.

Then the speed figures the issue sets (encode of 1M coordinates at b = 1 under 1 s per
client; decode of 100 clients x 1M x 1 bit under 10 s), with a memory-bound baseline
measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from experiments.runtime import emit
from fedcomp.codecs import decode_bytes, make_codec
from fedcomp.codecs.wire import HEADER_FIXED_BYTES
from fedcomp.onebit import OneBitCode, decode_compiled
from fedcomp.onebit import code as onebit_code
from fedcomp.onebit.choice import prefer_onebit
from fedcomp.onebit.decode_runs import decode_runs

#: Per-message bytes that do not grow with the tensor (a 1-d tensor's wire header, and
#: the one-bit body's fixed fields) are left out of bits/coord: at d = 256 they would
#: dominate, in a real model they are noise. Scales and scale codes are counted.
FIXED_HEADER = HEADER_FIXED_BYTES + 4
ONEBIT_PREAMBLE = 20
NS = (16, 100, 1000)
BITS = (1, 2, 4, 8)
DFS = (1.5, 2.5, 4.0)
LAMS = (1.0, 100.0, 1e4)
#: The subset on which every one-bit variant runs (the full grid runs inband only).
VARIANT_GRID = {"n": (100, 1000), "bits": (1, 2), "df": (2.5, 4.0), "lam": (100.0,)}
VARIANTS = (
    ("onebit/inband", {"center": "inband"}),
    ("onebit/previous", {"center": "previous"}),
    ("onebit/zero", {"center": "zero"}),
    ("onebit/inband/stochastic", {"center": "inband", "refine": "stochastic"}),
)


def make_data(
    n: int, d: int, df: float, lam: float, seed: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    mu = rng.uniform(-lam, lam, d)
    x = (mu + rng.standard_t(df, (n, d))).astype(np.float32)
    return x, mu


# --------------------------------------------------------------------------- baselines
def _pack_codes(codes: np.ndarray, bits: int) -> bytes:
    """Pack integer codes with ``bits`` bits each (the payload whose length we count)."""
    planes = (codes[:, None] >> np.arange(bits)) & 1
    return np.packbits(planes.astype(np.uint8).reshape(-1), bitorder="little").tobytes()


def _unpack_codes(buf: bytes, d: int, bits: int) -> np.ndarray:
    planes = np.unpackbits(np.frombuffer(buf, np.uint8), bitorder="little")[: d * bits]
    return (planes.reshape(d, bits).astype(np.int64) << np.arange(bits)).sum(axis=1)


def fixed_range(x: np.ndarray, bits: int, lam: float, rep: int, dithered: bool):
    """Fixed-range b-bit quantizer; returns (mean estimate, bits per coordinate)."""
    n, d = x.shape
    top = lam + 8.0
    levels = 2**bits - 1
    step = 2 * top / levels
    total = np.zeros(d)
    sent = 0
    for i in range(n):
        rng = np.random.default_rng([rep, i, 17])  # public for "dither", private otherwise
        t = (np.clip(x[i].astype(np.float64), -top, top) + top) / step
        if dithered:
            shift = rng.uniform(-0.5, 0.5, d)
            codes = np.clip(np.rint(t + shift), 0, levels).astype(np.int64)
        else:
            codes = np.clip(np.floor(t + rng.uniform(0, 1, d)), 0, levels).astype(np.int64)
        payload = _pack_codes(codes, bits)
        sent += len(payload)
        value = _unpack_codes(payload, d, bits) * step - top
        if dithered:
            value = value - shift * step
        total += value
    return total / n, 8 * sent / (n * d)


def fedcomp_codec(x: np.ndarray, spec: dict, rep: int):
    codec = make_codec(**spec)
    n, d = x.shape
    total = np.zeros(d)
    sent = 0
    for i in range(n):
        payload = bytes(codec.encode(torch.from_numpy(x[i]), seed=rep * 100_003 + i))
        sent += len(payload) - FIXED_HEADER
        total += decode_bytes(payload).double().numpy()
    return total / n, 8 * sent / (n * d)


def onebit(x: np.ndarray, bits: int, lam: float, rep: int, mu: np.ndarray, **params):
    n, d = x.shape
    code = OneBitCode(bits=bits, lam=lam, block=d, **params)
    seed = 7919 * rep + 13
    rng = np.random.default_rng([rep, 99])
    # Side information: "last round's aggregate", off by about tau.
    side = mu + rng.standard_normal(d)
    data = x - side.astype(np.float32) if code.center == "zero" else x
    payloads = [
        bytes(
            code.encode(
                torch.from_numpy(data[i]), client_index=i, num_clients=n, seed=seed, tau=1.0
            )
        )
        for i in range(n)
    ]
    est, result = code.decode(
        payloads,
        client_indices=list(range(n)),
        num_clients=n,
        seed=seed,
        tau=1.0,
        shape=(d,),
        side_center=side if code.center == "previous" else None,
    )
    est = est.double().numpy() + (side if code.center == "zero" else 0.0)
    center_error = np.abs(result.center - np.median(x, axis=0)) if code.center == "inband" else None
    sent = sum(len(p) - FIXED_HEADER - ONEBIT_PREAMBLE for p in payloads)
    return est, 8 * sent / (n * d), center_error


# --------------------------------------------------------------------------- grid
def methods_for(n: int, bits: int, df: float, lam: float) -> list[tuple[str, dict]]:
    out = [("onebit/inband", {"center": "inband"})]
    if (
        n in VARIANT_GRID["n"]
        and bits in VARIANT_GRID["bits"]
        and df in VARIANT_GRID["df"]
        and lam in VARIANT_GRID["lam"]
    ):
        out = list(VARIANTS)
    out += [("dither", {}), ("uniform", {})]
    if bits <= 4:
        out.append(("eden", {}))
    if bits >= 2:
        out.append(("qsgd", {}))
    if bits == 1:
        out += [("sign", {}), ("fp32", {})]
    return out


def run_method(name: str, params: dict, x, mu, bits, lam, rep):
    if name.startswith("onebit"):
        return onebit(x, bits, lam, rep, mu, **params)
    if name in ("dither", "uniform"):
        return (*fixed_range(x, bits, lam, rep, dithered=name == "dither"), None)
    if name == "qsgd":
        levels = 2 ** (bits - 1) - 1
        spec = {"name": "qsgd", "levels": levels, "block": x.shape[1]}
        return (*fedcomp_codec(x, spec, rep), None)
    if name == "sign":
        return (*fedcomp_codec(x, {"name": "sign", "block": x.shape[1]}, rep), None)
    if name == "eden":  # two rotations, unbiased scale, one rotation block per client
        block = 1 << max(8, (x.shape[1] - 1).bit_length())
        spec = {"name": "eden", "bits": bits, "block": min(block, 1 << 20)}
        return (*fedcomp_codec(x, spec, rep), None)
    return (*fedcomp_codec(x, {"name": "fp32"}, rep), None)


def bench_grid(dim: int, reps: int, ns, bits_list, dfs, lams) -> list[dict]:
    rows = []
    for n, bits, df, lam in itertools.product(ns, bits_list, dfs, lams):
        x, mu = make_data(n, dim, df, lam, seed=[n, int(10 * df), int(lam)])
        exact = x.astype(np.float64).mean(axis=0)
        for name, params in methods_for(n, bits, df, lam):
            estimates, sent, center_errors = [], 0.0, []
            t0 = time.perf_counter()
            for rep in range(reps):
                est, bpc, cerr = run_method(name, params, x, mu, bits, lam, rep)
                estimates.append(est)
                sent = bpc
                if cerr is not None:
                    center_errors.append(cerr)
            est = np.stack(estimates)
            variance = float(est.var(axis=0, ddof=1).mean()) if reps > 1 else float("nan")
            mse = float(((est - exact) ** 2).mean())
            bias2 = float(((est.mean(axis=0) - exact) ** 2).mean())
            if reps > 1:
                bias2 = max(0.0, bias2 - variance / reps)  # remove the Monte Carlo part
            row = {
                "n": n,
                "bits": bits,
                "df": df,
                "lam": lam,
                "method": name,
                "mse": mse,
                "bias2": bias2,
                "variance": variance,
                "bpc": sent,
                "seconds": (time.perf_counter() - t0) / reps,
            }
            if center_errors:
                row["center_p99"] = float(np.quantile(np.concatenate(center_errors), 0.99))
                row["center_within_2"] = float(np.mean(np.concatenate(center_errors) <= 2.0))
            rows.append(row)
            print(
                f"n={n:5d} b={bits} df={df} lam={lam:g} {name:26s} mse={mse:11.4g} "
                f"bits/coord={sent:.3f}",
                flush=True,
            )
    return rows


# --------------------------------------------------------------------------- speed
@contextlib.contextmanager
def _numpy_decoder():
    """The one-group decoder swapped for the NumPy run-sum one (the fallback without
    Numba), for timing it side by side."""
    chosen = onebit_code.decode_one_group
    onebit_code.decode_one_group = decode_runs
    try:
        yield
    finally:
        onebit_code.decode_one_group = chosen


def bench_speed(dim: int, clients: int) -> dict:
    rng = np.random.default_rng(0)
    code = OneBitCode(bits=1, lam=100.0)
    x = torch.from_numpy(rng.standard_t(4, dim).astype(np.float32))
    t0 = time.perf_counter()
    code.encode(x, client_index=0, num_clients=clients, seed=1, tau=1.0)
    encode_s = time.perf_counter() - t0
    payloads = [
        bytes(
            code.encode(
                torch.from_numpy(rng.standard_t(4, dim).astype(np.float32)),
                client_index=i,
                num_clients=clients,
                seed=1,
                tau=1.0,
            )
        )
        for i in range(clients)
    ]
    kwargs = {"client_indices": list(range(clients)), "num_clients": clients, "seed": 1}
    compiled = decode_compiled.available(code.query_set(np.ones(1), clients))
    decoder = "compiled" if compiled else "numpy"
    t0 = time.perf_counter()
    code.decode_mean(payloads[:2], **{**kwargs, "client_indices": [0, 1]}, tau=1.0)
    first_call_s = time.perf_counter() - t0  # loading (or compiling) the compiled code
    decode_times, cpu_times, numpy_times = [], [], []
    for _ in range(3):  # the median of three
        t0, c0 = time.perf_counter(), time.process_time()
        code.decode_mean(payloads, **kwargs, tau=1.0)
        decode_times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    with _numpy_decoder():  # the NumPy run-sum decoder on the same replies, once
        t0 = time.perf_counter()
        code.decode_mean(payloads, **kwargs, tau=1.0)
        numpy_times.append(time.perf_counter() - t0)
    decode_s, decode_cpu = float(np.median(decode_times)), float(np.median(cpu_times))
    dense = torch.from_numpy(rng.standard_normal((clients, dim)).astype(np.float32))
    times = []
    for _ in range(5):  # the median of five: one call of 25 ms is at the mercy of the OS
        t0 = time.perf_counter()
        dense.mean(dim=0)
        times.append(time.perf_counter() - t0)
    dense_s = float(np.median(times))
    return {
        "dim": dim,
        "clients": clients,
        "encode_s": encode_s,
        "decode_s": decode_s,
        "decode_cpu_s": decode_cpu,
        "decoder": decoder,
        "first_call_s": first_call_s,
        "numpy_decode_s": numpy_times[0],
        "dense_mean_s": dense_s,
        "load": os.getloadavg()[0],
    }


# --------------------------------------------------------------------------- report
def _best_baseline(rows, key):
    cands = [
        r
        for r in rows
        if (r["n"], r["bits"], r["df"], r["lam"]) == key
        and not r["method"].startswith("onebit")
        and r["method"] != "fp32"
    ]
    return min(cands, key=lambda r: r["mse"]) if cands else None


def _find(rows, n, bits, df, lam, method):
    for r in rows:
        if (r["n"], r["bits"], r["df"], r["lam"], r["method"]) == (n, bits, df, lam, method):
            return r
    return None


def targets(rows) -> list[str]:
    out = []
    for (n, bits, df, lam), need, absolute in (
        ((1000, 1, 4.0, 100.0), 10.0, 0.25),
        ((1000, 1, 2.5, 1e4), 1000.0, None),
    ):
        ob = _find(rows, n, bits, df, lam, "onebit/inband")
        best = _best_baseline(rows, (n, bits, df, lam))
        if ob is None or best is None:
            continue
        ratio = best["mse"] / ob["mse"]
        ok = ratio >= need and (absolute is None or ob["mse"] <= absolute)
        cond = f"MSE <= {absolute} and " if absolute else ""
        out.append(
            f"- df {df:g}, lambda = {lam:g} tau, n = {n}, b = {bits}: one-bit MSE "
            f"{ob['mse']:.3g} tau^2, best baseline ({best['method']}) {best['mse']:.3g}: "
            f"{ratio:.3g}x lower (target: {cond}>= {need:g}x) -> {'MET' if ok else 'MISSED'}"
        )
    centers = [r for r in rows if r["n"] == 1000 and "center_within_2" in r]
    if centers:
        worst = min(centers, key=lambda r: r["center_within_2"])
        share = worst["center_within_2"]
        out.append(
            f"- center within 2 tau of the median, n = 1000, all (b, df, lambda): worst "
            f"{100 * share:.2f}% of coordinates (b = {worst['bits']}, df {worst['df']:g}, "
            f"lambda {worst['lam']:g}; target >= 99%) -> {'MET' if share >= 0.99 else 'MISSED'}"
        )
    return out


def crossover(rows) -> list[str]:
    """Where one-bit (inband) beats the best baseline, against the crossover rule
    (fedcomp.onebit.choice.prefer_onebit)."""
    lines = [
        "| n | b | df | lambda/tau | one-bit MSE | best baseline | its MSE | ratio | rule picks |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    agree = total = 0
    for r in rows:
        if r["method"] != "onebit/inband":
            continue
        best = _best_baseline(rows, (r["n"], r["bits"], r["df"], r["lam"]))
        rule = prefer_onebit(r["lam"], r["bits"], r["n"], r["df"])
        agree += rule == (best["mse"] > r["mse"])
        total += 1
        lines.append(
            f"| {r['n']} | {r['bits']} | {r['df']:g} | {r['lam']:g} | {r['mse']:.3g} | "
            f"{best['method']} | {best['mse']:.3g} | {best['mse'] / r['mse']:.3g} | "
            f"{'one-bit' if rule else 'baseline'} |"
        )
    lines.append("")
    lines.append(
        f"fedcomp.onebit.prefer_onebit (the crossover rule with this benchmark's V(df) and "
        f"n b >= 240 for the in-band center) picks the measured winner in {agree} of "
        f"{total} cells."
    )
    return lines


def markdown(rows, speed, dim, reps, elapsed) -> str:
    lines = [
        "# Distributed mean estimation at equal bits (`make bench-dme`)",
        "",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads; "
        f"d = {dim} coordinates, {reps} public draws per cell, {elapsed:.0f} s in all.",
        "MSE of the mean in units of tau^2 (bias^2 + variance over the draws); bits/coord "
        "measured from the payloads: scales and scale codes included, the fixed "
        "per-message header (16 + 4 bytes, and one-bit's 20-byte preamble) excluded.",
        "",
        "## Targets (docs/onebit.md; benchmark, not test)",
        "",
        *targets(rows),
        "",
        "## Speed",
        "",
        f"- encode of {speed['dim']:,} coordinates at b = 1: {speed['encode_s']:.3f} s "
        f"(target < 1 s) -> {'MET' if speed['encode_s'] < 1 else 'MISSED'}",
        f"- decode of {speed['clients']} clients x {speed['dim']:,} x 1 bit ({speed['decoder']}"
        f" decoder, median of 3): {speed['decode_s']:.3f} s wall, {speed['decode_cpu_s']:.2f} s"
        f" CPU (load average {speed['load']:.1f} on this 2-core machine while it ran);"
        f" dense float32 mean of the same shape in this run: {speed['dense_mean_s']:.4f} s;"
        f" ratio {speed['decode_s'] / speed['dense_mean_s']:.1f}x (target <= 20x) -> "
        f"{'MET' if speed['decode_s'] <= 20 * speed['dense_mean_s'] else 'MISSED'}",
        f"- the NumPy run-sum decoder (without the fast extra) on the same replies: "
        f"{speed['numpy_decode_s']:.2f} s "
        f"({speed['numpy_decode_s'] / speed['dense_mean_s']:.0f}x the dense mean); the "
        f"process's first decode loads the compiled code from Numba's cache: "
        f"{speed['first_call_s']:.2f} s (compiling it, the first time after installing, "
        "takes longer)",
        "",
        "## Where one-bit wins (inband center vs the best baseline at the same b)",
        "",
        *crossover(rows),
        "",
        "## Every cell",
        "",
        "| n | b | df | lambda/tau | method | MSE | bias^2 | variance | bits/coord | center p99 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        center = f"{r['center_p99']:.2f}" if "center_p99" in r else ""
        lines.append(
            f"| {r['n']} | {r['bits']} | {r['df']:g} | {r['lam']:g} | {r['method']} | "
            f"{r['mse']:.4g} | {r['bias2']:.3g} | {r['variance']:.3g} | {r['bpc']:.3f} |"
            f" {center} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one-bit distributed mean estimation")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--speed-dim", type=int, default=1 << 20)
    parser.add_argument("--speed-clients", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="a small grid (smoke test)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    # Speed first: its first decode is then the process's first, which loads the
    # compiled decoder.
    speed = bench_speed(args.speed_dim, args.speed_clients)
    if args.quick:
        rows = bench_grid(args.dim, args.reps, (100,), (1, 2), (4.0,), (100.0,))
    else:
        rows = bench_grid(args.dim, args.reps, NS, BITS, DFS, LAMS)
    text = markdown(rows, speed, args.dim, args.reps, time.perf_counter() - t0)
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
