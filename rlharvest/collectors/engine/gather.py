"""How the batches of a collector's workers come back: one :class:`~.loops.BatchLoop` per way, chosen
by the collector's options as a ready :class:`Gathering` (docs/collection.md).

* :class:`Stacked` -> :class:`SyncStack`: every batch holds one rollout of every worker, asked of all at
  once and returned in worker order; with a preemptive threshold, the last workers are told to stop
  early once enough have answered.
* :class:`FirstReadyBatches` -> :class:`FirstReady`: every worker always has one request in flight;
  whichever answers first is served, and asked again (before the yield, or after it where weights
  pushed after a batch must reach it).
* :class:`PushedBatches` -> :class:`Pushed`: workers run free during iteration and push every batch
  unasked; the next batch of every worker is taken as it arrives (``DistributedSyncCollector``).

Each meets failed workers the same way: the fleet replaces the worker if its restart policy allows
(:meth:`~rlharvest.collectors.engine.fleet.Fleet.recover`, else the failure is raised), and the
replacement is asked again. Waiting time is recorded for ``stats()``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterator, Protocol

from tensordict import TensorDictBase

from ...errors import WorkerError, WorkerTimeoutError
from ...protocol import Command, Reply
from .loops import BatchLoop, LoopParts, assemble_sync, request_batch, valid_part
from .pushed import PushedBatchReceiver

__all__ = ["Gathering", "Stacked", "FirstReadyBatches", "PushedBatches", "SyncStack", "FirstReady", "Pushed"]


class Gathering(Protocol):
    """A way of gathering batches, as a collector's options hand it to the engine."""

    sync: bool
    """Every batch holds one rollout of every worker (its size changes as workers join and leave)."""
    stands_still: bool
    """The workers stand still between batches (False: they run free, so nothing can be asked of them at
    one moment: checkpoints, seeds and weight updates are refused)."""
    hooks_in_workers: bool
    """The pre/post-collect hooks run where the rollouts run (False: here, where batches are assembled)."""

    def loop(self, parts: LoopParts) -> BatchLoop:
        """The loop of one engine, given its collaborators."""


@dataclass(frozen=True)
class Stacked:
    """Every batch stacks (or concatenates) one rollout of every worker (``sync=True``)."""

    sync: ClassVar[bool] = True
    stands_still: ClassVar[bool] = True
    hooks_in_workers: ClassVar[bool] = True

    cat_results: str | int = "stack"
    """``"stack"`` or the dim the workers' batches are concatenated along."""
    preemptive_threshold: float | None = None
    """None (wait for every worker), or the fraction of workers after which the others are interrupted
    (their rollouts come back short, the missing steps marked with trajectory id -1)."""

    def loop(self, parts: LoopParts) -> SyncStack:
        return SyncStack(parts, self)


@dataclass(frozen=True)
class FirstReadyBatches:
    """Each batch is the first one ready (``sync=False``)."""

    sync: ClassVar[bool] = False
    stands_still: ClassVar[bool] = True
    hooks_in_workers: ClassVar[bool] = True

    relaunch_after_yield: bool = False
    """Ask a worker again only after its batch was yielded (weights the caller pushes after a batch
    reach it first); else it is asked again before the yield and collects while the caller trains."""

    def loop(self, parts: LoopParts) -> FirstReady:
        return FirstReady(parts, self.relaunch_after_yield)


@dataclass(frozen=True)
class PushedBatches:
    """The workers run free during iteration and push every batch; each batch stacks the next of each."""

    sync: ClassVar[bool] = True
    stands_still: ClassVar[bool] = False
    hooks_in_workers: ClassVar[bool] = True

    timeout: float
    """Seconds a worker may go without pushing a batch."""
    noun: str = "worker"
    """How errors name a worker."""

    def loop(self, parts: LoopParts) -> Pushed:
        return Pushed(parts, self.timeout, self.noun)


