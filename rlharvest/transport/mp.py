"""The ``mp`` backend: worker processes on this machine, commands through pipes, batches through
shared memory.

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

import ctypes
import os
import signal
import threading
import time

import torch
import torch.multiprocessing as torch_mp
from tensordict import TensorDictBase

from .._utils import CloudpickleWrapper, use_worker_scheduling, worker_scheduling
from ..data.flat import is_dense
from ..protocol import WorkerSpec
from ..rollout import TrajectoryCounter
from .base import Backend, WorkerTarget
from .pipes import PipeEndpoint, PipeHandle
from .shared_memory import SharedMemLinks

__all__ = ["MPBackend", "MPWorkerHandle", "MPWorkerEndpoint", "SharedTrajectoryCounter", "describe_exit", "mp_context",
           "set_parent_death_signal"]



def mp_context(start_method: str | None = None):
    """The multiprocessing context workers are started with: ``fork`` unless told otherwise.

    Worker processes only use pipes, shared memory, their env and policy, so forking (the fastest
    start) is safe for them; ``mp_start_method="spawn"``/``"forkserver"`` are honoured.
    """
    method = start_method or ("fork" if "fork" in torch_mp.get_all_start_methods() else "spawn")
    allowed = torch_mp.get_all_start_methods()
    if method not in allowed:
        raise ValueError(f"mp_start_method must be one of {allowed}, got {method!r}")
    return torch_mp.get_context(method)


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

    def peek(self) -> int:
        with self._lock:
            return int(self._value[0])

    def advance_to(self, value: int) -> None:
        with self._lock:
            self._value[0] = max(int(self._value[0]), int(value))

    def __getstate__(self):
        return {"_value": self._value, "_lock": self._lock, "_view": None}


class SignalBoard:
    """The shared ``[interrupt, progress]`` rows of every worker of a collector."""

    def __init__(self, num_workers: int) -> None:
        self.table = torch.zeros((num_workers, 2), dtype=torch.int64).share_memory_()


def describe_exit(code: int | None) -> str:
    """How a process ended, from its exit code, for error messages."""
    if code is None:
        return "it is still running"
    if code < 0:
        try:
            return f"it was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"it was killed by signal {-code}"
    return f"it exited with code {code}"


def set_parent_death_signal() -> None:
    """Ask Linux to kill this process when the thread that forked it dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # pragma: no cover - not Linux
        pass


class MPWorkerEndpoint(PipeEndpoint):
    """A worker process's end: the pipe, its signal row, and its shared batch buffer."""

    def __init__(self, conn, signals: torch.Tensor, worker_idx: int, parent_pid: int | None) -> None:
        super().__init__(conn, signals.numpy()[worker_idx], worker_idx)
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

    def parent_alive(self) -> bool:
        # Started by a forkserver (no parent pid to compare): the pipe's EOF tells.
        return super().parent_alive() and (self.parent_pid is None or os.getppid() == self.parent_pid)


def _process_main(target: WorkerTarget, spec, conn, signals, worker_idx: int, parent_pid: int | None,
                  death_signal: bool) -> None:
    """A worker process's first steps: make sure it dies with its parent, then run ``target``."""
    if death_signal:
        set_parent_death_signal()
    if parent_pid is not None and os.getppid() != parent_pid:  # the parent died before we got here
        return
    use_worker_scheduling()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    target = target.payload if isinstance(target, CloudpickleWrapper) else target
    spec = spec.payload if isinstance(spec, CloudpickleWrapper) else spec
    torch.set_num_threads(max(1, int(spec.num_threads)))
    target(spec, MPWorkerEndpoint(conn, signals, worker_idx, parent_pid))


class MPWorkerHandle(PipeHandle):
    """The parent's end of one worker process."""

    def __init__(self, process, conn, signals: torch.Tensor, worker_idx: int) -> None:
        super().__init__(conn, signals.numpy()[worker_idx], worker_idx)
        self.process = process
        self._batch: TensorDictBase | None = None

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def exit_description(self) -> str:
        code = self.process.exitcode
        if code is None:
            self.process.join(1.0)  # its pipe closed first: give the exit status a moment to arrive
            code = self.process.exitcode
        if code is None:
            return "it stopped answering (its connection closed) but is still running"
        return describe_exit(code)

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
        self.close_pipe()


class MPBackend(Backend):
    """Worker processes on this machine (``multiprocessing``: fork by default).

    Args:
        num_workers: how many workers the collector runs.
        target: what each worker process runs, ``target(spec, endpoint)`` (the worker loop).
        ctx: the multiprocessing context (see :func:`mp_context`).
        policy_devices: the device each worker runs its policy on (weights are staged there).

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

    def trajectory_counter(self) -> SharedTrajectoryCounter:
        """Trajectory ids shared by the workers (held in this process's shared memory)."""
        return SharedTrajectoryCounter(self.ctx)

    def start_one(self, index: int, spec: WorkerSpec) -> MPWorkerHandle:
        """Start the process of worker ``index``.

        Raises:
            ValueError: for a bad ``$RLHARVEST_WORKER_SCHED``.
        """
        worker_scheduling()
        parent_conn, child_conn = self.ctx.Pipe(duplex=True)
        # The spec goes through multiprocessing's pickler, which knows how to pass pipes, locks and
        # shared tensors; user callables inside it are already wrapped for cloudpickle.
        direct_child = self.ctx.get_start_method() in ("fork", "spawn")
        death_signal = direct_child and threading.current_thread() is threading.main_thread()
        parent_pid = os.getpid() if direct_child else None
        process = self.ctx.Process(
            target=_process_main,
            args=(self.target, spec, child_conn, self.signals.table, index, parent_pid, death_signal),
            name=f"rlharvest-worker-{index}",
            daemon=False,
        )
        process.start()
        child_conn.close()
        handle = self.handles[index] = MPWorkerHandle(process, parent_conn, self.signals.table, index)
        return handle

    def default_scheme(self) -> str:
        return "shared"

    def weight_links(self) -> SharedMemLinks:
        return SharedMemLinks(self.num_workers, self.liveness, ctx=self.ctx, devices=self.policy_devices)
