"""The layering, checked on the source: which packages may import which.

- the algorithm core (fedcomp, except fedcomp.flower) imports no flwr;
- fedcomp (fedcomp.flower included) imports neither clients, strategies nor experiments;
- clients (this repository's ClientApp) and strategies (its ServerApp) never import
  each other, and neither imports experiments.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> set[str]:
    """Top-level package names a module imports (also inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


RULES = {
    "fedcomp": {"clients", "strategies", "experiments"},
    "clients": {"strategies", "experiments"},
    "strategies": {"clients", "experiments"},
}


@pytest.mark.parametrize("package", sorted(RULES))
def test_packages_import_only_what_the_layering_allows(package: str) -> None:
    bad = {
        str(p.relative_to(ROOT)): sorted(_imports(p) & RULES[package]) for p in _modules(package)
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_only_fedcomp_flower_imports_flwr() -> None:
    flower = ROOT / "fedcomp" / "flower"
    core = [p for p in _modules("fedcomp") if flower not in p.parents]
    assert len(core) > 30  # the scan sees the core
    assert [str(p.relative_to(ROOT)) for p in core if "flwr" in _imports(p)] == []
    assert all("flwr" in _imports(p) for p in (flower / "mod.py", flower / "strategy.py"))


def test_the_two_lines_import_from_one_place() -> None:
    from fedcomp.flower import CompressedStrategy, CompressionMod
    from fedcomp.flower.mod import CompressionMod as Mod
    from fedcomp.flower.strategy import CompressedStrategy as Strategy

    assert (CompressionMod, CompressedStrategy) == (Mod, Strategy)
