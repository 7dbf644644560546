"""Tool-generated mutation testing of the protocol cores (mutmut), with a triaged summary.

    python -m experiments.mutation [--out experiments/results/mutation.md]   (make mutation)

Where ``make mutants`` applies hand-written bugs, this runs mutmut over the files
named in pyproject.toml's ``[tool.mutmut]`` (``only_mutate``), each mutant against the
fast tests of ``pytest_add_cli_args_test_selection`` that cover the mutated function.
mutmut works in ./mutants (a git-ignored copy; the checkout is never edited). The
summary counts each outcome and lists every surviving mutant with its diff and its
triage from experiments/mutation_triage.py; a survivor with no triage entry (or one
whose mutated line no longer matches) is marked "untriaged" and fails the command.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
import tomllib
from collections import Counter
from importlib.metadata import version
from pathlib import Path

from experiments.mutation_triage import NOTES, TRIAGE
from experiments.runtime import PROJECT_ROOT

#: mutmut's exit-code classes (mutmut.stats.status_by_exit_code, 3.x); others suspicious.
STATUS = {
    1: "killed",
    3: "killed",
    0: "survived",
    5: "no tests",
    33: "no tests",
    34: "skipped",
    35: "suspicious",
    36: "timeout",
    37: "caught by type check",
    -24: "timeout",
    24: "timeout",
    152: "timeout",
    255: "timeout",
    -11: "segfault",
    -9: "segfault",
    None: "not checked",
}


def mutmut_config() -> dict:
    return tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]


def outcomes(root: Path) -> dict[str, str]:
    """Each mutant's outcome, from mutmut's per-file .meta records."""
    result = {}
    for meta in sorted((root / "mutants").rglob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        for name, code in codes.items():
            result[name] = STATUS.get(code, "suspicious")
    return result


def mutant_diff(name: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "mutmut", "show", name],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def changed_lines(diff: str) -> tuple[str, str]:
    """The diff's removed and added lines (stripped, joined), for the table."""
    minus = [
        ln[1:].strip()
        for ln in diff.splitlines()
        if ln.startswith("-") and not ln.startswith("---")
    ]
    plus = [
        ln[1:].strip()
        for ln in diff.splitlines()
        if ln.startswith("+") and not ln.startswith("+++")
    ]
    return " / ".join(minus), " / ".join(plus)


def cell(text: str) -> str:
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`" if text else "(removed)"


def function_of(name: str) -> str:
    """``fedcomp.x.xǁClassǁmethod__mutmut_3`` -> ``fedcomp.x.Class.method``."""
    base = name.rsplit("__mutmut_", 1)[0]
    module, _, func = base.rpartition(".")
    func = func[2:] if func.startswith("x_") else func[1:] if func.startswith("x") else func
    return f"{module}.{func.strip('ǁ').replace('ǁ', '.')}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/results/mutation.md")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--no-run", action="store_true", help="rewrite the summary from the last run's ./mutants"
    )
    args = parser.parse_args()

    config = mutmut_config()
    wall_file = PROJECT_ROOT / "mutants" / "wall-seconds.txt"
    if args.no_run:
        wall = float(wall_file.read_text())
    else:
        env = dict(os.environ, PYTHONPATH="")  # mutmut puts ./mutants first; nothing else
        t0 = time.perf_counter()
        run = subprocess.run(
            [sys.executable, "-m", "mutmut", "run", "--max-children", str(args.max_children)],
            cwd=PROJECT_ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - t0
        if run.returncode != 0:
            sys.stderr.write(run.stdout[-4000:] + run.stderr[-4000:])
            raise SystemExit(f"mutmut run failed (exit {run.returncode})")
        wall_file.write_text(f"{wall:.1f}\n")

    status = outcomes(PROJECT_ROOT)
    counts = Counter(status.values())
    survivors = sorted(
        (n for n, s in status.items() if s == "survived"),
        key=lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)],
    )
    uncovered = Counter(function_of(n) for n, s in status.items() if s == "no tests")

    rows, untriaged, verdicts = [], 0, Counter()
    for name in survivors:
        old, new = changed_lines(mutant_diff(name))
        entry = TRIAGE.get(name)
        if entry is None or entry[0] not in new:
            verdict, reason = "untriaged", "no triage entry matches this mutant's line"
            untriaged += 1
        else:
            verdict, reason = entry[1], entry[2]
        verdicts[verdict] += 1
        rows.append(f"| `{name}` | {cell(old)} | {cell(new)} | {verdict} | {reason} |")

    main_kinds = ("killed", "timeout", "survived", "no tests", "suspicious")
    other = len(status) - sum(counts[k] for k in main_kinds)
    tested = len(status) - counts["no tests"] - counts["skipped"]
    caught = counts["killed"] + counts["timeout"] + counts["caught by type check"]
    tests = shlex.join(config["pytest_add_cli_args"] + config["pytest_add_cli_args_test_selection"])
    lines = [
        "# Mutation testing of the protocol cores (`make mutation`)",
        "",
        f"- tool: mutmut {version('mutmut')} (process isolation: "
        f"{config.get('process_isolation', 'fork')}, {args.max_children} workers)",
        "- files mutated: " + ", ".join(f"`{p}`" for p in config["only_mutate"]),
        f"- tests: `pytest {tests}`, each mutant "
        "against the tests among these that cover its function",
        f"- wall time: {wall / 60:.1f} min (stats collection and all mutants)",
        f"- mutants: {len(status)}; killed {counts['killed']}, timeout {counts['timeout']}, "
        f"survived {counts['survived']}, no covering test {counts['no tests']}, "
        f"suspicious {counts['suspicious']}, other {other}",
        f"- score: {caught}/{tested} = {100 * caught / max(tested, 1):.1f}% of the mutants a "
        "scoped test reaches",
        "",
        "Triage (experiments/mutation_triage.py): *equivalent* (no input changes the "
        "result), *missing invariant* (a behaviour no scoped test pins: a test is owed, "
        "in scope or out of it), *not worth it* (a message, a warning, speed, rounding of "
        "a diagnostic, or a case no caller reaches). Survivors: "
        + ", ".join(f"{v} {n}" for v, n in sorted(verdicts.items()))
        + ".",
        "",
        NOTES,
        "",
        "`python -m mutmut show NAME` prints a mutant's full diff after a run.",
        "",
        "## Survivors",
        "",
        "| mutant | original | mutated | triage | reason |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "## Functions no scoped test reaches",
        "",
        "Their mutants were not run (mutmut: no tests); other test files or the slow tests "
        "cover them, or nothing does.",
        "",
        "| function | mutants |",
        "|---|---|",
        *(f"| `{f}` | {n} |" for f, n in sorted(uncovered.items())),
        "",
    ]
    out = PROJECT_ROOT / args.out
    out.write_text("\n".join(lines))
    print(
        f"{len(status)} mutants, {counts['survived']} survived, {untriaged} untriaged; "
        f"{wall / 60:.1f} min; summary in {args.out}"
    )
    return 1 if untriaged else 0


if __name__ == "__main__":
    sys.exit(main())
