"""The examples in rlharvest's docstrings run and print what they say (a wrong example misleads more
than none)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import rlharvest

# the demo trains for minutes; the extras' modules import their engine on use, not at import
MODULES = sorted(info.name for info in pkgutil.walk_packages(rlharvest.__path__, "rlharvest.")
                 if not info.name.startswith("rlharvest.demo"))


@pytest.mark.timeout(120)
def test_every_docstring_example_runs_as_written():
    failures, attempted = [], 0
    for name in MODULES:
        module = importlib.import_module(name)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        for test in doctest.DocTestFinder(exclude_empty=True).find(module, name):
            if test.examples and test.filename and test.filename.endswith(".py"):
                attempted += runner.run(test, out=lambda text: failures.append(text)).attempted
    assert not failures, "".join(failures)
    assert attempted > 50  # the examples were found and run
