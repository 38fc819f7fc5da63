"""What the legacy weight updaters of worker processes read and write (``MultiProcessedWeightUpdater``,
``weight_update/updaters.py``): one staging copy of the weights per policy device, pushed to the workers
of that device when written; and the shared-memory weights the workers run on (docs/weights.md)."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDictBase

from ...weight_update.strategy import weights_of


__all__ = ["staged_weights", "push_staged", "cached_weights"]


def staged_weights(engine: Any) -> dict:
    """``{device: weights}``: private copies of the main-side weights, one per policy device (made on
    first use); a legacy updater writes them, then :func:`push_staged`."""
    staging = engine.legacy_staging
    if staging is None:
        source = engine.get_model("policy")
        if source is None:
            return {}
        weights = weights_of(source)
        devices = dict.fromkeys(engine.config.policy_device_of(w) for w in range(engine.num_workers))
        staging = engine.legacy_staging = {device: weights.detach().to(device).clone() for device in devices}
    return staging


def push_staged(engine: Any, updater: Any, device: torch.device) -> None:
    """A legacy updater wrote ``device``'s weights: push them to the workers on that device."""
    workers = [w for w in range(engine.num_workers) if engine.config.policy_device_of(w) == torch.device(device)]
    engine.weights.sender_schemes["policy"].send(weights=updater.policy_weights[device], worker_ids=workers)


def cached_weights(engine: Any, model_id: str) -> TensorDictBase | None:
    """The shared-memory weights the workers of ``model_id`` run on (first worker's device), or None when
    that model's scheme keeps none (pipes, or no update yet)."""
    scheme = (engine.weights.sender_schemes or {}).get(model_id)
    buffers = getattr(scheme.sender_transports, "shared", None) if scheme is not None else None
    if not buffers:
        return None
    return buffers.get(engine.config.policy_device_of(0), next(iter(buffers.values())))
