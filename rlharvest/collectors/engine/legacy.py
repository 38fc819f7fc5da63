"""What the legacy weight updaters of worker processes read and write (``MultiProcessedWeightUpdater``,
``weight_update/updaters.py``): one staging copy of the weights per policy device, pushed to the workers
of that device when written; the shared-memory weights the workers run on; and, for an updater written
against TorchRL's worker pipes, ``collector.pipes`` (docs/weights.md; the pipes:
docs/torchrl-compatibility.md)."""

from __future__ import annotations

import collections
from typing import Any, Callable, Sequence

import torch
from tensordict import TensorDictBase

from ...weight_update.strategy import weights_of
from .weights import WeightPublisher

__all__ = ["LegacyStaging", "WorkerPipe"]


class LegacyStaging:
    """The legacy updaters' side of a collector with worker processes.

    Args:
        weights: the publisher (its sender schemes).
        source: the main-side weight source of a model (``get_model``).
        devices: the device each worker it started with runs its policy on (a collector with a legacy
            updater does not grow; workers added to another share these devices).
    """

    def __init__(self, weights: WeightPublisher, source: Callable[[str], Any],
                 devices: Sequence[torch.device]) -> None:
        self.weights = weights
        self.source = source
        self.devices = tuple(devices)
        #: ``{device: weights}``, made on first use
        self.staging: dict | None = None
        self._pipes: list[WorkerPipe] = []

    def staged_weights(self) -> dict:
        """``{device: weights}``: private copies of the main-side weights, one per policy device (made on
        first use); a legacy updater writes them, then :meth:`push_staged`."""
        if self.staging is None:
            source = self.source("policy")
            if source is None:
                return {}
            weights = weights_of(source)
            devices = dict.fromkeys(self.devices)
            self.staging = {device: weights.detach().to(device).clone() for device in devices}
        return self.staging

    def push_staged(self, written: dict, device: torch.device) -> None:
        """A legacy updater wrote ``written[device]``: push it to the workers on that device."""
        workers = [w for w, on in enumerate(self.devices) if on == torch.device(device)]
        self.weights.sender_schemes["policy"].send(weights=written[device], worker_ids=workers)

    def cached_weights(self, model_id: str) -> TensorDictBase | None:
        """The shared-memory weights the workers of ``model_id`` run on (first worker's device), or None
        when that model's scheme keeps none (pipes, or no update yet)."""
        scheme = (self.weights.sender_schemes or {}).get(model_id)
        buffers = getattr(scheme.sender_transports, "shared", None) if scheme is not None else None
        if not buffers:
            return None
        return buffers.get(self.devices[0], next(iter(buffers.values())))

    def pipes(self) -> list[WorkerPipe]:
        """One :class:`WorkerPipe` per worker it started with (the same objects at every call)."""
        self._pipes += [WorkerPipe(self, worker) for worker in range(len(self._pipes), len(self.devices))]
        return list(self._pipes)

    def push_to(self, worker: int, weights: Any) -> None:
        """Deliver ``weights`` to worker ``worker`` through the policy's scheme; returns once it applied them.

        Raises:
            RuntimeError: when no scheme carries the policy's weights (a policy without any).
        """
        scheme = (self.weights.sender_schemes or {}).get("policy")
        if scheme is None:
            raise RuntimeError("No weight-sync scheme carries the policy's weights (the policy has none): there is "
                               "nothing to update in the workers.")
        scheme.send(weights=weights, worker_ids=[worker], wait=True)


class WorkerPipe:
    """``collector.pipes[worker]`` for a legacy updater written against TorchRL's worker pipes (TorchRL's
    ``examples/collectors/mp_collector_mps.py``): ``send((weights, "update"))`` delivers the weights to that
    worker and waits until it applied them; ``recv()`` then gives ``(None, "updated")``, the reply
    TorchRL's worker sends. The pipes' other messages are TorchRL's internals, not supported.
    """

    def __init__(self, staging: LegacyStaging, worker: int) -> None:
        self._staging = staging
        self._worker = worker
        self._replies: collections.deque = collections.deque()

    def send(self, message: Any) -> None:
        """Raises: NotImplementedError for anything but ``(weights, "update")``."""
        if not (isinstance(message, tuple) and len(message) == 2 and isinstance(message[1], str)
                and message[1] == "update"):
            kind = message[1] if isinstance(message, tuple) and len(message) == 2 else message
            raise NotImplementedError(f"collector.pipes[{self._worker}].send() takes (weights, 'update') only, got "
                                      f"{kind!r}: the other messages of TorchRL's worker pipes are its internals "
                                      "(use the collector's methods).")
        self._staging.push_to(self._worker, message[0])
        self._replies.append((None, "updated"))

    def recv(self) -> tuple:
        """The reply to the oldest update sent and not yet received.

        Raises:
            RuntimeError: when every reply was received (TorchRL's pipe would wait forever).
        """
        if not self._replies:
            raise RuntimeError(f"collector.pipes[{self._worker}].recv(): no reply is due (send((weights, 'update')) "
                               "first).")
        return self._replies.popleft()
