"""The options of the worker-process collectors (``MultiSyncCollector``, ``MultiAsyncCollector``,
``AsyncCollector``): parsed once from their arguments, and what builds their backend and worker specs."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar

import torch

from ..._utils import cpu_count, wrap_callable, user_stacklevel
from ...config import CollectorConfig, positive_seconds
from ...config_views import BatchShares, FramesPerBatch
from ...weight_update.torchrl_schemes import own_schemes
from ...data import ReplayBuffer
from ...protocol import WorkerSpec
from ...transport.mp import MPBackend, mp_context
from ...worker import run_worker
from ..engine.contract import Startup, WorkerSetup
from ..engine.extras import EngineExtra
from ..engine.fleet import Fleet
from ..engine.gather import FirstReadyBatches, Gathering, Stacked
from ..engine.running import IN_A_THREAD, WORKERS_WRITE, FreeRun
from ..engine.schedule import WeightPushes
from ..engine.served import PolicyServer
from ..engine.events import FleetEvents
from ..engine.state import Lifecycle
from ..engine.stats import ASKED_WHEN_VIEWED, WorkerCensus
from ..engine.traj_ids import PerWorkerIds, SharedIds, TrajectoryIds
from .autoscale import Autoscale, parse_autoscale
from .common import (check_env_constructors, check_policy_args, default_schemes, env_functions, held_here, per_worker,
                     stateless_copy, typed_class, validate_cat_results, validate_preemptive_threshold)
from .local import LocalOptions

__all__ = ["NodeProcesses", "WorkerProcessOptions"]

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
    default_collector: Any = None
    """rlharvest's ``Collector``, which workers build from typed options (the face gives it); a
    ``collector_class`` of the user's own is built from keyword arguments instead."""
    autoscale: Autoscale | None = None
    """How the fleet sizes itself while collecting (docs/elastic.md, "Autoscaling"), or None."""

    #: the collectors with workers wait this long for them to close at shutdown (seconds)
    shutdown_timeout = 10.0
    #: ``update_policy_weights_()`` without weights and without a policy: a factory's policy is the source
    factory_fallback = True
    #: how errors and ``stats()`` name a worker
    noun = "worker"
    #: ``shutdown(close_env=False)`` is refused: worker processes always close their envs
    refuses_keep_env = True
    shutdown_after_total = False
    #: the constructor returns once every worker is built
    startup = Startup()
    #: ``stats()`` asks the workers only for a per-worker view
    census: ClassVar[WorkerCensus] = ASKED_WHEN_VIEWED

    @classmethod
    def parse(cls, owner: str, *, sync: bool, create_env_fn: Any, num_workers: int | None, policy: Any,
              policy_factory: Any, default_collector: Any, collector_class: Any = None,
              num_sub_threads: int = 1, num_threads: int | None = None, cat_results: Any = None,
              preemptive_threshold: Any = None, update_at_each_batch: bool = False,
              worker_timeout: Any = DEFAULT_WORKER_TIMEOUT, mp_start_method: str | None = None, init_fn: Any = None,
              weight_updater: Any = None, weight_sync_schemes: dict | None = None,
              weight_recv_schemes: dict | None = None, reset_when_done: bool = True, local_init_rb: bool | None = None,
              autoscale: Any = None, **config_arguments: Any) -> WorkerProcessOptions:
        """Validate a worker-process collector's constructor arguments, once (a node running one is
        given them by its parent, parsed there: the defaults are the constructor's). ``frames_per_batch``
        is not among them: the face parses it apart (``FramesPerBatch``) and :meth:`worker_shares` splits it, so
        that only what sizes batches and the workers' specs hold it (docs/architecture.md).

        Raises:
            TypeError, ValueError, RuntimeError: naming the argument that does not fit.
        """
        if not reset_when_done:
            raise ValueError("reset_when_done=False is not supported (collectors always reset finished envs).")
        env_fns = env_functions(create_env_fn, num_workers)
        check_env_constructors(env_fns, "worker process")
        count = len(env_fns)
        factories = per_worker(policy_factory, count, "policy_factory") if policy_factory is not None else None
        weight_sync_schemes = own_schemes(weight_sync_schemes, "weight_sync_schemes")
        weight_recv_schemes = own_schemes(weight_recv_schemes, "weight_recv_schemes", receiving=True)
        check_policy_args(policy, factories, weight_updater, weight_sync_schemes)
        config = CollectorConfig.from_kwargs(owner, **config_arguments)
        if init_fn is not None and not callable(init_fn):
            raise TypeError(f"init_fn must be callable or None, got {type(init_fn).__name__}")
        if local_init_rb is False:  # the old per-collector initialisation; storage-level init is all there is
            warnings.warn("local_init_rb=False is deprecated and ignored (buffers are always initialised by their "
                          "storage).", FutureWarning, stacklevel=user_stacklevel())
        cat = validate_cat_results(cat_results, sync, config.use_buffers)
        config.check_workers(count)
        typed = collector_class is None or typed_class(collector_class, [default_collector])
        scaling = parse_autoscale(autoscale, sync=bool(sync), typed_workers=typed,
                                  legacy_updater=weight_updater is not None,
                                  distinct_factories=factories is not None and len({id(f) for f in factories}) > 1)
        return cls(config=config, sync=bool(sync), env_fns=tuple(env_fns), policy=policy,
                   policy_factories=tuple(factories) if factories is not None else None,
                   collector_class=collector_class, num_sub_threads=num_sub_threads, num_threads=num_threads,
                   cat_results=cat, preemptive_threshold=validate_preemptive_threshold(preemptive_threshold),
                   update_at_each_batch=bool(update_at_each_batch),
                   worker_timeout=positive_seconds("worker_timeout", worker_timeout), mp_start_method=mp_start_method,
                   init_fn=init_fn, weight_updater=weight_updater, weight_sync_schemes=weight_sync_schemes,
                   weight_recv_schemes=weight_recv_schemes, default_collector=default_collector, autoscale=scaling)

    def with_hooks(self, hooks: dict) -> WorkerProcessOptions:
        """These options with the pre/post-collect ``hooks`` (``{name: hook}``) set (for its workers too)."""
        return replace(self, config=replace(self.config, **hooks))

    def in_worker(self, *, create_env_fn: Any, policy: Any, policy_factory: Any,
                  worker_idx: int) -> WorkerProcessOptions:
        """The options a node running this collector builds it from: its env constructors (one per
        sub-worker) and policy, made on the node, and its index there."""
        env_fns = tuple(create_env_fn) if isinstance(create_env_fn, (list, tuple)) else (create_env_fn,) * len(
            self.env_fns)
        factories = tuple(per_worker(policy_factory, len(env_fns), "policy_factory")) if policy_factory else None
        return replace(self, env_fns=env_fns, policy=policy, policy_factories=factories,
                       config=replace(self.config, worker_idx=worker_idx))

    # ------------------------------------------------------------------ what the engine reads
    @property
    def num_workers(self) -> int:
        return len(self.env_fns)

    @property
    def gathering(self) -> Gathering:
        """Stacked batches, or the first ready. Serving a parent (inside a node), an async collector asks a
        worker again only after its batch was yielded, so that weights the parent pushes after taking a
        batch are in the next one (docs/collection.md)."""
        if self.sync:
            return Stacked(self.cat_results, self.preemptive_threshold)
        return FirstReadyBatches(relaunch_after_yield=self.config.worker_idx is not None)

    @property
    def pushes(self) -> WeightPushes:
        """``update_at_each_batch``: one update of every worker before each batch."""
        return WeightPushes(before_each_batch=self.update_at_each_batch, name_targets=False)

    @property
    def free_run(self) -> FreeRun:
        """``start()``: the workers write an rlharvest buffer themselves; any other, a thread here."""
        return WORKERS_WRITE if self.workers_write_buffer else IN_A_THREAD

    def trajectory_ids(self) -> TrajectoryIds:
        """One counter every worker shares; a collector class of the user's own counts its own ids,
        mapped here."""
        return SharedIds() if self.typed_workers else PerWorkerIds(self.num_workers)

    def extras(self, backend: MPBackend, fleet: Fleet, life: Lifecycle, events: FleetEvents) -> list[EngineExtra]:
        return []

    def served_policy(self, backend: MPBackend) -> PolicyServer | None:
        return None

    @property
    def typed_workers(self) -> bool:
        """Whether the workers build rlharvest's ``Collector`` from typed options (and share one
        trajectory counter); a collector class of the user's own counts its own ids, mapped here."""
        return self.collector_class is None or typed_class(self.collector_class, [self.default_collector])

    @property
    def version_tracker(self) -> Any:
        return self.config.track_policy_version or None

    @property
    def assembles_trajectories(self) -> bool:
        """Workers writing the buffer assemble their trajectories themselves."""
        return not self.workers_write_buffer

    def worker_shares(self, frames: FramesPerBatch) -> BatchShares:
        """Each worker's part of ``frames``: a sync batch is split between them, an async batch is one
        worker's whole.

        Raises:
            ValueError: a per-worker list of the wrong length, or shares that differ while batches are stacked.
        """
        shares = frames.shares(self.num_workers, "share" if self.sync else "whole")
        if self.sync and self.cat_results == "stack" and len(set(shares.shares)) > 1:
            raise ValueError(f"Per-worker frames {list(shares.shares)} differ, so batches cannot be stacked: pass "
                             "cat_results=-1 to concatenate them along time.")
        return shares

    @property
    def workers_write_buffer(self) -> bool:
        """Whether the workers write the replay buffer themselves: an rlharvest ``ReplayBuffer``, and
        no restarts (a worker killed while writing would leave a partial write and its lock held;
        docs/restarts.md)."""
        return isinstance(self.config.replay_buffer, ReplayBuffer) and not self.config.max_worker_restarts

    def build_backend(self) -> MPBackend:
        """Worker processes on this machine, each with its policy device."""
        devices = [self.config.policy_device_of(worker) for worker in range(self.num_workers)]
        return MPBackend(self.num_workers, run_worker, mp_context(self.mp_start_method), policy_devices=devices)

    def prepare(self, backend: MPBackend) -> WorkerSetup:
        """The weight schemes (the user's, the backend's default, or a legacy updater's transport), the
        policy each worker is given, a replay buffer workers can write, this process's torch threads and
        the trajectory counter the workers share."""
        policy, factories = self.policy, self.policy_factories
        legacy = self.weight_updater is not None
        schemes = self.weight_sync_schemes
        if legacy or schemes is None:
            schemes = default_schemes(backend.default_scheme(), policy, factories)
        schemes = held_here(dict(schemes or {}), buffer_here=self.config.replay_buffer is not None
                                                      and not self.workers_write_buffer)
        if factories is not None:
            worker_policy = None
        elif "policy" in schemes and policy is not None:
            worker_policy = stateless_copy(policy)  # its weights arrive through the scheme
        else:
            worker_policy = policy
        if self.workers_write_buffer:
            self.config.replay_buffer.make_process_safe(backend.ctx)
        torch.set_num_threads(self.torch_threads())
        # one counter for every worker: ids are unique across workers and fresh after a restart
        counter = backend.trajectory_counter() if self.typed_workers else None
        return WorkerSetup(policy=worker_policy, schemes=schemes, legacy=legacy, trajectory_counter=counter)

    def worker_specs(self, setup: WorkerSetup, shares: BatchShares, first: int = 0) -> list[WorkerSpec]:
        """One spec per worker from index ``first`` on: its env constructor, the policy it is given, its
        collector's typed options (``Collector``) or arguments (a class of the user's own) with its share
        of frames (of ``shares``)."""
        config = self.config
        written: dict[str, Any] = {}
        if self.workers_write_buffer:  # workers that write the buffer post-process what they write
            written = dict(postproc=config.postproc, split_trajs=config.split_trajs, replay_buffer=config.replay_buffer)
            if config.trajs_per_batch is not None:  # each worker writes its own trajectories
                written.update(trajs_per_batch=config.trajs_per_batch, trajs_per_write=config.trajs_per_write)
            if config.replay_write_mode is not None:
                written.update(replay_write_mode=config.replay_write_mode, trajs_per_write=config.trajs_per_write)
        factories = self.policy_factories
        return [WorkerSpec(
            worker_idx=worker,
            collector_class=wrap_callable(self.collector_class or self.default_collector),
            create_env_fn=wrap_callable(self.env_fns[worker]),
            **self._collector_arguments(worker, setup, written, shares.share(worker)),
            policy=wrap_callable(setup.policy),
            policy_factory=wrap_callable(factories[worker] if factories else None),
            weight_recv_schemes=setup.schemes or None,
            replay_buffer=config.replay_buffer if self.workers_write_buffer else None,
            num_threads=self.num_sub_threads,
            init_random_frames=config.init_random_frames,
            init_fn=wrap_callable(self.init_fn),
            preemption_grace=config.preemption_grace,
        ) for worker in range(first, self.num_workers)]

    def _collector_arguments(self, worker: int, setup: WorkerSetup, written: dict, frames: int) -> dict:
        if self.typed_workers:
            options = LocalOptions(config=self.config.worker_config(worker, frames_per_batch=frames, **written),
                                   create_env_fn=None, trajectory_counter=setup.trajectory_counter)
            return {"options": options}
        return {"collector_kwargs": self.config.for_worker(worker, frames_per_batch=frames, **written)}

    def added(self, first: int, create_env_fn: Any, num_envs: Any, policy: Any, collector_kwargs: Any,
              backend_options: Any, setup: WorkerSetup,
              shares: BatchShares) -> tuple[WorkerProcessOptions, list[WorkerSpec], list]:
        """``add_collectors``: these options grown by the new workers, their specs, and their devices (what
        the backend needs of each).

        Raises:
            ValueError: for an argument that does not fit (named in the message).
        """
        env_fns = list(create_env_fn) if isinstance(create_env_fn, (list, tuple)) else [create_env_fn]
        check_env_constructors(env_fns, "worker process")
        if not env_fns or any(not callable(env_fn) for env_fn in env_fns):
            raise ValueError(f"create_env_fn must be an env constructor or a non-empty list of them (one per new "
                             f"worker), got {create_env_fn!r}.")
        if num_envs is not None and num_envs != 1:
            raise ValueError(f"num_envs must be 1 (each worker process runs one env), got {num_envs!r}.")
        if any(entry is not None and entry is not self.policy for entry in
               (policy if isinstance(policy, (list, tuple)) else [policy])):
            raise ValueError("policy must be None or this collector's policy, or a list of those: every worker runs "
                             "the weights this collector sends.")
        factories = {id(factory): factory for factory in self.policy_factories or []}
        if len(factories) > 1:
            raise ValueError("add_collectors cannot choose the new workers' policy_factory: this collector was built "
                             "with a different one per worker.")
        count = len(env_fns)
        extra = _new_collector_kwargs(collector_kwargs, count, shares.share(0))
        config = self.config.grown(count)
        try:
            config.check_workers(first + count)
        except (RuntimeError, ValueError) as err:
            raise ValueError(f"add_collectors: {err} The collector was built with one value per worker: it cannot "
                             "tell the new workers' values.") from None
        grown = self.grown(env_fns, next(iter(factories.values()), None), config)
        specs = [_with_extra(spec, entry) for spec, entry in zip(grown.worker_specs(setup, shares, first=first), extra)]
        return grown, specs, [config.policy_device_of(worker) for worker in range(first, first + count)]

    def grown(self, env_fns: list, factory: Callable | None, config: CollectorConfig) -> WorkerProcessOptions:
        """These options with workers added after the others (``add_collectors``): their env
        constructors, the policy factory every worker shares (or None), and ``config`` grown for them
        (docs/elastic.md)."""
        count = len(env_fns)
        factories = self.policy_factories + (factory,) * count if self.policy_factories else None
        return replace(self, config=config, env_fns=self.env_fns + tuple(env_fns), policy_factories=factories)

    def scaled_backend_options(self, count: int) -> None:
        """What the backend needs of ``count`` workers the autoscaler adds: their devices follow the
        collector's (``added``)."""
        return None

    def torch_threads(self) -> int:
        """The torch threads of the collector's own process."""
        threads = self.num_threads if self.num_threads is not None else cpu_count() - self.num_workers
        return max(1, int(threads))



