"""The two ends of a ``torchdist`` node's link: the main process's handle of a node
(:class:`DistWorkerHandle`) and the node's endpoint (:class:`DistWorkerEndpoint`), over the node's
authenticated command channel and its process group (:mod:`rlharvest.transport.torchdist`).

A batch leaves a node as one flat ``uint8`` tensor (``rlharvest.data.flat``) sent point-to-point to
the main process, right after the node's BATCH reply; the layout travels once, with the first reply
(over the authenticated channel: the group only ever carries raw tensor bytes). The main process takes
only replies and heartbeats on a node's channel, and allocates a batch buffer only for a layout it
checked (:class:`~rlharvest.data.flat.FlatLayout`, within :func:`~rlharvest.transport.wire.node_limit`).

Liveness: a node sends a heartbeat every ``heartbeat_interval`` seconds; the parent declares it
dead when its connection closes (process death) or when no heartbeat arrived for
``heartbeat_timeout`` seconds (host unreachable). TCP_USER_TIMEOUT and keepalives make blocked
sockets fail instead of hanging on either side.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import queue
import struct
import termios
import threading
import time
from typing import Any, Callable

import torch
from tensordict import TensorDictBase

from ..data.flat import FlatLayout, is_dense
from ..errors import RemoteFailure, WorkerError
from ..protocol import Reply
from .base import WorkerEndpoint, WorkerHandle
from .channel import shutdown_connection
from .launchers import LaunchedNode
from .rendezvous import BATCH_TAG
from .torchdist_receiver import NodeGroupLinks
from .wire import UnsendableValue

__all__ = ["DistWorkerHandle", "DistWorkerEndpoint", "is_node_message"]


class DistWorkerHandle(WorkerHandle):
    """The parent's end of one node: its command channel, its batch buffer, its liveness.

    Args:
        conn: the node's command channel.
        group: the node's process group; ``peer_rank``: the node's rank in it.
        worker_idx: the node's index (its rank - 1).
        launched: how its launcher sees it.
        heartbeat_timeout: seconds without a heartbeat before the node counts as dead.
        store: the group's store (torch holds it by reference: it lives as long as the group).
    """

    def __init__(self, conn, group, peer_rank: int, worker_idx: int, launched: LaunchedNode,
                 heartbeat_timeout: float, store=None) -> None:
        self.conn = conn
        self.group = group
        self.store = store
        self.peer_rank = peer_rank
        self.worker_idx = worker_idx
        self.launched = launched
        self.heartbeat_timeout = heartbeat_timeout
        self._last_heard = time.monotonic()
        self._last_check = time.monotonic()
        self._unread = 0  # bytes waiting unread on the command socket at the last is_alive()
        self._closed = False
        self._steps = -1
        self._interrupts = 0
        self._layout: FlatLayout | None = None
        self._flat: torch.Tensor | None = None
        self._view: TensorDictBase | None = None

    def send(self, message: Any) -> None:
        self.conn.send(message)

    def poll(self, timeout: float = 0.0) -> bool:
        if self._closed:
            return False
        try:
            return self.conn.poll(timeout)
        except (EOFError, OSError):
            self._closed = True
            return False

    def recv(self) -> Any:
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            self._closed = True
            raise
        self._last_heard = time.monotonic()
        if isinstance(message, tuple) and message and message[0] == "hb":
            self._steps = message[1]
            return None
        return message

    def fileno(self) -> int:
        return self.conn.fileno()

    @property
    def pid(self) -> int | None:
        return self.launched.pid

    def is_alive(self) -> bool:
        """Cheap, and true to the node even while nobody drains its channel.

        A caller busy elsewhere (the weight sender waiting for carriers or acknowledgements) does not
        read heartbeats; they queue on the socket. Bytes waiting there that grew since the last look
        are as good as a heartbeat read: the node is sending, so it is alive.
        """
        now = time.monotonic()
        if now - self._last_check > self.heartbeat_timeout / 2:
            # Nobody looked at this node for a while (the caller was busy): heartbeats may be queued
            # unread, so restart the clock rather than declaring a healthy node dead.
            self._last_heard = max(self._last_heard, now)
        self._last_check = now
        unread = self._unread_bytes()
        if unread > self._unread:
            self._last_heard = now
        self._unread = unread
        if self._closed or not self.launched.is_alive():
            return False
        return now - self._last_heard < self.heartbeat_timeout

    def _unread_bytes(self) -> int:
        """Bytes received on the command socket that nobody read yet (FIONREAD); 0 once it is closed."""
        if self._closed:
            return 0
        try:
            raw = fcntl.ioctl(self.conn.fileno(), termios.FIONREAD, b"\0\0\0\0")
        except (OSError, ValueError):
            return 0
        return struct.unpack("i", raw)[0]

    def exit_description(self) -> str:
        # a dropped connection usually means the node ended: say how, as its launcher saw it
        if self.launched.ended(timeout=2.0 if self._closed else 0.0):
            return self.launched.exit_description()
        if self._closed:
            return "its connection closed"
        return f"no heartbeat for {self.heartbeat_timeout:g} s (host unreachable?)"

    def exit_kind(self) -> str:
        return "died" if self._closed or not self.launched.is_alive() else "heartbeat"

    def progress(self) -> int:
        return self._steps

    def interrupt(self) -> None:
        if self._closed:
            return
        try:
            self.conn.send(("interrupt",))
            self._interrupts += 1
        except OSError:
            self._closed = True

    def interrupt_mark(self) -> int:
        return self._interrupts

    def batch_resized(self) -> None:
        self._layout = None  # the node's next reply carries its new layout

    def fetch_batch(self, reply) -> TensorDictBase:
        if isinstance(reply.value, TensorDictBase):  # a batch that does not fit a flat buffer
            return reply.value
        if reply.value is not None:
            if not isinstance(reply.value, FlatLayout):
                raise WorkerError(f"sent a {type(reply.value).__name__} where a batch goes.",
                                  worker_idx=self.worker_idx)
            if self._layout is not None and reply.value != self._layout:  # a failure of the node's, as what follows
                raise WorkerError(f"changed its batch layout.\nbefore: {self._layout.describe()}\n"
                                  f"now: {reply.value.describe()}", worker_idx=self.worker_idx)
            try:
                self._flat, self._view = reply.value.allocate(zeroed=False)  # the node's bytes fill it whole
            except (RuntimeError, ValueError) as err:  # e.g. memory, for a layout within the limit
                raise WorkerError(f"its batch layout ({reply.value.total_bytes} bytes) could not be allocated: {err}",
                                  worker_idx=self.worker_idx) from err
            self._layout = reply.value
        if self._layout is None:
            raise WorkerError("sent a batch before its layout.", worker_idx=self.worker_idx)
        try:
            work = self.group.recv([self._flat], self.peer_rank, BATCH_TAG)
            work.wait(datetime.timedelta(seconds=self.heartbeat_timeout))
        except RuntimeError as err:
            cause = f"receiving its batch failed ({err})"
            if self.launched.ended(timeout=2.0):  # e.g. killed mid-transfer: that is the news
                cause = f"the node died while sending its batch: {self.launched.exit_description()}"
            raise WorkerError(f"{cause}.", worker_idx=self.worker_idx) from err
        return self._view

    def terminate(self, deadline: float) -> None:
        self.launched.terminate(deadline)  # a node told to close exits by the deadline: it may be awaited
        try:
            self.conn.close()
        except OSError:
            pass
        self._closed = True
        # The node is gone: its group (sockets, threads) and batch buffer go too, also while this
        # handle stays in the slot of a node that left (as they go with a replaced node's handle).
        self.group = self._flat = self._view = self._layout = None


def is_node_message(message: Any, worker_idx: int) -> bool:
    """What node ``worker_idx`` sends its parent: its replies (their fields checked by the wire format)
    and heartbeats (the main process takes nothing else on a node's command channel)."""
    if type(message) is Reply:
        return message.worker_idx == worker_idx
    return type(message) is tuple and len(message) == 2 and message[0] == "hb" and type(message[1]) is int


class DistWorkerEndpoint(WorkerEndpoint):
    """A node's end: a reader/heartbeat thread on the command channel, batches over the group.

    ``key``: the node's slot key (its weight channel's key derives from it); ``store``: the store the
    group was formed through, which lives as long as the node.
    """

    def __init__(self, conn, group, worker_idx: int, heartbeat_interval: float = 1.0, store=None,
                 key: bytes | None = None) -> None:
        self.conn = conn
        self.group = group
        self.store = store
        self.key = key
        self.worker_idx = worker_idx
        self._inbox: queue.Queue = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        self._send_lock = threading.Lock()
        self._interrupts = 0
        self._seen = 0
        self._steps = 0
        self._parent_dead = False
        self._stop = threading.Event()
        self._layout: FlatLayout | None = None
        self._flat: torch.Tensor | None = None
        self._batch_buffer: TensorDictBase | None = None
        self._pending_send = False
        self._interval = heartbeat_interval
        self._send_timeout = 60.0
        self._send_work = None
        self._thread = threading.Thread(target=self._read_loop, name="rlharvest-node-reader", daemon=True)
        self._thread.start()

    def _read_loop(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + self._interval
                self._send(("hb", self._steps))
            try:
                if not self.conn.poll(max(0.0, next_beat - time.monotonic())):
                    continue
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, tuple) and message and message[0] == "interrupt":
                self._interrupts += 1
                continue
            self._inbox.put(message)
            self._wake()
        self._parent_dead = True
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            if self._wake_w >= 0:  # -1 once closed
                os.write(self._wake_w, b"x")

    def _send(self, message: Any) -> None:
        try:
            with self._send_lock:
                self.conn.send(message)
        except OSError:
            self._parent_dead = True

    def fileno(self) -> int:
        return self._wake_r

    def wait_handle(self):
        return self

    def batch_buffer(self) -> TensorDictBase | None:
        return self._batch_buffer

    def batch_resized(self) -> None:
        self._layout = self._flat = self._batch_buffer = None  # the next reply carries the new layout

    def receiver_links(self) -> NodeGroupLinks:
        return NodeGroupLinks(self.group, key=self.key, rank=self.worker_idx + 1)

    def recv(self, timeout: float) -> Any | None:
        try:
            message = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return None
        os.read(self._wake_r, 1)
        return message

    def send(self, message: Any) -> None:
        try:
            self._send(message)
        except UnsendableValue as err:  # e.g. getattr_env of a value wire format 2 cannot hold: say so
            if not isinstance(message, Reply):
                raise
            failure = RemoteFailure.capture(err, self.worker_idx)
            self._send(Reply(message.request_id, message.worker_idx, failure=failure))
        if self._pending_send:
            # Non-blocking: the main process receives when it takes the reply, and meanwhile this node
            # must stay free to apply weight updates. The buffer is reused only after before_rollout().
            self._pending_send = False
            self._send_work = self.group.send([self._flat], 0, BATCH_TAG)

    def before_rollout(self, idle: Callable[[], None] | None = None) -> None:
        """Wait until the previous batch left the buffer, applying weight updates (``idle``) meanwhile.

        Running free, the main process may wait for this node's acknowledgement of an update that
        arrived after the last env step, before it takes the batch this node is sending.
        """
        work, self._send_work = self._send_work, None
        if work is None:
            return
        timeout = datetime.timedelta(seconds=self._send_timeout)
        try:
            if idle is None:
                work.wait(timeout)
                return
            # A gloo send reports completion only through wait() (is_completed() stays False until
            # then), so a thread waits while this one keeps applying updates.
            done, failure = threading.Event(), []

            def wait_send() -> None:
                try:
                    work.wait(timeout)
                except BaseException as err:
                    failure.append(err)
                finally:
                    done.set()

            threading.Thread(target=wait_send, name="rlharvest-batch-send", daemon=True).start()
            while not done.wait(1e-3):
                idle()
            if failure:
                raise failure[0]
        except RuntimeError:  # the main process is gone or unreachable
            self._parent_dead = True
            raise

    def publish_batch(self, batch: TensorDictBase) -> FlatLayout | TensorDictBase | None:
        if not is_dense(batch):
            return batch  # non-tensor or heterogeneous entries: pickled into the reply itself
        first = self._layout is None
        if first:
            self._layout = FlatLayout.of(batch)
            self._flat, self._batch_buffer = self._layout.allocate()
        if batch is not self._batch_buffer:
            self._batch_buffer.update_(batch)
        self._pending_send = True  # sent right after the BATCH reply (see send)
        return self._layout if first else None

    def interrupted(self) -> bool:
        return self._interrupts != self._seen

    def clear_interrupt(self, mark: int | None = None) -> None:
        self._seen = self._interrupts if mark is None else mark

    def report_progress(self, steps: int) -> None:
        self._steps = steps

    def parent_alive(self) -> bool:
        return not self._parent_dead

    def close(self) -> None:
        self._stop.set()
        # wakes the reader, which may be polling the channel until its next heartbeat is due (up to
        # heartbeat_interval: every node's exit waited that long); the socket is closed once it left
        shutdown_connection(self.conn)
        self._thread.join(2.0)
        try:
            self.conn.close()
        except OSError:
            pass
        # Once (run_worker and node_main both close): a second close would close whatever reused the numbers.
        fds, (self._wake_r, self._wake_w) = (self._wake_r, self._wake_w), (-1, -1)
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
