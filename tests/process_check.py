"""Which child processes of this process are alive: every test asserts that it leaves none behind.

Shared by the main suite (tests/conftest.py) and the TorchRL compatibility suite (compat/).
"""

from __future__ import annotations

import os
import time

import psutil
import pytest

# Python's own per-interpreter helpers (started once for spawn/forkserver, gone with the interpreter),
# and the checkpoint tests' zygote (tests/fresh.py: a session fixture; what it forks is counted).
_INTERPRETER_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "fresh.serve()")


def _is_ray_service(command: str) -> bool:
    """A process of the session's local Ray (its daemons, agents and idle pooled workers, started by
    ``ray.init`` and gone with ``ray.shutdown``), as opposed to an actor a test left alive
    (``ray::<ActorClass>``, also what its forked children inherit)."""
    if command.startswith("ray::"):
        name = command.split()[0]
        return name.startswith("ray::IDLE") or name.endswith("Agent")
    return "/site-packages/ray/" in command


def _is_session_browser(command: str) -> bool:
    """A process of the monitor tests' headless Chromium (tests/browser.py: one per session, quit at
    its end), which starts and ends renderer processes as pages load."""
    program = command.split(" ", 1)[0]
    return program.startswith("/usr/lib/chromium/") or program.endswith("/chromedriver")


def children() -> set[int]:
    """Live descendants of this process, but the interpreter's helpers themselves (what a forkserver
    starts, e.g. ``"mp"`` nodes, is counted: it carries the forkserver's command line), Ray's and the
    session's browser."""
    me = psutil.Process(os.getpid())
    alive = set()
    for child in me.children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            command = " ".join(child.cmdline())
            helper = child.ppid() == me.pid and any(name in command for name in _INTERPRETER_HELPERS)
            if helper or _is_ray_service(command) or _is_session_browser(command):
                continue
            alive.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def process_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie waiting for its parent to reap it counts as exited)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def assert_no_children(before: set[int] | None = None, timeout: float = 5.0) -> None:
    """Fail if a child process (other than those in ``before``) is still alive after ``timeout``."""
    before = before or set()
    deadline = time.monotonic() + timeout
    left = children() - before
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = children() - before
    if left:
        details = []
        for pid in left:
            try:
                details.append(f"{pid}: {' '.join(psutil.Process(pid).cmdline())[:120]}")
            except psutil.NoSuchProcess:
                pass
        if details:
            for pid in left:  # do not let one leak poison the following tests
                try:
                    psutil.Process(pid).kill()
                except psutil.NoSuchProcess:
                    pass
            pytest.fail("child processes survived the test:\n" + "\n".join(details))
