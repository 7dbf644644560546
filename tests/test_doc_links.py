"""Every relative link in the README and docs/ reaches a file, and its #anchor a heading
of that file (GitHub's rule: lower case, punctuation dropped, spaces to hyphens)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # not headings in code
    return {slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_slug_follows_githubs_rule() -> None:
    assert slug("Fashion-MNIST: NIID-Bench's FedAvg reproduced") == (
        "fashion-mnist-niid-benchs-fedavg-reproduced"
    )
    assert slug("Rotation and EDEN") == "rotation-and-eden"
    assert slug("At the socket: what (2026-12-05)") == "at-the-socket-what-2026-12-05"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_reaches_its_file_and_heading(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)
