"""What the worker specs of a collector are built from: the arguments only collectors with workers
take (one env constructor per worker, per-worker policies), the policy a worker is given, and the
default weight-sync scheme of a backend.

The arguments every collector shares are checked once, in :class:`rlharvest.config.CollectorConfig`.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch

from ..._utils import positive_int, unwrap, wrap_callable
from ...envs.factory import GYMNASIUM_ADVICE, gymnasium_instance
from ...weight_update.in_process import InProcessWeightSyncScheme
from ...weight_update.schemes import WeightSyncScheme
from ..engine.weights import has_weights

__all__ = [
    "typed_class",
    "per_worker",
    "env_functions",
    "stateless_copy",
    "default_schemes",
    "held_here",
    "has_weights",
    "wrap_callable",
    "validate_cat_results",
    "validate_preemptive_threshold",
    "check_policy_args",
]


def typed_class(collector_class: Any, ours: Sequence[type]) -> bool:
    """Whether workers build ``collector_class`` from typed options (``from_options``): one of ``ours``,
    or a subclass that keeps its constructor (its other methods are the user's and stay theirs). A
    class with a constructor of its own is called with keyword arguments, so that code runs."""
    if not isinstance(collector_class, type):
        return False
    return any(issubclass(collector_class, base) and collector_class.__init__ is base.__init__ for base in ours)


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
    return [create_env_fn] * positive_int("num_workers", num_workers)


def check_env_constructors(env_fns: Sequence[Any], noun: str) -> None:
    """Refuse, in the learner, what a worker could not build its env from: a gymnasium env instance
    (detected by its type), which the worker would only reject once started.

    Raises:
        TypeError: naming the entry and what to pass instead.
    """
    for index, env_fn in enumerate(env_fns):
        if gymnasium_instance(unwrap(env_fn)):
            raise TypeError(f"create_env_fn[{index}] is a gymnasium env ({type(unwrap(env_fn)).__name__}), which no "
                            f"{noun} can build its env from: {GYMNASIUM_ADVICE}.")


def per_worker(value: Any, num_workers: int, name: str, is_single: Callable[[Any], bool] | None = None) -> list:
    """Expand a scalar argument to one value per worker, or check a per-worker list's length."""
    single = is_single(value) if is_single is not None else not isinstance(value, (list, tuple))
    if single:
        return [value] * num_workers
    if len(value) != num_workers:
        raise ValueError(f"{name} must have exactly one value per worker ({num_workers}), got {len(value)}.")
    return list(value)


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


def stateless_copy(policy: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``policy`` whose parameters and buffers live on the meta device (no data copied)."""
    memo: dict[int, Any] = {}
    for param in policy.parameters():
        memo[id(param)] = torch.nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    for buffer in policy.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(policy, memo)


def default_schemes(scheme_name: str, policy: Any, factories: list | None,
                    **scheme_arguments: Any) -> dict[str, WeightSyncScheme]:
    """The schemes a collector with workers creates when none were given (docs/weights.md).

    Args:
        scheme_name: the backend's default scheme (``Backend.default_scheme()``).
        policy: the policy workers run (no scheme when it has no weights).
        factories: per-worker policy factories, or None.
        **scheme_arguments: arguments of the scheme.
    """
    if factories is not None and any(f is not None for f in factories):
        if scheme_name == "shared" and len({id(f) for f in factories}) > 1:
            scheme_arguments = {**scheme_arguments, "per_worker_weights": True}  # distinct policies: one buffer per worker
        return {"policy": WeightSyncScheme.from_backend(scheme_name, **scheme_arguments)}
    if has_weights(policy):
        return {"policy": WeightSyncScheme.from_backend(scheme_name, **scheme_arguments)}
    return {}


def held_here(schemes: dict[str, WeightSyncScheme], buffer_here: bool) -> dict[str, WeightSyncScheme]:
    """``schemes`` where each one that would send a model of this process to the workers is replaced by an
    :class:`InProcessWeightSyncScheme` of its strategy: the replay buffer's models, when the collector
    writes the buffer itself (``buffer_here``) and workers have no copy (docs/weights.md)."""
    if not buffer_here:
        return schemes
    return {model_id: InProcessWeightSyncScheme(strategy=scheme.strategy)
            if scheme.needs_workers and model_id.split(".")[0].split("[")[0] == "replay_buffer" else scheme
            for model_id, scheme in schemes.items()}


def check_policy_args(policy, factories: Sequence | None, weight_updater, schemes) -> None:
    if weight_updater is not None and schemes:
        raise TypeError("Pass either weight_updater or weight_sync_schemes, not both.")
    if policy is not None and factories is not None and any(f is not None for f in factories):
        if weight_updater is not None or schemes == {}:
            raise TypeError("policy and policy_factory together need weight-sync schemes (the policy is then "
                            "only the weight source).")
