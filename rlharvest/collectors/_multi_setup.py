"""Argument handling for the worker-process collectors: per-worker lists, policies and weight schemes."""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any, Callable, Sequence

import torch

from .._utils import CloudpickleWrapper, to_device_list
from ..weight_update.schemes import WeightSyncScheme
from ..weight_update.shared_mem import SharedMemWeightSyncScheme

__all__ = [
    "per_worker",
    "env_functions",
    "frames_per_worker",
    "stateless_copy",
    "default_schemes",
    "has_weights",
    "wrap_callable",
    "validate_cat_results",
]


def env_functions(create_env_fn, num_workers: int | None) -> list:
    """One env constructor per worker, from a list or from one callable and ``num_workers``."""
    if isinstance(create_env_fn, (list, tuple)):
        if num_workers is not None and num_workers != len(create_env_fn):
            raise ValueError(f"num_workers={num_workers} but {len(create_env_fn)} env constructors were given.")
        if not create_env_fn:
            raise ValueError("create_env_fn must hold at least one env constructor.")
        return list(create_env_fn)
    if num_workers is None:
        raise TypeError("Pass create_env_fn as a list of constructors (one per worker), or give num_workers.")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
    return [create_env_fn] * num_workers


def per_worker(value: Any, num_workers: int, name: str, is_single: Callable[[Any], bool] | None = None) -> list:
    """Expand a scalar argument to one value per worker, or check a per-worker list's length."""
    single = is_single(value) if is_single is not None else not isinstance(value, (list, tuple))
    if single:
        return [value] * num_workers
    if len(value) != num_workers:
        raise ValueError(f"{name} must have exactly one value per worker ({num_workers}), got {len(value)}.")
    return list(value)


def check_frames(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        hint = " (or a list of one per worker)" if name == "frames_per_batch" else ""
        raise TypeError(f"{name} must be a positive int{hint}, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def frames_per_worker(frames_per_batch, num_workers: int, sync: bool) -> tuple[list[int], int]:
    """``(per-worker frames, requested frames per batch)``.

    Raises:
        TypeError: naming ``frames_per_batch`` when it (or one of its values) is not an int.
        ValueError: for a wrong number of values or a value that is not positive.
    """
    if not isinstance(frames_per_batch, (list, tuple)):
        check_frames("frames_per_batch", frames_per_batch)
    if isinstance(frames_per_batch, (list, tuple)):
        if len(frames_per_batch) != num_workers:
            raise ValueError(
                f"frames_per_batch must have exactly one value per worker ({num_workers}), got {len(frames_per_batch)}."
            )
        for value in frames_per_batch:
            check_frames("each value of frames_per_batch", value)
        total = sum(frames_per_batch)
        # MultiAsync: each worker collects the whole batch (TorchRL's documented behaviour).
        return (list(frames_per_batch) if sync else [total] * num_workers), total
    if not sync:
        return [frames_per_batch] * num_workers, frames_per_batch
    each = math.ceil(frames_per_batch / num_workers)
    if each * num_workers != frames_per_batch:
        warnings.warn(
            f"frames_per_batch={frames_per_batch} is not divisible by the {num_workers} workers: each collects "
            f"{each} frames.", stacklevel=4,
        )
    return [each] * num_workers, frames_per_batch


def validate_cat_results(cat_results, sync: bool, use_buffers) -> str | int:
    if cat_results is None or cat_results == "stack":
        return "stack"
    if not sync:
        raise ValueError(f"cat_results={cat_results!r} is only supported by MultiSyncCollector.")
    if isinstance(cat_results, bool) or not isinstance(cat_results, int):
        raise ValueError(f"cat_results must be 'stack' or an int dim, got {cat_results!r}")
    if use_buffers is False:
        raise RuntimeError("cat_results with a dim needs use_buffers=True.")
    return cat_results


def validate_preemptive_threshold(value: Any) -> float | None:
    """None (off) or a fraction of workers in [0, 1] (1.0 waits for every worker: never preempts)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"preemptive_threshold must be None or a number between 0.0 and 1.0, got {value!r}")
    return float(value)


def has_weights(policy: Any) -> bool:
    return isinstance(policy, torch.nn.Module) and any(True for _ in policy.parameters()) or (
        isinstance(policy, torch.nn.Module) and any(True for _ in policy.buffers())
    )


def stateless_copy(policy: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``policy`` whose parameters and buffers live on the meta device (no data copied)."""
    memo: dict[int, Any] = {}
    for param in policy.parameters():
        memo[id(param)] = torch.nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    for buffer in policy.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(policy, memo)


def default_schemes(policy: Any, factories: list | None) -> dict[str, WeightSyncScheme]:
    """SPEC §3.2: the schemes a multi-process collector creates when none were given."""
    if factories is not None and any(f is not None for f in factories):
        distinct = len({id(f) for f in factories}) > 1
        return {"policy": SharedMemWeightSyncScheme(per_worker_weights=distinct)}
    if has_weights(policy):
        return {"policy": SharedMemWeightSyncScheme()}
    return {}


def wrap_callable(value: Any) -> Any:
    """Cloudpickle user callables so lambdas survive the spawn/forkserver start methods."""
    if value is None or isinstance(value, CloudpickleWrapper):
        return value
    return CloudpickleWrapper(value)


def device_lists(num_workers: int, **devices) -> dict[str, list]:
    return {name: to_device_list(value, num_workers, name) for name, value in devices.items()}


def check_policy_args(policy, factories: Sequence | None, weight_updater, schemes) -> None:
    if weight_updater is not None and schemes:
        raise TypeError("Pass either weight_updater or weight_sync_schemes, not both.")
    if policy is not None and factories is not None and any(f is not None for f in factories):
        if weight_updater is not None or schemes == {}:
            raise TypeError("policy and policy_factory together need weight-sync schemes (the policy is then "
                            "only the weight source).")
