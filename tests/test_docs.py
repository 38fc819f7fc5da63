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

What a block prints is checked: a block that prints is followed by an ``output`` block showing it,
which must match what it printed (doctest's comparison with ``ELLIPSIS``: ``...`` stands for what
varies from run to run, a port, a path, a figure of a learning run; a last line ``...`` for any
further lines, or none); a block that prints with no
``output`` block after it fails, as does an ``output`` block after a block that printed something
else. A block written as a doctest (``>>>`` lines) is checked by Sybil's doctest parser.

One directive is ours, read from the comment right above a block: ``<!-- pytest-mark: ray -->`` gives
the block's test that marker, so it runs with the session's Ray (``ray_session``) and is deselected by
``-m "not ray"`` like every Ray test.

Each block runs with ``__name__ == "__main__"`` (examples written as scripts run their main part) in a
temporary working directory of its page (files they write stay out of the checkout), and as in an
activated venv: ``python`` on the ``PATH`` is this interpreter (the join command a node runs).
"""

from __future__ import annotations

import contextlib
import doctest
import io
import os
import re
import sys
from pathlib import Path

import pytest
from sybil import Sybil
from sybil.evaluators.skip import Skipper
from sybil.parsers.markdown import ClearNamespaceParser, CodeBlockParser, PythonCodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "archive").glob("*.md"))]
MARK = re.compile(r"<!--\s*pytest-mark:\s*([\w-]+)\s*-->\s*\Z")
MARK_RAY = re.compile(r"^<!--\s*pytest-mark:\s*ray\s*-->", re.M)
FRAGMENT = re.compile(r"""\s*(["'])fragment: \S.*\1\s*\Z""")


def _shown(example) -> None:
    raise AssertionError("an output block is compared with the block before it, never run")


def _documents():
    sybil = Sybil(parsers=[PythonCodeBlockParser(), SkipParser(), ClearNamespaceParser(),
                           CodeBlockParser(language="output", evaluator=_shown)])
    for page in PAGES:
        document = sybil.parse(page)
        document.namespace["__name__"] = "__main__"
        yield page, document


def _collect() -> tuple[list, list, list]:
    """``(runnable blocks as pytest params (page, block, the output block after it or None), (page, line,
    skip arguments) of every skip directive, output blocks that follow no runnable block)``."""
    params, skips, stray = [], [], []
    for page, document in _documents():
        skip_next, last = False, None
        # A page's blocks share one namespace, in page order: they run in one pytest process (with -n),
        # the Ray tests' one for a page with a Ray block.
        group = pytest.mark.xdist_group("ray" if MARK_RAY.search(document.text) else "docs")
        for example in document.examples():
            where = f"{page.relative_to(ROOT)}:{example.line}"
            if example.region.evaluator is _shown:
                if last is None or last.values[2] is not None:
                    stray.append(where)
                else:
                    params[-1] = last = pytest.param(page, last.values[1], example, id=last.id, marks=last.marks)
                continue
            last = None
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
            params.append(last := pytest.param(page, example, None, id=where, marks=marks))
    return params, skips, stray


BLOCKS, SKIPS, STRAY_OUTPUTS = _collect()
WORKDIRS: dict[Path, Path] = {}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page, example, shown", BLOCKS)
def test_block_runs_as_written_and_prints_what_the_page_shows(page, example, shown, request, tmp_path_factory,
                                                               monkeypatch):
    if request.node.get_closest_marker("ray"):
        request.getfixturevalue("ray_session")
    if page not in WORKDIRS:  # one folder per page: a later block may read what an earlier one wrote
        WORKDIRS[page] = tmp_path_factory.mktemp(page.stem)
    monkeypatch.chdir(WORKDIRS[page])
    monkeypatch.setenv("PATH", os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        example.evaluate()
    check_printed(printed.getvalue(), shown.parsed if shown is not None else None)


def check_printed(printed: str, shown: str | None) -> None:
    """``printed`` matches the output block ``shown`` (``...`` matches anything), or the block printed
    nothing and the page shows no output.

    Raises:
        AssertionError: saying what was printed and what the page shows.
    """
    if shown is None:
        assert not printed, f"the block prints, but the page shows no output block after it:\n{printed}"
        return
    if shown.endswith("\n...\n"):  # a last line "..." stands for any further lines, or none
        shown = shown[:-1]
    if not doctest.OutputChecker().check_output(shown, printed, doctest.ELLIPSIS):
        raise AssertionError(f"the page shows:\n{shown}\nthe block printed:\n{printed}")


@pytest.mark.parametrize("printed, shown, matches", [
    ("1\n", "1\n", True), ("2\n", "1\n", False), ("", None, True), ("1\n", None, False),
    ("/usr/bin/python -m rlharvest node --join 127.0.0.1:40123\n", "... -m rlharvest node --join 127.0.0.1:...\n",
     True),
    ("[-15, -15]\n", "[0, 0]\n", False), ("step 1: a\n", "step 1: ...\n...\n", True),
    ("step 1: a\nstep 2: b\n", "step 1: ...\n...\n", True), ("step 2: b\n", "step 1: ...\n...\n", False)])
def test_printed_output_is_compared_with_the_output_block(printed, shown, matches):
    if matches:
        check_printed(printed, shown)
    else:
        with pytest.raises(AssertionError):
            check_printed(printed, shown)


def test_every_output_block_follows_a_block_that_runs():
    assert not STRAY_OUTPUTS, f"output blocks after no runnable block (or after another output block): {STRAY_OUTPUTS}"


def test_every_fragment_says_why():
    malformed = [(where, action, reason) for where, action, reason in SKIPS
                 if action != "next" or not reason or not FRAGMENT.match(reason)]
    assert not malformed, f'write <!-- skip: next "fragment: <why it cannot run here>" -->, got {malformed}'


def test_every_page_with_python_is_read():
    # README.md and the pages that show Python: a parser that found nothing would pass silently
    pages = {Path(param.values[0]).name for param in BLOCKS}
    assert {"README.md", "checkpoints.md", "evaluation.md", "ray.md", "elastic.md", "autoscaling.md"} <= pages, pages
