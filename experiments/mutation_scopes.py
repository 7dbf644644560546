"""The scopes of `make mutation`: which files mutmut mutates and which fast tests it runs.

mutmut reads one ``[tool.mutmut]`` table from the working directory's pyproject.toml.
Each scope therefore runs in a scratch directory of its own, ``mutants/<scope>/``
(git-ignored), holding links to the project's sources and tests and a copy of the
project's pyproject.toml whose ``[tool.mutmut]`` table names the scope's files and
tests (every other setting kept). The ``core`` scope is that table itself, so a plain
``mutmut run`` in the checkout still runs it.
"""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from experiments.runtime import PROJECT_ROOT


@dataclass(frozen=True)
class Scope:
    """One mutation run: the files mutated, the tests run, where its summary goes.

    Attributes
    ----------
    name
        The scope's name (``make mutation SCOPE=name``).
    files
        ``only_mutate`` globs, relative to the project root.
    tests
        Test files (``pytest_add_cli_args_test_selection``).
    summary
        The summary's path, relative to the project root.
    triage
        The module holding the scope's ``TRIAGE`` and ``NOTES``.
    deselect
        Test ids (or id prefixes) of those files that are not run: measured too slow
        per mutant (pytest ``--deselect``).
    left_out
        What was left out (slow test files or tests) and why, for the summary.
    """

    name: str
    files: tuple[str, ...]
    tests: tuple[str, ...]
    summary: str
    triage: str
    deselect: tuple[str, ...] = ()
    left_out: str = ""

    def selection(self) -> list[str]:
        """mutmut's ``pytest_add_cli_args_test_selection``: the files, then deselections."""
        return [*self.tests, *(arg for test in self.deselect for arg in ("--deselect", test))]

    def workdir(self, root: Path = PROJECT_ROOT) -> Path:
        """The scratch directory mutmut runs in (its ./mutants is inside)."""
        return root / "mutants" / self.name

    def mutates(self, path: str) -> bool:
        """True when the project-relative source ``path`` is one of the scope's files."""
        return any(fnmatch.fnmatch(path, pattern) for pattern in self.files)


def project_mutmut(root: Path = PROJECT_ROOT) -> dict:
    """The project's own ``[tool.mutmut]`` table (the core scope and shared settings)."""
    return tomllib.loads((root / "pyproject.toml").read_text())["tool"]["mutmut"]


def core_scope(root: Path = PROJECT_ROOT) -> Scope:
    """The scope pyproject.toml's ``[tool.mutmut]`` names (influence, control variates)."""
    table = project_mutmut(root)
    return Scope(
        name="core",
        files=tuple(table["only_mutate"]),
        tests=tuple(table["pytest_add_cli_args_test_selection"]),
        summary="experiments/results/mutation.md",
        triage="experiments.mutation_triage",
    )


#: The scopes after ``core``, in the order ``make mutation`` runs them. Test files were
#: chosen by measuring (pytest --durations): each covers the files and runs in seconds.
EXTRA_SCOPES: tuple[Scope, ...] = (
    Scope(
        name="codecs",
        files=(
            "fedcomp/codecs/base.py",
            "fedcomp/codecs/quantizers.py",
            "fedcomp/codecs/sparse.py",
            "fedcomp/codecs/wire.py",
        ),
        tests=(
            "tests/test_codecs.py",
            "tests/test_codec_factors.py",
            "tests/test_bounds.py",
        ),
        summary="experiments/results/mutation_codecs.md",
        triage="experiments.mutation_triage_codecs",
        deselect=tuple(
            f"tests/test_codecs.py::{t}"
            for t in (
                "test_unbiased_codecs_average_to_the_input",
                "test_large_tensors_are_within_two_percent_of_nominal",
                "test_mean_squared_error_is_the_codecs_variance",
            )
        ),
        left_out=(
            "the three Monte-Carlo tests of tests/test_codecs.py over large tensors "
            "(unbiased average, size within 2% of nominal, error = variance: 37 s of the "
            "file's 43 s measured with --durations on the loaded machine, run again in "
            "full by every surviving mutant); tests/test_codec_factors.py checks each "
            "variance factor on its worst-case input, tests/test_codec_invariants.py "
            "unbiasedness on small tensors"
        ),
    ),
    Scope(
        name="validation",
        files=("fedcomp/flower/validation.py",),
        tests=(
            "tests/test_validation_invariants.py",
            "tests/test_hostile_clients.py",
            "tests/test_bounded_influence.py",
        ),
        summary="experiments/results/mutation_validation.md",
        triage="experiments.mutation_triage_validation",
        deselect=(
            "tests/test_bounded_influence.py::test_a_bad_setting_is_one_line_and_exit_status_2",
            "tests/test_bounded_influence.py::test_a_failing_inner_strategy_fails_the_round_not_the_run",
        ),
        left_out=(
            "tests/test_fuzz_decoders.py (31 s: random payloads, 26 s in one test) and two "
            "tests of tests/test_bounded_influence.py (a CLI subprocess, 11 s; a failing "
            "inner strategy, 5 s), measured with the scope's stats on the loaded machine: "
            "every surviving mutant of decode_payloads re-ran 64 s of tests with them. A "
            "first run with them and without tests/test_validation_invariants.py was "
            "stopped after 38 of 228 mutants (16 survivors, all in check_evaluate_reply and "
            "majority_keys)"
        ),
    ),
    Scope(
        name="downlink",
        files=("fedcomp/downlink.py",),
        tests=("tests/test_downlink.py",),
        summary="experiments/results/mutation_downlink.md",
        triage="experiments.mutation_triage_downlink",
    ),
    Scope(
        name="trees",
        files=(
            "fedcomp/trees/aggregate.py",
            "fedcomp/trees/reduce.py",
            "fedcomp/trees/structure.py",
        ),
        tests=("tests/test_trees.py", "tests/test_tree_aggregation.py"),
        summary="experiments/results/mutation_trees.md",
        triage="experiments.mutation_triage_trees",
    ),
    Scope(
        name="onebit",
        files=("fedcomp/onebit/code.py", "fedcomp/onebit/decode.py"),
        tests=("tests/test_onebit.py",),
        summary="experiments/results/mutation_onebit.md",
        triage="experiments.mutation_triage_onebit",
    ),
)


