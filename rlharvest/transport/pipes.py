"""The two ends of a worker reached through a duplex pipe on this machine, plus a row of cheap
shared signals ``[interrupt, progress]`` (read between env steps, ~0.1 us), and where the row is wide
enough, what the worker left and what it wrote to the replay buffer.

The ``mp`` backend (processes) and the ``inprocess`` backend (threads) share these; each adds how
its worker lives and dies and how batches are published.
"""

from __future__ import annotations

import contextlib
import os
from multiprocessing import resource_sharer
from typing import Any, Callable

import numpy as np

from ..protocol import Written
from .base import WorkerEndpoint, WorkerHandle

__all__ = ["PipeHandle", "PipeEndpoint", "Doorbell", "OfferedDescriptors", "INTERRUPT", "PROGRESS", "LEFT",
           "WRITTEN", "ROW_WIDTH"]

#: the columns of a worker's signal row (``LEFT``: 1 once a preempted worker finished its rollout and
#: leaves, 2 once it handed it back; rows of two columns have none). From ``WRITTEN`` on, the worker's
#: :class:`~rlharvest.protocol.Written` totals: a sequence count (twice their ``reports``, odd while the
#: worker writes them), then ``frames, trajectory_frames, trajectories, pending_frames, free_frames``.
INTERRUPT, PROGRESS, LEFT, WRITTEN = 0, 1, 2, 3
#: the columns of a full row (rows of two columns have neither ``LEFT`` nor the totals)
ROW_WIDTH = WRITTEN + 6
#: reads of the totals that found the worker writing them, before giving up until the next read
_READ_TRIES = 100
#: what a worker did with its rollout in flight, by the value of its ``LEFT`` column
_LEFT_AS = {1: "finished", 2: "handed back"}


class OfferedDescriptors:
    """The descriptors this process offered one worker process in what it sent it, until it is gone.

    A shared-memory tensor pickled into a pipe (weights, a state dict) travels as a duplicate of its
    descriptor, kept by multiprocessing's resource sharer (one per process) until the receiver asks
    for it while it unpickles. A worker that dies before it read the message never asks: the duplicate,
    and the memory behind it, would stay until this process exits. :meth:`sending` notes what a send
    offered; :meth:`withdraw`, once the worker is gone, closes what it never took. Sends to workers
    happen on the collector's thread, one at a time: what the sharer registered during a send is that
    send's.
    """

    def __init__(self) -> None:
        self._keys: set[int] = set()

    def sending(self, send: Callable[[], None]) -> None:
        """Run ``send`` (one message to the worker), noting the descriptors it offered."""
        sharer = resource_sharer._resource_sharer
        first = sharer._key
        send()
        last = sharer._key
        if last != first or self._keys:
            with sharer._lock:  # those taken meanwhile are the sharer's no more
                self._keys = (self._keys | set(range(first + 1, last + 1))) & sharer._cache.keys()

    def withdraw(self) -> None:
        """The worker is gone: close the duplicates it never took."""
        if not self._keys:
            return
        sharer = resource_sharer._resource_sharer
        with sharer._lock:
            entries = [sharer._cache.pop(key, None) for key in self._keys]
        self._keys.clear()
        for entry in entries:
            if entry is not None:
                with contextlib.suppress(OSError):
                    entry[1]()  # closes the duplicate


