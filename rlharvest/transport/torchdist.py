"""The ``torchdist`` backend: nodes (on this or other machines) started through a launcher, a
torch.distributed process group per node for tensors, an authenticated TCP channel for commands.

Start-up (store, command listener, groups) is :mod:`rlharvest.transport.rendezvous`; the launchers
(``mp``, ``submitit``, ``submitit_delayed``) are :mod:`rlharvest.transport.launchers`. The command
channel of a node (``tcp_port + 1``, authenticated, see :mod:`rlharvest.transport.channel`) carries
typed commands and replies, the same messages as the worker processes' pipes, plus heartbeats from
the node. A node that replaces another is launched like the first ones, with the next *generation*
of its rank: it forms a group of its own with the main process, the other nodes keep theirs.

A batch leaves a node as one flat ``uint8`` tensor (``rlharvest.data.flat``) sent point-to-point to
rank 0, right after the node's BATCH reply; the layout travels once, with the first reply (over the
authenticated channel: the group only ever carries raw tensor bytes).

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
import socket
import struct
import termios
import threading
import time
from typing import Any, Callable

import cloudpickle
import torch
import torch.distributed as dist
from tensordict import TensorDictBase

from ..data.flat import FlatLayout, is_dense
from ..errors import WorkerError
from ..protocol import WorkerSpec
from .base import Backend, WorkerEndpoint, WorkerHandle
from .channel import AUTHKEY_ENV, open_channel, parse_authkey
from .launchers import LaunchedNode, NodeTarget, launch_nodes
from .rendezvous import BATCH_TAG, CONTROL_KEY, PAIR_BACKENDS, Rendezvous, node_group
from .torchdist_join import JoinService
from .torchdist_weights import NodeGroupLinks, NodeWeightLinks

__all__ = ["TorchDistBackend", "DistWorkerHandle", "DistWorkerEndpoint", "join_as_node", "node_authkey"]


class DistWorkerHandle(WorkerHandle):
    """The parent's end of one node: its command channel, its batch buffer, its liveness.

    Args:
        conn: the node's command channel.
        group: the node's process group; ``peer_rank``: the node's rank in it.
        worker_idx: the node's index (its rank - 1).
        launched: how its launcher sees it.
        heartbeat_timeout: seconds without a heartbeat before the node counts as dead.
    """

    def __init__(self, conn, group, peer_rank: int, worker_idx: int, launched: LaunchedNode,
                 heartbeat_timeout: float) -> None:
        self.conn = conn
        self.group = group
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
            work = self.group.recv([self._flat], self.peer_rank, BATCH_TAG)
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
        # The node is gone: its group (sockets, threads) and batch buffer go too, also while this
        # handle stays in the slot of a node that left (as they go with a replaced node's handle).
        self.group = self._flat = self._view = self._layout = None


class DistWorkerEndpoint(WorkerEndpoint):
    """A node's end: a reader/heartbeat thread on the command channel, batches over the group."""

    def __init__(self, conn, group, worker_idx: int, heartbeat_interval: float = 1.0, store=None) -> None:
        self.conn = conn
        self.group = group
        self.store = store  # the store the group was formed through: it lives as long as the node
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

    def receiver_links(self) -> NodeGroupLinks:
        return NodeGroupLinks(self.group)

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
        try:
            self.conn.close()
        except OSError:
            pass
        self._thread.join(2.0)
        # Once (run_worker and node_main both close): a second close would close whatever reused the numbers.
        fds, (self._wake_r, self._wake_w) = (self._wake_r, self._wake_w), (-1, -1)
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)


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


def join_as_node(rank: int, world_size: int, host: str, port: int, backend: str = "gloo", *,
                 authkey: bytes | str | None = None, timeout: float = 120.0, op_timeout: float = 1800.0,
                 user_timeout: float = 10.0, heartbeat_interval: float = 1.0, handshake_timeout: float = 5.0,
                 device_host: str | None = None, generation: int = 0) -> tuple[DistWorkerEndpoint, bytes]:
    """A node's side of start-up: join its group, connect its command channel, receive its spec.

    Returns the endpoint the worker loop serves and the (pickled) spec. The node uses the channel only
    once the main process proved it holds ``authkey``; what it reads from the store, a port number,
    can only make it fail (docs/security.md).

    Raises:
        AuthenticationFailed: the command listener did not prove it holds the key.
    """
    key = node_authkey(authkey)
    store = dist.TCPStore(host, int(port), world_size, False, datetime.timedelta(seconds=timeout))
    group, _ = node_group(backend, store, rank, world_size, generation, op_timeout, device_host)
    control_port = int(store.get(CONTROL_KEY))
    conn = open_channel(host, control_port, key, timeout, user_timeout, handshake_timeout)
    conn.send(("hello", rank, os.getpid(), socket.gethostname()))
    payload = conn.recv_bytes()
    return DistWorkerEndpoint(conn, group, rank - 1, heartbeat_interval, store), payload