class SyncStack(BatchLoop):
    """One rollout of every worker per batch, in worker order.

    Args:
        parts: the loop's collaborators.
        way: how the workers' rollouts make one batch.
    """

    def __init__(self, parts: LoopParts, way: Stacked) -> None:
        super().__init__(parts)
        self.cat_results = way.cat_results
        self.preemptive_threshold = way.preemptive_threshold

    def _loop(self) -> Iterator[TensorDictBase | None]:
        tally, pacing = self.tally, self.parts.pacing
        while not tally.reached_total():
            pacing.before_batch(self.fleet.active)
            tally.iter += 1
            random = tally.random_phase()
            gathered = self.gather(random)  # {worker: reply}, workers that left have none
            batches, replies = [], []
            for worker, reply in gathered.items():
                batch, reply = self._fetched(worker, reply, random)
                if reply is not None:  # None: it left (preempted) while sending, its rollout handed back
                    batches.append(batch)
                    replies.append(reply)
            yield from self.emit([b for b in batches if b is not None], replies, assemble=self._assemble)
            self.after_yield(None)

    def _assemble(self, batches: list[TensorDictBase]) -> TensorDictBase:
        return assemble_sync(batches, self.cat_results, self.preemptive_threshold is not None)

    def _fetched(self, worker: int, reply: Reply | None, random: bool) -> tuple[TensorDictBase | None, Reply | None]:
        """The batch of ``reply`` and the reply; when the worker fails while sending it (nodes send
        batches after replying), its replacement collects the batch again."""
        fleet = self.fleet
        while True:
            try:
                if reply is None:
                    request_id = request_batch(fleet, worker, random)
                    if request_id is None:
                        return None, None
                    reply = fleet.requests.wait_for(worker, request_id)
                return self.take(worker, reply), reply
            except WorkerError as err:
                fleet.recover(err)
                reply = None

    def gather(self, random: bool) -> dict[int, Reply]:
        """The replies of one rollout of every worker (workers that left have none), in worker order."""
        requests = self.fleet.requests
        workers = self.fleet.active
        count = len(workers)
        ids = {w: request_batch(self.fleet, w, random) for w in workers}
        replies: dict[int, Reply] = {}
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
        self.parts.progress.add_seconds("waiting", time.perf_counter() - waiting)
        return {w: replies[w] for w in workers if w in replies}


class FirstReady(BatchLoop):
    """Every worker keeps one request in flight; batches are served in order of arrival, except that a
    worker's first batch goes first: while a worker that started (with the collector, or later: a
    replacement, an added worker) has not delivered one, the others' next batches wait.

    A start is where arrival order is least fair: workers become ready at different times (a Ray actor
    imports torch for seconds), and a worker that is ready first can deliver many small batches before
    another one delivers any. So the first batch comes from the first worker ready, and the next ones
    from the others, one each, before any worker's second batch (docs/collection.md).

    Args:
        parts: the loop's collaborators.
        relaunch_after_yield: ask a worker again only after its batch was yielded.
    """

    def __init__(self, parts: LoopParts, relaunch_after_yield: bool = False) -> None:
        super().__init__(parts)
        self.relaunch_after_yield = relaunch_after_yield
        #: ``{worker: request id}`` of the requests in flight
        self.requests_in_flight: dict[int, int] = {}
        #: the workers that delivered a batch since they started
        self._served: set[int] = set()

    def _loop(self) -> Iterator[TensorDictBase | None]:
        tally = self.tally
        while self.restored and not tally.reached_total():  # collected before the checkpoint
            worker, frames, batch = self.restored.pop(0)
            tally.iter += 1
            tally.frames += frames
            yield from self.emit([batch], [], counted=True)
            self.after_yield(worker)
        while not tally.reached_total():
            for worker in self.idle():
                self.relaunch(worker)
            got = self.next()
            if got is None:  # a worker failed: its batch is dropped, the loop asks its replacement again
                continue
            worker, reply = got
            try:
                batch = self.take(worker, reply)
            except WorkerError as err:  # it failed while sending the batch: asked again of its replacement
                self.fleet.recover(err)
                continue
            tally.iter += 1
            copying = time.perf_counter()
            batch = batch.clone() if batch is not None else None  # private: the worker reuses its buffer
            self.parts.progress.add_seconds("transport", time.perf_counter() - copying)
            tally.frames += self.count_frames([reply])
            if not self.relaunch_after_yield and not tally.reached_total():
                self.relaunch(worker)  # before yielding: the worker collects while the caller trains
            yield from self.emit([batch] if batch is not None else [], [reply], counted=True)
            self.after_yield(worker)

    def relaunch(self, worker: int) -> None:
        """Weights for ``worker`` if due, then its next request (replacing it if found failed)."""
        self.parts.pacing.before_relaunch(worker, started=self.tally.iter >= 0)
        self.launch(worker, self.tally.random_phase())

    def launch(self, worker: int, random: bool) -> None:
        """Ask ``worker`` for its next rollout (none when it left meanwhile)."""
        request_id = request_batch(self.fleet, worker, random)
        if request_id is not None:
            self.requests_in_flight[worker] = request_id

    def idle(self) -> list[int]:
        """The workers with no request in flight."""
        return [w for w in self.fleet.active if w not in self.requests_in_flight]

    def next(self) -> tuple[int, Reply] | None:
        """The first reply ready, with its worker; None when the worker that failed was replaced (its
        request is dropped: the caller asks the replacement again)."""
        waiting = time.perf_counter()
        try:
            worker, reply = self.fleet.requests.wait_any(self._awaited())
        except WorkerError as err:
            self.fleet.recover(err)
            return None
        self.parts.progress.add_seconds("waiting", time.perf_counter() - waiting)
        del self.requests_in_flight[worker]
        self._served.add(worker)
        return worker, reply

    def _awaited(self) -> dict[int, int]:
        """The requests :meth:`next` may serve: those of workers that delivered no batch since they
        started, while any of them has one in flight; else every request in flight."""
        first = {worker: request_id for worker, request_id in self.requests_in_flight.items()
                 if worker not in self._served}
        return first or self.requests_in_flight

    def in_flight(self) -> dict[int, int]:
        return dict(self.requests_in_flight)

    def forget(self, worker: int) -> None:
        """Drop ``worker``'s request in flight (it is being replaced, or leaves): a replacement starts
        anew, its first batch first."""
        self.requests_in_flight.pop(worker, None)
        self._served.discard(worker)
        super().forget(worker)

    def drain(self) -> None:
        """Wait until the requests in flight have answered, so workers are idle. Their batches are kept
        for :meth:`next` (nothing is lost; a worker's buffer is reused only after its batch is
        taken); a worker that failed meanwhile is replaced (restarts on), its rollout asked again later."""
        for worker, request_id in list(self.requests_in_flight.items()):
            try:
                self.fleet.requests.wait_arrived(worker, request_id)
            except WorkerError as err:
                self.fleet.recover(err)

    def drop(self) -> None:
        """Wait for the requests in flight and discard their batches: the workers are idle, and the
        next batches are collected from scratch. Each batch is still fetched: a transport may carry
        something in it that later batches need (a worker process shares its buffer in its first)."""
        requests = self.fleet.requests
        for worker, request_id in list(self.requests_in_flight.items()):
            del self.requests_in_flight[worker]
            try:
                reply = requests.wait_for(worker, request_id)
            except WorkerError as err:
                self.fleet.recover(err)
                continue
            if not reply.written and self.fetched_early.pop((worker, request_id), None) is None:
                requests.handles[worker].fetch_batch(reply)
        super().drop()


