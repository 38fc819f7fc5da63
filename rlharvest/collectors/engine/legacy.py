"""What the legacy weight updaters of worker processes read and write (``MultiProcessedWeightUpdater``,
``weight_update/updaters.py``): one staging copy of the weights per policy device, pushed to the workers
of that device when written; and the shared-memory weights the workers run on (docs/weights.md)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from tensordict import TensorDictBase

from ...weight_update.strategy import weights_of
from .weights import WeightPublisher

__all__ = ["LegacyStaging"]


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
