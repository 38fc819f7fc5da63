"""Weights to worker processes through shared memory (or, for MultiProcess schemes, through pipes).

Atomicity: workers never run on the trainer's tensors, nor on the shared buffer. The sender copies
new weights into a shared *staging* buffer (one per device, or one per worker for per-worker
weights), bumps the worker's version in a shared array, and rings the worker's pipe. The worker
notices between two env steps (a ~0.1 us read of that array), copies the staging buffer into its
own parameters, cascades to its own workers if it has any, and acknowledges the version. So an
optimizer step in progress, or an in-place change without ``update_policy_weights_``, never
reaches a worker, and every frame collected after ``send`` returns uses the new weights.

If the sender has no weights (workers built their policies from distinct factories), each worker
*offers* a shared buffer holding its own weights instead, and updates are written into those.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from tensordict import TensorDictBase

from ..errors import RemoteFailure, WorkerError, WorkerTimeoutError
from ..weight_update.strategy import copy_weights_
from .base import WeightReceiver, WeightSender

__all__ = ["SharedMemWeightSender", "SharedMemWeightReceiver"]

Liveness = Callable[[int], tuple[bool, str]]


def _shared_copy(weights: TensorDictBase, device: torch.device | None) -> TensorDictBase:
    copy = weights.detach().clone()
    if device is not None:
        copy = copy.to(device)
    on_cpu = all(leaf.device.type == "cpu" for leaf in copy.values(True, True))
    return copy.share_memory_() if on_cpu else copy  # CUDA tensors are shared by IPC handle when pickled


class SharedMemWeightSender(WeightSender):
    """Parent end: staging buffers, per-worker versions and one pipe per worker.

    Args:
        num_workers: receivers.
        ctx: multiprocessing context (pipes are created with it).
        devices: policy device of each worker (buffers are shared per device).
        per_worker: one buffer per worker instead of per device.
        via_pipe: send the weights themselves through the pipes (MultiProcess scheme).
        liveness: ``liveness(worker) -> (alive, description)`` used while waiting for acks.
    """

    def __init__(self, num_workers: int, ctx, devices: list | None = None, per_worker: bool = False,
                 via_pipe: bool = False, liveness: Liveness | None = None) -> None:
        self.num_workers = num_workers
        self.devices = list(devices) if devices is not None else [None] * num_workers
        self.per_worker = per_worker
        self.via_pipe = via_pipe
        self.liveness = liveness
        pipes = [ctx.Pipe(duplex=True) for _ in range(num_workers)]
        self.conns = [parent for parent, _ in pipes]
        self._child_conns = [child for _, child in pipes]
        self.versions = torch.zeros(num_workers, dtype=torch.int64).share_memory_()
        self.buffers: dict[Any, TensorDictBase] = {}
        self._stateless = False
        self._offers_pending: set[int] = set()
        self._unacked: dict[int, int] = {}

    @property
    def shared(self) -> dict[Any, TensorDictBase]:
        return self.buffers

    def _key(self, worker: int):
        return worker if self.per_worker or self._stateless else self.devices[worker]

    def connection_info(self) -> dict:
        return {"conns": self._child_conns, "versions": self.versions, "via_pipe": self.via_pipe}

    # ------------------------------------------------------------------ connect
    def connect(self, initial) -> None:
        if initial is None:
            self._stateless = True
            self._offers_pending = set(range(self.num_workers))
            for conn in self.conns:
                conn.send(("offer_please",))
            return
        for worker, conn in enumerate(self.conns):
            weights = initial[worker] if isinstance(initial, dict) else initial
            if self.via_pipe:
                conn.send(("init", weights.detach().clone()))
                continue
            key = self._key(worker)
            if key not in self.buffers:
                self.buffers[key] = _shared_copy(weights, self.devices[worker])
            conn.send(("init", self.buffers[key]))

    def _collect_offers(self, workers: list[int], timeout: float) -> None:
        for worker in workers:
            if worker not in self._offers_pending:
                continue
            message = self._recv(worker, time.monotonic() + timeout, "its initial weights")
            if message[0] != "offer":
                raise RuntimeError(f"worker {worker} sent {message[0]!r} instead of its weights offer.")
            self.buffers[worker] = message[1]
            self._offers_pending.discard(worker)

    # ------------------------------------------------------------------ updates
    def deliver(self, payload, version: int, worker_ids: list[int]) -> None:
        self._collect_offers(worker_ids, 120.0)
        # A buffer may still be read by a worker of an unacknowledged (sync=False) update.
        busy = [w for w in self._unacked if self._key(w) in {self._key(t) for t in worker_ids}]
        if busy:
            self.wait_acks(max(self._unacked[w] for w in busy), busy, 120.0)
        if self.via_pipe:
            for worker in worker_ids:
                weights = payload[worker] if isinstance(payload, dict) else payload
                self.conns[worker].send(("update", version, weights.detach().clone()))
                self.versions[worker] = version
                self._unacked[worker] = version
            return
        written = set()
        for worker in worker_ids:
            key = self._key(worker)
            if key not in written:
                copy_weights_(self.buffers[key], payload[worker] if isinstance(payload, dict) else payload)
                written.add(key)
        for worker in worker_ids:
            self.versions[worker] = version
            self.conns[worker].send(("update", version))
            self._unacked[worker] = version

    def signal(self, version: int, worker_ids: list[int]) -> None:
        """Announce weights already written into the buffers (legacy updaters write them)."""
        for worker in worker_ids:
            self.versions[worker] = version
            self.conns[worker].send(("update", version))
            self._unacked[worker] = version

    def wait_acks(self, version: int, worker_ids: list[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for worker in worker_ids:
            # Acks arrive in order: the ack of the latest delivered version covers the older ones.
            while worker in self._unacked:
                message = self._recv(worker, deadline, f"an acknowledgement of weights version {version}")
                if message[0] == "ack":
                    if message[1] >= self._unacked[worker]:
                        del self._unacked[worker]
                elif message[0] == "error":
                    del self._unacked[worker]
                    raise message[1].to_exception(context="applying new weights")

    def _recv(self, worker: int, deadline: float, what: str):
        conn = self.conns[worker]
        while True:
            remaining = deadline - time.monotonic()
            try:
                if conn.poll(max(0.0, min(0.2, remaining))):
                    return conn.recv()
            except (EOFError, OSError) as err:
                raise WorkerError(f"lost the weight channel while waiting for {what}.", worker_idx=worker) from err
            if self.liveness is not None:
                alive, description = self.liveness(worker)
                if not alive:
                    raise WorkerError(f"died while the parent waited for {what}: {description}.", worker_idx=worker)
            if remaining <= 0:
                raise WorkerTimeoutError(f"no {what} within the weight-sync timeout.", worker_idx=worker)

    def close(self) -> None:
        for conn in self.conns + self._child_conns:
            try:
                conn.close()
            except OSError:
                pass


class SharedMemWeightReceiver(WeightReceiver):
    """Worker end: watches its version slot, reads the staging buffer, acknowledges."""

    def __init__(self, info: dict, worker_idx: int, local_weights: Callable[[], TensorDictBase | None]) -> None:
        self.conn = info["conns"][worker_idx]
        self.worker_idx = worker_idx
        self.via_pipe = info["via_pipe"]
        self._versions = info["versions"].numpy()
        self._local_weights = local_weights
        self._applied = 0
        self.buffer: TensorDictBase | None = None

    def fileno(self) -> int:
        return self.conn.fileno()

    def connect(self, timeout: float) -> TensorDictBase | None:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"worker {self.worker_idx}: no initial weights within {timeout} s.")
        message = self.conn.recv()
        if message[0] == "init":
            self.buffer = message[1]
            return self.buffer
        if message[0] == "offer_please":
            own = self._local_weights()
            if own is None:
                raise RuntimeError("The sender has no weights and this worker has no model to offer.")
            self.buffer = _shared_copy(own, None)
            self.conn.send(("offer", self.buffer))
            return None
        raise RuntimeError(f"Unexpected weight-sync message {message[0]!r} during connect.")

    def pending(self) -> bool:
        return int(self._versions[self.worker_idx]) != self._applied

    def receive(self, timeout: float):
        if not self.conn.poll(timeout):
            return None
        message = self.conn.recv()
        if message[0] != "update":
            return None
        version = message[1]
        return version, (message[2] if self.via_pipe else self.buffer)

    def ack(self, version: int) -> None:
        self._applied = version
        self.conn.send(("ack", version))

    def nack(self, failure: RemoteFailure) -> None:
        self.conn.send(("error", failure))

    def close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
