"""What a weight-sync scheme sends, resolved from what ``update_policy_weights_`` was given: the payload
(docs/weights.md, "What update_policy_weights_ accepts") and the workers it goes to."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDictBase

from ..data.flat import check_same_leaves, dotted_key, flat_leaves
from ..errors import ParameterFreeModelError
from .strategy import EXTRA_STATE, module_weights, weights_of

__all__ = ["check_fit", "payload_of", "resolve_worker_ids"]


def check_fit(weights: Any, model: Any, model_id: str) -> None:
    """Raise unless ``model`` can take the explicit ``weights`` (docs/weights.md, "What
    update_policy_weights_ accepts"): the same names as its parameters and buffers, each of the same
    shape. The learner checks every update here before anything is sent, so a worker never gets weights
    it cannot take, and no update is half sent.

    Args:
        weights: a module, a TensorDict, a dict of tensors, or per-worker ``{worker_idx: weights}``.
        model: the learner's copy of the model; one that is not a module (a function, the random
            policy, None) has no weights. Empty weights fit any model.
        model_id: the model's name in the messages.

    Raises:
        ParameterFreeModelError: weights for a model without parameters or buffers. WeightNamesError: names
            missing or extra. WeightShapeError: a tensor of another shape than the model's, named with
            both shapes.
    """
    if isinstance(weights, dict) and weights and all(isinstance(k, int) for k in weights):
        for one in weights.values():
            check_fit(one, model, model_id)
        return
    given = module_weights(weights) if isinstance(weights, torch.nn.Module) else weights_of(weights)  # (cached)
    if EXTRA_STATE in given.keys():  # what the model keeps outside its weights: it checks that itself
        given = given.exclude(EXTRA_STATE)
    keys, leaves = flat_leaves(given)
    if isinstance(model, torch.nn.Module):
        expected = module_weights(model)
    else:
        expected = weights_of(model) if isinstance(model, (TensorDictBase, dict)) else None
    expected_keys, expected_leaves = flat_leaves(expected) if expected is not None else ([], [])
    name = "the policy" if model_id == "policy" else f"the model {model_id!r}"
    name += " (none in this process)" if model is None else f" ({type(model).__name__})"
    if keys and not expected_keys:
        shown = ", ".join(dotted_key(key) for key in keys[:4])
        more = f" and {len(keys) - 4} more" if len(keys) > 4 else ""
        raise ParameterFreeModelError(
            f"{name[0].upper()}{name[1:]} has no parameters or buffers: it cannot take the {len(keys)} weight "
            f"tensors given ({shown}{more}). update_policy_weights_() without weights moves its version; to "
            "collect with learned weights, give the collector a policy module that holds them.")
    check_same_leaves(expected_keys, expected_leaves, keys, leaves, name)


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
