"""Workers as threads of this process: the worker loop behind in-process mailboxes.

For envs that release the GIL (or cost little), a worker thread avoids a process per env. Messages
are Python objects in a deque (nothing is pickled, a batch is handed over as it is); each mailbox
has a pipe that carries one byte per message, so the parent's multiplexed waits
(``multiprocessing.connection.wait`` on ``fileno()``) work unchanged. Threads cannot be killed:
``terminate`` joins until its deadline and leaves a thread that did not stop behind as a daemon.
"""

from __future__ import annotations

import collections
import os
import select
import threading
import time
from typing import Any

from tensordict import TensorDictBase

from .base import WorkerEndpoint, WorkerHandle

__all__ = ["ThreadWorkerHandle", "ThreadWorkerEndpoint", "start_worker_thread"]


class _Mailbox:
    """A one-way queue of messages whose readiness is a readable pipe."""

    def __init__(self) -> None:
        self._messages: collections.deque = collections.deque()
        self._read_fd, self._write_fd = os.pipe()
        self._lock = threading.Lock()

    def put(self, message: Any) -> None:
        with self._lock:
            if self._write_fd < 0:
                raise BrokenPipeError("the mailbox is closed")
            self._messages.append(message)
            os.write(self._write_fd, b"\x00")

    def ready(self, timeout: float) -> bool:
        if self._messages:
            return True
        if self._read_fd < 0:
            return False
        readable, _, _ = select.select([self._read_fd], [], [], max(0.0, timeout))
        return bool(readable) and bool(self._messages)

    def get(self) -> Any:
        os.read(self._read_fd, 1)
        return self._messages.popleft()

    def fileno(self) -> int:
        return self._read_fd

    def close(self) -> None:
        with self._lock:
            for fd in (self._read_fd, self._write_fd):
                if fd >= 0:
                    os.close(fd)
            self._read_fd = self._write_fd = -1


class _Signals:
    """The ``[interrupt, progress]`` counters of one worker (plain ints: threads share them)."""

    def __init__(self) -> None:
        self.interrupt = 0
        self.progress = 0


class ThreadWorkerEndpoint(WorkerEndpoint):
    """A worker thread's end: commands in, replies out, batches handed over as they are."""

    def __init__(self, inbox: _Mailbox, outbox: _Mailbox, signals: _Signals, worker_idx: int) -> None:
        self.inbox, self.outbox, self.signals = inbox, outbox, signals
        self.worker_idx = worker_idx
        self._interrupt_seen = signals.interrupt
        self.closed = False

    def fileno(self) -> int:
        return self.inbox.fileno()

    def recv(self, timeout: float) -> Any | None:
        if self.closed or not self.inbox.ready(timeout):
            return None
        return self.inbox.get()

    def send(self, message: Any) -> None:
        try:
            self.outbox.put(message)
        except BrokenPipeError:
            self.closed = True

    def publish_batch(self, batch: TensorDictBase) -> TensorDictBase:
        return batch  # same process: the parent reads it in place until its next command

    def interrupted(self) -> bool:
        return self.signals.interrupt != self._interrupt_seen

    def clear_interrupt(self, mark: int | None = None) -> None:
        self._interrupt_seen = self.signals.interrupt if mark is None else mark

    def report_progress(self, steps: int) -> None:
        self.signals.progress = steps

    def parent_alive(self) -> bool:
        return not self.closed


class ThreadWorkerHandle(WorkerHandle):
    """The parent's end of one worker thread."""

    def __init__(self, thread: threading.Thread, endpoint: ThreadWorkerEndpoint) -> None:
        self.thread = thread
        self.endpoint = endpoint
        self.worker_idx = endpoint.worker_idx

    def send(self, message: Any) -> None:
        self.endpoint.inbox.put(message)

    def poll(self, timeout: float = 0.0) -> bool:
        return self.endpoint.outbox.ready(timeout)

    def recv(self) -> Any:
        return self.endpoint.outbox.get()

    def fileno(self) -> int:
        return self.endpoint.outbox.fileno()

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def exit_description(self) -> str:
        return "its thread ended"

    def progress(self) -> int:
        return self.endpoint.signals.progress

    def interrupt(self) -> None:
        self.endpoint.signals.interrupt += 1

    def interrupt_mark(self) -> int:
        return self.endpoint.signals.interrupt

    def fetch_batch(self, reply) -> TensorDictBase:
        if reply.value is None:
            raise RuntimeError(f"worker thread {self.worker_idx} announced a batch without handing it over.")
        return reply.value

    def terminate(self, deadline: float) -> None:
        self.thread.join(max(0.0, deadline - time.monotonic()))
        self.endpoint.closed = True  # a thread still running stops at its next wait for a command
        if not self.thread.is_alive():
            self.endpoint.inbox.close()
            self.endpoint.outbox.close()


def start_worker_thread(spec, worker_idx: int) -> ThreadWorkerHandle:
    """Start one thread running the worker loop for ``spec``."""
    from ..worker import run_worker

    endpoint = ThreadWorkerEndpoint(_Mailbox(), _Mailbox(), _Signals(), worker_idx)
    thread = threading.Thread(target=run_worker, args=(spec, endpoint), name=f"rlharvest-worker-thread-{worker_idx}",
                              daemon=True)
    thread.start()
    return ThreadWorkerHandle(thread, endpoint)
