"""The parent's side of the worker loop: send commands, match replies, never wait unboundedly.

:class:`WorkerRequests` works with any :class:`~rlharvest.transport.base.WorkerHandle` (processes,
torch.distributed nodes, RPC nodes). Every wait

* multiplexes the workers' descriptors (``multiprocessing.connection.wait``),
* wakes up at least every ``liveness_interval`` seconds to check that the awaited workers are alive
  (a dead one raises :class:`WorkerError` naming it and saying how it died),
* is bounded: no reply and no progress for ``timeout`` seconds raises :class:`WorkerTimeoutError`.

Replies are matched to requests by id; a reply that arrives while another is awaited (an async
BATCH while waiting for a ``state_dict``) is kept until someone asks for it. A worker it saw
die stays dead until :meth:`WorkerRequests.replace` swaps a new handle in for it. A worker that left
(:meth:`WorkerRequests.retire`, docs/elastic.md) keeps its index as an empty slot: nothing is sent
to it any more, and :meth:`WorkerRequests.active` leaves it out.
"""

from __future__ import annotations

import collections
import itertools
import multiprocessing.connection
import time
from collections import defaultdict
from typing import Any, Callable, Iterable, Sequence

from ...errors import WorkerError, WorkerTimeoutError
from ...transport.base import DEPARTED, WorkerHandle
from ...protocol import FREE_BATCH, LEAVING, READY, Command, Message, Reply

__all__ = ["WorkerRequests"]


