"""WorkerPool: which reply an async wait serves when several arrived."""

from __future__ import annotations

import os

import pytest

from rlharvest.collectors._pool import WorkerPool
from rlharvest.transport.base import WorkerHandle
from rlharvest.worker import Command, Reply

pytestmark = pytest.mark.timeout(30)


class AnsweringHandle(WorkerHandle):
    """A worker that answers every command at once (its replies wait in a queue)."""

    def __init__(self, worker_idx: int) -> None:
        self.worker_idx = worker_idx
        self.replies: list = []
        self._r, self._w = os.pipe()

    def send(self, message) -> None:
        self.replies.append(Reply(message.request_id, self.worker_idx, value=self.worker_idx))

    def poll(self, timeout: float = 0.0) -> bool:
        return bool(self.replies)

    def recv(self):
        return self.replies.pop(0)

    def fileno(self) -> int:
        return self._r

    def is_alive(self) -> bool:
        return True

    def fetch_batch(self, reply):
        return reply.value

    def terminate(self, deadline: float) -> None:
        os.close(self._r)
        os.close(self._w)


def test_wait_any_serves_the_oldest_request_not_the_lowest_index():
    """A fast worker re-launched after every batch must not starve one whose batch is waiting."""
    handles = [AnsweringHandle(0), AnsweringHandle(1)]
    pool = WorkerPool(handles, timeout=5.0, expect_ready=False)
    requests = {1: pool.send(1, Command.COLLECT), 0: pool.send(0, Command.COLLECT)}
    served = []
    for _ in range(6):
        worker, reply = pool.wait_any(requests)
        served.append(worker)
        requests[worker] = pool.send(worker, Command.COLLECT)  # re-launched: its request is now the newest
    assert served == [1, 0, 1, 0, 1, 0]
    for handle in handles:
        handle.terminate(0.0)
