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
            "tests/test_codec_invariants.py",
            "tests/test_hostile_server.py",
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
        tests=("tests/test_validation_invariants.py",),
        summary="experiments/results/mutation_validation.md",
        triage="experiments.mutation_triage_validation",
        left_out=(
            "the end-to-end tests that reach fedcomp/flower/validation.py through the "
            "strategy: tests/test_hostile_clients.py (21 s), tests/test_bounded_influence.py "
            "(29 s) and tests/test_fuzz_decoders.py (32 s), measured by mutmut's stats on "
            "the loaded machine: 69 of their tests cover decode_payloads (64 s), and "
            "mutmut runs a mutant's covering tests in no particular order, so even a killed "
            "mutant cost tens of seconds (two runs with them were stopped at 38 and 67 of "
            "228 mutants, after 6 and 7 minutes; the first, without "
            "tests/test_validation_invariants.py, had 16 survivors among its 38, in "
            "check_evaluate_reply and majority_keys)"
        ),
    ),
    Scope(
        name="downlink",
        files=("fedcomp/downlink.py",),
        tests=(
            "tests/test_downlink.py",
            "tests/test_hostile_server.py",
            "tests/test_downlink_invariants.py",
        ),
        summary="experiments/results/mutation_downlink.md",
        triage="experiments.mutation_triage_downlink",
        deselect=(
            "tests/test_downlink.py::test_every_inner_strategy_and_memory_codec_composes_with_the_downlink",
            "tests/test_downlink.py::test_the_downlink_composes_with_trees_and_faults",
        ),
        left_out=(
            "two end-to-end tests of tests/test_downlink.py (every inner strategy and "
            "memory codec with the downlink, 18 s; trees and faults with it, 7 s: 25 s of "
            "the file's 33 s measured with --durations on the loaded machine, re-run by "
            "every surviving mutant)"
        ),
    ),
    Scope(
        name="trees",
        files=(
            "fedcomp/trees/aggregate.py",
            "fedcomp/trees/reduce.py",
            "fedcomp/trees/structure.py",
        ),
        tests=(
            "tests/test_trees.py",
            "tests/test_tree_aggregation.py",
            "tests/test_tree_invariants.py",
        ),
        summary="experiments/results/mutation_trees.md",
        triage="experiments.mutation_triage_trees",
    ),
    Scope(
        name="onebit",
        files=("fedcomp/onebit/code.py", "fedcomp/onebit/decode.py"),
        tests=("tests/test_onebit.py", "tests/test_onebit_invariants.py"),
        summary="experiments/results/mutation_onebit.md",
        triage="experiments.mutation_triage_onebit",
        deselect=tuple(
            f"tests/test_onebit.py::{t}"
            for t in (
                "test_unbiased_when_a_third_of_the_clients_drop",
                "test_unbiased_given_the_center_with_client_weights",
                "test_median_of_means_decodes_close_to_the_mean",
                "test_every_client_gets_b_distinct_queries_with_the_planned_inclusion",
                "test_median_of_means_around_a_side_center_adds_the_center_back",
                "test_client_and_server_processes_regenerate_the_same_assignment",
                "test_mse_at_n_1000_df_4_meets_the_reference_study",
                "test_wrong_tau_degrades_gracefully",
            )
        ),
        left_out=(
            "four Monte-Carlo tests of tests/test_onebit.py (unbiased with dropped "
            "clients, 21 s; unbiased given the center with weights, 21 s; median of "
            "means, 11 s; b distinct queries with the planned inclusion, 8.5 s: 61 s of "
            "the file's 74 s measured with --durations on the loaded machine, re-run by "
            "every surviving mutant); and, after a first run with the rest of the file "
            "was stopped at 334 of 1697 mutants (projected past an hour with one worker "
            "on the shared machine), four more: median of means around a side center "
            "(5.6 s in mutmut's stats, 32 s measured under load), the client and server "
            "processes' assignment (2.5 s; 13 s: it starts processes), the reference "
            "study's error at n = 1000 (1.0 s; 7.8 s) and a wrong tau (2 x 2 s; 2 x 6.5 s); "
            "tests/test_onebit_invariants.py holds the decoder to the run-sum decoder and "
            "its groups to each group decoded alone instead"
        ),
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
