"""A node's liveness as the main process sees it (DistWorkerHandle.is_alive, transport/torchdist.py)
when nobody drains the node's command channel: the weight sender waits for carriers or
acknowledgements without reading heartbeats, and an update longer than ``heartbeat_timeout`` must
not declare healthy nodes dead (issue 25, item 3)."""

from __future__ import annotations

import multiprocessing.connection as mpc
import socket
import threading
import time

import pytest

from mocks import wait_until
from rlharvest.transport.torchdist import DistWorkerHandle

pytestmark = pytest.mark.timeout(60)

HEARTBEAT_TIMEOUT = 0.5


class _Running:
    """The launcher's view of a node that runs."""

    pid = None

    def is_alive(self) -> bool:
        return True

    def ended(self, timeout: float = 0.0) -> bool:
        return False


@pytest.fixture
def node():
    """A handle on one end of a socket pair, and a thread beating on the other end until stopped."""
    ours, theirs = socket.socketpair()
    parent, child = mpc.Connection(ours.detach()), mpc.Connection(theirs.detach())
    handle = DistWorkerHandle(parent, None, 1, 0, _Running(), HEARTBEAT_TIMEOUT)
    stop = threading.Event()

    def beat() -> None:
        steps = 0
        while not stop.wait(0.05):
            steps += 1
            child.send(("hb", steps))

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    yield handle, stop
    stop.set()
    thread.join(5.0)
    parent.close()
    child.close()


def _checked_for(handle: DistWorkerHandle, seconds: float) -> list[bool]:
    """``is_alive()`` every ~10 ms for ``seconds``, without ever reading the channel (a busy caller)."""
    seen: list[bool] = []
    end = time.monotonic() + seconds

    def look() -> bool:
        seen.append(handle.is_alive())
        return time.monotonic() > end

    wait_until(look, timeout=seconds + 30, what="the end of the checks")
    return seen


def test_heartbeats_waiting_unread_keep_a_node_alive(node):
    handle, _ = node
    seen = _checked_for(handle, 4 * HEARTBEAT_TIMEOUT)
    assert all(seen), f"a beating node was declared dead after {seen.index(False)} checks"
    assert handle.poll(0) and handle.recv() is None  # the heartbeats are still there for whoever reads them


def test_a_node_that_stops_beating_is_declared_dead(node):
    handle, stop = node
    stop.set()
    wait_until(lambda: not handle.is_alive(), timeout=20, what="the silent node declared dead")
    assert handle.exit_description().startswith("no heartbeat for 0.5 s")