@dataclass(frozen=True)
class NodeProcesses:
    """What a node running a worker-process collector builds it from: the collector's options and,
    apart from them, its ``frames_per_batch`` (both parsed in the parent)."""

    options: WorkerProcessOptions
    frames: FramesPerBatch

    def in_worker(self, **made_on_node: Any) -> NodeProcesses:
        """:meth:`WorkerProcessOptions.in_worker`, the frames unchanged."""
        return replace(self, options=self.options.in_worker(**made_on_node))

    def worker_shares(self) -> BatchShares:
        """The node's share split between its own workers (:meth:`WorkerProcessOptions.worker_shares`)."""
        return self.options.worker_shares(self.frames)


def _new_collector_kwargs(collector_kwargs: Any, count: int, share: int) -> list[dict]:
    """The extra collector arguments of each of ``count`` new workers (``add_collectors``)."""
    entries = list(collector_kwargs) if isinstance(collector_kwargs, (list, tuple)) else [collector_kwargs] * count
    if len(entries) != count:
        raise ValueError(f"collector_kwargs must hold one entry per new worker ({count}), got {len(entries)}.")
    for index, entry in enumerate(entries):
        if entry is not None and not isinstance(entry, dict):
            raise ValueError(f"collector_kwargs must be a dict or a list of dicts (one per new worker), got "
                             f"{type(entry).__name__} at index {index}.")
        frames = (entry or {}).get("frames_per_batch", share)
        if frames != share:
            raise ValueError(f"collector_kwargs[{index}]['frames_per_batch']={frames!r}: every worker collects "
                             f"{share} frames per rollout (leave it out).")
    return [dict(entry or {}) for entry in entries]


def _with_extra(spec: WorkerSpec, extra: dict) -> WorkerSpec:
    """``spec`` with the user's extra collector arguments: validated into its typed options, or added to
    a class of the user's own keyword arguments."""
    extra = {name: value for name, value in extra.items() if name != "frames_per_batch"}
    if not extra:
        return spec
    if spec.options is not None:
        config = spec.options.config
        try:
            config = replace(config, **extra)
        except TypeError as err:
            raise ValueError(f"collector_kwargs: {err}") from None
        return replace(spec, options=replace(spec.options, config=config))
    return replace(spec, collector_kwargs={**spec.collector_kwargs, **extra})
