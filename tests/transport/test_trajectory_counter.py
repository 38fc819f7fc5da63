"""The trajectory ids the ``mp`` workers of a collector share: a worker killed while it held the
counter's lock must not leave the others (and its replacement) waiting forever (docs/restarts.md)."""

from __future__ import annotations

import os
import signal

import pytest
from mocks import wait_until

from rlharvest.transport.mp import SharedTrajectoryCounter, mp_context

pytestmark = pytest.mark.timeout(60)


def _hold(counter: SharedTrajectoryCounter, record_pid: bool, ready) -> None:
    counter._lock.acquire()
    if record_pid:
        counter._value.numpy()[1] = os.getpid()
    ready.set()
    signal.pause()  # killed here, holding the lock


@pytest.mark.parametrize("record_pid", [True, False], ids=["holder-recorded", "killed-before-recording"])
def test_a_worker_killed_holding_the_lock_does_not_block_the_others(record_pid):
    ctx = mp_context()
    counter = SharedTrajectoryCounter(ctx, start=10)
    ready = ctx.Event()
    process = ctx.Process(target=_hold, args=(counter, record_pid, ready), daemon=True)
    process.start()
    assert ready.wait(30)
    os.kill(process.pid, signal.SIGKILL)
    process.join(30)
    assert not counter._lock.acquire(timeout=0.05)  # still taken by the dead worker
    counter.recover(process.pid)
    assert counter.take(3) == 10 and counter.take(1) == 13
    wait_until(lambda: counter.peek() == 14, 5.0, "the counter after two takes")


def test_recovering_a_worker_that_held_nothing_leaves_the_lock_alone():
    counter = SharedTrajectoryCounter(mp_context())
    counter.take(5)
    counter.recover(12345)
    assert counter.take(1) == 5
    assert counter._lock.acquire(timeout=1.0)  # released exactly once: taking it again works
    counter._lock.release()
