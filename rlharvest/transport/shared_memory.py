"""Weights to worker processes through shared memory (or, for MultiProcess schemes, through pipes).

The sender copies an update once, into a shared *generation* buffer no worker currently uses
(``weight_pool``); each targeted worker notices it between two env steps (a ~0.1 us read of a shared
version array), swaps its model's tensors for views of that buffer, cascades to its own workers if
it has any, and acknowledges. So an update costs one copy plus a few microseconds per worker, an
optimizer step in progress (or an in-place change without ``update_policy_weights_``) never reaches
a worker, and every frame collected after ``send`` returns uses the new weights.

Buffers are shared per policy device, or per worker for per-worker weights. A sender without
weights (workers built their policies from distinct factories) lets workers keep their own weights
until the first update, whose payload defines the layout. A worker that replaces another maps the
generation its device (or its worker index) last got: the current weights, without a copy. A
worker added to a running collector is connected the same way (the sender is ``growable``): it gets
a pipe, a version slot of its own, and the generation of its device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDictBase

from ..data.flat import freeze
from ..errors import RemoteFailure
from .base import Liveness, WeightLinks, WeightReceiver, WeightSender, receive_from
from .pipes import OfferedDescriptors
from .weight_pool import GenerationBook, TorchShmAllocator

__all__ = ["SharedMemLinks", "SharedMemWeightSender", "SharedMemWeightReceiver"]


@dataclass
class SharedMemLinks(WeightLinks):
    """What shared-memory weight senders need from a backend whose workers share this machine.

    Attributes:
        ctx: the multiprocessing context pipes are made with.
        devices: the policy device of each worker (weights are staged per device), or None.
    """

    ctx: Any = None
    devices: list | None = None


class SharedMemWeightSender(WeightSender):
    """Parent end: generation pools, per-worker versions and one pipe per worker.

    Args:
        num_workers: receivers.
        ctx: multiprocessing context (pipes are created with it).
        devices: policy device of each worker (buffers are shared per device).
        per_worker: one pool per worker instead of per device.
        via_pipe: send each update's tensors through the pipes (MultiProcess scheme).
        liveness: ``liveness(worker) -> (alive, description)`` used while waiting for acks.
        device_source: the backend's list of policy devices, which it extends in place when it
            adds workers: where an added worker's device is read (default: the first worker's).
    """

    growable = True

    def __init__(self, num_workers: int, ctx, devices: list | None = None, per_worker: bool = False,
                 via_pipe: bool = False, liveness: Liveness | None = None, device_source: list | None = None) -> None:
        self.num_workers = num_workers
        self._device_source = device_source
        self.devices = list(devices) if devices is not None else [None] * num_workers
        self.per_worker = per_worker
        self.via_pipe = via_pipe
        self.liveness = liveness
        self._ctx = ctx
        pipes = [ctx.Pipe(duplex=True) for _ in range(num_workers)]
        self.conns = [parent for parent, _ in pipes]
        self._child_conns = [child for _, child in pipes]
        #: worker -> the generation buffers offered it through its pipe (closed if it never took them)
        self._offered: dict[int, OfferedDescriptors] = {}
        self.versions = torch.zeros(num_workers, dtype=torch.int64).share_memory_()
        # writes through numpy: 0.3 us instead of 6; an added worker's slot lives in a table of its own
        self._versions = _VersionSlots(self.versions)
        #: pool key (device, or worker) -> the generations of its workers
        self.books: dict[Any, GenerationBook] = {}
        self._unacked: dict[int, int] = {}
        #: pool key -> (generation, version) of the last weights announced for it (what a replacement maps)
        self._latest: dict[Any, tuple[int, int]] = {}
        #: pool key -> (version, weights) of the last update sent through the pipes (MultiProcess scheme)
        self._latest_sent: dict[Any, tuple[int, TensorDictBase]] = {}

    @property
    def shared(self) -> dict[Any, TensorDictBase]:
        return self.buffers

    @property
    def buffers(self) -> dict[Any, TensorDictBase]:
        """The generation each pool's workers currently run on, by pool key (device or worker)."""
        out = {}
        for key, book in self.books.items():
            if book.current:
                out[key] = book.pool.get(next(iter(book.current.values()))).view
        return out

    def _key(self, worker: int):
        return worker if self.per_worker else self.devices[worker]

    def _book(self, worker: int) -> GenerationBook:
        key = self._key(worker)
        if key not in self.books:
            self.books[key] = GenerationBook(TorchShmAllocator, device=None if self.per_worker else key)
        return self.books[key]

    def connection_info(self) -> dict:
        return {"conns": self._child_conns, "versions": self.versions, "version_tables": self._versions.tables,
                "via_pipe": self.via_pipe}

    # ------------------------------------------------------------------ connect
    def connect(self, initial) -> None:
        if initial is None:
            for conn in self.conns:
                conn.send(("init", None, None))
            return
        if isinstance(initial, dict):
            self.per_worker = True
        self._announce(initial, 0, list(range(self.num_workers)), kind="init")

    # ------------------------------------------------------------------ updates
    def deliver(self, payload, version: int, worker_ids: list[int]) -> None:
        # Generations pending for unacknowledged (sync=False) updates may still be read: settle them.
        busy = [w for w in self._unacked if w in worker_ids or self._key(w) in {self._key(t) for t in worker_ids}]
        if busy:
            self.wait_acks(max(self._unacked[w] for w in busy), busy, 120.0)
        self._announce(payload, version, worker_ids, kind="update")

    def _announce(self, payload, version: int, worker_ids: list[int], kind: str) -> None:
        if self.via_pipe:
            for worker in worker_ids:
                weights = (payload[worker] if isinstance(payload, dict) else payload).detach().clone()
                self._versions[worker] = version
                self._latest_sent[self._key(worker)] = (version, weights)
                self._send(worker, (kind, version, weights))
                if kind == "update":
                    self._unacked[worker] = version
            return
        by_key: dict[Any, list[int]] = {}
        for worker in worker_ids:
            by_key.setdefault(self._key(worker), []).append(worker)
        for key, workers in by_key.items():
            weights = payload[workers[0]] if isinstance(payload, dict) else payload
            book = self._book(workers[0])
            # the generation of the last weights stays untouched: a replacement may still map it
            generation = book.stage(weights, keep=[self._latest[key][0]] if key in self._latest else [])
            self._latest[key] = (generation.gen_id, version)
            for worker in workers:
                handle = book.hand(worker, generation.gen_id, generation.handle, initial=kind == "init")
                self._versions[worker] = version
                self._send(worker, (kind, version, (generation.gen_id, handle)))
                if kind == "update":
                    self._unacked[worker] = version

    def _send(self, worker: int, message: tuple) -> None:
        offered = self._offered.setdefault(worker, OfferedDescriptors())
        offered.sending(lambda: self.conns[worker].send(message))

    # ------------------------------------------------------------------ replacements and added workers
    def replace(self, worker: int) -> None:
        if worker >= self.num_workers:
            self._grow_to(worker + 1)
        self._release(worker)
        self.conns[worker], self._child_conns[worker] = self._ctx.Pipe(duplex=True)

    def _grow_to(self, count: int) -> None:
        """Serve workers up to ``count`` (added after start-up): a pipe and a version slot each."""
        for worker in range(self.num_workers, count):
            source = self._device_source
            device = source[worker] if source is not None and worker < len(source) else self.devices[0]
            self.devices.append(torch.device(device) if device is not None else None)
            self.conns.append(None)
            self._child_conns.append(None)
            self._versions.add(worker)
        self.num_workers = count

    def retire(self, worker: int) -> None:
        """``worker`` left the collector for good: close its pipe and free what only it used (its
        version slot if it was added, its generations with per-worker weights). Its slot stays
        (indices do not move)."""
        self._release(worker)
        if self.per_worker:
            book = self.books.pop(worker, None)
            if book is not None:
                book.close()
            self._latest.pop(worker, None)
            self._latest_sent.pop(worker, None)
        self._versions.release(worker)

    def _release(self, worker: int) -> None:
        """Forget ``worker``'s receiver (it is gone): its pipe, its pending acknowledgement, the
        generations it mapped."""
        for conn in (self.conns[worker], self._child_conns[worker]):
            try:
                if conn is not None:
                    conn.close()
            except OSError:
                pass
        self.conns[worker] = self._child_conns[worker] = None
        offered = self._offered.pop(worker, None)
        if offered is not None:  # generations it never took (it died before reading them)
            offered.withdraw()
        self._unacked.pop(worker, None)
        book = self.books.get(self._key(worker))
        if book is not None:
            book.forget(worker)

    def attach(self, worker: int, timeout: float) -> None:
        """Hand the new receiver the current weights of its pool key (mapped, not copied)."""
        key = self._key(worker)
        if self.via_pipe:
            version, body = self._latest_sent.get(key, (0, None))
        elif key in self._latest:
            gen_id, version = self._latest[key]
            book = self._book(worker)
            body = (gen_id, book.hand(worker, gen_id, book.pool.get(gen_id).handle, initial=True))
        else:  # workers kept the weights their own policies were built with
            version, body = 0, None
        self._versions[worker] = version
        self._send(worker, ("init", version, body))

    def wait_acks(self, version: int, worker_ids: list[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for worker in worker_ids:
            # Acks arrive in order: the ack of the latest delivered version covers the older ones.
            while worker in self._unacked:
                message = receive_from(self.conns[worker], worker, deadline,
                                       f"an acknowledgement of weights version {version}", self.liveness)
                if message[0] == "ack":
                    _, acked, gen_id = message
                    if gen_id is not None:
                        self._book(worker).acknowledged(worker, gen_id)
                    if acked >= self._unacked[worker]:
                        del self._unacked[worker]
                elif message[0] == "error":
                    del self._unacked[worker]
                    self._book(worker).dropped(worker)
                    raise message[1].to_exception(context="applying new weights")

    def close(self) -> None:
        for conn in self.conns + self._child_conns:
            try:
                if conn is not None:
                    conn.close()
            except OSError:
                pass
        for offered in self._offered.values():  # the workers are gone (the collector shut down)
            offered.withdraw()
        self._offered.clear()
        for book in self.books.values():
            book.close()


class _VersionSlots:
    """The shared version slot of every worker: one table for the workers a sender starts with, one
    of its own for each worker added later (the tables running receivers read never move); the table
    of an added worker that left is released with it."""

    def __init__(self, table: torch.Tensor) -> None:
        #: ``(first worker, table)``, in order (what receivers look their slot up in)
        self.tables: list[tuple[int, torch.Tensor]] = [(0, table)]
        self._first = table.numpy()
        #: added worker -> the view of its own table
        self._own: dict[int, Any] = {}

    def add(self, worker: int) -> None:
        table = torch.zeros(1, dtype=torch.int64).share_memory_()
        self.tables.append((worker, table))
        self._own[worker] = table.numpy()

    def release(self, worker: int) -> None:
        """``worker`` (added after start-up) left: free its table. The first table stays."""
        if self._own.pop(worker, None) is not None:
            self.tables[:] = [entry for entry in self.tables if entry[0] != worker]

    def __setitem__(self, worker: int, version: int) -> None:
        own = self._own.get(worker)
        if own is not None:
            own[0] = version
        elif worker < len(self._first):
            self._first[worker] = version


class SharedMemWeightReceiver(WeightReceiver):
    """Worker end: watches its version slot, maps generations, acknowledges with the one it runs on."""

    #: the scheme swaps the model's tensors for the received ones instead of copying
    zero_copy = True

    def __init__(self, info: dict, worker_idx: int) -> None:
        self.conn = info["conns"][worker_idx]
        self.worker_idx = worker_idx
        self.via_pipe = info["via_pipe"]
        tables = info.get("version_tables") or [(0, info["versions"])]
        first, table = max((entry for entry in tables if entry[0] <= worker_idx), key=lambda entry: entry[0])
        self._versions = table.numpy()
        self._slot = worker_idx - first
        self._applied = 0
        self._generations: dict[int, TensorDictBase] = {}
        self._gen_id: int | None = None

    def wait_handle(self):
        return self.conn

    def _weights_of(self, body) -> TensorDictBase | None:
        if self.via_pipe:
            return body
        gen_id, handle = body
        if handle is not None:
            self._generations[gen_id] = freeze(handle)
        self._gen_id = gen_id
        return self._generations.get(gen_id)

    def connect(self, timeout: float) -> TensorDictBase | None:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"worker {self.worker_idx}: no initial weights within {timeout} s.")
        kind, version, body = self.conn.recv()
        if kind != "init":
            raise RuntimeError(f"Unexpected weight-sync message {kind!r} during connect.")
        self._applied = version  # a replacement starts at the current version
        return None if body is None else self._weights_of(body)

    def pending(self) -> bool:
        return int(self._versions[self._slot]) != self._applied

    def receive(self, timeout: float):
        if not self.conn.poll(timeout):
            return None
        kind, version, body = self.conn.recv()
        if kind != "update":
            return None
        return version, self._weights_of(body)

    def ack(self, version: int) -> None:
        self._applied = version
        self.conn.send(("ack", version, None if self.via_pipe else self._gen_id))

    def nack(self, failure: RemoteFailure) -> None:
        self.conn.send(("error", failure))

    def close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