class WorkerRequests:
    """Commands and replies for a set of workers (one can be replaced, and more added).

    Args:
        handles: one handle per worker, in worker-index order.
        timeout: seconds a worker may take to answer (while making no progress) before
            :class:`WorkerTimeoutError`.
        liveness_interval: how often liveness is checked during a wait.
        noun: how errors name a worker ("worker", "node").
        on_collect: ``on_collect(worker, request_id)`` once each COLLECT request was sent (the collector
            measures how long the worker held its batch, ``stats()``), or None.
    """

    #: request id of the reply every worker sends once it is built (or failed to build)
    READY = READY

    def __init__(self, handles: Sequence[WorkerHandle], timeout: float, liveness_interval: float = 0.2,
                 noun: str = "worker", on_collect: Callable[[int, int], None] | None = None) -> None:
        self.handles = list(handles)
        self.on_collect = on_collect
        self.timeout = float(timeout)
        self.liveness_interval = liveness_interval
        self.noun = noun
        self._ids = itertools.count(1)
        self._stash: dict[int, dict[int, Reply]] = defaultdict(dict)
        self._outstanding: dict[int, dict[int, Command]] = defaultdict(dict)
        self._dead: set[int] = set()
        #: workers that timed out: shutdown does not wait for them to answer
        self.unresponsive: set[int] = set()
        self._free: collections.deque = collections.deque()
        #: workers that left (removed, preempted): their indices stay, as empty slots
        self.retired: set[int] = set()
        #: workers that said they leave (preempted: SIGTERM), with what they did with their rollout
        self.leaving: dict[int, str] = {}
        #: wait_any's deadline of each ``(worker, request_id)``, kept until its reply is taken
        self._deadlines: dict[tuple[int, int], _Deadline] = {}
        #: ``(worker, request_id)`` given up by :meth:`values_within`: their late replies are discarded
        self._abandoned: set[tuple[int, int]] = set()
        for worker in range(len(self.handles)):  # every worker answers READY once built (or failed)
            self._outstanding[worker][self.READY] = None

    def __len__(self) -> int:
        return len(self.handles)

    def active(self) -> list[int]:
        """The indices of the workers that have not left, in order."""
        return [worker for worker in range(len(self.handles)) if worker not in self.retired]

    def retire(self, worker: int) -> None:
        """``worker`` left (its process is gone): forget what it had outstanding, stashed or pushed, and
        leave its index empty; sending to it raises from now on."""
        self.forget(worker)
        self.retired.add(worker)
        self._dead.add(worker)
        self.leaving.pop(worker, None)
        self.unresponsive.discard(worker)
        self.handles[worker] = DEPARTED  # what the worker's handle held goes with it
        self._free = collections.deque(item for item in self._free if item[0] != worker)

    def take_pushed(self, worker: int) -> list[Reply]:
        """Take every batch ``worker`` pushed (running free) that nobody took yet, oldest first."""
        self._drain(worker)
        mine = [reply for index, reply in self._free if index == worker]
        self._free = collections.deque(item for item in self._free if item[0] != worker)
        return mine

    def replace(self, worker: int, handle: WorkerHandle) -> None:
        """Talk to ``handle`` as ``worker`` from now on (a replacement): what was outstanding, stashed
        or pushed for the old one is dropped, and its READY reply is expected."""
        self.handles[worker] = handle
        self.forget(worker)
        self.leaving.pop(worker, None)
        self.retired.discard(worker)
        self._dead.discard(worker)
        self.unresponsive.discard(worker)
        self._free = collections.deque(item for item in self._free if item[0] != worker)
        self._outstanding[worker][self.READY] = None

    def add(self, handle: WorkerHandle) -> int:
        """Talk to ``handle`` as a new worker after the others (a collector that grew); its READY
        reply is expected. Returns its index."""
        worker = len(self.handles)
        self.handles.append(handle)
        self.replace(worker, handle)
        return worker

    def truncate(self, count: int) -> None:
        """Forget the workers from index ``count`` on (undoing :meth:`add` for workers that failed to start)."""
        for worker in range(count, len(self.handles)):
            self.forget(worker)
            self._dead.discard(worker)
            self.retired.discard(worker)
            self.unresponsive.discard(worker)
        self._free = collections.deque(item for item in self._free if item[0] < count)
        del self.handles[count:]

    # ------------------------------------------------------------------ sending
    def send(self, worker: int, command: Command, payload: Any = None) -> int:
        """Send a command; returns its request id.

        Raises:
            ValueError: for a worker that left (its index is an empty slot).
            WorkerError: for a worker found dead.
        """
        if worker in self.retired:
            raise ValueError(f"{self.noun} {worker} was removed from this collector: nothing can be sent to it.")
        if worker in self._dead:
            raise self._death_error(worker, command)
        request_id = next(self._ids)
        try:
            self.handles[worker].send(Message(command, request_id, payload))
        except (BrokenPipeError, EOFError, OSError, ConnectionError) as err:
            self._drain(worker)
            self._dead.add(worker)
            self._settle_start(worker)
            raise self._death_error(worker, command) from err
        self._outstanding[worker][request_id] = command
        if command is Command.COLLECT and self.on_collect is not None:
            self.on_collect(worker, request_id)
        return request_id

    def request(self, worker: int, command: Command, payload: Any = None, timeout: float | None = None) -> Any:
        """Send a command and return the value of its reply."""
        request_id = self.send(worker, command, payload)
        return self.wait_for(worker, request_id, timeout).value

    def broadcast(self, command: Command, payload: Any = None, workers: Iterable[int] | None = None,
                  timeout: float | None = None) -> list[Any]:
        """Send to several workers at once, then gather their values in worker order."""
        workers = self.active() if workers is None else list(workers)
        ids = {w: self.send(w, command, payload) for w in workers}
        return [self.wait_for(w, ids[w], timeout).value for w in workers]

    # ------------------------------------------------------------------ receiving
    def wait_for(self, worker: int, request_id: int, timeout: float | None = None) -> Reply:
        """The reply to ``request_id`` (raising its failure, if any)."""
        self.wait_arrived(worker, request_id, timeout)
        return self._take(worker, request_id)

    def wait_arrived(self, worker: int, request_id: int, timeout: float | None = None) -> None:
        """Wait until the reply to ``request_id`` arrived, leaving it for whoever takes it."""
        deadline = _Deadline(self.timeout if timeout is None else timeout, self.handles[worker])
        while request_id not in self._stash[worker]:
            self._wait({worker: request_id}, {worker: deadline})

    def wait_any(self, requests: dict[int, int], timeout: float | None = None) -> tuple[int, Reply]:
        """A reply among ``{worker: request_id}``: of those that arrived, the oldest request's.

        Serving the request sent first (not the lowest worker index) keeps a fast worker that is
        re-launched again and again from starving a slower one whose batch is waiting. A request's
        deadline runs across calls: a worker that makes no progress is reported even while the
        others keep answering (async iteration calls this once per batch).
        """
        if not requests:
            raise RuntimeError("wait_any() needs at least one outstanding request.")
        seconds = self.timeout if timeout is None else timeout
        deadlines = {w: self._request_deadline(w, r, seconds) for w, r in requests.items()}
        while True:
            for worker, request_id in requests.items():
                self._drain(worker)
                self._settle_start(worker)
                # A dead or stuck worker must be noticed even while the others keep answering.
                if request_id not in self._stash[worker]:
                    self._check_alive(worker, request_id)
                    deadlines[worker].check(self, worker)
            ready = [(request_id, worker) for worker, request_id in requests.items()
                     if request_id in self._stash[worker]]
            if ready:
                request_id, worker = min(ready)
                return worker, self._take(worker, request_id)
            self._wait(requests, deadlines)

    def values_within(self, requests: dict[int, int], timeout: float | None) -> dict[int, Any]:
        """The values of the replies to ``{worker: request_id}`` that arrive within ``timeout`` seconds
        (None: no limit), by worker. For monitoring calls (``RayCollector.stats``): nothing is raised and
        no worker is marked unresponsive; a worker that died, failed the command or did not answer in
        time is left out, and a late reply is discarded when it arrives."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pending, values = dict(requests), {}
        while pending:
            for worker, request_id in list(pending.items()):
                self._drain(worker)
                if request_id in self._stash[worker]:
                    del pending[worker]
                    try:
                        values[worker] = self._take(worker, request_id).value
                    except Exception:  # the command failed in the worker: no value
                        pass
                elif self.is_dead(worker):
                    del pending[worker]
            remaining = self.liveness_interval if deadline is None else deadline - time.monotonic()
            if not pending or remaining <= 0:
                break
            handles = [self.handles[w] for w in pending]
            multiprocessing.connection.wait(handles, timeout=min(self.liveness_interval, remaining))
        for worker, request_id in pending.items():
            self._outstanding[worker].pop(request_id, None)
            self._abandoned.add((worker, request_id))
        return values

    def _request_deadline(self, worker: int, request_id: int, seconds: float) -> _Deadline:
        key = (worker, request_id)
        if key not in self._deadlines:
            self._deadlines[key] = _Deadline(seconds, self.handles[worker])
        return self._deadlines[key]

    def next_pushed(self, timeout: float, workers: list[int] | None = None) -> tuple[int, Reply] | None:
        """The next batch pushed by a worker running free (of ``workers`` if given), or None after
        ``timeout`` seconds. Raises when one of the workers died."""
        workers = self.active() if workers is None else workers
        deadline = time.monotonic() + timeout
        while True:
            for index, (worker, reply) in enumerate(self._free):
                if worker in workers:
                    del self._free[index]
                    if reply.failure is not None:
                        raise reply.failure.to_exception(context="running free")
                    return worker, reply
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            handles = [self.handles[w] for w in workers if w not in self._dead]
            multiprocessing.connection.wait(handles, timeout=min(self.liveness_interval, remaining))
            for worker in workers:
                self._drain(worker)
                if not any(w == worker for w, _ in self._free):
                    self._check_alive(worker, None)

    def raise_start_failure(self) -> None:
        """Raise the failure a worker reported while starting (its READY reply), if one did.

        A worker that fails to build its collector reports why, then exits: whoever noticed the exit
        first (a weight channel waiting for it) calls this so the user sees the cause, not the exit.
        """
        for worker in self.active():
            self._drain(worker)
            reply = self._stash[worker].get(self.READY)
            if reply is not None and reply.failure is not None:
                self._take(worker, self.READY)

    def _settle_start(self, worker: int) -> None:
        """Take ``worker``'s READY reply once it arrived, raising the failure it reports: a worker
        started without waiting for it (``Fleet.start(wait=False)``) is asked for work before it is
        built, and its start-up failure is the cause to report, not its exit."""
        reply = self._stash[worker].get(self.READY)
        if reply is not None:
            if reply.failure is not None:  # its worker loop ended after reporting it
                self._dead.add(worker)
            self._take(worker, self.READY)

    def has_reply(self, worker: int, request_id: int) -> bool:
        """Non-blocking: has this reply arrived?"""
        self._drain(worker)
        return request_id in self._stash[worker]

    def peek(self, worker: int, request_id: int) -> Reply | None:
        """The reply to ``request_id`` if it arrived, left for :meth:`wait_for` to take (None if not)."""
        self._drain(worker)
        return self._stash[worker].get(request_id)

    def outstanding(self, worker: int) -> dict[int, Command]:
        return dict(self._outstanding[worker])

    def _take(self, worker: int, request_id: int) -> Reply:
        reply = self._stash[worker].pop(request_id)
        command = self._outstanding[worker].pop(request_id, None)
        self._deadlines.pop((worker, request_id), None)
        if reply.failure is not None:
            name = command.value if command is not None else ("start-up" if request_id == -1 else "command")
            raise reply.failure.to_exception(context=f"{name!r}")
        return reply

    def _drain(self, worker: int) -> None:
        handle = self.handles[worker]
        while worker not in self._dead and handle.poll(0.0):
            try:
                reply = handle.recv()
            except (EOFError, OSError, ConnectionError):
                self._dead.add(worker)
                return
            if reply is None:  # a heartbeat, consumed by the handle
                continue
            if reply.request_id == LEAVING:  # preempted: its exit that follows is a leave
                self.leaving[worker] = reply.value
                continue
            if (worker, reply.request_id) in self._abandoned:
                self._abandoned.discard((worker, reply.request_id))
            elif reply.request_id <= FREE_BATCH:  # pushed by a worker running free
                self._free.append((worker, reply))
            else:
                self._stash[worker][reply.request_id] = reply

    def _wait(self, awaited: dict[int, int], deadlines: dict[int, "_Deadline"]) -> None:
        """One bounded wait for the awaited ``{worker: request_id}`` replies.

        Returns when one of them arrived, or after at most ``liveness_interval`` seconds; raises when
        an awaited worker died (without having answered) or exceeded its deadline.
        """
        workers = list(awaited)
        handles = [self.handles[w] for w in workers if w not in self._dead]
        remaining = min([self.liveness_interval] + [deadlines[w].remaining() for w in workers])
        if handles:
            multiprocessing.connection.wait(handles, timeout=max(0.0, remaining))
        for worker in workers:
            self._drain(worker)
            if awaited[worker] != self.READY:
                self._settle_start(worker)
        if any(awaited[w] in self._stash[w] for w in workers):
            return
        # Liveness of every awaited worker, also when others keep answering (async mode).
        for worker in workers:
            self._check_alive(worker, awaited[worker])
        for worker in workers:
            deadlines[worker].check(self, worker)

    def _check_alive(self, worker: int, request_id: int) -> None:
        handle = self.handles[worker]
        # A worker that said it leaves sent every reply it will ever send before saying so.
        if worker in self._dead or worker in self.leaving or not handle.is_alive():
            self._drain(worker)  # a reply sent just before dying is still valid
            if request_id in self._stash[worker]:
                return
            self._dead.add(worker)
            if request_id != self.READY:
                self._settle_start(worker)
            raise self._death_error(worker, self._outstanding[worker].get(request_id))

    def _death_error(self, worker: int, command: Command | None) -> WorkerError:
        starting = self.READY in self._outstanding[worker]
        doing = f" while handling {command.value!r}" if command is not None and not starting else " while starting"
        if command is None and not starting:
            doing = ""
        self._drain(worker)  # its goodbye, if it said one before its exit
        left_as = self.handles[worker].left_as()
        if left_as is not None:  # said in shared memory: a connection reset cannot lose it
            self.leaving.setdefault(worker, left_as)
        if worker in self.leaving:
            err = WorkerError(f"the {self.noun} was preempted (SIGTERM) and left{doing} (a rollout in flight, if "
                              f"any, was {self.leaving[worker]}).", worker_idx=worker)
            err.kind = "preempted"  # a leave: the restart policy does not count it
            return err
        err = WorkerError(f"the {self.noun} died{doing}: {self.handles[worker].exit_description()}.",
                          worker_idx=worker)
        err.kind = self.handles[worker].exit_kind()  # how it is gone, for the restart policy
        return err

    def said_leaving(self, worker: int) -> bool:
        """Whether ``worker`` said it leaves (preempted): a failure met elsewhere (its weight channel
        closing) is then its leave."""
        if 0 <= worker < len(self.handles) and worker not in self.retired:
            self._drain(worker)
            left_as = self.handles[worker].left_as()
            if left_as is not None:
                self.leaving.setdefault(worker, left_as)
        return worker in self.leaving

    def is_dead(self, worker: int) -> bool:
        return worker in self._dead or worker in self.leaving or not self.handles[worker].is_alive()

    def clear(self) -> None:
        """Drop every reply not taken and every batch pushed (the workers are stopped): a reply may hold
        a batch, a worker's first one its whole buffer."""
        for worker in range(len(self.handles)):
            self.forget(worker)
        self._free.clear()

    def forget(self, worker: int) -> None:
        """Drop the outstanding requests and stashed replies of ``worker`` (e.g. at shutdown)."""
        self._outstanding.pop(worker, None)
        self._stash.pop(worker, None)
        self._abandoned = {key for key in self._abandoned if key[0] != worker}
        self._deadlines = {key: deadline for key, deadline in self._deadlines.items() if key[0] != worker}