class TorchDistBackend(Backend):
    """Nodes in torch.distributed process groups, started through a launcher.

    Args:
        num_workers: how many nodes.
        target: what every node runs (the node entry point, ``rlharvest.worker.nodes.node_main``).
        net: addresses, ports, key and timeouts (``collectors.distributed._network.NetworkConfig``).
        launcher: ``"mp"``, ``"submitit"`` or ``"submitit_delayed"``.
        backend: the process-group backend (``"gloo"``, ...).
        slurm_kwargs: SLURM parameters of the node jobs; start_method: of ``"mp"`` nodes.
        op_timeout: seconds a group operation may take.
    """

    noun = "node"

    def __init__(self, num_workers: int, target: NodeTarget, net: Any, *, launcher: str, backend: str = "gloo",
                 slurm_kwargs: dict | None = None, start_method: str | None = None, op_timeout: float = 1800.0) -> None:
        super().__init__(num_workers)
        self.target, self.net, self.launcher, self.backend = target, net, launcher, backend
        self.slurm_kwargs, self.start_method, self.op_timeout = slurm_kwargs, start_method, op_timeout
        self.launched: list[LaunchedNode | None] = [None] * num_workers
        self.generations = [0] * num_workers
        self.rendezvous: Rendezvous | None = None
        #: ``launcher="external"``: the acceptor giving joining nodes their slots (torchdist_join)
        self.joins: JoinService | None = None
        #: seconds the last replacement's own group took to form, once the node reached the store
        self.last_group_seconds: float | None = None

    @property
    def refills_slots(self) -> bool:
        """``launcher="external"``: a node that joins takes the slot of one that left."""
        return self.launcher == "external"

    @property
    def growable(self) -> bool:
        """Nodes can be added (``add_collectors``) where one can be replaced: each forms a group of its
        own with this process, like a replacement."""
        return self.backend in PAIR_BACKENDS and self.launcher not in ("submitit_delayed", "external")

    def grow(self, count: int, options=None) -> None:
        super().grow(count, options)
        self.launched.extend([None] * count)
        self.generations.extend([-1] * count)  # start_one starts them at generation 0

    def truncate(self, num_workers: int) -> None:
        super().truncate(num_workers)
        del self.launched[num_workers:]
        del self.generations[num_workers:]

    def _launch(self, indices: list[int]) -> None:
        net = self.net
        for index in indices:
            kwargs = {**net.node_kwargs(), "generation": self.generations[index]}
            self.launched[index], = launch_nodes(
                self.launcher, [index + 1], self.num_workers + 1, net.advertised_host, net.tcp_port, self.backend,
                target=self.target, slurm_kwargs=self.slurm_kwargs, start_method=self.start_method,
                node_kwargs=kwargs, warm_replacements=self.replacements_expected)

    def _alive(self, indices: list[int]):
        def check() -> None:
            for index in indices:
                node = self.launched[index]
                if not node.is_alive():
                    raise WorkerError(f"the node died while starting: {node.exit_description()}.", worker_idx=index)
        return check

    def _connect(self, specs: list[WorkerSpec], generation: int) -> list[DistWorkerHandle]:
        """Form the groups of the launched nodes, take their channels, send them their specs."""
        indices = [spec.worker_idx for spec in specs]
        ranks = [index + 1 for index in indices]
        alive = self._alive(indices)
        start = time.monotonic()
        groups = self.rendezvous.form_groups(self.backend, ranks, generation, self.op_timeout, alive)
        self.last_group_seconds = time.monotonic() - start
        channels = self.rendezvous.accept_nodes(ranks, alive)
        handles = []
        for spec, rank in zip(specs, ranks):
            group, peer_rank = groups[rank]
            handle = DistWorkerHandle(channels[rank], group, peer_rank, spec.worker_idx, self.launched[spec.worker_idx],
                                      self.net.heartbeat_timeout)
            handle.conn.send_bytes(cloudpickle.dumps(spec))
            self.handles[spec.worker_idx] = handle
            handles.append(handle)
        return handles

    # ------------------------------------------------------------------ nodes that join (launcher="external")
    def open_joins(self) -> None:
        """``launcher="external"``: serve the store and take joining nodes from now on (idempotent)."""
        if self.joins is not None:
            return
        net = self.net
        Rendezvous.check_port(net.tcp_port, net.bind_host)
        self.rendezvous = self._rendezvous()
        kwargs = {key: value for key, value in net.node_kwargs().items() if key in ("heartbeat_interval",)}
        self.joins = JoinService(self.rendezvous, self.backend, self.num_workers, kwargs, timeout=net.worker_timeout,
                                 op_timeout=self.op_timeout)

    def _take_joined(self, specs: list[WorkerSpec], what: str) -> list[DistWorkerHandle]:
        """The handles of the nodes that joined the slots of ``specs`` (waiting up to ``worker_timeout``)."""
        joined = self.joins.take([spec.worker_idx for spec in specs], self.net.worker_timeout, what)
        handles = []
        for spec in specs:
            node = joined[spec.worker_idx]
            self.launched[spec.worker_idx] = node.node
            handle = DistWorkerHandle(node.channel, node.group, 1, spec.worker_idx, node.node, self.net.heartbeat_timeout)
            handle.conn.send_bytes(cloudpickle.dumps(spec))
            self.handles[spec.worker_idx] = handle
            handles.append(handle)
        return handles

    def _rendezvous(self) -> Rendezvous:
        net = self.net
        return Rendezvous(net.bind_host, net.tcp_port, self.num_workers + 1, net.authkey, timeout=net.worker_timeout,
                          user_timeout=net.user_timeout, handshake_timeout=net.handshake_timeout,
                          device_host=net.device_host)

    def start_all(self, specs) -> list[DistWorkerHandle]:
        if self.launcher == "external":
            self.open_joins()
            return self._take_joined(list(specs), "the first batch waits for every slot")
        net = self.net
        Rendezvous.check_port(net.tcp_port, net.bind_host)
        # Nodes first (they wait for the store): forking happens before this process starts threads.
        self._launch([spec.worker_idx for spec in specs])
        self.rendezvous = self._rendezvous()
        return self._connect(list(specs), generation=0)

    def start_one(self, index: int, spec: WorkerSpec) -> DistWorkerHandle:
        """Launch a node in place of node ``index`` (its next generation), or a node added at index
        ``index`` after :meth:`grow`, which forms a group of its own with this process; the other
        nodes keep theirs.

        Raises:
            NotImplementedError: for nodes started elsewhere (``submitit_delayed``), or a backend
                whose group spans every node (mpi, ucc).
        """
        if self.launcher == "submitit_delayed":
            raise NotImplementedError("launcher='submitit_delayed': nodes are started elsewhere, so the collector "
                                      "cannot start one in place of another.")
        if self.backend not in PAIR_BACKENDS:
            raise NotImplementedError(f"backend={self.backend!r} forms one group of every node: a node cannot be "
                                      f"replaced (use one of {list(PAIR_BACKENDS)}).")
        if self.launcher == "external":  # the next node that joins this slot
            return self._take_joined([spec], f"replacing node {index}")[0]
        self.generations[index] += 1
        self.rendezvous.open_commands()
        self._launch([index])
        return self._connect([spec], self.generations[index])[0]

    def stop_one(self, index: int, deadline: float) -> None:
        handle, node = self.handles[index], self.launched[index]
        if handle is not None:
            handle.terminate(deadline)
        elif node is not None:
            node.terminate(deadline)
        if self.joins is not None and (handle is not None or node is not None):
            self.joins.want(index)  # an empty slot: the next node that joins takes it

    def stop_all(self, deadline: float, closing=()) -> None:
        if self.joins is not None:
            self.joins.close()
            self.joins = None
        super().stop_all(deadline, closing)
        if self.rendezvous is not None:
            self.rendezvous.close()
            self.rendezvous = None

    def default_scheme(self) -> str:
        return "distributed"

    def peer(self, index: int) -> tuple[Any, int]:
        """The group reaching node ``index``, and the node's rank in it."""
        handle = self.handles[index]
        return handle.group, handle.peer_rank

    def weight_links(self) -> NodeWeightLinks:
        net = self.net
        return NodeWeightLinks(self.num_workers, self.liveness, host=net.advertised_host, bind_host=net.bind_host,
                               port=net.tcp_port + 2, peer=self.peer, user_timeout=net.user_timeout,
                               handshake_timeout=net.handshake_timeout,
                               relay_silence=min(net.user_timeout, net.heartbeat_timeout / 3))
