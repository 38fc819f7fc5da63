"""Weights to nodes (the transport of DistributedWeightSyncScheme).

An update is announced on a per-node TCP channel (served by the sender on ``tcp_port + 2``) with its
version; the node applies it between two env steps by swapping its model's tensors (no copy) and
acknowledges the version once it applied (and cascaded) it. The payload travels

* to a node on another host: as one flat tensor sent point-to-point over the process group, into
  the node's own alternating pair of buffers;
* to a node on this host (it reached us through loopback, same kernel): through a named
  shared-memory generation buffer (``weight_pool``), copied once by the sender whatever the number
  of local nodes, instead of through loopback TCP.

The node's receiver reads its channel in a thread, so the per-step check is a flag read. A node that
replaces another connects a channel of its own after start-up (``replace`` reopens the listener,
``attach`` takes the new node and hands it the weights of the last update with that version).
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from tensordict import TensorDictBase

from ..data.flat import FlatLayout, copy_leaves_
from ..errors import WorkerError, WorkerTimeoutError
from .base import WeightLinks, WeightReceiver, WeightSender
from .channel import ChannelListener, listen, new_authkey, open_channel, shutdown_connection
from .ports import boot_id, is_loopback
from .rendezvous import WEIGHTS_TAG
from .weight_pool import GenerationPool, NamedShmAllocator, attach_named, copy_into

__all__ = ["NodeWeightLinks", "NodeGroupLinks", "DistWeightSender", "DistWeightReceiver"]

#: ``peer(worker) -> (group, rank)``: the process group reaching a node, and the node's rank in it
Peer = Callable[[int], "tuple[Any, int]"]


@dataclass
class NodeWeightLinks(WeightLinks):
    """What the weight senders of nodes need: where to listen, how to reach each node's group.

    Attributes:
        host: the address nodes connect to; bind_host: the address the listener binds.
        port: the weight channel's port.
        peer: the group reaching a node, and the node's rank in it.
        user_timeout: seconds of silence after which a blocked socket fails.
        handshake_timeout: seconds a node has to authenticate on the weight port.
    """

    host: str = "127.0.0.1"
    bind_host: str = "127.0.0.1"
    port: int = 0
    peer: Peer | None = None
    user_timeout: float = 10.0
    handshake_timeout: float = 5.0


@dataclass
class NodeGroupLinks:
    """What a node's weight receiver needs from its transport: the node's group with the main
    process (and the main process's rank in it)."""

    group: Any
    parent_rank: int = 0


class DistWeightSender(WeightSender):
    """Parent end: a listener for the nodes' weight channels, a shared-memory generation pool for
    nodes on this host and a flat send buffer for the others."""

    def __init__(self, num_workers: int, host: str, bind_host: str, port: int, peer: Peer,
                 liveness: Callable[[int], tuple[bool, str]] | None, user_timeout: float = 10.0,
                 handshake_timeout: float = 5.0) -> None:
        self.num_workers = num_workers
        self.host, self.bind_host, self.port = host, bind_host, port
        self.peer = peer
        self.liveness = liveness
        self.user_timeout, self.handshake_timeout = user_timeout, handshake_timeout
        # Its own key, which reaches the nodes inside their spec (over their authenticated command channel).
        self.authkey = new_authkey()
        self.listener = self._listen()
        self.conns: dict[int, Any] = {}
        self.local: dict[int, bool] = {}
        self._pool: GenerationPool | None = None
        self._current: dict[int, int] = {}
        self._pending: dict[int, int] = {}
        self._seen: dict[int, set] = {w: set() for w in range(num_workers)}
        self._layout: FlatLayout | None = None
        self._flat: torch.Tensor | None = None
        self._view: TensorDictBase | None = None
        self._layout_sent: set[int] = set()
        self._works: list = []
        self._unacked: dict[int, int] = {}
        #: version of the last weights announced, and where they are (("shm", generation) or ("pg", None))
        self._latest: tuple[int, tuple] | None = None

    def _listen(self) -> ChannelListener:
        return ChannelListener(listen(self.bind_host, self.port), self.authkey, "weight", self.handshake_timeout,
                               self.user_timeout)

    def connection_info(self) -> dict:
        return {"host": self.host, "port": self.listener.port, "authkey": self.authkey.hex(),
                "handshake_timeout": self.listener.handshake_timeout}

    def connect(self, initial, timeout: float = 120.0) -> None:
        self._accept(list(range(self.num_workers)), timeout, "to connect its weight channel")
        if initial is None:
            for conn in self.conns.values():
                conn.send(("init", 0, None))
            return
        self._announce(initial, 0, list(range(self.num_workers)), "init")
        self._finish_sends(timeout)

    def _accept(self, workers: list[int], timeout: float, what: str) -> None:
        """The weight channels of ``workers``; then the port closes."""
        deadline = time.monotonic() + timeout
        here = boot_id()
        while any(w not in self.conns for w in workers):
            item = self.listener.next(0.2)
            if item is not None:
                conn, hello, peer = item
                worker = _hello_worker(hello, self.num_workers)
                if worker is None or worker not in workers or worker in self.conns:  # authenticated, yet unexpected
                    conn.close()
                    self.listener.drop(peer, f"unexpected or duplicate hello {hello!r:.80}")
                    continue
                self.conns[worker] = conn
                self.local[worker] = bool(hello[2]) and hello[3] == here
                continue
            self._check_peers([w for w in workers if w not in self.conns], what)
            if time.monotonic() > deadline:
                missing = sum(w not in self.conns for w in workers)
                raise WorkerTimeoutError(f"{missing} of {len(workers)} nodes did not connect their weight channel "
                                         "in time.")
        self.listener.close()  # every awaited node is connected: the port closes

    # ------------------------------------------------------------------ replacements
    def replace(self, worker: int) -> None:
        conn = self.conns.pop(worker, None)
        if conn is not None:
            conn.close()
        self.local.pop(worker, None)
        self._seen[worker] = set()
        self._layout_sent.discard(worker)
        for state in (self._current, self._pending, self._unacked):
            state.pop(worker, None)
        self.listener.close()
        self.listener = self._listen()  # connection_info() now names its port

    def attach(self, worker: int, timeout: float) -> None:
        """Take the new node's channel and hand it the last weights announced, with their version."""
        self._accept([worker], timeout, "to connect its weight channel")
        if self._latest is None:
            self.conns[worker].send(("init", 0, None))
            return
        version, (where, generation) = self._latest
        self._finish_sends(timeout)  # the flat buffer is re-sent from, or re-staged into
        self._announce(generation.view if where == "shm" else self._view, version, [worker], "init")
        self._finish_sends(timeout)

    def _announce(self, payload: TensorDictBase, version: int, workers: list[int], kind: str) -> None:
        local = [w for w in workers if self.local[w]]
        remote = [w for w in workers if not self.local[w]]
        if local:
            generation = self._stage_shared(payload, local)
            self._latest = (version, ("shm", generation))
            for worker in local:
                handle = None if generation.gen_id in self._seen[worker] else generation.handle
                self._seen[worker].add(generation.gen_id)
                self._pending[worker] = generation.gen_id
                self.conns[worker].send((kind, version, ("shm", generation.gen_id, handle)))
        if remote:
            self._stage_flat(payload)
            self._latest = (version, ("pg", None))
            for worker in remote:
                layout = None if worker in self._layout_sent else self._layout
                self._layout_sent.add(worker)
                self.conns[worker].send((kind, version, ("pg", layout)))
                group, rank = self.peer(worker)
                self._works.append(group.send([self._flat], rank, WEIGHTS_TAG))
        if kind == "init":  # initial weights are not acknowledged: the node runs on them once connected
            self._current.update({w: self._pending.pop(w) for w in workers if w in self._pending})
        else:
            self._unacked.update({w: version for w in workers})

    def _stage_shared(self, weights: TensorDictBase, workers: list[int]):
        if self._pool is None:
            self._pool = GenerationPool(FlatLayout.of(weights), NamedShmAllocator())
        busy = set(self._current.values()) | set(self._pending.values())
        generation, _ = self._pool.acquire(busy)
        copy_into(generation, self._pool.keys, weights)
        return generation

    def _stage_flat(self, weights: TensorDictBase) -> None:
        if self._layout is None:
            self._layout = FlatLayout.of(weights)
            self._flat, self._view = self._layout.allocate()
        copy_leaves_(self._view, weights)

    def _finish_sends(self, timeout: float) -> None:
        works, self._works = self._works, []
        for work in works:
            work.wait(datetime.timedelta(seconds=timeout))

    def deliver(self, payload, version: int, worker_ids: list[int]) -> None:
        self._finish_sends(120.0)  # the flat buffer may still be read by an unfinished (sync=False) send
        if self._pending:  # a generation announced without acknowledgement may still be mapped in
            self.wait_acks(version - 1, list(self._pending), 120.0)
        self._announce(payload, version, worker_ids, "update")

    def wait_acks(self, version: int, worker_ids: list[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._finish_sends(timeout)
        for worker in worker_ids:
            while worker in self._unacked:
                message = self._recv(worker, deadline)
                if message[0] == "ack":
                    _, acked, gen_id = message
                    if gen_id is not None:
                        self._current[worker] = gen_id
                        self._pending.pop(worker, None)
                    if acked >= self._unacked[worker]:
                        del self._unacked[worker]
                elif message[0] == "error":
                    del self._unacked[worker]
                    self._pending.pop(worker, None)
                    raise message[1].to_exception(context="applying new weights")

    def _recv(self, worker: int, deadline: float):
        conn = self.conns[worker]
        while True:
            try:
                if conn.poll(0.2):
                    return conn.recv()
            except (EOFError, OSError) as err:
                raise WorkerError("its weight channel closed (the node died?).", worker_idx=worker) from err
            self._check_peers([worker], "to acknowledge new weights")
            if time.monotonic() > deadline:
                raise WorkerTimeoutError("no weight acknowledgement within the weight-sync timeout.", worker_idx=worker)

    def _check_peers(self, workers: list[int], what: str) -> None:
        if self.liveness is None:
            return
        for worker in workers:
            alive, description = self.liveness(worker)
            if not alive:
                raise WorkerError(f"died while the main process waited for it {what}: {description}.",
                                  worker_idx=worker)

    def close(self) -> None:
        for conn in self.conns.values():
            try:
                conn.close()
            except OSError:
                pass
        self.listener.close()
        if self._pool is not None:
            self._pool.close()


class DistWeightReceiver(WeightReceiver):
    """Node end: a reader thread on the weight channel; payloads mapped or received, then swapped in."""

    zero_copy = True

    def __init__(self, info: dict, worker_idx: int, links: NodeGroupLinks | None = None,
                 user_timeout: float = 10.0) -> None:
        self.info = info
        self.worker_idx = worker_idx
        self.links = links
        self.user_timeout = user_timeout
        self.conn = None
        self._inbox: queue.Queue = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        self._segments: dict[int, tuple] = {}
        self._gen_id: int | None = None
        self._buffers: list | None = None  # two (flat, view) pairs received over the process group
        self._in_use = 1
        self._thread: threading.Thread | None = None

    def fileno(self) -> int:
        return self._wake_r

    def wait_handle(self):
        return self

    def connect(self, timeout: float) -> TensorDictBase | None:
        info = self.info
        self.conn = open_channel(info["host"], info["port"], bytes.fromhex(info["authkey"]), timeout,
                                 self.user_timeout, info.get("handshake_timeout", 5.0))
        self.conn.send(("hello", self.worker_idx, is_loopback(info["host"]), boot_id()))
        kind, version, body = self.conn.recv()  # a replacement gets the current weights and their version
        if kind != "init":
            raise RuntimeError(f"unexpected weight-channel message {kind!r} during connect")
        # The thread holds the channel and the inbox, not the receiver: when it ends it must not drop
        # the last reference to the weight buffers (deallocating tensors in a daemon thread while the
        # interpreter finalizes can abort the process).
        self._thread = threading.Thread(target=_read_loop, args=(self.conn, self._inbox, self._wake_w),
                                        name="rlharvest-weights-reader", daemon=True)
        self._thread.start()
        return None if body is None else self._payload(body, timeout)

    def _payload(self, body, timeout: float) -> TensorDictBase:
        if body[0] == "shm":
            _, gen_id, handle = body
            if handle is not None:
                self._segments[gen_id] = attach_named(handle)
            self._gen_id = gen_id
            return self._segments[gen_id][1]
        _, layout = body
        if layout is not None:
            self._buffers = [layout.allocate(), layout.allocate()]
        self._in_use = 1 - self._in_use  # receive into the buffer the model does not run on
        flat, view = self._buffers[self._in_use]
        if self.links is None:
            raise RuntimeError("weights over a process group need the node's group: this receiver has none.")
        self.links.group.recv([flat], self.links.parent_rank, WEIGHTS_TAG).wait(datetime.timedelta(seconds=timeout))
        return view

    def pending(self) -> bool:
        return not self._inbox.empty()

    def receive(self, timeout: float):
        try:
            message = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return None
        os.read(self._wake_r, 1)
        kind, version, body = message
        if kind != "update":
            return None
        return version, self._payload(body, 120.0)

    def ack(self, version: int) -> None:
        self.conn.send(("ack", version, self._gen_id))

    def nack(self, failure) -> None:
        self.conn.send(("error", failure))

    def close(self) -> None:
        if self.conn is not None:
            # close() alone does not wake a recv() blocked in the reader thread; shutdown() does.
            shutdown_connection(self.conn)
            try:
                self.conn.close()
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        for segment, _ in self._segments.values():
            try:
                segment.close()
            except (BufferError, OSError):
                pass  # views of the segment may still be alive in the model: the OS frees it at exit
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


def _hello_worker(hello: Any, num_workers: int) -> int | None:
    """The worker index in a node's ``("hello", worker, local, boot_id)`` if it is a valid one."""
    if (isinstance(hello, tuple) and len(hello) == 4 and hello[0] == "hello" and type(hello[1]) is int
            and 0 <= hello[1] < num_workers):
        return hello[1]
    return None


def _read_loop(conn, inbox: queue.Queue, wake_w: int) -> None:
    """Move weight-channel messages to ``inbox`` and wake the worker loop, until the channel closes."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        inbox.put(message)
        try:
            os.write(wake_w, b"x")
        except OSError:  # the receiver closed meanwhile
            return
