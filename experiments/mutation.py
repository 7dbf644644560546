"""Tool-generated mutation testing of the protocol cores (mutmut), scope by scope, with
a triaged summary per scope.

    python -m experiments.mutation [--scope all|core|codecs|...]   (make mutation SCOPE=...)

Where ``make mutants`` applies hand-written bugs, this runs mutmut over each scope's
files (experiments/mutation_scopes.py; ``core`` is pyproject.toml's ``[tool.mutmut]``),
each mutant against the scope's fast tests that cover the mutated function. Each scope
runs in its own scratch directory, mutants/<scope>/ (git-ignored; the checkout is never
edited), and the run fails if mutmut mutated a file outside the scope. The summary
counts each outcome and lists every surviving mutant with its diff and its triage from
the scope's triage module; a survivor with no triage entry (or one whose mutated line no
longer matches), or an entry whose mutant no longer survives (stale), fails the command.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from experiments.mutation_scopes import Scope, prepare_workdir, project_mutmut, select
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

#: Run in a scope's directory: every survivor's diff from one process (``mutmut show``
#: would start one per mutant).
_DIFFS = (
    "import json, sys\n"
    "from mutmut.mutation.diff_apply import get_diff_for_mutant\n"
    "print(json.dumps({n: get_diff_for_mutant(n) for n in json.load(sys.stdin)}))\n"
)


@dataclass
class Outcome:
    """One scope's run, as the index needs it."""

    scope: Scope
    mutants: int
    survived: int
    caught: int
    tested: int
    wall: float
    problems: int


