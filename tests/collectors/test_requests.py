"""The worker pool on the in-process backend: requests and replies matched by id, bounded waits that
notice dead and silent workers, and a handle swapped in for a replaced worker. Milliseconds."""

from __future__ import annotations

import os
import time

import pytest
from mocks import ConstantObsEnv

from rlharvest import WorkerError, WorkerTimeoutError
from rlharvest.collectors import Collector
from rlharvest.collectors.engine.requests import WorkerRequests
from rlharvest.envs import CountingEnv
from rlharvest.protocol import READY, Command, Reply, WorkerSpec
from rlharvest.transport.base import WorkerHandle
from rlharvest.transport.inprocess import InProcessBackend
from rlharvest.worker import run_worker

pytestmark = pytest.mark.timeout(30)


def spec(worker: int, env=CountingEnv, frames: int = 4) -> WorkerSpec:
    return WorkerSpec(worker, Collector, env, {"frames_per_batch": frames})


@pytest.fixture
def pool_of():
    backends = []

    def start(*specs: WorkerSpec, timeout: float = 10.0) -> tuple[WorkerRequests, InProcessBackend]:
        backend = InProcessBackend(len(specs), run_worker)
        backends.append(backend)
        pool = WorkerRequests(backend.start_all(list(specs)), timeout=timeout)
        for worker in range(len(specs)):
            pool.wait_for(worker, READY)
        return pool, backend

    yield start
    for backend in backends:
        backend.stop_all(time.monotonic() + 5.0)


def test_requests_and_broadcasts(pool_of):
    pool, _ = pool_of(spec(0), spec(1))
    assert pool.broadcast(Command.GETATTR_ENV, "max_steps") == [5, 5]
    assert pool.request(1, Command.SEED, (10, False)) == 11


def test_a_reply_that_arrives_while_another_is_awaited_is_kept(pool_of):
    pool, _ = pool_of(spec(0))
    collect = pool.send(0, Command.COLLECT, (False, 0))
    assert pool.request(0, Command.GETATTR_ENV, "max_steps") == 5  # answered after the batch
    assert pool.has_reply(0, collect)
    assert pool.wait_for(0, collect).frames == 4


def test_wait_any_returns_the_first_ready(pool_of):
    slow = lambda: ConstantObsEnv(value=1, delay=0.05)  # noqa: E731
    pool, _ = pool_of(spec(0, slow, frames=8), spec(1))
    requests = {w: pool.send(w, Command.COLLECT, (False, 0)) for w in (0, 1)}
    worker, reply = pool.wait_any(requests)
    assert worker == 1 and reply.frames == 4
    assert pool.wait_for(0, requests[0]).frames == 8


def test_a_dead_worker_is_named_and_a_replacement_is_talked_to(pool_of):
    pool, backend = pool_of(spec(0), spec(1))
    backend.stop_one(1, time.monotonic())
    with pytest.raises(WorkerError) as info:
        pool.request(1, Command.GETATTR_ENV, "max_steps")
    assert info.value.worker_idx == 1 and "died" in str(info.value)
    assert pool.is_dead(1)
    pool.replace(1, backend.start_one(1, spec(1)))
    pool.wait_for(1, READY)
    assert not pool.is_dead(1) and pool.request(1, Command.GETATTR_ENV, "max_steps") == 5


def test_no_answer_and_no_progress_times_out(pool_of):
    stuck = lambda: ConstantObsEnv(delay=1.0)  # noqa: E731  (one step outlasts the pool's timeout)
    pool, _ = pool_of(spec(0, stuck, frames=1), timeout=0.2)
    with pytest.raises(WorkerTimeoutError) as info:
        pool.request(0, Command.COLLECT, (False, 0))
    assert info.value.worker_idx == 0 and "'collect'" in str(info.value)
    assert 0 in pool.unresponsive


class AnsweringHandle(WorkerHandle):
    """A worker that answers every command at once (its replies wait in a queue)."""

    def __init__(self, worker_idx: int) -> None:
        self.worker_idx = worker_idx
        self.replies: list = [Reply(READY, worker_idx)]  # built at once
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
    pool = WorkerRequests(handles, timeout=5.0)
    for worker in (0, 1):
        pool.wait_for(worker, READY)
    requests = {1: pool.send(1, Command.COLLECT), 0: pool.send(0, Command.COLLECT)}
    served = []
    for _ in range(6):
        worker, reply = pool.wait_any(requests)
        served.append(worker)
        requests[worker] = pool.send(worker, Command.COLLECT)  # re-launched: its request is now the newest
    assert served == [1, 0, 1, 0, 1, 0]
    for handle in handles:
        handle.terminate(0.0)


def test_wait_any_reports_a_stuck_worker_while_another_keeps_answering(pool_of):
    stuck = lambda: ConstantObsEnv(delay=1.0)  # noqa: E731  (one step outlasts the pool's timeout)
    pool, _ = pool_of(spec(0, stuck, frames=1), spec(1), timeout=0.3)
    requests = {0: pool.send(0, Command.COLLECT, (False, 0)), 1: pool.send(1, Command.COLLECT, (False, 0))}
    deadline = time.monotonic() + 10.0
    with pytest.raises(WorkerTimeoutError) as info:
        while time.monotonic() < deadline:  # worker 1 answers every time it is asked, worker 0 never
            worker, _ = pool.wait_any(requests)
            assert worker == 1
            requests[1] = pool.send(1, Command.COLLECT, (False, 0))
    assert info.value.worker_idx == 0
