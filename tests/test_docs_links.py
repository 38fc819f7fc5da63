"""Every relative link in README.md, CHANGELOG.md, docs/*.md, docs/archive/*.md and
benchmarks/README.md points to a file that exists, every docs page is listed in docs/index.md, and the
reference pages (docs/ outside docs/archive/, every README) stay under 30 KB: a page that grows past
it has become a lab notebook, and its history belongs in docs/archive/."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md",
         *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "archive").glob("*.md"))]
#: the most a reference page may hold (bytes)
REFERENCE_LIMIT = 30_000
# Markdown links and images: [text](target) and ![alt](target); the target ends at a space or ")".
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)  # code blocks hold no links
    targets = (match.group(1) for match in LINK.finditer(text))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_resolve(page):
    missing = []
    for target in relative_links(page):
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_index_lists_every_docs_page():
    index = ROOT / "docs" / "index.md"
    listed = {(index.parent / target).resolve() for target in relative_links(index)}
    unlisted = [p.name for p in (ROOT / "docs").glob("*.md") if p != index and p.resolve() not in listed]
    assert not unlisted, f"docs/index.md does not list {unlisted}"


def _readmes() -> list[Path]:
    """Every README of the repository, outside hidden folders (virtual environments, .git)."""
    found = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [name for name in subfolders if not name.startswith(".") and name != "__pycache__"]
        found += [Path(folder) / name for name in files if name.upper().startswith("README")]
    return found


def test_reference_pages_stay_under_30_kb():
    archive = ROOT / "docs" / "archive"
    pages = [p for p in (ROOT / "docs").rglob("*.md") if archive not in p.parents] + _readmes()
    assert ROOT / "README.md" in pages and ROOT / "docs" / "performance.md" in pages
    too_long = {str(p.relative_to(ROOT)): p.stat().st_size for p in pages if p.stat().st_size > REFERENCE_LIMIT}
    assert not too_long, (f"reference pages over {REFERENCE_LIMIT} bytes: {too_long}; move dated runs, superseded "
                          "figures and investigations to docs/archive/ (linked from the page), or split the page")
