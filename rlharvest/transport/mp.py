"""The ``mp`` backend: worker processes on this machine, commands through pipes, batches through
shared memory.

* Commands and replies are small pickled dataclasses on a duplex pipe per worker.
* A batch is never pickled per rollout: the first BATCH reply carries the worker's batch buffer
  after moving it to shared memory; later rollouts write into that same memory and their replies
  only say "ready".
* Cheap signals live in a shared int64 array, one row per worker: ``[interrupt, progress, left]``, then
  what it wrote to the replay buffer. The parent bumps ``interrupt`` to stop a rollout early (read by
  the worker between env steps, ~0.1 us); the worker advances ``progress`` every step, which the parent
  reads to tell a slow worker from a hung one, and updates its totals after each write to the replay
  buffer, which ``stats()`` reads while the workers run free (``pipes.py``).
* Workers exit by themselves when the parent dies: PR_SET_PDEATHSIG where possible, and a check of
  the parent pid whenever they are idle.
"""

from __future__ import annotations

import os
import threading
from typing import Sequence

import torch
from tensordict import TensorDictBase

from .._processes import (
    describe_exit,
    describe_process_exit,
    end_process,
    mp_context,
    parent_watch,
    prepare_worker_process,
    set_parent_death_signal,
)
from .._utils import CloudpickleWrapper, worker_scheduling
from ..data.flat import is_dense
from ..protocol import WorkerSpec
from ..rollout import TrajectoryCounter
from .base import Backend, WorkerTarget
from .pipes import LEFT, ROW_WIDTH, PipeEndpoint, PipeHandle
from .shared_memory import SharedMemLinks

# describe_exit, mp_context and set_parent_death_signal live in _processes.py (ParallelEnv's sub-env
# processes use them too, below this layer); they are re-exported here for the backends and launchers.
__all__ = ["MPBackend", "MPWorkerHandle", "MPWorkerEndpoint", "SharedTrajectoryCounter", "describe_exit", "mp_context",
           "set_parent_death_signal"]


class SharedTrajectoryCounter(TrajectoryCounter):
    """Trajectory ids shared by every worker of a collector (a locked counter in shared memory).

    The counter also records which process holds the lock: a worker killed while holding it would
    otherwise leave every other worker waiting forever, and :meth:`recover` releases it for the dead.
    """

    def __init__(self, ctx, start: int = 0) -> None:
        self._value = torch.tensor([start, 0], dtype=torch.int64).share_memory_()  # [next id, holder pid]
        self._lock = ctx.Lock()
        self._view = None

    def take(self, n: int) -> int:
        view = self._view
        if view is None:
            view = self._view = self._value.numpy()
        with self._lock:
            view[1] = os.getpid()
            first = int(view[0])
            view[0] = first + n
            view[1] = 0
        return first

    #: seconds the lock may stay taken, with no live holder recorded, before it counts as a dead one's
    #: (a live worker holds it for a few microseconds)
    STUCK_AFTER = 1.0

    def recover(self, pid: int | None) -> None:
        """Release the lock if the process ``pid``, now dead, died holding it.

        The holder's pid is written once the lock is taken and cleared before it is released: a
        worker killed in between the two (a few bytecodes, but workers of short episodes take ids
        thousands of times a second) leaves the lock taken with no holder recorded. So when the lock
        cannot be taken for :attr:`STUCK_AFTER` seconds and no other process is recorded holding it,
        it is released too.
        """
        if pid is None:
            return
        view = self._value.numpy()
        if int(view[1]) == pid:
            view[1] = 0
            self._lock.release()  # a semaphore: any process may release it
        elif self._lock.acquire(timeout=self.STUCK_AFTER):
            self._lock.release()
        elif int(view[1]) in (0, pid):
            view[1] = 0
            self._lock.release()

    def peek(self) -> int:
        with self._lock:
            return int(self._value[0])

    def advance_to(self, value: int) -> None:
        with self._lock:
            self._value[0] = max(int(self._value[0]), int(value))

    def close(self) -> None:
        """The workers are gone (the collector shut down): keep the next id in this process's own
        memory, and free the shared one."""
        self._value, self._view = self._value.clone(), None
        self._lock = threading.Lock()

    def __getstate__(self):
        return {"_value": self._value, "_lock": self._lock, "_view": None}


