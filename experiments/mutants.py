"""A mutation check: deliberate bugs the test suite must catch.

    python -m experiments.mutants [--out experiments/results/mutants.md]   (make mutants)

Each mutant replaces one exact snippet of the committed code (in a throwaway git
worktree of HEAD, so the checkout is never touched) and runs the tests that should
catch it; a mutant the tests pass is a hole in the suite and makes the command fail.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from experiments.runtime import PROJECT_ROOT


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
)


def run_mutant(mutant: Mutant, head: str) -> tuple[bool, float, str]:
    """Apply the mutant in a worktree of ``head``; return (killed, seconds, last line)."""
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "worktree", "add", "--detach", "-q", str(tree), head],
            cwd=PROJECT_ROOT,
            check=True,
        )
        try:
            target = tree / mutant.path
            text = target.read_text()
            if text.count(mutant.old) != 1:
                raise SystemExit(f"{mutant.name}: the snippet is not in {mutant.path} once")
            target.write_text(text.replace(mutant.old, mutant.new))
            t0 = time.perf_counter()
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-x",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "-m",
                    "not slow",
                    *mutant.tests,
                ],
                cwd=tree,
                capture_output=True,
                text=True,
                timeout=1800,
            )
            seconds = time.perf_counter() - t0
            lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
            return out.returncode != 0, seconds, lines[-1] if lines else ""
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(tree)], cwd=PROJECT_ROOT, check=False
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the summary here")
    args = parser.parse_args(argv)
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    rows = [
        "| mutant | the bug | tests run | caught | seconds | pytest's last line |",
        "|---|---|---|---|---|---|",
    ]
    survived = 0
    for mutant in MUTANTS:
        killed, seconds, last = run_mutant(mutant, head)
        survived += not killed
        rows.append(
            f"| {mutant.name} | {mutant.what} | {', '.join(mutant.tests)} | "
            f"{'yes' if killed else '**NO**'} | {seconds:.0f} | {last} |"
        )
        print(rows[-1], flush=True)
    text = (
        f"# Mutation check (commit {head})\n\n"
        "Command: `make mutants` (`python -m experiments.mutants`). Each mutant is one\n"
        "deliberate bug applied to a throwaway worktree; the tests listed must fail.\n\n"
        + "\n".join(rows)
        + f"\n\n{len(MUTANTS) - survived} of {len(MUTANTS)} mutants caught.\n"
    )
    if args.out:
        args.out.write_text(text)
    print(text)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
