"""Worker processes on this machine: commands through pipes, batches through shared memory.

* Commands and replies are small pickled dataclasses on a duplex pipe per worker.
* A batch is never pickled per rollout: the first BATCH reply carries the worker's batch buffer
  after moving it to shared memory; later rollouts write into that same memory and their replies
  only say "ready".
* Cheap signals live in a shared int64 array, one row per worker: ``[interrupt, progress]``. The
  parent bumps ``interrupt`` to stop a rollout early (read by the worker between env steps, ~0.1 us);
  the worker advances ``progress`` every step, which the parent reads to tell a slow worker from a
  hung one.
* Workers exit by themselves when the parent dies: PR_SET_PDEATHSIG where possible, and a check of
  the parent pid whenever they are idle.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from tensordict import TensorDictBase

from .._processes import (
    describe_exit,
    mp_context,
    parent_watch,
    prepare_worker_process,
    set_parent_death_signal,
)
from .._utils import CloudpickleWrapper, worker_scheduling
from ..data.flat import is_dense
from ..rollout import TrajectoryCounter
from .base import WorkerEndpoint, WorkerHandle

__all__ = [
    "MPWorkerHandle",
    "MPWorkerEndpoint",
    "SharedTrajectoryCounter",
    "start_worker_process",
    "mp_context",
    "parent_watch",
    "prepare_worker_process",
    "describe_exit",
]

_set_parent_death_signal = set_parent_death_signal  # the name distributed launchers import

_INTERRUPT, _PROGRESS = 0, 1


class SharedTrajectoryCounter(TrajectoryCounter):
    """Trajectory ids shared by every worker of a collector (a locked counter in shared memory)."""

    def __init__(self, ctx, start: int = 0) -> None:
        self._value = torch.full((1,), start, dtype=torch.int64).share_memory_()
        self._lock = ctx.Lock()
        self._view = None

    def take(self, n: int) -> int:
        view = self._view
        if view is None:
            view = self._view = self._value.numpy()
        with self._lock:
            first = int(view[0])
            view[0] = first + n
        return first

    def __getstate__(self):
        return {"_value": self._value, "_lock": self._lock, "_view": None}


class SignalBoard:
    """The shared ``[interrupt, progress]`` rows of every worker of a collector."""

    def __init__(self, num_workers: int) -> None:
        self.table = torch.zeros((num_workers, 2), dtype=torch.int64).share_memory_()


class MPWorkerEndpoint(WorkerEndpoint):
    """A worker process's end: the pipe, its signal row, and its shared batch buffer."""

    def __init__(self, conn, signals: torch.Tensor, worker_idx: int, parent_pid: int) -> None:
        self.conn = conn
        self.worker_idx = worker_idx
        self.parent_pid = parent_pid
        self._signals = signals.numpy()[worker_idx]
        self._interrupt_seen = int(self._signals[_INTERRUPT])
        self._shared: TensorDictBase | None = None

    def fileno(self) -> int:
        return self.conn.fileno()

    def recv(self, timeout: float) -> Any | None:
        try:
            if self.conn.poll(timeout):
                return self.conn.recv()
        except (EOFError, OSError):
            self.parent_pid = -1  # the parent's end closed: it is gone
        return None

    def send(self, message: Any) -> None:
        try:
            self.conn.send(message)
        except (BrokenPipeError, OSError):
            self.parent_pid = -1

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

    @property
    def batch_buffer(self) -> TensorDictBase | None:
        return self._shared

    def interrupted(self) -> bool:
        return int(self._signals[_INTERRUPT]) != self._interrupt_seen

    def clear_interrupt(self, mark: int | None = None) -> None:
        self._interrupt_seen = int(self._signals[_INTERRUPT]) if mark is None else mark

    def report_progress(self, steps: int) -> None:
        self._signals[_PROGRESS] = steps

    def parent_alive(self) -> bool:
        if self.parent_pid is None:  # started by a forkserver: the pipe's EOF tells (recv sets -1)
            return True
        return self.parent_pid > 0 and os.getppid() == self.parent_pid

    def close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass


def _worker_main(spec, conn, signals, worker_idx: int, parent_pid: int | None, death_signal: bool) -> None:
    if not prepare_worker_process(parent_pid, death_signal):
        return
    from ..worker import run_worker

    spec = spec.payload if isinstance(spec, CloudpickleWrapper) else spec
    torch.set_num_threads(max(1, int(spec.num_threads)))
    run_worker(spec, MPWorkerEndpoint(conn, signals, worker_idx, parent_pid))


class MPWorkerHandle(WorkerHandle):
    """The parent's end of one worker process."""

    def __init__(self, process, conn, signals: torch.Tensor, worker_idx: int) -> None:
        self.process = process
        self.conn = conn
        self.worker_idx = worker_idx
        self._signals = signals.numpy()[worker_idx]
        self._batch: TensorDictBase | None = None

    def send(self, message: Any) -> None:
        self.conn.send(message)

    def poll(self, timeout: float = 0.0) -> bool:
        try:
            return self.conn.poll(timeout)
        except (EOFError, OSError):
            return False

    def recv(self) -> Any:
        return self.conn.recv()

    def fileno(self) -> int:
        return self.conn.fileno()

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def exit_description(self) -> str:
        return describe_exit(self.process)

    def progress(self) -> int:
        return int(self._signals[_PROGRESS])

    def interrupt(self) -> None:
        self._signals[_INTERRUPT] += 1

    def interrupt_mark(self) -> int:
        return int(self._signals[_INTERRUPT])

    def fetch_batch(self, reply) -> TensorDictBase:
        if reply.value is not None:
            self._batch = reply.value
        if self._batch is None:
            raise RuntimeError(f"worker {self.worker_idx} announced a batch but never shared its buffer.")
        return self._batch

    def terminate(self, deadline: float) -> None:
        process = self.process
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.terminate()
            process.join(0.5)
        if process.is_alive():
            process.kill()
            process.join(1.0)
        try:
            self.conn.close()
        except OSError:
            pass


def start_worker_process(spec, ctx, signals: SignalBoard, worker_idx: int) -> MPWorkerHandle:
    """Start one worker process running the worker loop for ``spec``.

    Raises:
        ValueError: for a bad ``$RLHARVEST_WORKER_SCHED``.
    """
    worker_scheduling()
    parent_conn, child_conn = ctx.Pipe(duplex=True)
    # User callables inside the spec are already CloudpickleWrapper-ed by the collector; the spec itself
    # goes through multiprocessing's pickler, which knows how to pass pipes, locks and shared tensors.
    payload = spec
    parent_pid, death_signal = parent_watch(ctx)
    process = ctx.Process(
        target=_worker_main,
        args=(payload, child_conn, signals.table, worker_idx, parent_pid, death_signal),
        name=f"rlharvest-worker-{worker_idx}",
        daemon=False,
    )
    process.start()
    child_conn.close()
    return MPWorkerHandle(process, parent_conn, signals.table, worker_idx)