class SignalBoard:
    """The shared ``[interrupt, progress, left, written...]`` rows of every worker of a collector.

    The workers a collector starts with share one table; each worker added later (``MPBackend.grow``)
    gets a table of its own, so the rows the running workers hold never move, and the table of an
    added worker that left is released with it (:meth:`release`).
    """

    def __init__(self, num_workers: int) -> None:
        self.table = torch.zeros((num_workers, ROW_WIDTH), dtype=torch.int64).share_memory_()
        #: added worker -> its own one-row table
        self._own: dict[int, torch.Tensor] = {}

    def row(self, worker: int) -> tuple[torch.Tensor, int]:
        """The table holding ``worker``'s row, and the row's index in it."""
        own = self._own.get(worker)
        return (own, 0) if own is not None else (self.table, worker)

    def grow(self, first: int, count: int) -> None:
        """Rows for workers ``first`` .. ``first + count - 1``."""
        for worker in range(first, first + count):
            self._own[worker] = torch.zeros((1, ROW_WIDTH), dtype=torch.int64).share_memory_()

    def truncate(self, num_workers: int) -> None:
        """Forget the rows of workers from ``num_workers`` on (tables of added workers only)."""
        self._own = {worker: table for worker, table in self._own.items() if worker < num_workers}

    def release(self, worker: int) -> None:
        """``worker`` left for good: its own table (an added worker's) is freed; rows of the first
        table stay (the table is shared by the first workers)."""
        self._own.pop(worker, None)

    def close(self) -> None:
        """Free every table (the collector is shut down; handles keep private copies of their rows)."""
        self._own.clear()
        self.table = torch.zeros((0, ROW_WIDTH), dtype=torch.int64)


class MPWorkerEndpoint(PipeEndpoint):
    """A worker process's end: the pipe, its signal row, and its shared batch buffer."""

    def __init__(self, conn, signals: torch.Tensor, row: int, worker_idx: int, parent_pid: int | None) -> None:
        super().__init__(conn, signals.numpy()[row], worker_idx)
        self.parent_pid = parent_pid
        self._shared: TensorDictBase | None = None

    def publish_batch(self, batch: TensorDictBase) -> TensorDictBase | None:
        if not is_dense(batch):
            # Non-tensor or heterogeneous entries cannot live in one reused buffer: the batch travels
            # in the reply (tensors through shared memory, the rest pickled).
            return batch
        if self._shared is None:
            if not batch.is_shared():
                batch.share_memory_()
            self._shared = batch
            return batch
        if batch is not self._shared:
            self._shared.update_(batch)
        return None

    def batch_buffer(self) -> TensorDictBase | None:
        return self._shared

    def batch_resized(self) -> None:
        self._shared = None  # the next batch is shared afresh and travels once, in its reply

    def parent_alive(self) -> bool:
        # Started by a forkserver (no parent pid to compare): the pipe's EOF tells.
        return super().parent_alive() and (self.parent_pid is None or os.getppid() == self.parent_pid)


def _process_main(target: WorkerTarget, spec: WorkerSpec, conn, signals, row: int, worker_idx: int, parent_pid: int | None,
                  death_signal: bool) -> None:
    """A worker process's first steps: make sure it dies with its parent, then run ``target``."""
    if not prepare_worker_process(parent_pid, death_signal):
        return
    target = target.payload if isinstance(target, CloudpickleWrapper) else target
    spec = spec.payload if isinstance(spec, CloudpickleWrapper) else spec
    torch.set_num_threads(max(1, int(spec.num_threads)))
    target(spec, MPWorkerEndpoint(conn, signals, row, worker_idx, parent_pid))


class MPWorkerHandle(PipeHandle):
    """The parent's end of one worker process."""

    def __init__(self, process, conn, signals: torch.Tensor, row: int, worker_idx: int) -> None:
        super().__init__(conn, signals.numpy()[row], worker_idx)
        #: the worker's process; None once it ended and was released (:meth:`terminate`)
        self.process = process
        self._pid = process.pid
        self._exitcode: int | None = None
        self._batch: TensorDictBase | None = None

    @property
    def pid(self) -> int | None:
        return self._pid

    def is_alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def exit_description(self) -> str:
        return describe_process_exit(self.process) if self.process is not None else describe_exit(self._exitcode)

    def fetch_batch(self, reply) -> TensorDictBase:
        if reply.value is not None:
            self._batch = reply.value
        if self._batch is None:
            raise RuntimeError(f"worker {self.worker_idx} announced a batch but never shared its buffer.")
        return self._batch

    def terminate(self, deadline: float) -> None:
        """Make sure the process is gone, then release what this process holds of it: the batch
        buffer (its shared memory stays mapped here, one descriptor per tensor, while referenced),
        the pipe, and the process's sentinel. A handle outlives its worker (a departed worker's slot
        keeps it), so without this each departure would keep them until the collector is collected."""
        process = self.process
        if process is not None:
            end_process(process, deadline)
        self.close_pipe()
        self._batch = None
        self._signals = self._signals.copy()  # the row of an added worker is a shared table of its own
        if process is not None and process.exitcode is not None:
            self._exitcode, self.process = process.exitcode, None
            process.close()


