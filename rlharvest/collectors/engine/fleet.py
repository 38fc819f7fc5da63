"""The workers of one collector: their specs, the backend running them, the requests sent to them and
the weight schemes feeding them, with one way to start them, replace one, and stop them.

Every collector with workers (worker processes, nodes, RPC nodes) holds one :class:`Fleet`; the
collector decides *what* its workers are (their specs), the backend *how* they run. Replacing a
worker (docs/backends.md, "Replacing a worker"):

1. the backend makes sure the old worker is gone (``stop_one``);
2. every weight scheme forgets its receiver and opens a channel for the new one (``replace``);
3. the worker's spec, with the changes the collector asks for (a fresh trajectory-id range, the
   current policy version, the seed), starts a new worker at the same index (``start_one``);
4. the requests go to the new handle; every scheme connects the new receiver and hands it the current
   weights (``attach``); the new worker answers READY once built, before it ever collects.

Adding workers (:meth:`Fleet.grow`, docs/backends.md, "Adding workers") takes steps 2-4 at new
indices, after the backend made room for them (``Backend.grow``); it needs a backend and weight
senders that are ``growable``.

Removing workers (:meth:`Fleet.remove`, docs/elastic.md) is a graceful leave: each stops at a rollout
boundary (a rollout in flight is cut short, taken off its transport and dropped whole), closes, and is
made sure gone; every weight scheme forgets it. Its index stays as an empty slot (``active`` leaves
it out), so the other workers keep theirs.

A failed worker met anywhere is handed to :meth:`Fleet.recover`: the restart policy admits it (or
raises), and the worker is renewed (:meth:`Fleet.renew`): the collector's :class:`Replacement` hooks
drop what it had in flight and say what its replacement starts with.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ...errors import WorkerError
from ...protocol import READY, Command, WorkerSpec
from ...transport.base import Backend, WorkerHandle
from .events import EventKind, FleetEvents
from .requests import WorkerRequests
from .restarts import RestartPolicy

__all__ = ["Fleet", "Replacement"]

_log = logging.getLogger("rlharvest")


def _nothing(worker: int) -> None:
    return None


def _no_changes(worker: int) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Replacement:
    """What a collector does around the replacement of one of its workers (all optional)."""

    before: Callable[[int], None] = _nothing
    """Drop what the worker had in flight (its request, its unfinished trajectories), and count the
    totals it advertised last: called once it is gone (it writes no more), before its slot is released."""
    changes: Callable[[int], dict[str, Any]] = _no_changes
    """What the replacement starts with besides its spec (the current policy version, a fresh
    trajectory-id range)."""
    after: Callable[[int], None] = _nothing
    """Bring the replacement to where the others are (running free, new remote references)."""
    left: Callable[[int], None] = _nothing
    """A worker left for good (preempted, not replaced): the collector's batches shrink."""


