"""Every Python block of README.md, docs/*.md and docs/archive/*.md runs as written (a wrong example
misleads more than none).

Sybil (https://sybil.readthedocs.io) reads the pages: it finds the fenced ``python`` blocks and its
HTML-comment directives, and runs each block in one namespace per page, in page order, so a block may
use what an earlier one of its page defined. We chose it over pytest-markdown-docs because the pages
need exactly those directives, all invisible on the rendered page:

* ``<!-- skip: next "fragment: <why>" -->`` before a block that cannot run here on purpose (it needs a
  SLURM cluster, say). Such a block is not collected at all (a skipped test proves nothing), and
  :func:`test_every_fragment_says_why` holds each to a reason;
* ``<!-- clear-namespace -->`` and ``<!-- invisible-code-block: python -->`` where a page needs them.

One directive is ours, read from the comment right above a block: ``<!-- pytest-mark: ray -->`` gives
the block's test that marker, so it runs with the session's Ray (``ray_session``) and is deselected by
``-m "not ray"`` like every Ray test.

Each block runs with ``__name__ == "__main__"`` (examples written as scripts run their main part) in a
temporary working directory of its page (files they write stay out of the checkout), and as in an
activated venv: ``python`` on the ``PATH`` is this interpreter (the join command a node runs).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from sybil import Sybil
from sybil.evaluators.skip import Skipper
from sybil.parsers.markdown import ClearNamespaceParser, PythonCodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "archive").glob("*.md"))]
MARK = re.compile(r"<!--\s*pytest-mark:\s*([\w-]+)\s*-->\s*\Z")
MARK_RAY = re.compile(r"^<!--\s*pytest-mark:\s*ray\s*-->", re.M)
FRAGMENT = re.compile(r"""\s*(["'])fragment: \S.*\1\s*\Z""")


def _documents():
    sybil = Sybil(parsers=[PythonCodeBlockParser(), SkipParser(), ClearNamespaceParser()])
    for page in PAGES:
        document = sybil.parse(page)
        document.namespace["__name__"] = "__main__"
        yield page, document


def _collect() -> tuple[list, list]:
    """``(runnable blocks as pytest params, (page, line, skip arguments) of every skip directive)``."""
    params, skips = [], []
    for page, document in _documents():
        skip_next = False
        # A page's blocks share one namespace, in page order: they run in one pytest process (with -n),
        # the Ray tests' one for a page with a Ray block.
        group = pytest.mark.xdist_group("ray" if MARK_RAY.search(document.text) else "docs")
        for example in document.examples():
            where = f"{page.relative_to(ROOT)}:{example.line}"
            if isinstance(example.region.evaluator, Skipper):
                action, reason = example.parsed
                skips.append((where, action, reason))
                skip_next = action == "next"
                continue
            if skip_next:  # a fragment: not run, and not reported as a skipped test either
                skip_next = False
                continue
            mark = MARK.search(document.text, 0, example.region.start)
            marks = [getattr(pytest.mark, mark.group(1)), group] if mark else [group]
            params.append(pytest.param(page, example, id=where, marks=marks))
    return params, skips


BLOCKS, SKIPS = _collect()
WORKDIRS: dict[Path, Path] = {}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page, example", BLOCKS)
def test_block_runs_as_written(page, example, request, tmp_path_factory, monkeypatch):
    if request.node.get_closest_marker("ray"):
        request.getfixturevalue("ray_session")
    if page not in WORKDIRS:  # one folder per page: a later block may read what an earlier one wrote
        WORKDIRS[page] = tmp_path_factory.mktemp(page.stem)
    monkeypatch.chdir(WORKDIRS[page])
    monkeypatch.setenv("PATH", os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    example.evaluate()


def test_every_fragment_says_why():
    malformed = [(where, action, reason) for where, action, reason in SKIPS
                 if action != "next" or not reason or not FRAGMENT.match(reason)]
    assert not malformed, f'write <!-- skip: next "fragment: <why it cannot run here>" -->, got {malformed}'


def test_every_page_with_python_is_read():
    # README.md and the pages that show Python: a parser that found nothing would pass silently
    pages = {Path(param.values[0]).name for param in BLOCKS}
    assert {"README.md", "checkpoints.md", "evaluation.md", "ray.md", "elastic.md", "autoscaling.md"} <= pages, pages