class PipeHandle(WorkerHandle):
    """The parent's end: commands and replies on ``conn``; interrupts and progress in ``signals``.

    Args:
        conn: the parent's end of the worker's duplex pipe.
        signals: the worker's row ``[interrupt, progress]`` (shared with the worker).
        worker_idx: the worker's index.
    """

    def __init__(self, conn, signals: np.ndarray, worker_idx: int) -> None:
        self.conn = conn
        self.worker_idx = worker_idx
        self._signals = signals
        self.offered = OfferedDescriptors()

    def send(self, message: Any) -> None:
        self.offered.sending(lambda: self.conn.send(message))

    def poll(self, timeout: float = 0.0) -> bool:
        try:
            return self.conn.poll(timeout)
        except (EOFError, OSError):
            return False

    def recv(self) -> Any:
        return self.conn.recv()

    def fileno(self) -> int:
        return self.conn.fileno()

    def progress(self) -> int:
        return int(self._signals[PROGRESS])

    def interrupt(self) -> None:
        self._signals[INTERRUPT] += 1

    def interrupt_mark(self) -> int:
        return int(self._signals[INTERRUPT])

    def left_as(self) -> str | None:
        return _LEFT_AS.get(int(self._signals[LEFT])) if len(self._signals) > LEFT else None

    def written(self) -> Written | None:
        row = self._signals
        if len(row) < ROW_WIDTH:
            return None
        for _ in range(_READ_TRIES):  # a consistent copy: the sequence count even and unchanged across it
            sequence = int(row[WRITTEN])
            if not sequence:  # it wrote nothing (or writes no replay buffer)
                return None
            values = row[WRITTEN + 1:ROW_WIDTH].tolist()
            if sequence % 2 == 0 and int(row[WRITTEN]) == sequence:
                return Written(*values[:4], free_frames=values[4], reports=sequence // 2)
        return None  # being written all along (a worker killed mid-way): its replies still tell

    def close_pipe(self) -> None:
        """Close the pipe, and what the worker was offered and never took (call once it is gone)."""
        try:
            self.conn.close()
        except OSError:
            pass
        self.offered.withdraw()


class PipeEndpoint(WorkerEndpoint):
    """The worker's end; a pipe that closed or broke means the parent is gone."""

    def __init__(self, conn, signals: np.ndarray, worker_idx: int) -> None:
        self.conn = conn
        self.worker_idx = worker_idx
        self._signals = signals
        self._interrupt_seen = int(signals[INTERRUPT])
        self._parent_gone = False

    def fileno(self) -> int:
        return self.conn.fileno()

    def wait_handle(self):
        return self.conn

    def recv(self, timeout: float) -> Any | None:
        try:
            if self.conn.poll(timeout):
                return self.conn.recv()
        except (EOFError, OSError):
            self._parent_gone = True
        return None

    def send(self, message: Any) -> None:
        try:
            self.conn.send(message)
        except (BrokenPipeError, OSError):
            self._parent_gone = True

    def interrupted(self) -> bool:
        return int(self._signals[INTERRUPT]) != self._interrupt_seen

    def clear_interrupt(self, mark: int | None = None) -> None:
        self._interrupt_seen = int(self._signals[INTERRUPT]) if mark is None else mark

    def report_progress(self, steps: int) -> None:
        self._signals[PROGRESS] = steps

    def report_written(self, totals: Written) -> None:
        row = self._signals
        if len(row) < ROW_WIDTH or totals.reports < 1:
            return
        row[WRITTEN] = 2 * totals.reports - 1  # odd: the parent does not read a half-written copy
        row[WRITTEN + 1:ROW_WIDTH] = (totals.frames, totals.trajectory_frames, totals.trajectories,
                                      totals.pending_frames, totals.free_frames)
        row[WRITTEN] = 2 * totals.reports

    def announce_leaving(self, handed_back: bool) -> None:
        if len(self._signals) > LEFT:
            self._signals[LEFT] = 2 if handed_back else 1

    def parent_alive(self) -> bool:
        return not self._parent_gone

    def close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass


class Doorbell:
    """A pipe rung when something arrives: what ``multiprocessing.connection.wait`` waits on."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def fileno(self) -> int:
        return self._read

    def ring(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._write, b"x")

    def clear(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._read, 4096):
                pass

    def close(self) -> None:
        """Close both ends, once: a second close would close whatever reused the descriptor numbers."""
        fds, (self._read, self._write) = (self._read, self._write), (-1, -1)
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