class Fleet:
    """Starts, replaces and stops the workers of one collector.

    Args:
        backend: runs the workers (processes, threads, nodes, RPC nodes).
        schemes: the sender weight schemes (``{model_id: scheme}``), initialised on the sender side.
        timeout: seconds a worker may take to answer while making no progress.
        restarts: which failed workers are replaced (default: none, failures raise).
        replacement: the collector's hooks around a replacement.
        on_collect: called with ``(worker, request_id)`` once each rollout is asked for (``WorkerRequests``).
        events: where workers added and removed are published (default: the restart policy's).

    Example:
        >>> from rlharvest.collectors import Collector
        >>> from rlharvest.envs import CountingEnv
        >>> from rlharvest.transport.inprocess import InProcessBackend
        >>> from rlharvest.worker import WorkerSpec, run_worker
        >>> fleet = Fleet(InProcessBackend(1, run_worker), {}, timeout=10.0)
        >>> fleet.start([WorkerSpec(0, Collector, CountingEnv, {"frames_per_batch": 4})])
        >>> fleet.requests.request(0, Command.COLLECT, (False, 0)) is None
        True
        >>> fleet.stop(5.0)
    """

    def __init__(self, backend: Backend, schemes: dict[str, Any], timeout: float,
                 restarts: RestartPolicy | None = None, replacement: Replacement | None = None,
                 on_collect: Callable[[int, int], None] | None = None, events: FleetEvents | None = None) -> None:
        self.backend = backend
        self.on_collect = on_collect
        self.restarts = restarts if restarts is not None else RestartPolicy(0, 0.0, backend.noun, events)
        self.events = events if events is not None else self.restarts.events
        self.replacement = replacement if replacement is not None else Replacement()
        self.schemes = schemes
        self.timeout = float(timeout)
        self.specs: list[WorkerSpec] = []
        self._requests: WorkerRequests | None = None
        #: ``start``'s arguments while the start waits for its first use (nodes that join, docs/elastic.md)
        self._deferred: tuple | None = None
        #: set by :meth:`stop`
        self.stopped = False

    @property
    def requests(self) -> WorkerRequests | None:
        """The requests to the workers; a deferred start (:meth:`start` with ``deferred=True``) happens
        here, at the first use: it waits for the workers (and raises what their start raises)."""
        if self._deferred is not None:
            specs, started, wait = self._deferred
            self._deferred = None
            self._start(specs, started, wait)
        return self._requests

    @property
    def current_requests(self) -> WorkerRequests | None:
        """The requests to the workers if they were started, without starting them (None otherwise)."""
        return self._requests

    def __len__(self) -> int:
        """The number of slots: every index ever given, including those of workers that left."""
        return len(self.specs)

    @property
    def active(self) -> list[int]:
        """The indices of the workers that have not left, in order."""
        return self._requests.active() if self._requests is not None else list(range(len(self.specs)))

    def start(self, specs: Sequence[WorkerSpec], started: Callable[[], None] | None = None,
              wait: bool = True, deferred: bool = False) -> None:
        """Start every worker, deliver the initial weights, and wait until each is built.

        Args:
            specs: one per worker, in index order.
            started: called once every worker was started, before waiting for them: a service the
                workers call while they are built (a policy server) starts then, so that no thread
                of it runs while worker processes are forked.
            wait: False returns without waiting until the workers are built: they queue commands
                meanwhile, and the first wait on a worker that failed to build raises its failure.
            deferred: start at the first use of :attr:`requests` instead of now (nodes that join a
                collector from elsewhere: its constructor returns before any has joined).

        Raises:
            WorkerError: naming a worker that died or failed while starting (all are stopped then).
        """
        self.specs = list(specs)
        if deferred:
            self._deferred = (self.specs, started, wait)
            return
        self._start(self.specs, started, wait)

    def _start(self, specs: list[WorkerSpec], started: Callable[[], None] | None, wait: bool) -> None:
        if self.restarts.enabled:
            self.backend.expect_replacements()
        try:
            handles = self.backend.start_all(self.specs)
            if started is not None:
                started()
            self._requests = WorkerRequests(handles, timeout=self.timeout, noun=self.backend.noun,
                                            on_collect=self.on_collect)
            self._reporting_start_failures(lambda: [scheme.connect() for scheme in self.schemes.values()])
            if wait:
                for worker in range(len(handles)):
                    self.requests.wait_for(worker, READY)
        except BaseException:
            self.stop(5.0)
            raise

    def pids(self) -> list[int | None]:
        """The process id of each worker that is a process of this machine, None for the others."""
        requests = self._requests
        return [handle.pid for handle in requests.handles] if requests is not None else []

    def handles(self) -> list[WorkerHandle]:
        """The workers' handles, in index order (empty once stopped)."""
        requests = self._requests
        return list(requests.handles) if requests is not None and not self.stopped else []

    def interrupt(self) -> None:
        """Make the workers' rollouts in progress end soon (nothing when they were never started)."""
        requests = self._requests
        if requests is not None:
            for worker in requests.active():
                requests.handles[worker].interrupt()

    def remember(self, index: int, **changes: Any) -> None:
        """Record in worker ``index``'s spec what it became (a seed it was given), for a replacement."""
        if self.specs[index] is not None:
            self.specs[index] = self.specs[index].replacement(**changes)

    def replace(self, index: int, **changes: Any) -> WorkerHandle:
        """Start a new worker in place of worker ``index``, from its spec with ``changes``.

        The old worker is terminated if it still runs; the new one has the current weights before
        it collects. Returns once it is built.

        Raises:
            WorkerError: when the new worker died or failed while starting.
        """
        self.backend.stop_one(index, time.monotonic())
        for scheme in self.schemes.values():
            scheme.replace(index)
        spec = self.specs[index] = self.specs[index].replacement(**changes)
        handle = self.backend.start_one(index, spec)
        self.requests.replace(index, handle)
        self._reporting_start_failures(lambda: [scheme.attach(index) for scheme in self.schemes.values()])
        self.requests.wait_for(index, READY)
        return handle

    def renew(self, index: int, **changes: Any) -> WorkerHandle:
        """Replace worker ``index`` as the collector wants it (its :class:`Replacement` hooks around
        :meth:`replace`), with ``changes`` to its spec on top of the hooks' own."""
        hooks = self.replacement
        self.backend.stop_one(index, time.monotonic())  # gone before ``before``: it writes no more
        hooks.before(index)
        handle = self.replace(index, **{**hooks.changes(index), **changes})
        hooks.after(index)
        return handle

    def recover(self, err: WorkerError, **changes: Any) -> int:
        """Replace the worker ``err`` names, as the restart policy allows, and return its index; a
        replacement that fails while starting counts as one more failure.

        Raises:
            WorkerError: ``err`` itself with ``max_worker_restarts=0``, or when this backend cannot
                replace a worker (nodes started elsewhere); past the limit, a ``RestartLimitError``
                listing every cause.
        """
        worker = err.worker_idx
        if getattr(err, "kind", None) != "preempted" and worker is not None and self._requests is not None \
                and self.requests.said_leaving(worker):  # met elsewhere first (its weight channel closing)
            err.kind = "preempted"
        if getattr(err, "kind", None) == "preempted":
            return self._after_preemption(err, **changes)
        worker = self.restarts.admit(err)
        while True:
            try:
                self.renew(worker, restart=self.restarts.replacements_of(worker), **changes)
                return worker
            except WorkerError as again:
                worker = self.restarts.admit(again)
            except NotImplementedError as cannot:  # a backend that cannot start a worker again (not ``replaceable``)
                raise err from cannot

    def _after_preemption(self, err: WorkerError, **changes: Any) -> int:
        """A worker left on SIGTERM (docs/elastic.md): not a failure. With restarts on, a replacement is
        started where the launcher can; otherwise (or when it cannot) the collection goes on without
        it, its index an empty slot. Returns its index (check ``requests.retired``).

        Raises:
            WorkerError: ``err`` when it was the last worker.
        """
        replace = self.restarts.enabled and self.backend.replaceable
        worker = self.restarts.record_leave(err, replace)
        if replace:
            try:
                self.renew(worker, restart=self.restarts.replacements_of(worker), **changes)
                return worker
            except WorkerError as again:  # the replacement failed: a failure like any other
                return self.recover(again, **changes)
            except NotImplementedError:  # nodes started elsewhere: go on without it
                pass
        if [w for w in self.active if w != worker] == []:
            raise err
        self._retire(worker, time.monotonic() + 1.0)
        self.replacement.left(worker)
        return worker

    def grow(self, specs: Sequence[WorkerSpec], options: Sequence[dict] | None = None) -> None:
        """Start more workers after the others, each running the current weights before it collects.

        All are started at once, then connected to every weight scheme, then awaited (READY). When
        one fails, the new workers are stopped and the fleet is left as it was.

        Args:
            specs: one per new worker, with indices ``len(self)``, ``len(self) + 1``, ... in order.
            options: what the backend needs of each new worker (``Backend.grow``), or None.

        Raises:
            RuntimeError: before :meth:`start`.
            ValueError: for specs whose indices do not follow the current workers'.
            NotImplementedError: when the backend or a weight scheme cannot serve more workers.
            WorkerError: naming a new worker that died or failed while starting.
        """
        if self.requests is None:  # (a deferred start happens here)
            raise RuntimeError("Fleet.grow() needs the fleet started first.")
        first, specs = len(self.specs), list(specs)
        indices = [spec.worker_idx for spec in specs]
        if indices != list(range(first, first + len(specs))):
            raise ValueError(f"new {self.backend.noun}s take indices {first}..{first + len(specs) - 1}, got {indices}.")
        self.check_growable()
        self.backend.grow(len(specs), options)
        try:
            for spec in specs:
                for scheme in self.schemes.values():
                    scheme.replace(spec.worker_idx)  # a channel for it, before its spec travels
                self.specs.append(spec)
                self.requests.add(self.backend.start_one(spec.worker_idx, spec))
            for spec in specs:
                self._reporting_start_failures(lambda: [scheme.attach(spec.worker_idx)
                                                        for scheme in self.schemes.values()])
            for spec in specs:
                self.requests.wait_for(spec.worker_idx, READY)
        except BaseException:
            self.shrink(first)
            raise
        self.events.publish(EventKind.ADD, f"added {self.backend.noun}s {indices}", workers=tuple(indices),
                            logger=_log)

    def remove(self, indices: Sequence[int], timeout: float | None = None, running_free: bool = False) -> None:
        """Make the workers ``indices`` leave, gracefully, within ``timeout`` seconds (default: the
        fleet's): each stops at a rollout boundary, closes, and is gone when this returns.

        A rollout in flight is interrupted, taken off the transport and dropped whole (its frames are
        never counted; a worker writing the replay buffer itself writes the steps it collected, and
        its totals are counted once it is gone); with ``running_free`` the workers are paused first,
        and the batches they pushed meanwhile are dropped the same way. A worker that does not close in time, or fails
        while leaving, is terminated. Every weight scheme forgets it; its index stays an empty slot.

        Raises:
            ValueError: for an index that is not a current worker, or when no worker would be left.
        """
        indices = self.check_removable(indices)
        deadline = time.monotonic() + (self.timeout if timeout is None else float(timeout))
        for index in indices:
            self.requests.handles[index].interrupt()
        closed = {index for index in indices if self._settle(index, deadline, running_free)}
        for index in indices:
            self._retire(index, deadline if index in closed else time.monotonic())
        forced = sorted(set(indices) - closed)
        self.events.publish(EventKind.REMOVE, f"removed {self.backend.noun}s {indices}" + (
            f" ({forced} did not close in time and were terminated)" if forced else ""),
            workers=tuple(indices), details={"terminated": len(forced)}, logger=_log)

    def _retire(self, index: int, deadline: float) -> None:
        """Worker ``index`` leaves for good: make sure it is gone, let the collector drop what it had in
        flight and count what it advertised last (gone, it writes no more: the rollout it was cutting
        short has been written), and release everything kept for it here (the backend's slot, the
        schemes' channels, the requests' bookkeeping): a departed worker holds no descriptor and no
        shared memory in this process (docs/elastic.md)."""
        self.backend.stop_one(index, deadline)
        self.replacement.before(index)
        self.backend.retire(index)
        for scheme in self.schemes.values():
            scheme.forget(index)
        self.requests.retire(index)
        if not self.backend.refills_slots:  # no worker will start from its spec (a copy of the policy)
            self.specs[index] = None

    def check_removable(self, indices: Sequence[int] | int) -> list[int]:
        """``indices`` as a sorted list of current workers that may leave.

        Raises:
            ValueError: for an index that is not a current worker (never was, or left already), a
                repeated one, or when every current worker would leave.
        """
        noun = self.backend.noun
        indices = [indices] if isinstance(indices, int) and not isinstance(indices, bool) else list(indices)
        active = self.active
        for index in indices:
            if isinstance(index, bool) or not isinstance(index, int):
                raise ValueError(f"indices must be {noun} indices (ints), got {index!r}.")
            if index not in active:
                state = "was removed already" if 0 <= index < len(self.specs) else "does not exist"
                raise ValueError(f"{noun} {index} {state}: the current {noun}s are {active}.")
        if len(set(indices)) != len(indices):
            raise ValueError(f"indices name a {noun} twice: {indices}.")
        if not indices:
            raise ValueError(f"indices is empty: name the {noun}s to remove.")
        if set(active) <= set(indices):
            raise ValueError(f"removing {noun}{'s' if len(indices) > 1 else ''} {sorted(indices)} would leave no {noun}: "
                             f"{noun} {active[-1]} is the last one (call shutdown() to stop collecting).")
        return sorted(indices)

    def _settle(self, index: int, deadline: float, running_free: bool) -> bool:
        """Bring worker ``index`` to a rollout boundary and ask it to close; True once it acknowledged.
        Batches it announces meanwhile are taken off the transport (a node blocks until its batch is
        received) and dropped."""
        requests = self.requests
        handle = requests.handles[index]
        try:
            pending = list(requests.outstanding(index))
            if running_free:
                pending.append(requests.send(index, Command.PAUSE))
            for request_id in pending:
                command = requests.outstanding(index).get(request_id)
                while running_free and not requests.has_reply(index, request_id):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    got = requests.next_pushed(min(0.05, remaining), [index])
                    if got is not None:  # pushed while pausing: off the transport, dropped whole
                        handle.fetch_batch(got[1])
                reply = requests.wait_for(index, request_id, timeout=max(0.05, deadline - time.monotonic()))
                if command is Command.COLLECT and not reply.written:
                    handle.fetch_batch(reply)  # off the transport; dropped whole
            for reply in requests.take_pushed(index):
                handle.fetch_batch(reply)
            requests.request(index, Command.CLOSE, timeout=max(0.05, deadline - time.monotonic()))
            return True
        except Exception:  # failed or hung while leaving: it is terminated
            return False

    def check_growable(self) -> None:
        """Raise NotImplementedError naming what cannot serve more workers (the backend, a weight sender)."""
        noun = self.backend.noun
        if not self.backend.growable:
            raise NotImplementedError(f"{type(self.backend).__name__} cannot add {noun}s to a running collector.")
        for model_id, scheme in self.schemes.items():
            sender = scheme.sender_transports
            if sender is not None and not sender.growable:
                raise NotImplementedError(f"the weight scheme of {model_id!r} ({type(scheme).__name__}) cannot serve "
                                          f"{noun}s added after start-up.")

    def shrink(self, count: int) -> None:
        """Stop the workers from index ``count`` on and forget them (undoes a growth that failed)."""
        for index in range(count, self.backend.num_workers):
            with contextlib.suppress(Exception):
                self.backend.stop_one(index, time.monotonic())
            for scheme in self.schemes.values():
                with contextlib.suppress(Exception):
                    scheme.replace(index)  # forgets its receiver
        self.backend.truncate(count)
        self.requests.truncate(count)
        del self.specs[count:]

    def _reporting_start_failures(self, connect) -> None:
        """Run ``connect`` (weight channels waiting for workers); when it finds a worker gone, raise
        what that worker reported while it failed to build, if it did, rather than its exit."""
        try:
            connect()
        except WorkerError:
            self.requests.raise_start_failure()
            raise

    def stop(self, timeout: float) -> None:
        """Ask every worker to close, then make sure each is gone, within one deadline (idempotent)."""
        self.stopped = True
        deadline = time.monotonic() + timeout
        closing: set[int] = set()
        self._deferred = None  # never started: nothing to ask
        requests = self._requests
        if requests is not None:
            close_ids = {}
            for worker, handle in enumerate(requests.handles):
                if worker in requests.retired or requests.is_dead(worker):
                    continue
                handle.interrupt()
                with contextlib.suppress(WorkerError):
                    request_id = requests.send(worker, Command.CLOSE)
                    if worker not in requests.unresponsive:  # a hung worker will not answer: terminate it
                        close_ids[worker] = request_id
            for worker, request_id in close_ids.items():
                with contextlib.suppress(Exception):
                    requests.wait_for(worker, request_id, timeout=max(0.05, deadline - time.monotonic()))
                    closing.add(worker)
        # Workers that acknowledged CLOSE exit by themselves; the others are terminated right away.
        self.backend.stop_all(deadline, closing)
        if requests is not None:  # replies never taken may hold batches (a first one carries its buffer)
            requests.clear()
