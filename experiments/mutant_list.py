"""The deliberate bugs of ``make mutants`` (experiments/mutants.py), as data.

Each replaces one exact snippet of a protocol core with a plausible bug written from the
definition it breaks (a dropped term, a factor, an off-by-one at a boundary, a swapped
weight); the tests named must fail. A mutant that survives is a missing invariant.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTANTS = (
    Mutant(
        "sign-scaled-by-max",
        "scaled sign uses max|x| per block instead of mean|x|",
        "fedcomp/codecs/quantizers.py",
        'block_reduce(flat, self.block, "abssum") / block_counts(x.numel(), self.block)',
        'block_reduce(flat, self.block, "amax")',
        ("tests/test_codecs.py",),
    ),
    Mutant(
        "bf16-truncation",
        "bf16 truncates toward zero instead of rounding to nearest",
        "fedcomp/codecs/dense.py",
        "        cast = x.detach().to(self.wire_dtype)\n",
        "        cast = x.detach().to(self.wire_dtype)\n"
        "        if self.wire_dtype == torch.bfloat16:\n"
        "            bits = x.detach().float().contiguous().view(torch.int32) & -65536\n"
        "            cast = bits.view(torch.float32).to(torch.bfloat16)\n",
        ("tests/test_codecs.py",),
    ),
    Mutant(
        "onebit-forgets-center",
        "the one-bit decoder drops the coarse center from the estimate",
        "fedcomp/onebit/decode.py",
        "mean[first : first + count] = center + _median_of_means(est, group_weight)",
        "mean[first : first + count] = _median_of_means(est, group_weight)",
        ("tests/test_onebit.py",),
    ),
    Mutant(
        "tree-drops-a-leaf",
        "a reduction tree treats leaf 0 as zero",
        "fedcomp/trees/reduce.py",
        "            return cast[node], False",
        "            return (torch.zeros_like(cast[node]) if node == 0 else cast[node]), False",
        ("tests/test_trees.py", "tests/test_tree_aggregation.py"),
    ),
    Mutant(
        "traffic-misses-evaluate",
        "evaluate instructions are not counted",
        "fedcomp/flower/accounting.py",
        "    wire = wire_bytes(msg)\n",
        "    wire = wire_bytes(msg)\n"
        "    if kind == Kind.EVALUATE_INSTRUCTION:\n"
        "        return wire\n",
        ("tests/test_traffic.py",),
    ),
    Mutant(
        "downlink-unscaled-feedback",
        "downlink error feedback adds decode(p) unscaled (diverges for noisy codecs)",
        "fedcomp/downlink.py",
        "return max(float(d @ q) / qq, 0.0) if qq > 0 else 1.0",
        "return 1.0",
        ("tests/test_downlink.py",),
    ),
    Mutant(
        "replica-skips-checksum",
        "a client trains on a replica whose checksum differs from the server's",
        "fedcomp/downlink.py",
        "        if got != digest:\n            raise ReplicaError(",
        "        if False:\n            raise ReplicaError(",
        ("tests/test_downlink.py",),
    ),
    # --- residual control variates (tests/test_protocol_maths.py) --------------------
    Mutant(
        "residual-ghat-scaled-by-alpha",
        "the server reconstructs h + alpha * decode(q) instead of h + decode(q)",
        "fedcomp/controlvariates.py",
        "            ghat[name] = (h + r_hat.astype(np.float32, copy=False)).astype(np.float32)",
        "            ghat[name] = (h + np.float32(self.memory.alpha_for(h.size))"
        " * r_hat.astype(np.float32, copy=False)).astype(np.float32)",
        ("tests/test_protocol_maths.py",),
    ),
    Mutant(
        "residual-ghat-drops-h",
        "the server reconstructs decode(q) alone, forgetting the control variate",
        "fedcomp/controlvariates.py",
        "            ghat[name] = (h + r_hat.astype(np.float32, copy=False)).astype(np.float32)",
        "            ghat[name] = r_hat.astype(np.float32)",
        ("tests/test_protocol_maths.py",),
    ),
    Mutant(
        "residual-alpha-without-one",
        "alpha = 1 / omega instead of 1 / (1 + omega)",
        "fedcomp/codecs/residual.py",
        "        return 1.0 / (1.0 + float(self.inner.variance_factor(numel)))",
        "        return 1.0 / float(self.inner.variance_factor(numel))",
        ("tests/test_protocol_maths.py",),
    ),
    Mutant(
        "residual-mirror-step-one",
        "the server's mirror moves by the whole decoded residual (alpha = 1)",
        "fedcomp/controlvariates.py",
        "            updated[name] = apply_residual(h, r_hat, self.memory.alpha_for(h.size))",
        "            updated[name] = apply_residual(h, r_hat, 1.0)",
        ("tests/test_protocol_maths.py",),
    ),
    Mutant(
        "handoff-unweighted",
        "the per-client hand-off tells the inner strategy every client had one example",
        "fedcomp/flower/handoff.py",
        "                        RECORD_METRICS: client_metrics(d),",
        "                        RECORD_METRICS: MetricRecord("
        "{**client_metrics(d), KEY_NUM_EXAMPLES: 1}),",
        ("tests/test_protocol_maths.py",),
    ),
    # --- one-bit joint code --------------------------------------------------------
    Mutant(
        "onebit-side-center-zero",
        "the one-bit decoder ignores the previous aggregate as side center",
        "fedcomp/flower/families/joint.py",
        "            side_center=state.center_for(name, reference.size),",
        "            side_center=np.zeros(reference.size),",
        ("tests/test_protocol_maths.py",),
    ),
    Mutant(
        "onebit-tau-mean",
        "tau follows the mean of the clients' scale codes instead of their median",
        "fedcomp/onebit/code.py",
        "        spread = np.median(scale_value(np.stack(rows)), axis=0)",
        "        spread = np.mean(scale_value(np.stack(rows)), axis=0)",
        ("tests/test_protocol_maths.py",),
    ),
    Mutant(
        "onebit-tau-unclipped",
        "tau may jump by any factor between rounds",
        "fedcomp/onebit/code.py",
        "        return np.clip(new, prev / MAX_TAU_STEP, prev * MAX_TAU_STEP)",
        "        return new",
        ("tests/test_protocol_maths.py",),
    ),
    # --- reduction-tree statistics and schedules -------------------------------------
    Mutant(
        "tree-ema-swapped",
        "the moving mean weighs the new round by the decay instead of 1 - decay",
        "fedcomp/trees/aggregate.py",
        "            self.mean[key] = decay * self.mean[key] + (1 - decay) * m",
        "            self.mean[key] = (1 - decay) * self.mean[key] + decay * m",
        ("tests/test_protocol_maths.py",),
    ),
    Mutant(
        "tree-second-moment-of-mean",
        "the moving second moment averages m^2 instead of the round's second moment",
        "fedcomp/trees/aggregate.py",
        "            self.second[key] = decay * self.second[key] + (1 - decay) * q",
        "            self.second[key] = decay * self.second[key] + (1 - decay) * m * m",
        ("tests/test_protocol_maths.py",),
    ),
    Mutant(
        "tree-ema-off",
        "stats=ema keeps only the current round",
        "fedcomp/trees/aggregate.py",
        '    decay = config.ema_decay if config.stats == "ema" else 0.0',
        "    decay = 0.0",
        ("tests/test_protocol_maths.py",),
    ),
    Mutant(
        "tree-refresh-off-by-one",
        "trees are refreshed on rounds R, 2R, ... instead of 1, R + 1, ...",
        "fedcomp/trees/aggregate.py",
        '    return config.stats == "current" or (server_round - 1) % config.refresh_rounds == 0',
        '    return config.stats == "current" or server_round % config.refresh_rounds == 0',
        ("tests/test_protocol_maths.py",),
    ),
    Mutant(
        "tree-cache-by-count",
        "a cached tree is reused for another set of clients of the same size",
        "fedcomp/trees/aggregate.py",
        "    if not refresh and cached is not None and cached[0] == key_ids:",
        "    if not refresh and cached is not None and len(cached[0]) == len(key_ids):",
        ("tests/test_protocol_maths.py",),
    ),
    # --- downlink replica versions -----------------------------------------------------
    Mutant(
        "downlink-history-drops-newest",
        "the broadcast history evicts its newest step instead of its oldest",
        "fedcomp/downlink.py",
        "            self.history.popleft()",
        "            self.history.pop()",
        ("tests/test_protocol_maths.py",),
    ),
    Mutant(
        "downlink-steps-by-target",
        "a lagging client is sent the steps whose target, not source, it has reached",
        "fedcomp/downlink.py",
        "        steps = [s for s in self.history if s.source >= have]",
        "        steps = [s for s in self.history if s.target >= have]",
        ("tests/test_protocol_maths.py",),
    ),
    Mutant(
        "downlink-confirm-by-source",
        "a client's confirmed version is checked against the steps' source checksums",
        "fedcomp/downlink.py",
        "**{s.target: s.checksum for s in self.history}}",
        "**{s.source: s.checksum for s in self.history}}",
        ("tests/test_protocol_maths.py",),
    ),
    Mutant(
        "downlink-history-by-count",
        "the history keeps 8 steps whatever they weigh (not at most one model's bytes)",
        "fedcomp/downlink.py",
        "        while sum(s.nbytes for s in self.history) > self.full_nbytes and self.history:",
        "        while len(self.history) > 8:",
        ("tests/test_protocol_maths.py",),
    ),
    # --- variance factors and decoder bounds (tests/test_codec_factors.py, test_bounds.py) --
    Mutant(
        "uniform-factor-doubled",
        "the uniform codec claims twice its variance factor",
        "fedcomp/codecs/quantizers.py",
        "        return min(self.block, max(numel, 1)) / (2**self.bits - 1) ** 2\n",
        "        return 2 * min(self.block, max(numel, 1)) / (2**self.bits - 1) ** 2\n",
        ("tests/test_codec_factors.py",),
    ),
    Mutant(
        "dither-factor-no-third",
        "subtractive dither claims the plain quantizer's factor (no 1/3)",
        "fedcomp/codecs/quantizers.py",
        "/ (3 * (2**self.bits - 1) ** 2)",
        "/ (2**self.bits - 1) ** 2",
        ("tests/test_codec_factors.py",),
    ),
    Mutant(
        "qsgd-factor-max",
        "QSGD takes the larger of its two bounds",
        "fedcomp/codecs/quantizers.py",
        "return min(d / self.levels**2, math.sqrt(d) / self.levels)",
        "return max(d / self.levels**2, math.sqrt(d) / self.levels)",
        ("tests/test_codec_factors.py",),
    ),
    Mutant(
        "randk-factor-no-minus-one",
        "random-k claims n/k instead of n/k - 1",
        "fedcomp/codecs/sparse.py",
        "return numel / k - 1 if k else 0.0",
        "return numel / k if k else 0.0",
        ("tests/test_codec_factors.py",),
    ),
    Mutant(
        "rotate-factor-unpadded",
        "rotate uses the inner factor of the unpadded length",
        "fedcomp/codecs/rotated.py",
        "return self.inner.variance_factor(padded_length(max(numel, 1), self.rotation_block))",
        "return self.inner.variance_factor(max(numel, 1))",
        ("tests/test_codec_factors.py",),
    ),
    Mutant(
        "wire-ndim-off-by-one",
        "a payload header of 8 dimensions is refused",
        "fedcomp/codecs/wire.py",
        "    if ndim > MAX_NDIM:\n",
        "    if ndim >= MAX_NDIM:\n",
        ("tests/test_bounds.py",),
    ),
    Mutant(
        "wire-numel-off-by-one",
        "a payload may claim one element more than the global tensor",
        "fedcomp/codecs/wire.py",
        "    if numel > max_numel:\n",
        "    if numel > max_numel + 1:\n",
        ("tests/test_bounds.py",),
    ),
    Mutant(
        "topk-index-equal-numel",
        "a top-k index equal to numel is accepted",
        "fedcomp/codecs/sparse.py",
        "        if k and idx[-1] >= n:\n",
        "        if k and idx[-1] > n:\n",
        ("tests/test_bounds.py",),
    ),
    Mutant(
        "topk-k-numel-plus-one",
        "top-k accepts k = numel + 1",
        "fedcomp/codecs/sparse.py",
        'check_range(cls.name, "k", fields[0], 1 if h.numel else 0, h.numel)',
        'check_range(cls.name, "k", fields[0], 1 if h.numel else 0, h.numel + 1)',
        ("tests/test_bounds.py",),
    ),
    Mutant(
        "varint-ten-bytes",
        "a 10-byte varint is accepted",
        "fedcomp/codecs/packing.py",
        "if lengths.size and lengths.max() > 9:",
        "if lengths.size and lengths.max() > 10:",
        ("tests/test_bounds.py",),
    ),
    Mutant(
        "uniform-bits-nine",
        "uniform accepts 9 bits",
        "fedcomp/codecs/quantizers.py",
        'return _read_bits_block(payload, cls.name, "bits", 8)',
        'return _read_bits_block(payload, cls.name, "bits", 9)',
        ("tests/test_bounds.py",),
    ),
    Mutant(
        "qsgd-levels-128",
        "QSGD accepts 128 levels",
        "fedcomp/codecs/quantizers.py",
        'return _read_bits_block(payload, cls.name, "levels", 127)',
        'return _read_bits_block(payload, cls.name, "levels", 128)',
        ("tests/test_bounds.py",),
    ),
    Mutant(
        "lowrank-rank-65",
        "PowerSGD accepts rank 65",
        "fedcomp/codecs/lowrank.py",
        'return {"rank": check_range(cls.name, "rank", rank, 1, MAX_RANK), "mode": mode}',
        'return {"rank": check_range(cls.name, "rank", rank, 1, MAX_RANK + 1), "mode": mode}',
        ("tests/test_bounds.py",),
    ),
    Mutant(
        "eden-block-128",
        "EDEN accepts a block of 128",
        "fedcomp/codecs/eden.py",
        'block = check_range(cls.name, "block", block, MIN_BLOCK, MAX_BLOCK)',
        'block = check_range(cls.name, "block", block, MIN_BLOCK // 2, MAX_BLOCK)',
        ("tests/test_bounds.py",),
    ),
    Mutant(
        "entropy-size-plus-one",
        "the entropy stage inflates one byte beyond its bound",
        "fedcomp/codecs/entropy.py",
        "size, 1, max_inner_size(h.numel, len(h.shape)))",
        "size, 1, max_inner_size(h.numel, len(h.shape)) + 1)",
        ("tests/test_bounds.py",),
    ),
    Mutant(
        "expect-length-allows-long",
        "a body longer than its parameters imply is accepted",
        "fedcomp/codecs/blocks.py",
        "    if len(body) != expected:\n",
        "    if len(body) < expected:\n",
        ("tests/test_bounds.py",),
    ),
    Mutant(
        "raw-body-long",
        "a raw body longer than numel x itemsize is accepted",
        "fedcomp/codecs/dense.py",
        "    if len(body) != numel * itemsize:\n",
        "    if len(body) < numel * itemsize:\n",
        ("tests/test_bounds.py",),
    ),
    Mutant(
        "lowrank-no-orth",
        "PowerSGD normalizes P instead of orthonormalizing it",
        "fedcomp/codecs/lowrank.py",
        '    p, _ = torch.linalg.qr(p, mode="reduced")  # orthonormal columns\n',
        "    p = p / p.norm()\n",
        ("tests/test_codecs.py",),
    ),
    Mutant(
        "qsgd1-scale-15pct",
        "ternary QSGD decodes 15% too large",
        "fedcomp/codecs/quantizers.py",
        "        scale_blocks_(values, block, norms / levels)\n",
        "        scale_blocks_(values, block, norms * (1.15 if levels == 1 else 1.0) / levels)\n",
        ("tests/test_codecs.py",),
    ),
    # --- bounded influence and reply validation (tests/test_bounded_influence.py) --------
    Mutant(
        "influence-upper-median",
        "the reference norm is the upper median (a hostile client among two sets it)",
        "fedcomp/influence.py",
        "    return float(sorted(norms)[(len(norms) - 1) // 2])",
        "    return float(sorted(norms)[len(norms) // 2])",
        ("tests/test_bounded_influence.py",),
    ),
    Mutant(
        "influence-clip-to-twice",
        "clipping scales an update to twice the cap",
        "fedcomp/influence.py",
        "    return [cap / norm if norm > cap > 0 else 1.0 for norm in norms]",
        "    return [2 * cap / norm if norm > 2 * cap > 0 else 1.0 for norm in norms]",
        ("tests/test_bounded_influence.py",),
    ),
    Mutant(
        "weight-bound-open",
        "a reply claiming exactly max_num_examples is rejected (the bound is exclusive)",
        "fedcomp/flower/validation.py",
        "not 0 < weight <= max_weight:",
        "not 0 < weight < max_weight:",
        ("tests/test_bounded_influence.py",),
    ),
    Mutant(
        "train-metrics-unchecked",
        "train metrics are not checked to be finite numbers",
        "fedcomp/flower/validation.py",
        "        if isinstance(value, list) or not math.isfinite(value):",
        "        if False:",
        ("tests/test_bounded_influence.py",),
    ),
    Mutant(
        "learning-check-lenient-loss",
        "a run whose loss ends equal to the initial counts as learning",
        "fedcomp/flower/outcome.py",
        "and loss1 >= loss0:",
        "and loss1 > loss0:",
        ("tests/test_bounded_influence.py",),
    ),
    Mutant(
        "total-weight-unchecked",
        "an infinite total weight is accepted",
        "fedcomp/influence.py",
        "    return bool(np.isfinite(total) and total > 0)",
        "    return bool(total > 0)",
        ("tests/test_bounded_influence.py",),
    ),
)
