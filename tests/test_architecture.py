"""Architecture kept, checked on the source: no function in fedcomp/ over 60 lines, and
no dead code (vulture over fedcomp, clients, strategies and experiments, with the
whitelist and settings of pyproject's [tool.vulture]; `make lint` and `make test` run
it too)."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 60


def long_functions(source: str, limit: int = MAX_LINES) -> list[tuple[str, int, int]]:
    """(name, first line, length) of each function or method longer than ``limit``
    lines, from its ``def`` to its last line (docstring included, decorators not)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                found.append((node.name, node.lineno, length))
    return found


def _function(body_lines: int) -> str:
    """A method whose ``def`` and body span 1 + ``body_lines`` lines."""
    body = "".join(f"    x{i} = {i}\n" for i in range(body_lines))
    return "class A:\n    @staticmethod\n" + textwrap.indent("def f():\n" + body, "    ")


def test_the_scan_measures_from_def_to_the_last_line() -> None:
    assert long_functions(_function(MAX_LINES - 1)) == []  # exactly 60 lines
    assert long_functions(_function(MAX_LINES)) == [("f", 3, MAX_LINES + 1)]
    nested = "def outer():\n" + textwrap.indent(_function(MAX_LINES), "    ") + "    return 0\n"
    assert [name for name, _, _ in long_functions(nested)] == ["outer", "f"]


def test_no_function_in_fedcomp_is_over_60_lines() -> None:
    files = sorted((ROOT / "fedcomp").rglob("*.py"))
    assert len(files) > 50  # the scan sees the package
    over = {
        f"{path.relative_to(ROOT)}:{line} {name}": length
        for path in files
        for name, line, length in long_functions(path.read_text())
    }
    assert over == {}, "split these into named steps"


def test_vulture_finds_no_dead_code() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "vulture"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
