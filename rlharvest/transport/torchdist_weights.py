"""Weights to nodes over the process group (the transport of DistributedWeightSyncScheme).

Same protocol as the shared-memory transport, other wires: an update is announced on a per-node TCP
channel (served by the sender on ``tcp_port + 2``) with its version (and the flat layout, the first
time), the weights follow as one flat tensor sent point-to-point to the node's rank, and the node
acknowledges the version once it applied (and cascaded) them. The node's receiver reads its channel
in a thread, so the per-step check is a flag read.
"""

from __future__ import annotations

import datetime
import os
import queue
import secrets
import threading
import time
from typing import Any, Callable

import torch
from tensordict import TensorDictBase

from ..data.flat import FlatLayout
from ..errors import WorkerError, WorkerTimeoutError
from ..weight_update.strategy import copy_weights_
from .base import WeightReceiver, WeightSender
from .torchdist import WEIGHTS_TAG, accept_channel, listen, open_channel

__all__ = ["DistWeightSender", "DistWeightReceiver", "node_group", "set_node_group"]

_NODE_GROUP: list = [None]


def set_node_group(group) -> None:
    """Record this node's process group (called by the node entry point)."""
    _NODE_GROUP[0] = group


def node_group():
    return _NODE_GROUP[0]


class DistWeightSender(WeightSender):
    """Parent end: a listener for the nodes' weight channels and a flat send buffer."""

    def __init__(self, num_workers: int, host: str, bind_host: str, port: int, group: Callable[[], Any],
                 liveness: Callable[[int], tuple[bool, str]] | None, user_timeout: float = 10.0) -> None:
        self.num_workers = num_workers
        self.host = host
        self.group = group
        self.liveness = liveness
        self.user_timeout = user_timeout
        self.server = listen(bind_host, port)
        self.authkey = secrets.token_bytes(16)
        self.conns: dict[int, Any] = {}
        self._layout: FlatLayout | None = None
        self._flat: torch.Tensor | None = None
        self._view: TensorDictBase | None = None
        self._works: list = []
        self._unacked: dict[int, int] = {}

    def connection_info(self) -> dict:
        return {"host": self.host, "port": self.server.getsockname()[1], "authkey": self.authkey.hex()}

    def connect(self, initial, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.conns) < self.num_workers:
            conn = accept_channel(self.server, self.authkey, 0.2, self.user_timeout)
            if conn is not None:
                self.conns[int(conn.recv()[1])] = conn
                continue
            self._check_peers(list(range(self.num_workers)), "to connect its weight channel")
            if time.monotonic() > deadline:
                raise WorkerTimeoutError(f"only {len(self.conns)} of {self.num_workers} nodes connected their "
                                         "weight channel in time.")
        if initial is None:
            for conn in self.conns.values():
                conn.send(("init", None))
            return
        self._stage(initial)
        for worker, conn in self.conns.items():
            conn.send(("init", self._layout))
            self._works.append(self.group().send([self._flat], worker + 1, WEIGHTS_TAG))
        self._finish_sends(timeout)

    def _stage(self, weights: TensorDictBase) -> bool:
        """Copy into the flat buffer; True when the layout is new."""
        new = self._layout is None
        if new:
            self._layout = FlatLayout.of(weights)
            self._flat, self._view = self._layout.allocate()
        copy_weights_(self._view, weights)
        return new

    def _finish_sends(self, timeout: float) -> None:
        works, self._works = self._works, []
        for work in works:
            work.wait(datetime.timedelta(seconds=timeout))

    def deliver(self, payload, version: int, worker_ids: list[int]) -> None:
        self._finish_sends(120.0)  # the buffer may still be read by an unfinished (sync=False) send
        new = self._stage(payload)
        for worker in worker_ids:
            self.conns[worker].send(("update", version, self._layout if new else None))
            self._works.append(self.group().send([self._flat], worker + 1, WEIGHTS_TAG))
            self._unacked[worker] = version

    def wait_acks(self, version: int, worker_ids: list[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._finish_sends(timeout)
        for worker in worker_ids:
            while worker in self._unacked:
                message = self._recv(worker, deadline)
                if message[0] == "ack" and message[1] >= self._unacked[worker]:
                    del self._unacked[worker]
                elif message[0] == "error":
                    del self._unacked[worker]
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
        try:
            self.server.close()
        except OSError:
            pass


class DistWeightReceiver(WeightReceiver):
    """Node end: a reader thread on the weight channel; weights arrive over the process group."""

    def __init__(self, info: dict, worker_idx: int, user_timeout: float = 10.0) -> None:
        self.info = info
        self.worker_idx = worker_idx
        self.user_timeout = user_timeout
        self.conn = None
        self._inbox: queue.Queue = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        self._layout: FlatLayout | None = None
        self._flat: torch.Tensor | None = None
        self._view: TensorDictBase | None = None
        self._thread: threading.Thread | None = None

    def fileno(self) -> int:
        return self._wake_r

    def connect(self, timeout: float) -> TensorDictBase | None:
        info = self.info
        self.conn = open_channel(info["host"], info["port"], bytes.fromhex(info["authkey"]), timeout,
                                 self.user_timeout)
        self.conn.send(("hello", self.worker_idx))
        kind, layout = self.conn.recv()
        if kind != "init":
            raise RuntimeError(f"unexpected weight-channel message {kind!r} during connect")
        self._thread = threading.Thread(target=self._read_loop, name="rlharvest-weights-reader", daemon=True)
        self._thread.start()
        if layout is None:
            return None
        return self._receive_payload(layout, timeout)

    def _read_loop(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return
            self._inbox.put(message)
            os.write(self._wake_w, b"x")

    def _receive_payload(self, layout: FlatLayout | None, timeout: float) -> TensorDictBase:
        if layout is not None:
            self._layout = layout
            self._flat, self._view = layout.allocate()
        group = node_group()
        group.recv([self._flat], 0, WEIGHTS_TAG).wait(datetime.timedelta(seconds=timeout))
        return self._view

    def pending(self) -> bool:
        return not self._inbox.empty()

    def receive(self, timeout: float):
        try:
            message = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return None
        os.read(self._wake_r, 1)
        if message[0] != "update":
            return None
        _, version, layout = message
        return version, self._receive_payload(layout, 120.0)

    def ack(self, version: int) -> None:
        self.conn.send(("ack", version))

    def nack(self, failure) -> None:
        self.conn.send(("error", failure))

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except OSError:
                pass
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
