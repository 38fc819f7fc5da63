"""The workers of one collector: their specs, the backend running them, the pool talking to them and
the weight schemes feeding them, with one way to start them, replace one, and stop them.

Every collector with workers (worker processes, nodes, RPC nodes) holds one :class:`Fleet`; the
collector decides *what* its workers are (their specs), the backend *how* they run. Replacing a
worker (docs/backends.md, "Replacing a worker"):

1. the backend makes sure the old worker is gone (``stop_one``);
2. every weight scheme forgets its receiver and opens a channel for the new one (``replace``);
3. the worker's spec, with the changes the collector asks for (a fresh trajectory-id range, the
   current policy version, the seed), starts a new worker at the same index (``start_one``);
4. the pool talks to the new handle; every scheme connects the new receiver and hands it the current
   weights (``attach``); the new worker answers READY once built, before it ever collects.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Sequence

from ..errors import WorkerError
from ..protocol import READY, Command, WorkerSpec
from ..transport.base import Backend, WorkerHandle
from ._pool import WorkerPool
from ._restarts import RestartPolicy

__all__ = ["Fleet"]


class Fleet:
    """Starts, replaces and stops the workers of one collector.

    Args:
        backend: runs the workers (processes, threads, nodes, RPC nodes).
        schemes: the sender weight schemes (``{model_id: scheme}``), initialised on the sender side.
        timeout: seconds a worker may take to answer while making no progress.
        restarts: which failed workers are replaced (default: none, failures raise).

    Example:
        >>> from rlharvest.collectors import Collector
        >>> from rlharvest.envs import CountingEnv
        >>> from rlharvest.transport.inprocess import InProcessBackend
        >>> from rlharvest.worker import WorkerSpec, run_worker
        >>> fleet = Fleet(InProcessBackend(1, run_worker), {}, timeout=10.0)
        >>> fleet.start([WorkerSpec(0, Collector, CountingEnv, {"frames_per_batch": 4})])
        >>> fleet.pool.request(0, Command.COLLECT, (False, 0)) is None
        True
        >>> fleet.stop(5.0)
    """

    def __init__(self, backend: Backend, schemes: dict[str, Any], timeout: float,
                 restarts: RestartPolicy | None = None) -> None:
        self.backend = backend
        self.restarts = restarts if restarts is not None else RestartPolicy(0, 0.0, backend.noun)
        self.schemes = schemes
        self.timeout = float(timeout)
        self.specs: list[WorkerSpec] = []
        self.pool: WorkerPool | None = None

    def __len__(self) -> int:
        return len(self.specs)

    def start(self, specs: Sequence[WorkerSpec], started: Callable[[], None] | None = None,
              wait: bool = True) -> None:
        """Start every worker, deliver the initial weights, and wait until each is built.

        Args:
            specs: one per worker, in index order.
            started: called once every worker was started, before waiting for them: a service the
                workers call while they are built (a policy server) starts then, so that no thread
                of it runs while worker processes are forked.
            wait: False returns without waiting until the workers are built: they queue commands
                meanwhile, and the first wait on a worker that failed to build raises its failure.

        Raises:
            WorkerError: naming a worker that died or failed while starting (all are stopped then).
        """
        self.specs = list(specs)
        try:
            handles = self.backend.start_all(self.specs)
            if started is not None:
                started()
            self.pool = WorkerPool(handles, timeout=self.timeout, noun=self.backend.noun)
            self._reporting_start_failures(lambda: [scheme.connect() for scheme in self.schemes.values()])
            if wait:
                for worker in range(len(handles)):
                    self.pool.wait_for(worker, READY)
        except BaseException:
            self.stop(5.0)
            raise

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
        self.pool.replace(index, handle)
        self._reporting_start_failures(lambda: [scheme.attach(index) for scheme in self.schemes.values()])
        self.pool.wait_for(index, READY)
        return handle

    def _reporting_start_failures(self, connect) -> None:
        """Run ``connect`` (weight channels waiting for workers); when it finds a worker gone, raise
        what that worker reported while it failed to build, if it did, rather than its exit."""
        try:
            connect()
        except WorkerError:
            self.pool.raise_start_failure()
            raise

    def stop(self, timeout: float) -> None:
        """Ask every worker to close, then make sure each is gone, within one deadline (idempotent)."""
        deadline = time.monotonic() + timeout
        closing: set[int] = set()
        pool = self.pool
        if pool is not None:
            requests = {}
            for worker, handle in enumerate(pool.handles):
                if pool.is_dead(worker):
                    continue
                handle.interrupt()
                with contextlib.suppress(WorkerError):
                    request_id = pool.send(worker, Command.CLOSE)
                    if worker not in pool.unresponsive:  # a hung worker will not answer: terminate it
                        requests[worker] = request_id
            for worker, request_id in requests.items():
                with contextlib.suppress(Exception):
                    pool.wait_for(worker, request_id, timeout=max(0.05, deadline - time.monotonic()))
                    closing.add(worker)
        # Workers that acknowledged CLOSE exit by themselves; the others are terminated right away.
        self.backend.stop_all(deadline, closing)
