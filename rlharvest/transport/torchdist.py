"""Nodes on other machines: a torch.distributed process group for tensors, TCP for commands.

Start-up (store, command listener, group) is :mod:`rlharvest.transport.rendezvous`; this module is
what runs afterwards. The command channel of a node (``tcp_port + 1``, authenticated, see
:mod:`rlharvest.transport.channel`) carries typed commands and replies, the same messages as the
worker processes' pipes, plus heartbeats from the node.

A batch leaves a node as one flat ``uint8`` tensor (``rlharvest.data.flat``) sent point-to-point to
rank 0, right after the node's BATCH reply; the layout travels once, with the first reply (over the
authenticated channel: the group only ever carries raw tensor bytes).

Liveness: a node sends a heartbeat every ``heartbeat_interval`` seconds; the parent declares it
dead when its connection closes (process death) or when no heartbeat arrived for
``heartbeat_timeout`` seconds (host unreachable). TCP_USER_TIMEOUT and keepalives make blocked
sockets fail instead of hanging on either side.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import threading
import time
from typing import Any, Callable

import cloudpickle
import torch
import torch.distributed as dist
from tensordict import TensorDictBase

from .._utils import use_worker_scheduling
from ..data.flat import FlatLayout, is_dense
from ..errors import RemoteFailure, WorkerError
from .base import WorkerEndpoint, WorkerHandle
from .channel import AUTHKEY_ENV, open_channel, parse_authkey
from .rendezvous import (BACKENDS, CONTROL_KEY, Rendezvous, check_backend, distributed_state_exists,
                         make_process_group, mark_distributed_state)

__all__ = [
    "BACKENDS",
    "check_backend",
    "make_process_group",
    "Rendezvous",
    "DistWorkerHandle",
    "DistWorkerEndpoint",
    "node_authkey",
    "run_node",
]

# re-exported: the launchers and collectors import them from here
_ = (distributed_state_exists, mark_distributed_state)

BATCH_TAG = 11
WEIGHTS_TAG = 12


class DistWorkerHandle(WorkerHandle):
    """The parent's end of one node: its command channel, its batch buffer, its liveness."""

    def __init__(self, conn, group, rank: int, launched, heartbeat_timeout: float) -> None:
        self.conn = conn
        self.group = group
        self.rank = rank
        self.worker_idx = rank - 1
        self.launched = launched
        self.heartbeat_timeout = heartbeat_timeout
        self._last_heard = time.monotonic()
        self._last_check = time.monotonic()
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

    def is_alive(self) -> bool:
        """Cheap: the pool drains the channel (heartbeats included) before asking."""
        now = time.monotonic()
        if now - self._last_check > self.heartbeat_timeout / 2:
            # Nobody looked at this node for a while (the caller was busy): heartbeats may be queued
            # unread, so restart the clock rather than declaring a healthy node dead.
            self._last_heard = max(self._last_heard, now)
        self._last_check = now
        if self._closed or not self.launched.is_alive():
            return False
        return now - self._last_heard < self.heartbeat_timeout

    def exit_description(self) -> str:
        # a dropped connection usually means the node ended: say how, as its launcher saw it
        if self.launched.ended(timeout=2.0 if self._closed else 0.0):
            return self.launched.exit_description()
        if self._closed:
            return "its connection closed"
        return f"no heartbeat for {self.heartbeat_timeout:g} s (host unreachable?)"

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

    def fetch_batch(self, reply) -> TensorDictBase:
        if isinstance(reply.value, TensorDictBase):  # a batch that does not fit a flat buffer
            return reply.value
        if reply.value is not None:
            if self._layout is not None and reply.value != self._layout:
                raise ValueError(
                    f"node {self.worker_idx} changed its batch layout.\nbefore: {self._layout.describe()}\n"
                    f"now: {reply.value.describe()}"
                )
            self._layout = reply.value
            self._flat, self._view = self._layout.allocate()
        if self._layout is None:
            raise RuntimeError(f"node {self.worker_idx} sent a batch before its layout.")
        try:
            work = self.group.recv([self._flat], self.rank, BATCH_TAG)
            work.wait(datetime.timedelta(seconds=self.heartbeat_timeout))
        except RuntimeError as err:
            cause = f"receiving its batch failed ({err})"
            if self.launched.ended(timeout=2.0):  # e.g. killed mid-transfer: that is the news
                cause = f"the node died while sending its batch: {self.launched.exit_description()}"
            raise WorkerError(f"{cause}.", worker_idx=self.worker_idx) from err
        return self._view

    def terminate(self, deadline: float) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
        self._closed = True
        self.launched.terminate(deadline)


