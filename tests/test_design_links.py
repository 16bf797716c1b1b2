"""Module docstrings and comments point at the design pages as plain text (`docs/design/core.md#runtime`),
which `mkdocs build --strict` never sees: every such reference must name a page and a heading that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = re.compile(r"docs/([A-Za-z0-9_./-]+\.md)#([A-Za-z0-9_-]+)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*(?:\{#([A-Za-z0-9_-]+)\})?\s*$")


def anchors(page: Path) -> set[str]:
    """The ids of a page's headings: an explicit `{#id}`, else the heading's slug as mkdocs makes it."""
    toc = pytest.importorskip("markdown.extensions.toc")
    found: set[str] = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            found.add(match.group(2) or toc.slugify(match.group(1), "-"))
    return found


def references(root: Path) -> list[tuple[str, str, str]]:
    """(file, page, anchor) of every `docs/<page>.md#<anchor>` in the package's source."""
    return [
        (str(path.relative_to(root)), page, anchor)
        for path in sorted((root / "otel_train").rglob("*.py"))
        for page, anchor in REFERENCE.findall(path.read_text(encoding="utf-8"))
    ]


def broken(root: Path) -> list[str]:
    cache: dict[str, set[str]] = {}
    out = []
    for source, page, anchor in references(root):
        path = root / "docs" / page
        if page not in cache:
            cache[page] = anchors(path) if path.is_file() else set()
        if anchor not in cache[page]:
            out.append(f"{source}: docs/{page}#{anchor}")
    return out


def test_every_design_reference_in_the_package_names_a_real_heading() -> None:
    assert references(ROOT), "the package's docstrings link to no design page"
    assert broken(ROOT) == []


def test_a_reference_to_a_missing_heading_or_page_is_found(tmp_path: Path) -> None:
    (tmp_path / "docs" / "design").mkdir(parents=True)
    (tmp_path / "docs" / "design" / "core.md").write_text(
        "# Core\n\n## The runtime {#runtime}\n\n```text\n## not a heading {#fenced}\n```\n\n## Running at scale\n",
        encoding="utf-8",
    )
    (tmp_path / "otel_train").mkdir()
    (tmp_path / "otel_train" / "m.py").write_text(
        '"""Design: docs/design/core.md#runtime, docs/design/core.md#running-at-scale."""\n'
        "# docs/design/core.md#gone docs/design/core.md#fenced docs/design/none.md#runtime\n",
        encoding="utf-8",
    )
    assert broken(tmp_path) == [
        "otel_train/m.py: docs/design/core.md#gone",
        "otel_train/m.py: docs/design/core.md#fenced",
        "otel_train/m.py: docs/design/none.md#runtime",
    ]