def outcomes(work: Path) -> dict[str, str]:
    """Each mutant's outcome: mutmut's per-file .meta records, or after a re-run of the
    survivors (:func:`rerun_survivors`) the merged outcomes it saved."""
    merged = work / "mutants" / "merged-outcomes.json"
    if merged.exists():
        return json.loads(merged.read_text())
    result = {}
    for meta in sorted((work / "mutants").rglob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        for name, code in codes.items():
            result[name] = STATUS.get(code, "suspicious")
    return result


def source_of(name: str) -> str:
    """``fedcomp.x.xǁClassǁmethod__mutmut_3`` -> ``fedcomp/x.py``."""
    module = name.rsplit("__mutmut_", 1)[0].rpartition(".")[0]
    return module.replace(".", "/") + ".py"


def check_mutated_files(scope: Scope, names: list[str]) -> None:
    """mutmut mutated exactly the scope's files (each glob reached, nothing outside).

    Raises
    ------
    SystemExit
        Naming the files outside the scope, or the scope's patterns with no mutant.
    """
    files = {source_of(n) for n in names}
    outside = sorted(f for f in files if not scope.mutates(f))
    if outside:
        raise SystemExit(f"scope {scope.name}: mutmut mutated files outside it: {outside}")
    idle = [p for p in scope.files if not any(fnmatch.fnmatch(f, p) for f in files)]
    if idle:
        raise SystemExit(f"scope {scope.name}: no mutant in {idle}")


def survivor_diffs(work: Path, names: list[str]) -> dict[str, str]:
    """mutmut's diff of each named mutant, computed in the scope's directory."""
    out = subprocess.run(
        [sys.executable, "-c", _DIFFS],
        cwd=work,
        input=json.dumps(names),
        env=dict(os.environ, PYTHONPATH=""),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


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


def natural(name: str) -> list:
    """Sort key: mutant 10 after mutant 9."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def run_mutmut(work: Path, max_children: int, names: list[str] | None = None) -> float:
    """``mutmut run`` in the scope's directory (only the ``names`` mutants when given);
    its wall time in seconds, also saved in mutants/run.json."""
    # mutmut puts ./mutants first on the path, nothing else. One OpenMP thread: each
    # mutant's process is forked from mutmut's, and a child forked after torch started
    # its OpenMP pool hangs in its first parallel operation (measured: 2M-element ops),
    # which mutmut then reported as a timeout, i.e. as caught.
    env = dict(os.environ, PYTHONPATH="", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    t0 = time.perf_counter()
    command = ["mutmut", "run", "--max-children", str(max_children), *(names or [])]
    run = subprocess.run(
        [sys.executable, "-m", *command],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    if run.returncode != 0:
        sys.stderr.write(run.stdout[-4000:] + run.stderr[-4000:])
        raise SystemExit(f"mutmut run failed in {work} (exit {run.returncode})")
    record = {"wall_seconds": round(wall, 1), "max_children": max_children}
    (work / "mutants" / "run.json").write_text(
        json.dumps({**record, "tests": project_selection(work)})
    )
    return wall


def project_selection(work: Path) -> list[str]:
    """The test selection the scope's directory ran with."""
    return project_mutmut(work)["pytest_add_cli_args_test_selection"]


def rerun_survivors(scope: Scope, max_children: int) -> None:
    """Run the last run's survivors again against the scope's tests as they are now
    (tests added since), in a fresh directory; the other mutants keep their outcome
    (a killed mutant stays killed when tests are only added). Saves the merged outcomes
    and both wall times.

    Raises
    ------
    SystemExit
        When the scope has no previous run, or the re-run left a survivor unchecked.
    """
    work = scope.workdir()
    if not (work / "mutants" / "run.json").exists():
        raise SystemExit(f"scope {scope.name}: no previous run to re-run the survivors of")
    before, first = outcomes(work), json.loads((work / "mutants" / "run.json").read_text())
    survivors = sorted((n for n, s in before.items() if s == "survived"), key=natural)
    previous_tests = first.get("tests") or project_selection(work)
    prepare_workdir(scope)
    wall = run_mutmut(work, max_children, survivors)
    after = outcomes(work)
    unchecked = [n for n in survivors if after.get(n, "not checked") == "not checked"]
    if unchecked:
        raise SystemExit(f"scope {scope.name}: the re-run did not check {unchecked[:5]}")
    (work / "mutants" / "merged-outcomes.json").write_text(
        json.dumps({**before, **{n: after[n] for n in survivors}})
    )
    earlier = first.get("rerun", {"wall_seconds": 0.0, "runs": 0})
    rerun = {
        "wall_seconds": round(earlier["wall_seconds"] + wall, 1),
        "mutants": len(survivors),
        "runs": earlier.get("runs", 1) + 1,
    }
    (work / "mutants" / "run.json").write_text(
        json.dumps({**first, "tests": previous_tests, "rerun": rerun})
    )


def triage_rows(
    survivors: list[str], diffs: dict[str, str], triage: dict[str, tuple[str, str, str]]
) -> tuple[list[str], Counter, int]:
    """The survivor table's rows, the count of each verdict, and how many are untriaged."""
    rows, verdicts, untriaged = [], Counter(), 0
    for name in survivors:
        old, new = changed_lines(diffs[name])
        entry = triage.get(name)
        if entry is None or entry[0] not in new:
            verdict, reason = "untriaged", "no triage entry matches this mutant's line"
            untriaged += 1
        else:
            verdict, reason = entry[1], entry[2]
        verdicts[verdict] += 1
        rows.append(f"| `{name}` | {cell(old)} | {cell(new)} | {verdict} | {reason} |")
    return rows, verdicts, untriaged


def header_lines(scope: Scope, status: dict[str, str], run: dict, triage_path: str) -> list[str]:
    """The summary's head: tool, files, tests, wall time, counts and score."""
    config = project_mutmut()
    counts = Counter(status.values())
    main_kinds = ("killed", "timeout", "survived", "no tests", "suspicious")
    other = len(status) - sum(counts[k] for k in main_kinds)
    tested = len(status) - counts["no tests"] - counts["skipped"]
    caught = counts["killed"] + counts["timeout"] + counts["caught by type check"]
    tests = shlex.join(config["pytest_add_cli_args"] + scope.selection())
    return [
        f"# Mutation testing, scope `{scope.name}` (`make mutation SCOPE={scope.name}`)",
        "",
        f"- tool: mutmut {version('mutmut')} (process isolation: "
        f"{config.get('process_isolation', 'fork')}, {run['max_children']} workers)",
        "- files mutated: " + ", ".join(f"`{p}`" for p in scope.files),
        f"- tests: `pytest {tests}`, each mutant "
        "against the tests among these that cover its function",
        *([f"- left out: {scope.left_out}"] if scope.left_out else []),
        f"- wall time: {run['wall_seconds'] / 60:.1f} min (stats collection and all mutants)",
        *(
            [
                f"- re-run: the survivors of that run against the tests above, "
                f"{run['rerun'].get('runs', 1)} time(s) as tests were added (the last with "
                f"{run['rerun']['mutants']} survivors), in "
                f"{run['rerun']['wall_seconds'] / 60:.1f} min in all; the first "
                f"run's tests were `{shlex.join(run['tests'])}` (the other mutants keep its "
                "outcome: tests were only added)"
            ]
            if "rerun" in run
            else []
        ),
        *([f"- note: {run['note']}"] if run.get("note") else []),
        f"- mutants: {len(status)}; killed {counts['killed']}, timeout {counts['timeout']}, "
        f"survived {counts['survived']}, no covering test {counts['no tests']}, "
        f"suspicious {counts['suspicious']}, other {other}",
        f"- score: {caught}/{tested} = {100 * caught / max(tested, 1):.1f}% of the mutants a "
        "scoped test reaches",
        "",
        f"Triage ({triage_path}): *equivalent* (no input changes the "
        "result), *missing invariant* (a behaviour no scoped test pins: a test is owed, "
        "in scope or out of it), *not worth it* (a message, a warning, speed, rounding of "
        "a diagnostic, or a case no caller reaches).",
    ]


def table_lines(rows: list[str], uncovered: Counter, stale: list[str]) -> list[str]:
    """The summary's tables: survivors, unreached functions, stale triage entries."""
    lines = [
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
    if stale:
        lines += ["## Stale triage entries (their mutant no longer survives: delete them)", ""]
        lines += [*(f"- `{n}`" for n in stale), ""]
    return lines


def summarise(scope: Scope, out: Path) -> Outcome:
    """Write the scope's summary from its last run; the counts for the index."""
    work = scope.workdir()
    status = outcomes(work)
    check_mutated_files(scope, list(status))
    run = json.loads((work / "mutants" / "run.json").read_text())
    module = importlib.import_module(scope.triage)
    survivors = sorted((n for n, s in status.items() if s == "survived"), key=natural)
    rows, verdicts, untriaged = triage_rows(
        survivors, survivor_diffs(work, survivors), module.TRIAGE
    )
    stale = sorted(set(module.TRIAGE) - set(survivors), key=natural)
    uncovered = Counter(function_of(n) for n, s in status.items() if s == "no tests")
    lines = [
        *header_lines(scope, status, run, scope.triage.replace(".", "/") + ".py"),
        "Survivors: " + ", ".join(f"{v} {n}" for v, n in sorted(verdicts.items())) + ".",
        "",
        module.NOTES,
        "",
        f"`cd {scope.workdir().relative_to(PROJECT_ROOT)} && python -m mutmut show NAME` "
        "prints a mutant's full diff after a run.",
        "",
        *table_lines(rows, uncovered, stale),
    ]
    out.write_text("\n".join(lines))
    counts = Counter(status.values())
    wall = run["wall_seconds"] + run.get("rerun", {}).get("wall_seconds", 0.0)
    print(
        f"{scope.name}: {len(status)} mutants, {counts['survived']} survived, "
        f"{untriaged} untriaged, {len(stale)} stale; {wall / 60:.1f} min; "
        f"summary in {out.relative_to(PROJECT_ROOT)}"
    )
    tested = len(status) - counts["no tests"] - counts["skipped"]
    caught = counts["killed"] + counts["timeout"] + counts["caught by type check"]
    return Outcome(
        scope, len(status), counts["survived"], caught, tested, wall, untriaged + len(stale)
    )


def write_index(results: list[Outcome], missing: list[str], out: Path) -> None:
    """The all-scopes table: each scope's counts and wall time, the total, and the
    scopes without a run (``--no-run`` only)."""
    total = sum(r.wall for r in results)
    lines = [
        "# Mutation testing, every scope (`make mutation`)",
        "",
        f"mutmut {version('mutmut')}, scopes run one after another, 2 workers; total wall "
        f"time of the {len(results)} scopes run: {total / 60:.1f} min (each scope's stats "
        "collection and mutants, and the re-run of its survivors where there was one).",
        "",
        "| scope | files | mutants | survived | score | wall (min) | summary |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {r.scope.name} | {', '.join(f'`{f}`' for f in r.scope.files)} | {r.mutants} "
            f"| {r.survived} | {100 * r.caught / max(r.tested, 1):.1f}% | {r.wall / 60:.1f} "
            f"| [{Path(r.scope.summary).name}]({Path(r.scope.summary).name}) |"
            for r in results
        ),
        *(f"| {name} | (no run in mutants/ to summarise) | | | | | |" for name in missing),
        "",
    ]
    out.write_text("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scope", default="all", help="a scope's name, or all (each in turn)")
    parser.add_argument("--out", help="the summary's path (one scope only; default: the scope's)")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--no-run", action="store_true", help="rewrite the summaries from the last runs"
    )
    parser.add_argument(
        "--rerun-survivors",
        action="store_true",
        help="run the last run's survivors again against the scope's current tests",
    )
    args = parser.parse_args()
    try:
        chosen = select(args.scope)
    except ValueError as err:
        parser.error(str(err))
    if args.out and args.scope == "all":
        chosen = select("core")  # the one-scope command of before the scopes: core
    elif args.out and len(chosen) > 1:
        parser.error("--out names one summary: give --scope too")
    results = []
    results, missing = [], []
    for scope in chosen:
        if args.rerun_survivors:
            rerun_survivors(scope, args.max_children)
        elif not args.no_run:
            run_mutmut(prepare_workdir(scope), args.max_children)
        elif not (scope.workdir() / "mutants" / "run.json").exists():
            missing.append(scope.name)  # --no-run: this scope has no run to summarise
            continue
        results.append(summarise(scope, PROJECT_ROOT / (args.out or scope.summary)))
    if len(chosen) > 1:
        write_index(results, missing, PROJECT_ROOT / "experiments/results/mutation_all.md")
    if missing:
        print(f"no run in mutants/ to summarise for: {', '.join(missing)}", file=sys.stderr)
    return 1 if missing or any(r.problems for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
