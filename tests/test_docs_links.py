"""Every relative link in README.md, docs/*.md and benchmarks/README.md points to a file that exists,
and every docs page is listed in docs/index.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
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
