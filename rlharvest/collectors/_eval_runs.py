"""How an :class:`~rlharvest.collectors.Evaluator` builds the run of its backend: an ``EvalCollector``
in a thread of this process (or another collector class), a ``MultiSyncCollector`` with one worker
process, or a Ray actor (``distributed/ray_eval.py``); the collector's arguments are the same for every
backend (docs/evaluation.md)."""

from __future__ import annotations

from typing import Any, Callable

from ..envs.adapters import is_env
from ..envs.factory import make_env
from ._evaluation import EvalCollector, EvalConfig, LocalRun, WorkerRun, build_policy
from .async_batched import AsyncBatchedCollector
from .distributed.ray_eval import RayEvalRun, RayEvalWorker
from .multi import AsyncCollector, MultiAsyncCollector, MultiSyncCollector
from .single import Collector

__all__ = ["EvalConfig", "run_builder"]

#: the classes ``collector_cls`` may name
_BY_NAME = {cls.__name__: cls for cls in (Collector, MultiSyncCollector, MultiAsyncCollector, AsyncCollector,
                                          AsyncBatchedCollector, EvalCollector)}


def _collector_class(collector_cls: type | str | None) -> type:
    if collector_cls is None:
        return EvalCollector
    if isinstance(collector_cls, str):
        if collector_cls not in _BY_NAME:
            raise ValueError(f"collector_cls {collector_cls!r} is not a class of rlharvest.collectors (one of "
                             f"{sorted(_BY_NAME)}).")
        return _BY_NAME[collector_cls]
    return collector_cls


def run_builder(config: EvalConfig, env: Any, policy: Any, policy_factory: Any, collector_cls: Any,
                schemes: dict | None) -> tuple[Callable[[], Any], bool]:
    """How the backend's run is built, and whether it is built with the evaluator (else by the
    first evaluation). The collector's arguments are the same for every backend."""
    # collector_kwargs may set what has a default here (traj_format="cat": metrics read flat batches too)
    collect = {**dict(frames_per_batch=config.frames_per_batch, total_frames=-1, max_frames_per_traj=config.max_steps,
                      trajs_per_batch=config.num_trajectories, traj_format="padded",
                      exploration_type=config.exploration_type), **config.collector_kwargs}
    if config.backend == "ray":
        return (lambda: RayEvalRun(RayEvalWorker(
            config.init_fn, env, policy_factory, num_gpus=config.num_gpus, reward_keys=config.reward_key,
            num_trajectories=config.num_trajectories, frames_per_batch=config.frames_per_batch,
            collector_kwargs=config.collector_kwargs, **config.ray_kwargs), config)), True
    if config.backend == "process" or schemes is not None:
        def build_worker() -> WorkerRun:
            collector = MultiSyncCollector(
                [env], policy_factory=policy_factory, collector_class=EvalCollector, weight_sync_schemes=schemes,
                init_fn=config.init_fn, policy_device=config.device, **collect)
            return WorkerRun(collector, config.reward_key, config.metrics_fn)
        return build_worker, True

    cls = _collector_class(collector_cls)

    def build_local() -> LocalRun:
        if cls is EvalCollector:
            collector = cls(env, policy, policy_factory=policy_factory, policy_device=config.device, **collect)
        else:  # another collector calls factories without the env: the env and policy are built here
            built_env = make_env(env, None)
            built_policy = policy if policy_factory is None else build_policy(policy_factory, built_env)
            collector = cls(built_env, built_policy, policy_device=config.device, **collect)
        return LocalRun(collector, config.reward_key, config.metrics_fn)

    # A constructor and a factory: both are built by whoever evaluates first (the background thread
    # for trigger_eval), as TorchRL does, so that the env can live on a device of its own.
    return build_local, not (policy_factory is not None and not is_env(env) and callable(env))