def scopes(root: Path = PROJECT_ROOT) -> dict[str, Scope]:
    """Every scope by name, ``core`` first."""
    return {s.name: s for s in (core_scope(root), *EXTRA_SCOPES)}


def select(name: str, root: Path = PROJECT_ROOT) -> list[Scope]:
    """The scopes ``make mutation SCOPE=name`` runs (``all``: every one in turn).

    Raises
    ------
    ValueError
        When ``name`` is neither ``all`` nor a scope's name, listing those allowed.
    """
    known = scopes(root)
    if name == "all":
        return list(known.values())
    if name not in known:
        raise ValueError(f"unknown mutation scope {name!r}; allowed: all, {', '.join(known)}")
    return [known[name]]


_TABLE = re.compile(r"^\[tool\.mutmut\]\n(?:(?!\[).*\n|\n)*", re.MULTILINE)


def _toml_value(value: object) -> str:
    # JSON strings, numbers, booleans and lists of them are valid TOML values.
    return json.dumps(value)


def scoped_pyproject(text: str, scope: Scope) -> str:
    """pyproject.toml's text with its ``[tool.mutmut]`` table naming ``scope``'s files
    and tests; every other key of the table (and every other table) is kept.

    Raises
    ------
    ValueError
        When the text has no ``[tool.mutmut]`` table, or more than one.
    """
    found = _TABLE.findall(text)
    if len(found) != 1:
        raise ValueError(f"pyproject.toml must hold one [tool.mutmut] table, found {len(found)}")
    table = dict(tomllib.loads(text)["tool"]["mutmut"])
    table["only_mutate"] = list(scope.files)
    table["pytest_add_cli_args_test_selection"] = scope.selection()
    body = "".join(f"{key} = {_toml_value(value)}\n" for key, value in table.items())
    # A function as replacement: the body's backslashes stay literal.
    return _TABLE.sub(lambda _: f"[tool.mutmut]\n{body}\n", text, count=1)


def prepare_workdir(scope: Scope, root: Path = PROJECT_ROOT) -> Path:
    """A fresh scratch directory for ``scope``: links to the sources, the tests and the
    directories ``also_copy`` names, and the scoped pyproject.toml. A previous run's
    ./mutants there is removed (each run starts clean)."""
    work = scope.workdir(root)
    table = project_mutmut(root)
    linked = {*table["source_paths"], "tests/", *table.get("also_copy", [])}
    if work.exists():
        _remove_tree(work)
    work.mkdir(parents=True)
    for entry in sorted(linked):
        name = entry.rstrip("/")
        (work / name).symlink_to(root / name, target_is_directory=(root / name).is_dir())
    text = (root / "pyproject.toml").read_text()
    (work / "pyproject.toml").write_text(scoped_pyproject(text, scope))
    return work


def _remove_tree(path: Path) -> None:
    """Remove ``path`` without following its links into the project."""
    for child in path.iterdir():
        if child.is_symlink() or child.is_file():
            child.unlink()
        else:
            _remove_tree(child)
    path.rmdir()
