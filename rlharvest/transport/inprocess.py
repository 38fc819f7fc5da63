"""The ``inprocess`` backend: every worker is a thread of this process.

The same commands and replies as worker processes, through the same kind of pipes (messages are
pickled both ways), so a collector, the worker pool and the weight schemes run against it exactly as
against processes; a batch is read where the worker wrote it (the worker reuses that buffer for
its next rollout, as worker processes reuse their shared memory). Each worker gets its own copy of
the spec's policy and env constructor, as it would crossing a process boundary; what is meant to be
shared (the trajectory counter, the weight channels) stays shared. Starting a worker costs
milliseconds, which makes it the backend of the unit and contract tests.

Threads cannot be killed: stopping a worker closes its pipe and waits for its thread, and a
worker hung inside its env keeps its (daemon) thread until the interpreter exits.
"""

from __future__ import annotations

import copy
import dataclasses
import multiprocessing
import threading
import time
import traceback
import numpy as np
from tensordict import TensorDictBase

from ..protocol import WorkerSpec
from ..rollout import LocalTrajectoryCounter
from .base import Backend, WorkerTarget
from .pipes import PipeEndpoint, PipeHandle
from .shared_memory import SharedMemLinks

__all__ = ["InProcessBackend", "InProcessHandle", "InProcessEndpoint"]

#: seconds a stopped worker thread gets to return (it polls its pipe at least every 0.25 s)
_GRACE = 1.0


class _Slot:
    """Where a worker thread leaves its latest batch for the parent, and their cheap signals."""

    def __init__(self) -> None:
        self.batch: TensorDictBase | None = None
        self.signals = np.zeros(2, dtype=np.int64)  # [interrupt, progress]
        self.failure: str | None = None


class InProcessEndpoint(PipeEndpoint):
    """A worker thread's end: its pipe and its slot."""

    def __init__(self, conn, slot: _Slot, worker_idx: int) -> None:
        super().__init__(conn, slot.signals, worker_idx)
        self.slot = slot

    def publish_batch(self, batch: TensorDictBase) -> None:
        self.slot.batch = batch
        return None


class InProcessHandle(PipeHandle):
    """The parent's end of one worker thread."""

    def __init__(self, thread: threading.Thread, conn, slot: _Slot, worker_idx: int) -> None:
        super().__init__(conn, slot.signals, worker_idx)
        self.thread = thread
        self.slot = slot

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def exit_description(self) -> str:
        if self.thread.is_alive():
            return "it stopped answering (its connection closed) but its thread still runs"
        return "its thread ended" + (f" with:\n{self.slot.failure}" if self.slot.failure else "")

    def fetch_batch(self, reply) -> TensorDictBase:
        if self.slot.batch is None:
            raise RuntimeError(f"worker {self.worker_idx} announced a batch but published none.")
        return self.slot.batch

    def terminate(self, deadline: float) -> None:
        self.close_pipe()  # the worker's next wait sees the parent gone and returns
        # A thread cannot be killed: give it the moment it needs to notice, whatever the deadline
        # (its weight channels are closed next, and it must not be waiting on them then).
        self.thread.join(max(_GRACE, deadline - time.monotonic()))


def _thread_main(target: WorkerTarget, spec: WorkerSpec, endpoint: InProcessEndpoint) -> None:
    try:
        target(spec, endpoint)
    except BaseException:  # the worker loop reports its own failures; this is a failure of the loop
        endpoint.slot.failure = traceback.format_exc()
        raise


class InProcessBackend(Backend):
    """Workers as threads of this process (for tests: milliseconds to start).

    Args:
        num_workers: how many workers the collector runs.
        target: what each worker thread runs, ``target(spec, endpoint)`` (the worker loop).

    Example:
        >>> from rlharvest.worker import run_worker
        >>> backend = InProcessBackend(1, run_worker)
        >>> backend.default_scheme()
        'shared'
    """

    #: a worker thread needs nothing of the backend but its handle slot: workers can be added
    growable = True

    def __init__(self, num_workers: int, target: WorkerTarget) -> None:
        super().__init__(num_workers)
        self.target = target
        self.ctx = multiprocessing.get_context()

    def trajectory_counter(self) -> LocalTrajectoryCounter:
        """Trajectory ids shared by the workers (one thread-safe counter)."""
        return LocalTrajectoryCounter()

    def start_one(self, index: int, spec: WorkerSpec) -> InProcessHandle:
        spec = dataclasses.replace(spec, policy=copy.deepcopy(spec.policy),
                                   create_env_fn=copy.deepcopy(spec.create_env_fn))
        parent_conn, child_conn = multiprocessing.Pipe(duplex=True)
        slot = _Slot()
        endpoint = InProcessEndpoint(child_conn, slot, index)
        thread = threading.Thread(target=_thread_main, args=(self.target, spec, endpoint),
                                  name=f"rlharvest-worker-{index}", daemon=True)
        thread.start()
        handle = self.handles[index] = InProcessHandle(thread, parent_conn, slot, index)
        return handle

    def default_scheme(self) -> str:
        return "shared"

    def weight_links(self) -> SharedMemLinks:
        return SharedMemLinks(self.num_workers, self.liveness, ctx=self.ctx)
