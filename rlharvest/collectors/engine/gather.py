"""How the batches of a collector's workers come back: one small class per way.

* :class:`SyncStack`: every batch holds one rollout of every worker, asked of all at once and
  returned in worker order; with a preemptive threshold, the last workers are told to stop early
  once enough have answered.
* :class:`FirstReady`: every worker always has one request in flight; whichever answers first is
  served, and asked again.
* :class:`Pushed`: workers run free and push every batch unasked; the next batch of a given worker
  is taken as it arrives.

Each meets failed workers the same way: the fleet replaces the worker if its restart policy allows
(:meth:`~rlharvest.collectors.engine.fleet.Fleet.recover`, else the failure is raised), and the
replacement is asked again. Waiting time is recorded for ``stats()``.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from tensordict import TensorDictBase

from ...errors import WorkerError, WorkerTimeoutError
from ...protocol import Command
from .fleet import Fleet
from .progress import ProgressMeter

__all__ = ["SyncStack", "FirstReady", "Pushed", "request_batch"]


def request_batch(fleet: Fleet, worker: int, random: bool) -> int | None:
    """Ask ``worker`` for one rollout (random actions when ``random``), replacing it first when it is
    found failed (restarts on); interrupts issued from now on stop that rollout. Returns the
    request id, or None when the worker left (preempted, not replaced: docs/elastic.md)."""
    while True:
        if worker in fleet.requests.retired:
            return None
        try:
            mark = fleet.requests.handles[worker].interrupt_mark()
            return fleet.requests.send(worker, Command.COLLECT, (bool(random), mark))
        except WorkerError as err:
            fleet.recover(err)


class SyncStack:
    """One rollout of every worker per batch, in worker order.

    Args:
        fleet: the workers.
        progress: where waiting time is recorded.
        preemptive_threshold: None (wait for every worker), or the fraction of workers after which
            the others are interrupted (their rollouts come back short, the missing steps marked
            with trajectory id -1).
    """

    def __init__(self, fleet: Fleet, progress: ProgressMeter,
                 preemptive_threshold: float | None = None) -> None:
        self.fleet = fleet
        self.progress = progress
        self.preemptive_threshold = preemptive_threshold

    def gather(self, random: bool) -> dict[int, Any]:
        """The replies of one rollout of every worker (workers that left have none), in worker order."""
        requests = self.fleet.requests
        workers = self.fleet.active
        count = len(workers)
        ids = {w: request_batch(self.fleet, w, random) for w in workers}
        replies: dict[int, Any] = {}
        waiting = time.perf_counter()

        def ask_again(failed: int) -> None:
            """Its batch is dropped and asked again of its replacement; a worker that left has none."""
            replies.pop(failed, None)
            ids[failed] = request_batch(self.fleet, failed, random)
            if ids[failed] is None:
                del ids[failed]

        for worker in [w for w, request_id in ids.items() if request_id is None]:
            del ids[worker]
        if self.preemptive_threshold is None:
            for worker in workers:
                while worker in ids and worker not in replies:
                    try:
                        replies[worker] = requests.wait_for(worker, ids[worker])
                    except WorkerError as err:
                        ask_again(self.fleet.recover(err))
        else:
            needed = int(count * self.preemptive_threshold)
            while len(replies) < len(ids):
                if len(replies) >= needed:
                    for worker in ids:
                        if worker not in replies:
                            requests.handles[worker].interrupt()
                try:
                    worker, reply = requests.wait_any({w: r for w, r in ids.items() if w not in replies})
                except WorkerError as err:  # asked again of its replacement
                    ask_again(self.fleet.recover(err))
                    continue
                replies[worker] = reply
        self.progress.add_seconds("waiting", time.perf_counter() - waiting)
        return {w: replies[w] for w in workers if w in replies}

    def drain(self) -> None:
        """Nothing is in flight between two batches."""

    def drop(self) -> None:
        """Nothing is in flight between two batches."""

    def forget(self, worker: int) -> None:
        """Nothing is in flight between two batches."""


class FirstReady:
    """Every worker keeps one request in flight; batches are served in order of arrival, except that a
    worker's first batch goes first: while a worker that started (with the collector, or later: a
    replacement, an added worker) has not delivered one, the others' next batches wait.

    A start is where arrival order is least fair: workers become ready at different times (a Ray actor
    imports torch for seconds), and a worker that is ready first can deliver many small batches before
    another one delivers any. So the first batch comes from the first worker ready, and the next ones
    from the others, one each, before any worker's second batch (docs/collection.md).

    Args:
        fleet: the workers.
        progress: where waiting time is recorded.
    """

    def __init__(self, fleet: Fleet, progress: ProgressMeter) -> None:
        self.fleet = fleet
        self.progress = progress
        #: ``{worker: request id}`` of the requests in flight
        self.in_flight: dict[int, int] = {}
        #: the workers that delivered a batch since they started
        self._served: set[int] = set()

    def launch(self, worker: int, random: bool) -> None:
        """Ask ``worker`` for its next rollout (none when it left meanwhile)."""
        request_id = request_batch(self.fleet, worker, random)
        if request_id is not None:
            self.in_flight[worker] = request_id

    def idle(self) -> list[int]:
        """The workers with no request in flight."""
        return [w for w in self.fleet.active if w not in self.in_flight]

    def next(self) -> tuple[int, Any] | None:
        """The first reply ready, with its worker; None when the worker that failed was replaced (its
        request is dropped: the caller asks the replacement again)."""
        waiting = time.perf_counter()
        try:
            worker, reply = self.fleet.requests.wait_any(self._awaited())
        except WorkerError as err:
            self.fleet.recover(err)
            return None
        self.progress.add_seconds("waiting", time.perf_counter() - waiting)
        del self.in_flight[worker]
        self._served.add(worker)
        return worker, reply

    def _awaited(self) -> dict[int, int]:
        """The requests :meth:`next` may serve: those of workers that delivered no batch since they
        started, while any of them has one in flight; else every request in flight."""
        first = {worker: request_id for worker, request_id in self.in_flight.items() if worker not in self._served}
        return first or self.in_flight

    def forget(self, worker: int) -> None:
        """Drop ``worker``'s request in flight (it is being replaced, or leaves): a replacement starts
        anew, its first batch first."""
        self.in_flight.pop(worker, None)
        self._served.discard(worker)

    def drain(self) -> None:
        """Wait until the requests in flight have answered, so workers are idle. Their batches are kept
        for :meth:`next` (nothing is lost; a worker's buffer is reused only after its batch is
        taken); a worker that failed meanwhile is replaced (restarts on), its rollout asked again later."""
        for worker, request_id in list(self.in_flight.items()):
            try:
                self.fleet.requests.wait_arrived(worker, request_id)
            except WorkerError as err:
                self.fleet.recover(err)


    def drop(self) -> None:
        """Wait for the requests in flight and discard their replies: the workers are idle, and the
        next batches are collected from scratch."""
        for worker, request_id in list(self.in_flight.items()):
            del self.in_flight[worker]
            try:
                self.fleet.requests.wait_for(worker, request_id)
            except WorkerError as err:
                self.fleet.recover(err)


class Pushed:
    """Workers run free and push every batch; the next batch of each worker is taken as it arrives.

    Args:
        fleet: the workers (told to run free by the caller).
        progress: where waiting time is recorded.
        timeout: seconds a worker may go without pushing a batch.
        noun: how errors name a worker.
    """

    def __init__(self, fleet: Fleet, progress: ProgressMeter, timeout: float,
                 noun: str = "worker") -> None:
        self.fleet = fleet
        self.progress = progress
        self.timeout = timeout
        self.noun = noun

    def next_of(self, worker: int, fetch: Callable[[int, Any], TensorDictBase]) -> tuple[Any, TensorDictBase]:
        """``worker``'s next pushed batch: the reply announcing it, and ``fetch(worker, reply)``. A
        worker that failed (also while its batch is fetched) is replaced (restarts on) and its
        replacement's next batch awaited instead, the one it was sending being dropped.

        Raises:
            TimeoutError: when ``worker`` pushed nothing for ``timeout`` seconds (restarts off).
        """
        while True:
            try:
                waiting = time.perf_counter()
                got = self.fleet.requests.next_pushed(self.timeout, [worker])
                self.progress.add_seconds("waiting", time.perf_counter() - waiting)
                if got is not None:
                    return got[1], fetch(worker, got[1])
                if worker in self.fleet.requests.retired:
                    return None, None
                if not self.fleet.restarts.enabled:
                    raise TimeoutError(f"{self.noun} {worker} pushed no batch within {self.timeout:g} s.")
                raise WorkerTimeoutError(f"pushed no batch within {self.timeout:g} s.", worker_idx=worker)
            except WorkerError as err:
                self.fleet.recover(err)
                if worker in self.fleet.requests.retired:  # preempted, not replaced: it has no next batch
                    return None, None

    def drain(self) -> None:
        """Pushed batches wait where they are; nothing to wait for."""

    def drop(self) -> None:
        """Nothing is asked of a worker running free."""

    def forget(self, worker: int) -> None:
        """Nothing is asked of a worker running free."""
