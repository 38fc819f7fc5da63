"""The monitor tests' headless Chromium: one per pytest process (tests/browser.py), started before any
test's check of child processes (a session fixture) and quit at the session's end."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def browser():
    from browser import Browser

    started = Browser()
    yield started
    started.quit()
