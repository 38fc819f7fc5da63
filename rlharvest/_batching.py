"""The pure pieces of the rollout loop's per-batch work: stacking per-step values into a batch, and
setting truncation flags (``max_frames_per_traj``, ``set_truncated``), including flags that live inside
a sub-TensorDict kept whole. ``rollout.py`` calls them; nothing here keeps state.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, TensorDictBase, is_non_tensor, is_tensor_collection

from ._utils import NestedKey, as_tuple_key

__all__ = ["STRUCTURED", "value_meta", "stack_structured", "stack_into", "or_flag", "owner_of", "truncate_inside"]

_PY_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float32}


#: layout "dtype" of values kept whole (non-tensor data, heterogeneous or extra-batch-dim sub-TensorDicts)
STRUCTURED = "structured"


def value_meta(value: Any) -> tuple[tuple, Any]:
    """``(shape, dtype)`` of one step's value in the batch layout (``STRUCTURED`` for values kept whole)."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype
    if is_tensor_collection(value):  # sub-TensorDicts kept whole, non-tensor data
        return tuple(value.shape), STRUCTURED
    if isinstance(value, np.ndarray):
        return value.shape, torch.from_numpy(np.zeros((), dtype=value.dtype)).dtype
    if isinstance(value, np.generic):
        return (1,), torch.from_numpy(np.zeros((), dtype=value.dtype)).dtype
    return (1,), _PY_DTYPES[type(value)]


def stack_structured(values: list, dim: int) -> TensorDictBase:
    """Stack values kept whole: dense when their shapes agree, lazily (heterogeneous) otherwise."""
    if len({getattr(v, "device", None) for v in values}) > 1:
        # the same entry built with and without a device (reset vs step): stack them device-less
        values = [v.copy().clear_device_() for v in values]
    if is_non_tensor(values[0]):
        return torch.stack(values, dim)
    return LazyStackedTensorDict.maybe_dense_stack(values, dim)


def stack_into(values: list, out: torch.Tensor | None, dim: int, shape: tuple, dtype) -> torch.Tensor:
    """Stack per-step values along ``dim``; into ``out`` when given."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        stackable = out is not None and out.device == first.device and out.dtype == first.dtype == values[-1].dtype
        if stackable and out.is_contiguous() and tuple(out.shape) == (*first.shape[:dim], len(values), *first.shape[dim:]):
            try:
                return torch.stack(values, dim, out=out)
            except RuntimeError:  # some torch versions
                pass
        # Into rows of a longer batch (not contiguous), stacking into a new tensor and copying it is 1.5-4x
        # faster than stacking into the rows (docs/performance.md, "A batched step").
        stacked = torch.stack(values, dim)
    elif isinstance(first, np.ndarray):
        stacked = torch.from_numpy(np.stack(values, dim))
    else:  # Python or numpy scalars of an unbatched env: one value per step
        view = _numpy_view(out)
        if view is not None:  # numpy converts a list of scalars ~8x faster than torch.tensor
            view[...] = np.asarray(values, dtype=view.dtype).reshape(view.shape)
            return out
        stacked = torch.tensor(values, dtype=dtype).reshape(shape)
    if stacked.dtype != dtype:  # only on this slow path: the env's dtype changed since the first step
        raise TypeError(f"dtype {stacked.dtype} instead of {dtype}")
    if out is None:
        return stacked.to(dtype)
    out.copy_(stacked.reshape(out.shape))
    return out


def _numpy_view(out: torch.Tensor | None) -> np.ndarray | None:
    """``out`` as a numpy array sharing its memory, or None (no ``out``, another device, a dtype numpy
    lacks)."""
    if out is None or out.device.type != "cpu":
        return None
    try:
        return out.numpy()
    except (RuntimeError, TypeError):
        return None


def or_flag(previous: Any, hit: Any, like: Any, batch_size: torch.Size) -> Any:
    """``previous | hit`` in the form of ``like`` (a Python bool for unbatched array envs, else a
    tensor), ``hit`` being one flag per sub-env broadcast over the flag's trailing dims."""
    if not isinstance(like, torch.Tensor) and not isinstance(previous, torch.Tensor):
        return bool(previous) or bool(hit)
    shape = (previous if isinstance(previous, torch.Tensor) else torch.as_tensor(like)).shape
    if isinstance(hit, torch.Tensor):
        flags = hit.reshape(*batch_size, *([1] * (len(shape) - len(batch_size)))).expand(shape)
    else:
        flags = torch.full(shape, bool(hit), dtype=torch.bool)
    if previous is None:
        return flags.clone()
    return torch.as_tensor(previous).bool() | flags


def owner_of(values: dict, key: NestedKey) -> NestedKey | None:
    """The entry kept whole (a sub-TensorDict) that holds ``key``, when ``key`` is not a value itself."""
    if key in values:
        return None
    path = as_tuple_key(key)
    for depth in range(len(path) - 1, 0, -1):
        prefix = path[0] if depth == 1 else path[:depth]
        if prefix in values:
            return prefix
    raise KeyError(f"the env's step has no entry {key!r} (its done keys name it)")


def truncate_inside(sub: TensorDictBase, owner: NestedKey, truncated_key, done_key, hit, batch_size):
    """``_truncate`` for flags inside a sub-TensorDict: a shallow copy with the flags set."""
    sub = sub.copy()
    depth = len(as_tuple_key(owner))
    inner_done, inner_truncated = as_tuple_key(done_key)[depth:], as_tuple_key(truncated_key)[depth:]
    like = sub.get(inner_done)
    previous = sub.get(inner_truncated, None)
    sub.set(inner_truncated, or_flag(previous, hit, like, batch_size))
    sub.set(inner_done, or_flag(like, hit, like, batch_size))
    return sub