class MPBackend(Backend):
    """Worker processes on this machine (``multiprocessing``: fork by default).

    Args:
        num_workers: how many workers the collector runs.
        target: what each worker process runs, ``target(spec, endpoint)`` (the worker loop).
        ctx: the multiprocessing context (see :func:`mp_context`).
        policy_devices: the device each worker runs its policy on (weights are staged there).

    Workers can be added to a running collector (``growable``, docs/backends.md "Adding workers"):
    each gets a signal row of its own and its policy device (``grow``'s options) appended to
    ``policy_devices``, the list the weight senders read.

    Example:
        >>> from rlharvest.worker import run_worker
        >>> backend = MPBackend(2, run_worker, mp_context())
        >>> backend.default_scheme()
        'shared'
    """

    def __init__(self, num_workers: int, target: WorkerTarget, ctx, policy_devices: list | None = None) -> None:
        super().__init__(num_workers)
        self.target = target
        self.ctx = ctx
        self.policy_devices = policy_devices
        self.signals = SignalBoard(num_workers)
        self._counters: list[SharedTrajectoryCounter] = []

    growable = True

    def grow(self, count: int, options: Sequence[dict] | None = None) -> None:
        """Room for ``count`` more worker processes; ``options``: the policy device of each (default:
        worker 0's)."""
        first = self.num_workers
        super().grow(count, options)
        self.signals.grow(first, count)
        if self.policy_devices is not None:
            devices = list(options) if options is not None else [self.policy_devices[0]] * count
            self.policy_devices.extend(devices)  # in place: the weight senders read this very list

    def truncate(self, num_workers: int) -> None:
        super().truncate(num_workers)
        self.signals.truncate(num_workers)
        if self.policy_devices is not None:
            del self.policy_devices[num_workers:]

    def trajectory_counter(self) -> SharedTrajectoryCounter:
        """Trajectory ids shared by the workers (held in this process's shared memory)."""
        counter = SharedTrajectoryCounter(self.ctx)
        self._counters.append(counter)
        return counter

    def stop_one(self, index: int, deadline: float) -> None:
        handle = self.handles[index]
        super().stop_one(index, deadline)
        if handle is not None:
            for counter in self._counters:  # a worker killed inside take() must not block the others
                counter.recover(handle.pid)

    def retire(self, index: int) -> None:
        self.signals.release(index)
        super().retire(index)

    def stop_all(self, deadline: float, closing=()) -> None:
        super().stop_all(deadline, closing)
        self.signals.close()
        for counter in self._counters:
            counter.close()

    def start_one(self, index: int, spec: WorkerSpec) -> MPWorkerHandle:
        """Start the process of worker ``index``.

        Raises:
            ValueError: for a bad ``$RLHARVEST_WORKER_SCHED``.
        """
        worker_scheduling()
        parent_conn, child_conn = self.ctx.Pipe(duplex=True)
        # The spec goes through multiprocessing's pickler, which knows how to pass pipes, locks and
        # shared tensors; user callables inside it are already wrapped for cloudpickle.
        parent_pid, death_signal = parent_watch(self.ctx)
        signals, row = self.signals.row(index)
        signals[row, LEFT:] = 0  # a replacement has not left nor written (its predecessor may have: pipes.py)
        process = self.ctx.Process(
            target=_process_main,
            args=(self.target, spec, child_conn, signals, row, index, parent_pid, death_signal),
            name=f"rlharvest-worker-{index}",
            daemon=False,
        )
        process.start()
        child_conn.close()
        handle = self.handles[index] = MPWorkerHandle(process, parent_conn, signals, row, index)
        return handle

    def default_scheme(self) -> str:
        return "shared"

    def weight_links(self) -> SharedMemLinks:
        return SharedMemLinks(self.num_workers, self.liveness, ctx=self.ctx, devices=self.policy_devices)