class _Deadline:
    """Fails a wait after ``seconds`` without an answer and without progress.

    Progress is sampled at every check (every ``liveness_interval``), so the clock restarts at the
    worker's last step, not at the start of the wait: a worker that hangs after a few steps is
    reported ``seconds`` after its last step (comparing only at expiry counted those steps as new
    and reported it after twice that).
    """

    def __init__(self, seconds: float, handle: WorkerHandle) -> None:
        self.seconds = seconds
        self.handle = handle
        self.progress = handle.progress()
        self.started = self.last_progress = time.monotonic()

    def remaining(self) -> float:
        return max(0.0, self.last_progress + self.seconds - time.monotonic())

    def check(self, requests: WorkerRequests, worker: int) -> None:
        now = time.monotonic()
        progress = self.handle.progress()
        if progress != self.progress and progress >= 0:
            self.progress, self.last_progress = progress, now
            return
        if now < self.last_progress + self.seconds:
            return
        pending = next(iter(requests._outstanding[worker].values()), None)
        doing = f" to {pending.value!r}" if pending is not None else ""
        requests.unresponsive.add(worker)
        raise WorkerTimeoutError(
            f"no answer{doing} after {now - self.started:.1f} s, and no progress for {now - self.last_progress:.1f} s "
            f"(worker_timeout={self.seconds:g} s: raise it if this {requests.noun} is legitimately slow).",
            worker_idx=worker,
        )
