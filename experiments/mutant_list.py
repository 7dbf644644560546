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
        "fedcomp/flower/joint.py",
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
        "fedcomp/flower/guards.py",
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
