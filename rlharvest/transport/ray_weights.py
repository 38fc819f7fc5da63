"""Weights to Ray actors (the transport of RayWeightSyncScheme).

An update is put in Ray's object store once (``ray.put`` copies the learner's tensors there, so they
are never shared), whatever the number of actors; each targeted actor is handed the reference, its
worker loop fetches the weights between two env steps (or as soon as it is idle), applies them,
and acknowledges the version: the actor call that delivered the reference returns it then.

Dense weights travel as raw bytes (one buffer per tensor, read without a copy on the actor's node)
with their layout; anything else is pickled as it is. A replacement actor gets the weights of the
last update (or of the start) before it is built, as initial weights.
"""

from __future__ import annotations

import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from ..data.flat import flat_leaves, is_dense
from ..errors import RemoteFailure, WorkerError, WorkerTimeoutError
from .base import WeightLinks, WeightReceiver, WeightSender

__all__ = ["RayWeightLinks", "RayWeightSender", "RayWeightReceiver", "WeightInboxes", "stage_weights",
           "unstage_weights"]


@dataclass
class RayWeightLinks(WeightLinks):
    """What Ray weight senders need: the actors' handles, by index (updated in place on a replacement)."""

    handles: list = field(default_factory=list)


def stage_weights(weights: TensorDictBase):
    """Put ``weights`` in the object store (one copy); returns the reference."""
    import ray

    if not is_dense(weights):
        return ray.put(("pickled", weights))
    keys, leaves = flat_leaves(weights)
    layout = [(key, leaf.dtype, tuple(leaf.shape)) for key, leaf in zip(keys, leaves)]
    buffers = [leaf.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy() for leaf in leaves]
    return ray.put(("flat", tuple(weights.batch_size), layout, buffers))


