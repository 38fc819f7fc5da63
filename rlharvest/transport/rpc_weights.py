"""Weights to RPC nodes (the transport of RPCWeightSyncScheme): they ride in an RPC to each targeted
node, which swaps them in between two env steps and returns the version as acknowledgement.

Nodes on this host get a generation of a named shared-memory pool instead of the tensors (one copy
by the sender whatever the number of local nodes, then a swap on each node). A node that replaces
another gets the weights of the last update (or of the start) in an RPC of its own before it
collects, as initial weights: its version comes with its spec.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.distributed.rpc as rpc
from tensordict import TensorDictBase

from ..errors import WorkerError
from .base import WeightLinks, WeightReceiver, WeightSender
from .weight_pool import GenerationBook, NamedShmAllocator

__all__ = ["RPCWeightLinks", "RPCWeightSender", "RPCWeightReceiver"]


@dataclass
class RPCWeightLinks(WeightLinks):
    """What RPC weight senders need: the nodes' handles (updated in place when a node is replaced),
    and the node function that applies weights."""

    handles: list = field(default_factory=list)
    apply_weights: Callable | None = None


class RPCWeightSender(WeightSender):
    """Weights in an RPC to each targeted node; its return value is the acknowledgement.

    Args:
        handles: the nodes' handles (``name``, ``local``, ``is_alive``, ``wait_built``), by index.
        model_id: the model these weights are for.
        apply_weights: the node function that applies them.
    """

    #: serves nodes added after start-up: ``handles`` is the backend's list, which grows in place
    growable = True

    def __init__(self, handles: list, model_id: str, apply_weights: Callable) -> None:
        self.handles = handles
        self.model_id = model_id
        self.apply_weights = apply_weights
        self._futures: dict[int, Any] = {}
        #: the shared-memory generations of nodes on this host (the future of an RPC is its acknowledgement)
        self.book = GenerationBook(NamedShmAllocator)
        #: ``(version, payload)`` of the last update (or the initial weights): what a replacement gets
        self._latest: tuple[int, TensorDictBase] | None = None

    @property
    def num_workers(self) -> int:
        return len(self.handles)

    def connect(self, initial) -> None:
        """Nodes received the policy with their spec: only remember the weights for replacements."""
        if initial is not None and not isinstance(initial, dict):
            self._latest = (0, initial)

    def deliver(self, payload, version: int, worker_ids: list[int], initial: bool = False) -> None:
        if self._futures:  # a generation may still be in flight to a node (sync=False)
            self.wait_acks(version - 1, list(self._futures), 120.0)
        if not isinstance(payload, dict):
            self._latest = (version, payload)
        local = [w for w in worker_ids if self.handles[w].local]
        generation = self.book.stage(payload) if local else None
        for worker in worker_ids:
            handle = self.handles[worker]
            body = payload
            if worker in local:
                body = ("shm", generation.gen_id, self.book.hand(worker, generation.gen_id, generation.handle))
            self._futures[worker] = rpc.rpc_async(handle.name, self.apply_weights,
                                                  args=(self.model_id, version, body, initial), timeout=0)

    def retire(self, worker: int) -> None:
        """Node ``worker`` left: nothing of it is awaited any more."""
        self.replace(worker)

    def replace(self, worker: int) -> None:
        self._futures.pop(worker, None)
        self.book.forget(worker)

    def attach(self, worker: int, timeout: float) -> None:
        """Hand the replacement the weights of the last update (its spec brought those of the start)."""
        if self._latest is None or self._latest[0] == 0:
            return
        version, payload = self._latest
        self.handles[worker].wait_built(timeout)  # the weights go into its worker: it must exist
        self.deliver(payload, version, [worker], initial=True)
        self.wait_acks(version, [worker], timeout)

    def wait_acks(self, version: int, worker_ids: list[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for worker in worker_ids:
            future = self._futures.pop(worker, None)
            if future is None:
                continue
            handle = self.handles[worker]
            done = threading.Event()
            future.add_done_callback(lambda _: done.set())
            while not done.wait(0.2):  # wakes as soon as the node answers; checks liveness meanwhile
                if not handle.is_alive():
                    raise WorkerError(f"died while applying new weights: {handle.exit_description()}.",
                                      worker_idx=worker)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"node {worker} did not acknowledge weights version {version} in time.")
            try:
                _, gen_id = future.wait()
            except Exception as err:
                self.book.dropped(worker)
                raise WorkerError(f"applying new weights failed: {err}", worker_idx=worker) from err
            self.book.acknowledged(worker, gen_id)

    def close(self) -> None:
        self.book.close()


class RPCWeightReceiver(WeightReceiver):
    """Passive: updates are pushed by the sender's RPC (the scheme's ``apply_pushed``), never polled."""

    def connect(self, timeout: float):
        return None

    def pending(self) -> bool:
        return False

    def receive(self, timeout: float):
        return None

    def ack(self, version: int) -> None:
        return None
