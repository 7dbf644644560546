"""The scopes of `make mutation` (experiments/mutation_scopes.py): each scope's
scratch pyproject.toml names exactly its files and tests and keeps every other setting,
and the run's check refuses a mutant outside the scope."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from experiments.mutation import check_mutated_files, source_of
from experiments.mutation_scopes import (
    EXTRA_SCOPES,
    Scope,
    core_scope,
    prepare_workdir,
    scoped_pyproject,
    select,
)
from experiments.runtime import PROJECT_ROOT

SCOPE = Scope(
    name="toy",
    files=("fedcomp/a.py", "fedcomp/sub/*.py"),
    tests=("tests/test_a.py",),
    summary="experiments/results/mutation_toy.md",
    triage="experiments.mutation_triage",
)

PYPROJECT = """[project]
name = "x"

[tool.mutmut]
source_paths = ["fedcomp/"]
only_mutate = [
    "fedcomp/old.py",
]
pytest_add_cli_args = ["-q"]
pytest_add_cli_args_test_selection = ["tests/test_old.py"]
process_isolation = "fork"

[tool.after]
key = 1
"""


def test_the_scoped_table_names_the_scope_and_keeps_the_rest() -> None:
    text = scoped_pyproject(PYPROJECT, SCOPE)
    data = tomllib.loads(text)
    assert data["tool"]["mutmut"] == {
        "source_paths": ["fedcomp/"],
        "only_mutate": ["fedcomp/a.py", "fedcomp/sub/*.py"],
        "pytest_add_cli_args": ["-q"],
        "pytest_add_cli_args_test_selection": ["tests/test_a.py"],
        "process_isolation": "fork",
    }
    assert data["project"] == {"name": "x"}
    assert data["tool"]["after"] == {"key": 1}


def test_a_pyproject_without_one_mutmut_table_is_refused() -> None:
    with pytest.raises(ValueError, match="found 0"):
        scoped_pyproject("[project]\nname = 'x'\n", SCOPE)
    with pytest.raises(ValueError, match="found 2"):
        scoped_pyproject(PYPROJECT + "\n[tool.mutmut]\nx = 1\n", SCOPE)


def test_core_is_the_projects_own_table_and_scopes_are_distinct() -> None:
    table = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    core = core_scope()
    assert list(core.files) == table["only_mutate"]
    assert list(core.tests) == table["pytest_add_cli_args_test_selection"]
    every = select("all")
    assert [s.name for s in every] == ["core", *(s.name for s in EXTRA_SCOPES)]
    assert len({s.summary for s in every}) == len(every)
    for scope in every:
        for test in scope.tests:
            assert (PROJECT_ROOT / test).is_file(), test
        for pattern in scope.files:
            assert list(PROJECT_ROOT.glob(pattern)), pattern


def test_an_unknown_scope_names_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match=r"'nope'.*allowed: all, core, codecs"):
        select("nope")


def test_the_workdir_links_the_sources_and_scopes_its_pyproject(tmp_path: Path) -> None:
    (tmp_path / "fedcomp").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "conf").mkdir()
    (tmp_path / "fedcomp" / "a.py").write_text("X = 1\n")
    (tmp_path / "pyproject.toml").write_text(
        PYPROJECT.replace('process_isolation = "fork"', 'also_copy = ["conf/"]')
    )
    work = prepare_workdir(SCOPE, tmp_path)
    (work / "mutants").mkdir()  # a previous run's output is removed, the links' targets kept
    work = prepare_workdir(SCOPE, tmp_path)
    assert work == tmp_path / "mutants" / "toy"
    assert sorted(p.name for p in work.iterdir()) == ["conf", "fedcomp", "pyproject.toml", "tests"]
    assert (work / "fedcomp").resolve() == (tmp_path / "fedcomp").resolve()
    assert (tmp_path / "fedcomp" / "a.py").read_text() == "X = 1\n"
    table = tomllib.loads((work / "pyproject.toml").read_text())["tool"]["mutmut"]
    assert table["only_mutate"] == list(SCOPE.files)


def test_a_mutant_outside_the_scope_or_a_file_without_mutants_fails_the_run() -> None:
    inside = ["fedcomp.a.x_f__mutmut_1", "fedcomp.sub.b.xǁCǁm__mutmut_2"]
    assert [source_of(n) for n in inside] == ["fedcomp/a.py", "fedcomp/sub/b.py"]
    check_mutated_files(SCOPE, inside)
    with pytest.raises(SystemExit, match=re.escape("outside it: ['fedcomp/c.py']")):
        check_mutated_files(SCOPE, [*inside, "fedcomp.c.x_g__mutmut_1"])
    with pytest.raises(SystemExit, match=re.escape("no mutant in ['fedcomp/sub/*.py']")):
        check_mutated_files(SCOPE, inside[:1])
