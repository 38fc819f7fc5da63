"""The options of the worker-process collectors (``MultiSyncCollector``, ``MultiAsyncCollector``,
``AsyncCollector``): parsed once from their arguments, and what builds their backend and worker specs."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable

from ...config import CollectorConfig, positive_seconds
from ...data import ReplayBuffer
from ...protocol import WorkerSpec
from ...transport.mp import MPBackend, mp_context
from ...worker import run_worker
from .._specs import (check_policy_args, env_functions, per_worker, validate_cat_results,
                      validate_preemptive_threshold, wrap_callable)

__all__ = ["WorkerProcessOptions"]

#: seconds a worker may go without answering or making progress before TimeoutError
DEFAULT_WORKER_TIMEOUT = 120.0


@dataclass(frozen=True)
class WorkerProcessOptions:
    """What a worker-process collector is built from, validated (docs/collection.md)."""

    config: CollectorConfig
    """The arguments every collector shares."""
    sync: bool
    """Every batch stacks one rollout of every worker (True), or is the first ready (False)."""
    env_fns: tuple[Callable, ...]
    """One env constructor per worker."""
    policy: Any
    """The user's policy (the main-side source of weights), or None."""
    policy_factories: tuple[Callable | None, ...] | None
    """One policy factory per worker, or None."""
    frames_per_worker: tuple[int, ...]
    """Frames each worker collects per request."""
    collector_class: Any
    """The collector each worker runs (``Collector`` by default)."""
    num_sub_threads: int
    """torch threads of each worker."""
    num_threads: int | None
    """torch threads of this process (None: the cores the workers leave)."""
    cat_results: str | int
    """``"stack"`` or the dim sync batches are concatenated along."""
    preemptive_threshold: float | None
    """Sync: the fraction of workers after which the others are told to stop early."""
    update_at_each_batch: bool
    """Push the policy's weights before every batch."""
    worker_timeout: float
    """Seconds a worker may go without answering or making progress."""
    mp_start_method: str | None
    init_fn: Callable[[], None] | None
    """Called in each worker before it builds its env."""
    weight_updater: Any
    """A legacy weight updater (exclusive with ``weight_sync_schemes``)."""
    weight_sync_schemes: dict | None
    """``{model_id: scheme}`` sending weights to the workers (None: the backend's default)."""
    weight_recv_schemes: dict | None
    """Schemes through which this collector itself receives weights."""

    @classmethod
    def parse(cls, owner: str, *, sync: bool, create_env_fn: Any, num_workers: int | None, policy: Any,
              policy_factory: Any, frames_per_batch: Any, collector_class: Any, num_sub_threads: int,
              num_threads: int | None, cat_results: Any, preemptive_threshold: Any, update_at_each_batch: bool,
              worker_timeout: Any, mp_start_method: str | None, init_fn: Any, weight_updater: Any,
              weight_sync_schemes: dict | None, weight_recv_schemes: dict | None, reset_when_done: bool, local_init_rb: bool | None,
              **config_arguments: Any) -> WorkerProcessOptions:
        """Validate a worker-process collector's constructor arguments, once.

        Raises:
            TypeError, ValueError, RuntimeError: naming the argument that does not fit.
        """
        if not reset_when_done:
            raise ValueError("reset_when_done=False is not supported (collectors always reset finished envs).")
        env_fns = env_functions(create_env_fn, num_workers)
        count = len(env_fns)
        factories = per_worker(policy_factory, count, "policy_factory") if policy_factory is not None else None
        check_policy_args(policy, factories, weight_updater, weight_sync_schemes)
        config = CollectorConfig.from_kwargs(owner, frames_per_batch=frames_per_batch, **config_arguments)
        if init_fn is not None and not callable(init_fn):
            raise TypeError(f"init_fn must be callable or None, got {type(init_fn).__name__}")
        if local_init_rb is False:  # the old per-collector initialisation; storage-level init is all there is
            warnings.warn("local_init_rb=False is deprecated and ignored (buffers are always initialised by their "
                          "storage).", FutureWarning, stacklevel=4)
        frames = tuple(config.split_frames(count, "share" if sync else "whole"))
        cat = validate_cat_results(cat_results, sync, config.use_buffers)
        if sync and cat == "stack" and len(set(frames)) > 1:
            raise ValueError(f"Per-worker frames {list(frames)} differ, so batches cannot be stacked: pass "
                             "cat_results=-1 to concatenate them along time.")
        config.check_workers(count)
        return cls(config=config, sync=bool(sync), env_fns=tuple(env_fns), policy=policy,
                   policy_factories=tuple(factories) if factories is not None else None, frames_per_worker=frames,
                   collector_class=collector_class, num_sub_threads=num_sub_threads, num_threads=num_threads,
                   cat_results=cat, preemptive_threshold=validate_preemptive_threshold(preemptive_threshold),
                   update_at_each_batch=bool(update_at_each_batch),
                   worker_timeout=positive_seconds("worker_timeout", worker_timeout), mp_start_method=mp_start_method,
                   init_fn=init_fn, weight_updater=weight_updater, weight_sync_schemes=weight_sync_schemes,
                   weight_recv_schemes=weight_recv_schemes)

    @property
    def num_workers(self) -> int:
        return len(self.env_fns)

    @property
    def workers_write_buffer(self) -> bool:
        """Whether the workers write the replay buffer themselves: an rlharvest ``ReplayBuffer``, and
        no restarts (a worker killed while writing would leave a partial write and its lock held;
        docs/restarts.md)."""
        return isinstance(self.config.replay_buffer, ReplayBuffer) and not self.config.max_worker_restarts

    def backend(self) -> MPBackend:
        """Worker processes on this machine, each with its policy device."""
        devices = [self.config.policy_device_of(worker) for worker in range(self.num_workers)]
        return MPBackend(self.num_workers, run_worker, mp_context(self.mp_start_method), policy_devices=devices)

    def worker_specs(self, *, default_collector: type, policy: Any, schemes: dict, traj_counter: Any) -> list[WorkerSpec]:
        """One spec per worker: its env constructor, the ``policy`` it is given (a stateless copy when
        weights arrive through ``schemes``), its collector's arguments with its share of frames."""
        config = self.config
        written: dict[str, Any] = {}
        if self.workers_write_buffer:  # workers that write the buffer post-process what they write
            written = dict(postproc=config.postproc, split_trajs=config.split_trajs)
            if config.trajs_per_batch is not None:  # each worker writes its own trajectories
                written.update(trajs_per_batch=config.trajs_per_batch, trajs_per_write=config.trajs_per_write)
        factories = self.policy_factories
        return [WorkerSpec(
            worker_idx=worker,
            collector_class=wrap_callable(self.collector_class or default_collector),
            create_env_fn=wrap_callable(self.env_fns[worker]),
            collector_kwargs=config.for_worker(worker, frames_per_batch=self.frames_per_worker[worker],
                                               traj_pool=traj_counter, **written),
            policy=wrap_callable(policy),
            policy_factory=wrap_callable(factories[worker] if factories else None),
            weight_recv_schemes=schemes or None,
            replay_buffer=config.replay_buffer if self.workers_write_buffer else None,
            num_threads=self.num_sub_threads,
            init_random_frames=config.init_random_frames,
            init_fn=wrap_callable(self.init_fn),
            preemption_grace=config.preemption_grace,
        ) for worker in range(self.num_workers)]

    def grown(self, env_fns: list, factory: Callable | None, config: CollectorConfig) -> WorkerProcessOptions:
        """These options with workers added after the others (``add_collectors``): their env
        constructors, the policy factory every worker shares (or None), the first worker's share
        of frames for each, and ``config`` grown for them (docs/elastic.md)."""
        count = len(env_fns)
        factories = self.policy_factories + (factory,) * count if self.policy_factories else None
        return replace(self, config=config, env_fns=self.env_fns + tuple(env_fns), policy_factories=factories,
                       frames_per_worker=self.frames_per_worker + (self.frames_per_worker[0],) * count)

    def torch_threads(self) -> int:
        """The torch threads of the collector's own process."""
        from ..._utils import cpu_count

        threads = self.num_threads if self.num_threads is not None else cpu_count() - self.num_workers
        return max(1, int(threads))