class Pushed(BatchLoop):
    """Workers run free and push every batch; the next batch of each worker is taken as it arrives.

    Args:
        parts: the loop's collaborators.
        timeout: seconds a worker may go without pushing a batch.
        noun: how errors name a worker.
    """

    def __init__(self, parts: LoopParts, timeout: float, noun: str = "worker") -> None:
        super().__init__(parts)
        self.timeout = timeout
        self.noun = noun

    def _loop(self) -> Iterator[TensorDictBase | None]:
        tally, pacing, ids = self.tally, self.parts.pacing, self.parts.ids
        if not self.pushing:
            self.fleet.requests.broadcast(Command.RUN_FREE)
            self.pushing = True
        while not tally.reached_total():
            pacing.before_pushed_batch()
            tally.iter += 1
            batches, frames = [], 0
            for node in self.fleet.active:
                reply, batch = self.next_of(node, lambda w, r: ids.remap(self.fetch(w, r), w))
                if reply is None:  # it left (preempted) and was not replaced
                    continue
                batches.append(valid_part(batch).clone() if reply.frames < batch.numel() else batch)
                frames += reply.frames
            tally.frames += frames
            pacing.pushed_batch_yielded()
            yield from self.emit(batches, [], counted=True, assemble=assemble_sync)

    def next_of(self, worker: int, fetch: Callable[[int, Reply], TensorDictBase]
                ) -> tuple[Reply | None, TensorDictBase | None]:
        """``worker``'s next pushed batch: the reply announcing it, and ``fetch(worker, reply)``. A
        worker that failed (also while its batch is fetched) is replaced (restarts on) and its
        replacement's next batch awaited instead, the one it was sending being dropped.

        Raises:
            TimeoutError: when ``worker`` pushed nothing for ``timeout`` seconds (restarts off).
        """
        fleet = self.fleet
        while True:
            try:
                waiting = time.perf_counter()
                got = fleet.requests.next_pushed(self.timeout, [worker])
                self.parts.progress.add_seconds("waiting", time.perf_counter() - waiting)
                if got is not None:
                    return got[1], fetch(worker, got[1])
                if worker in fleet.requests.retired:
                    return None, None
                if not fleet.restarts.enabled:
                    raise TimeoutError(f"{self.noun} {worker} pushed no batch within {self.timeout:g} s.")
                raise WorkerTimeoutError(f"pushed no batch within {self.timeout:g} s.", worker_idx=worker)
            except WorkerError as err:
                fleet.recover(err)
                if worker in fleet.requests.retired:  # preempted, not replaced: it has no next batch
                    return None, None

    def stop_pushing(self) -> None:
        """Stop workers that run free for iteration, taking what they pushed meanwhile (dropped)."""
        if not self.pushing:
            return
        receiver = PushedBatchReceiver(self.fleet, self.write_pushed)
        receiver.stop_requested.set()
        receiver.run()
        self.pushing = False