def unstage_weights(staged: tuple) -> TensorDictBase:
    """The weights of a staged object, as read from the object store (read-only views when dense)."""
    if staged[0] == "pickled":
        return staged[1]
    _, batch_size, layout, buffers = staged
    weights = TensorDict({}, batch_size=batch_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the store's buffers are read-only: they are only read (copied in)
        for (key, dtype, shape), buffer in zip(layout, buffers):
            weights.set(key, torch.from_numpy(buffer).view(dtype).view(shape))
    return weights


# ---------------------------------------------------------------------------------------------- actor side
class _Inbox:
    """One model's weights waiting in an actor: the initial ones, the latest update, its acknowledgement."""

    def __init__(self) -> None:
        from .ray import _Doorbell

        self.cond = threading.Condition()
        self.initial: tuple | None = None
        self.update: tuple | None = None
        self.acked = 0
        self.failure: RemoteFailure | None = None
        self.doorbell = _Doorbell()


class WeightInboxes:
    """Per model, what the parent delivered to this actor, for its receivers (the actor's receiver links)."""

    def __init__(self) -> None:
        self._inboxes: dict[str, _Inbox] = {}
        self._lock = threading.Lock()

    def get(self, model_id: str) -> _Inbox:
        with self._lock:
            return self._inboxes.setdefault(model_id, _Inbox())

    def deliver(self, model_id: str, version: int, payload: list, initial: bool, timeout: float):
        """Leave ``payload`` for the receiver; for an update, wait until it acknowledged ``version``.

        Returns the version, or the failure that stopped the update (a RemoteFailure).
        """
        inbox = self.get(model_id)
        with inbox.cond:
            if initial:
                inbox.initial = (version, payload)
                inbox.cond.notify_all()
                return version
            inbox.failure = None
            inbox.update = (version, payload)  # the latest wins: acknowledging it covers older ones
            inbox.doorbell.ring()
            inbox.cond.wait_for(lambda: inbox.acked >= version or inbox.failure is not None, timeout)
            if inbox.failure is not None:
                return inbox.failure
            if inbox.acked < version:
                error = WorkerTimeoutError(f"weights version {version} were not applied within {timeout:g} s.")
                return RemoteFailure.capture(error, None)
            return version


class RayWeightReceiver(WeightReceiver):
    """An actor's end: the inbox of its model, filled by the parent's ``deliver_weights`` calls."""

    def __init__(self, inbox: _Inbox) -> None:
        self.inbox = inbox

    def connect(self, timeout: float) -> TensorDictBase | None:
        """The initial weights (None when the parent has none: the policy came with the spec)."""
        inbox = self.inbox
        with inbox.cond:
            if not inbox.cond.wait_for(lambda: inbox.initial is not None, timeout):
                raise TimeoutError(f"no initial weights arrived within {timeout:g} s.")
            _, payload = inbox.initial
        return _fetch(payload)

    def pending(self) -> bool:
        return self.inbox.update is not None

    def receive(self, timeout: float) -> tuple[int, TensorDictBase] | None:
        inbox = self.inbox
        with inbox.cond:
            if inbox.update is None and timeout > 0:
                inbox.cond.wait_for(lambda: inbox.update is not None, timeout)
            item, inbox.update = inbox.update, None
            inbox.doorbell.clear()
        if item is None:
            return None
        version, payload = item
        return version, _fetch(payload)

    def ack(self, version: int) -> None:
        with self.inbox.cond:
            self.inbox.acked = max(self.inbox.acked, version)
            self.inbox.cond.notify_all()

    def nack(self, failure) -> None:
        with self.inbox.cond:
            self.inbox.failure = failure
            self.inbox.cond.notify_all()

    def wait_handle(self):
        return self.inbox.doorbell


def _fetch(payload: list) -> TensorDictBase | None:
    if not payload or payload[0] is None:
        return None
    import ray

    return unstage_weights(ray.get(payload[0]))


# ---------------------------------------------------------------------------------------------- parent side
class RayWeightSender(WeightSender):
    """One ``ray.put`` per update, its reference handed to every targeted actor.

    Args:
        handles: the actors' handles (``actor``, ``is_alive``, ``exit_description``), by index.
        model_id: the model these weights are for.
    """

    def __init__(self, handles: list, model_id: str) -> None:
        self.handles = handles
        self.model_id = model_id
        self._acks: dict[int, tuple[int, Any]] = {}
        #: ``(version, reference)`` of the last update or of the initial weights: what a replacement gets
        self._latest: tuple[int, Any] | None = None
        self.timeout = 120.0

    @property
    def num_workers(self) -> int:
        return len(self.handles)

    def _send(self, worker: int, version: int, ref: Any, initial: bool):
        return self.handles[worker].actor.deliver_weights.remote(self.model_id, version, [ref], initial, self.timeout)

    def connect(self, initial) -> None:
        """Hand every actor its initial weights (or word that there are none) once, by reference."""
        ref = stage_weights(initial) if initial is not None else None
        self._latest = (0, ref)
        for worker in range(self.num_workers):
            self._send(worker, 0, ref, initial=True)

    def deliver(self, payload, version: int, worker_ids: list[int]) -> None:
        if isinstance(payload, dict):
            raise ValueError("RayWeightSyncScheme sends the same weights to every actor (no per-worker payloads).")
        ref = stage_weights(payload)
        self._latest = (version, ref)
        for worker in worker_ids:
            self._acks[worker] = (version, self._send(worker, version, ref, initial=False))

    def wait_acks(self, version: int, worker_ids: list[int], timeout: float) -> None:
        import ray

        deadline = time.monotonic() + timeout
        waiting = {worker: self._acks[worker][1] for worker in worker_ids if worker in self._acks}
        while waiting:
            ready, _ = ray.wait(list(waiting.values()), num_returns=len(waiting), timeout=0.2)
            for worker, ref in list(waiting.items()):
                if ref in ready:
                    del waiting[worker]
                    self._acks.pop(worker, None)
                    self._check_ack(worker, ref, version)
                elif not self.handles[worker].is_alive():
                    raise WorkerError(f"the actor died while applying new weights: "
                                      f"{self.handles[worker].exit_description()}.", worker_idx=worker)
            if waiting and time.monotonic() > deadline:
                raise WorkerTimeoutError(f"actor(s) {sorted(waiting)} did not acknowledge weights version {version} "
                                         f"within {timeout:g} s.", worker_idx=min(waiting))

    def _check_ack(self, worker: int, ref: Any, version: int) -> None:
        import ray

        try:
            answer = ray.get(ref)
        except Exception as err:
            handle = self.handles[worker]
            raise WorkerError(f"the actor died while applying new weights: {handle.exit_description()} "
                              f"({type(err).__name__}).", worker_idx=worker) from err
        if isinstance(answer, RemoteFailure):
            raise answer.to_exception(context="applying new weights")

    def replace(self, worker: int) -> None:
        self._acks.pop(worker, None)

    def attach(self, worker: int, timeout: float) -> None:
        """Hand the replacement the weights of the last update (or of the start), as its initial weights."""
        version, ref = self._latest if self._latest is not None else (0, None)
        self._send(worker, version, ref, initial=True)