class DistWorkerEndpoint(WorkerEndpoint):
    """A node's end: a reader/heartbeat thread on the command channel, batches over the group."""

    def __init__(self, conn, group, rank: int, heartbeat_interval: float = 1.0) -> None:
        self.conn = conn
        self.group = group
        self.rank = rank
        self.worker_idx = rank - 1
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
        self.batch_buffer: TensorDictBase | None = None
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
            os.write(self._wake_w, b"x")
        self._parent_dead = True
        os.write(self._wake_w, b"x")

    def _send(self, message: Any) -> None:
        try:
            with self._send_lock:
                self.conn.send(message)
        except OSError:
            self._parent_dead = True

    def fileno(self) -> int:
        return self._wake_r

    def recv(self, timeout: float) -> Any | None:
        try:
            message = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return None
        os.read(self._wake_r, 1)
        return message

    def send(self, message: Any) -> None:
        self._send(message)
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
            self._flat, self.batch_buffer = self._layout.allocate()
        if batch is not self.batch_buffer:
            self.batch_buffer.update_(batch)
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
        try:
            self.conn.close()
        except OSError:
            pass
        self._thread.join(2.0)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


def node_authkey(authkey: bytes | str | None) -> bytes:
    """The key a node proves it holds: ``authkey`` if given, else ``$RLHARVEST_AUTHKEY`` (hex).

    Raises:
        ValueError: when neither is set, or the key is malformed.
    """
    if authkey is None:
        authkey = os.environ.get(AUTHKEY_ENV)
        if not authkey:
            raise ValueError(f"this node has no key to authenticate with the main process: set {AUTHKEY_ENV} to "
                             "the collector's key (hex), see docs/security.md.")
        return parse_authkey(authkey, AUTHKEY_ENV)
    return parse_authkey(authkey)


def run_node(rank: int, world_size: int, host: str, port: int, backend: str = "gloo", *,
             authkey: bytes | str | None = None, timeout: float = 120.0, op_timeout: float = 1800.0,
             user_timeout: float = 10.0, heartbeat_interval: float = 1.0, handshake_timeout: float = 5.0,
             device_host: str | None = None) -> None:
    """A node's whole life: join the group, connect the command channel, receive its spec, serve.

    Every launcher (local processes, SLURM jobs, nodes started by hand or by
    ``submitit_delayed_launcher``) runs exactly this; the node learns its configuration from the main
    process over the command channel, which it uses only once the main process proved it holds
    ``authkey`` (what it reads from the store, a port number, can only make it fail, see
    docs/security.md).

    Raises:
        AuthenticationFailed: the command listener did not prove it holds the key.
    """
    from ..worker import Reply, run_worker

    key = node_authkey(authkey)
    use_worker_scheduling()  # before the store and gloo start their threads: they inherit it
    torch.set_num_threads(1)
    store = dist.TCPStore(host, int(port), world_size, False, datetime.timedelta(seconds=timeout))
    group = make_process_group(backend, store, rank, world_size, op_timeout, device_host)
    from .torchdist_weights import set_node_group

    set_node_group(group)
    control_port = int(store.get(CONTROL_KEY))
    conn = open_channel(host, control_port, key, timeout, user_timeout, handshake_timeout)
    conn.send(("hello", rank, os.getpid(), socket.gethostname()))
    payload = conn.recv_bytes()
    endpoint = DistWorkerEndpoint(conn, group, rank, heartbeat_interval)
    try:
        # The spec names the env constructors and the policy by reference: a node whose sys.path
        # lacks their module must say so to the main process, not only in its own log.
        spec = cloudpickle.loads(payload)  # authenticated bytes from the main process
    except BaseException as err:
        endpoint.send(Reply(-1, rank - 1, failure=RemoteFailure.capture(err, rank - 1)))
        endpoint.close()
        return
    torch.set_num_threads(max(1, int(spec.num_threads)))
    try:
        run_worker(spec, endpoint)
    finally:
        endpoint.close()
        del group, store
