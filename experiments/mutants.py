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
from pathlib import Path

from experiments.mutant_list import MUTANTS, Mutant
from experiments.runtime import PROJECT_ROOT


def killing_test(stdout: str) -> str:
    """The first test pytest reports as failed or errored (``-rfE``), or ""."""
    for line in stdout.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" ", 1)[1].split(" - ", 1)[0]
    return ""


def run_mutant(mutant: Mutant, head: str) -> tuple[bool, float, str]:
    """Apply the mutant in a worktree of ``head``; return (killed, seconds, the test
    that failed first, or pytest's last line when none did)."""
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
                    "-rfE",
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
            killer = killing_test(out.stdout)
            return out.returncode != 0, seconds, killer or (lines[-1] if lines else "")
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
        "| mutant | the bug | tests run | caught | seconds | killed by |",
        "|---|---|---|---|---|---|",
    ]
    survived = 0
    for mutant in MUTANTS:
        killed, seconds, last = run_mutant(mutant, head)
        survived += not killed
        what, last = mutant.what.replace("|", "\\|"), last.replace("|", "\\|")
        rows.append(
            f"| {mutant.name} | {what} | {', '.join(mutant.tests)} | "
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
