"""What a weight-sync scheme sends, resolved from what ``update_policy_weights_`` was given: the payload
(docs/weights.md, "What update_policy_weights_ accepts") and the workers it goes to."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDictBase

from .strategy import module_weights, weights_of

__all__ = ["payload_of", "resolve_worker_ids"]


def payload_of(weights: Any, model: Any, model_id: str | None, context: Any, per_worker_ok: bool,
               owner: str) -> TensorDictBase | dict[int, TensorDictBase]:
    """The payload for ``weights``: the model's own weights (None), an attribute path resolved by the
    collector (``context.resolve``), per-worker weights ``{worker_idx: weights}``, or weights as given.

    Raises:
        RuntimeError: no weights and no model. ValueError: a path without a collector, or per-worker
            weights for a scheme that takes none.
    """
    if weights is None:
        if model is None:
            raise RuntimeError(f"No weights given and no model to read them from for model_id={model_id!r}.")
        return module_weights(model) if isinstance(model, torch.nn.Module) else weights_of(model)
    if isinstance(weights, str):
        if context is None:
            raise ValueError(f"Cannot resolve weights path {weights!r} without a collector context.")
        return weights_of(context.resolve(weights))
    if isinstance(weights, dict) and weights and all(isinstance(k, int) for k in weights):
        if not per_worker_ok:
            raise ValueError(f"{owner} does not accept per-worker weights ({{worker_idx: weights}}); use "
                             "SharedMemWeightSyncScheme(per_worker_weights=True).")
        return {int(k): weights_of(v) for k, v in weights.items()}
    return weights_of(weights)


def resolve_worker_ids(worker_ids: Any, payload: Any, count: int, retired: set, owner: str) -> list[int]:
    """The 0-based indices ``worker_ids`` names (None: every worker that did not leave; per-worker
    weights: the workers they are for).

    Raises:
        ValueError: for an index that is not an int, not a worker, or a worker that left.
    """
    if isinstance(payload, dict) and worker_ids is None:
        worker_ids = sorted(payload)
    if worker_ids is None:
        return [worker for worker in range(count) if worker not in retired]
    if isinstance(worker_ids, (int, torch.device, str)):
        worker_ids = [worker_ids]
    resolved = []
    for worker_id in worker_ids:
        if isinstance(worker_id, bool) or not isinstance(worker_id, int):
            raise ValueError(f"worker_ids must be 0-based worker indices for {owner}, got {worker_id!r}")
        if not 0 <= worker_id < count:
            raise ValueError(f"Worker {worker_id} not registered (this scheme serves workers 0..{count - 1}).")
        if worker_id in retired:
            raise ValueError(f"Worker {worker_id} was removed from the collector: it takes no weights.")
        resolved.append(worker_id)
    return resolved
