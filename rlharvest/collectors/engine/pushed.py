"""Workers running free push batches; a receiver thread writes them into the replay buffer.

While they run free, the receiver is the only user of the fleet's WorkerRequests: it takes each pushed
batch (posting the process-group receive a node waits for), and hands it on (``BatchLoop.write_pushed``:
ids remapped, uncollected steps dropped, the buffer extended); it also replaces a worker that failed
(restarts on), under the lock shared with weight updates (``Background.replace_free_worker``).
``pause()`` and the shutdown talk to that thread through events, so the requests stay single-threaded.
"""

from __future__ import annotations

import threading
from typing import Callable

from ...errors import WorkerError
from ...protocol import Command, Reply
from .fleet import Fleet

__all__ = ["PushedBatchReceiver", "Receiving"]


class Receiving:
    """Whether a receiver thread owns the workers (they run free pushing to it), and the lock it holds
    while it replaces a worker: weight updates sent from the caller's thread take it too, and leave a
    worker they find failed to that thread."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.active = False


class PushedBatchReceiver(threading.Thread):
    """Drains batches pushed by free-running workers.

    Args:
        fleet: the workers running free.
        take: ``take(worker, reply)`` takes one pushed batch (into the replay buffer, or dropped).
        replace: ``replace(error)`` replaces the worker a failure names and sets it running free too;
            None: a failure met while running is raised (surfaced by ``pause()`` and the shutdown).
    """

    def __init__(self, fleet: Fleet, take: Callable[[int, Reply], None],
                 replace: Callable[[WorkerError], None] | None = None) -> None:
        super().__init__(name="rlharvest-pushed-batches", daemon=True)
        self.fleet = fleet
        self.take = take
        self.replace = replace
        self.error: BaseException | None = None
        self.stop_requested = threading.Event()
        self.pause_requested = threading.Event()
        self.paused = threading.Event()
        self.resume_requested = threading.Event()
        self.quiet = threading.Event()  # set once every node stopped pushing (after a stop request)

    def run(self) -> None:
        try:
            while not self.stop_requested.is_set():
                if self.pause_requested.is_set():
                    self._pause()
                    continue
                self._take_one(0.1, replace_failed=True)
            self._quiesce()
        except BaseException as err:  # surfaced by pause() / async_shutdown()
            self.error = err
            self.paused.set()
            self.quiet.set()

    def _take_one(self, timeout: float, replace_failed: bool = False) -> bool:
        """Write the next pushed batch, if one comes within ``timeout`` s. With ``replace_failed``, a
        node found failed (also while sending a batch, which is then dropped whole) is replaced as the
        restart policy allows, and runs free like the others (docs/restarts.md)."""
        try:
            item = self.fleet.requests.next_pushed(timeout)
            if item is None:
                return False
            worker, reply = item
            self.take(worker, reply)
        except WorkerError as err:
            if not replace_failed or self.replace is None:
                raise
            self.replace(err)
            return False
        return True

    def _stop_pushing(self) -> None:
        """Ask every node to stop after its current rollout; keep writing what arrives meanwhile."""
        pool = self.fleet.requests
        for handle in pool.handles:
            handle.interrupt()
        requests = {w: pool.send(w, Command.PAUSE) for w in range(len(pool))}
        while requests:
            for worker, request_id in list(requests.items()):
                if pool.has_reply(worker, request_id):
                    pool.wait_for(worker, request_id)
                    del requests[worker]
            if requests:
                self._take_one(0.05)
        while self._take_one(0.0):  # batches pushed right before the pause
            pass

    def _pause(self) -> None:
        self._stop_pushing()
        self.paused.set()
        while not (self.resume_requested.wait(0.1) or self.stop_requested.is_set()):
            pass
        self.pause_requested.clear()
        self.resume_requested.clear()
        self.paused.clear()
        if not self.stop_requested.is_set():
            self.fleet.requests.broadcast(Command.RESUME)

    def _quiesce(self) -> None:
        self._stop_pushing()
        self.quiet.set()
