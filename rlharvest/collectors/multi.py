"""Worker-process collectors: MultiSyncCollector, MultiAsyncCollector, AsyncCollector (docs/collection.md).

Faces over :class:`~rlharvest.collectors.engine.engine.CollectionEngine` with the ``mp`` backend: each
worker is a process running the worker loop around its own Collector (so THE rollout loop); batches
come back through shared memory, weights go out through shared-memory schemes, and every wait is
bounded and checks that workers are alive. ``MultiCollector(sync=...)`` picks the sync or async one.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from tensordict import TensorDictBase

from ..config_views import BatchShares, FramesPerBatch
from ..policies import ExplorationType
from . import _workers
from .base import BaseCollector
from .engine.engine import CollectionEngine
from .options.autoscale import Autoscale
from .options.mp import DEFAULT_WORKER_TIMEOUT, NodeProcesses, WorkerProcessOptions
from .single import Collector

__all__ = ["MultiSyncCollector", "MultiAsyncCollector", "AsyncCollector", "MultiCollector", "DEFAULT_WORKER_TIMEOUT"]


class MultiCollector(BaseCollector):
    """Collectors whose rollouts run in worker processes on this machine.

    ``MultiCollector(create_env_fn, policy, sync=True, ...)`` returns a :class:`MultiSyncCollector`,
    ``sync=False`` a :class:`MultiAsyncCollector`; both are instances of this class.
    ``autoscale=Autoscale(min_collectors, max_collectors)`` sizes the fleet while collecting
    (docs/elastic.md, "Autoscaling").

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> collector = MultiCollector([CountingEnv] * 2, frames_per_batch=8, total_frames=8, sync=False)
        >>> isinstance(collector, (MultiCollector, MultiAsyncCollector))
        True
        >>> collector.shutdown()
    """

    @classmethod
    def _construct(cls, args: tuple, kwargs: dict) -> Any:
        """``MultiCollector`` picks by ``sync``; its subclasses check that ``sync`` does not contradict them."""
        sync = kwargs.get("sync")
        if cls is __class__:  # this class itself, whatever its module's name now holds (mock.patch)
            return object.__new__(MultiAsyncCollector if sync is False else MultiSyncCollector)
        own = issubclass(cls, MultiSyncCollector)
        if sync is not None and bool(sync) != own:
            raise TypeError(f"{cls.__name__} is {'' if own else 'a'}synchronous: sync={sync!r} contradicts it "
                            "(use MultiCollector(..., sync=...) to choose).")
        return object.__new__(cls)

    def __init__(
        self,
        create_env_fn: Sequence[Callable] | Callable,
        policy: Callable | None = None,
        *,
        num_workers: int | None = None,
        policy_factory: Callable | Sequence[Callable] | None = None,
        frames_per_batch: int | Sequence[int],
        total_frames: int = -1,
        device=None,
        storing_device=None,
        env_device=None,
        policy_device=None,
        create_env_kwargs: dict | Sequence[dict] | None = None,
        collector_class: Any = None,
        max_frames_per_traj: int | None = None,
        init_random_frames: int | None = None,
        reset_at_each_iter: bool = False,
        postproc: Callable | None = None,
        split_trajs: bool | None = None,
        exploration_type=ExplorationType.RANDOM,
        reset_when_done: bool = True,
        update_at_each_batch: bool = False,
        preemptive_threshold: float | None = None,
        num_threads: int | None = None,
        num_sub_threads: int = 1,
        cat_results: str | int | None = None,
        set_truncated: bool = False,
        use_buffers: bool | None = None,
        replay_buffer=None,
        extend_buffer: bool = True,
        local_init_rb: bool | None = None,
        trust_policy: bool | None = None,
        compile_policy=None,
        cudagraph_policy=None,
        no_cuda_sync: bool = False,
        weight_updater=None,
        weight_sync_schemes: dict | None = None,
        weight_recv_schemes: dict | None = None,
        track_policy_version: Any = False,
        worker_idx: int | None = None,
        sync: bool | None = None,
        worker_timeout: float = DEFAULT_WORKER_TIMEOUT,
        max_worker_restarts: int = 0,
        restart_delay: float = 0.0,
        preemption_grace: float = 5.0,
        mp_start_method: str | None = None,
        pre_collect_hook: Callable[[], None] | None = None,
        post_collect_hook: Callable[[TensorDictBase], None] | None = None,
        trajs_per_batch: int | None = None,
        trajs_per_write: int | None = None,
        replay_write_mode: str | None = None,
        traj_format: str | None = None,
        track_traj_ids: bool = True,
        compact_obs: bool = False,
        init_fn: Callable[[], None] | None = None,
        auto_register_policy_transforms: bool | None = None,
        autoscale: Autoscale | None = None,
    ) -> None:
        frames = FramesPerBatch.parse(frames_per_batch)  # apart from the options: only what sizes batches reads it
        options = WorkerProcessOptions.parse(
            type(self).__name__, sync=isinstance(self, MultiSyncCollector), default_collector=Collector,
            create_env_fn=create_env_fn, policy=policy, num_workers=num_workers, policy_factory=policy_factory,
            total_frames=total_frames, device=device,
            storing_device=storing_device, env_device=env_device, policy_device=policy_device,
            create_env_kwargs=create_env_kwargs, collector_class=collector_class,
            max_frames_per_traj=max_frames_per_traj, init_random_frames=init_random_frames,
            reset_at_each_iter=reset_at_each_iter, postproc=postproc, split_trajs=split_trajs,
            exploration_type=exploration_type, reset_when_done=reset_when_done,
            update_at_each_batch=update_at_each_batch, preemptive_threshold=preemptive_threshold,
            num_threads=num_threads, num_sub_threads=num_sub_threads, cat_results=cat_results,
            set_truncated=set_truncated, use_buffers=use_buffers, replay_buffer=replay_buffer,
            extend_buffer=extend_buffer, local_init_rb=local_init_rb, trust_policy=trust_policy,
            compile_policy=compile_policy, cudagraph_policy=cudagraph_policy, no_cuda_sync=no_cuda_sync,
            weight_updater=weight_updater, weight_sync_schemes=weight_sync_schemes,
            weight_recv_schemes=weight_recv_schemes, track_policy_version=track_policy_version,
            worker_idx=worker_idx, worker_timeout=worker_timeout, max_worker_restarts=max_worker_restarts,
            restart_delay=restart_delay, preemption_grace=preemption_grace, mp_start_method=mp_start_method,
            pre_collect_hook=pre_collect_hook, post_collect_hook=post_collect_hook,
            trajs_per_batch=trajs_per_batch, trajs_per_write=trajs_per_write, traj_format=traj_format,
            replay_write_mode=replay_write_mode,
            track_traj_ids=track_traj_ids, compact_obs=compact_obs, init_fn=init_fn,
            auto_register_policy_transforms=auto_register_policy_transforms, autoscale=autoscale)
        self._build(options, options.worker_shares(frames))

    # ------------------------------------------------------------------ every collector with workers (``_workers.py``)
    @classmethod
    def from_options(cls, options: NodeProcesses) -> MultiCollector:
        """The collector a node runs, from the options and frames its parent parsed (nothing is parsed again)."""
        collector = object.__new__(cls)
        collector._build(options.options, options.worker_shares())
        return collector

    def _build(self, options: WorkerProcessOptions, shares: BatchShares) -> None:
        self._engine = CollectionEngine(options, shares, self)  # the face holds it while the workers start
        self._engine.start()

    worker_pids = _workers.worker_pids
    num_workers = _workers.num_workers
    active_workers = _workers.active_workers
    restart_causes = _workers.restart_causes
    remove_collectors = _workers.remove_collectors
    add_collectors = _workers.add_collectors
    worker_policy_versions = _workers.worker_policy_versions

    # ------------------------------------------------------------------ what the options hold
    @property
    def policy(self) -> Any:
        """The user's policy (the main-side source of the workers' weights), or None."""
        return self._engine.options.policy

    @property
    def policy_factory(self) -> list | None:
        factories = self._engine.options.policy_factories
        return list(factories) if factories is not None else None

    @property
    def update_at_each_batch(self) -> bool:
        return self._engine.options.update_at_each_batch

    @property
    def preemptive_threshold(self) -> float | None:
        return self._engine.options.preemptive_threshold

    @property
    def frames_per_batch_worker(self) -> list[int]:
        engine = self._engine
        return engine.shares.of_workers(engine.options.num_workers)

    def fake_tensordict(self) -> TensorDictBase:
        """Not available for worker-process collectors (as in TorchRL): ask a Collector of the same env.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(f"{type(self).__name__}.fake_tensordict() is not implemented: build a Collector "
                                  "with one of the env constructors and call its fake_tensordict().")

    # ------------------------------------------------------------------ legacy weight updaters
    def get_cached_weights(self, model_id: str) -> TensorDictBase | None:
        """The shared-memory weights the workers of ``model_id`` run on (first worker's device), or
        None when that model's scheme keeps none (pipes, or no update yet)."""
        return self._engine.legacy.cached_weights(model_id)

    @property
    def policy_weights(self) -> dict:
        """``{device: weights}`` staging area of legacy updaters (private copies; pushed on write)."""
        return self._engine.legacy.staged_weights()

    @property
    def pipes(self) -> list:
        """One pipe per worker, for a legacy updater written against TorchRL's worker pipes: ``pipes[i].send(
        (weights, "update"))`` delivers weights to worker ``i`` (waiting until it applied them), and
        ``pipes[i].recv()`` gives ``(None, "updated")`` (docs/torchrl-compatibility.md)."""
        return self._engine.legacy.pipes()

    def legacy_weights_written(self, device) -> None:
        """A legacy MultiProcessedWeightUpdater wrote ``device``'s weights: push them to those workers."""
        self._engine.legacy.push_staged(self.weight_updater.policy_weights, device)


class MultiSyncCollector(MultiCollector):
    """Workers collect in lockstep: every batch stacks one rollout of every worker, ordered by index.

    Nothing is stepped between a yield and the next request, so it is safe for on-policy training.

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> collector = MultiSyncCollector([CountingEnv] * 2, frames_per_batch=8, total_frames=16)
        >>> [tuple(batch.shape) for batch in collector]
        [(2, 4), (2, 4)]
        >>> collector.shutdown()
    """


class MultiAsyncCollector(MultiCollector):
    """Workers collect continuously; each batch is the first one ready (off-policy training).

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> collector = MultiAsyncCollector([CountingEnv] * 2, frames_per_batch=8, total_frames=16)
        >>> [batch.numel() for batch in collector]
        [8, 8]
        >>> collector.shutdown()
    """


class AsyncCollector(MultiAsyncCollector):
    """One Collector running in a background process (a MultiAsyncCollector with one worker).

    Takes MultiAsyncCollector's arguments, with one env constructor and one dict of
    ``create_env_kwargs`` instead of lists.

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> collector = AsyncCollector(CountingEnv, frames_per_batch=4, total_frames=8)
        >>> len(list(collector))
        2
        >>> collector.shutdown()
    """

    def __init__(
        self,
        create_env_fn: Callable,
        policy: Callable | None = None,
        *,
        num_workers: int | None = 1,
        policy_factory: Callable | Sequence[Callable] | None = None,
        frames_per_batch: int | Sequence[int],
        total_frames: int = -1,
        device=None,
        storing_device=None,
        env_device=None,
        policy_device=None,
        create_env_kwargs: dict | None = None,
        collector_class: Any = None,
        max_frames_per_traj: int | None = None,
        init_random_frames: int | None = None,
        reset_at_each_iter: bool = False,
        postproc: Callable | None = None,
        split_trajs: bool | None = None,
        exploration_type=ExplorationType.RANDOM,
        reset_when_done: bool = True,
        update_at_each_batch: bool = False,
        preemptive_threshold: float | None = None,
        num_threads: int | None = None,
        num_sub_threads: int = 1,
        cat_results: str | int | None = None,
        set_truncated: bool = False,
        use_buffers: bool | None = None,
        replay_buffer=None,
        extend_buffer: bool = True,
        local_init_rb: bool | None = None,
        trust_policy: bool | None = None,
        compile_policy=None,
        cudagraph_policy=None,
        no_cuda_sync: bool = False,
        weight_updater=None,
        weight_sync_schemes: dict | None = None,
        weight_recv_schemes: dict | None = None,
        track_policy_version: Any = False,
        worker_idx: int | None = None,
        sync: bool | None = None,
        worker_timeout: float = DEFAULT_WORKER_TIMEOUT,
        max_worker_restarts: int = 0,
        restart_delay: float = 0.0,
        preemption_grace: float = 5.0,
        mp_start_method: str | None = None,
        pre_collect_hook: Callable[[], None] | None = None,
        post_collect_hook: Callable[[TensorDictBase], None] | None = None,
        trajs_per_batch: int | None = None,
        trajs_per_write: int | None = None,
        replay_write_mode: str | None = None,
        traj_format: str | None = None,
        track_traj_ids: bool = True,
        compact_obs: bool = False,
        init_fn: Callable[[], None] | None = None,
        auto_register_policy_transforms: bool | None = None,
        autoscale: Autoscale | None = None,
    ) -> None:
        if isinstance(create_env_fn, (list, tuple)):
            raise TypeError("AsyncCollector takes one env constructor, not a list (use MultiAsyncCollector).")
        if num_workers != 1:
            raise ValueError(f"AsyncCollector runs exactly one worker, got num_workers={num_workers!r}.")
        if autoscale is not None:
            raise ValueError("AsyncCollector runs exactly one worker, so autoscale must be None: use "
                             "MultiAsyncCollector(autoscale=...) for a fleet that sizes itself.")
        frames = FramesPerBatch.parse(frames_per_batch)  # apart from the options: only what sizes batches reads it
        options = WorkerProcessOptions.parse(
            type(self).__name__, sync=False, default_collector=Collector, create_env_fn=[create_env_fn],
            num_workers=None, create_env_kwargs=[create_env_kwargs or {}],
            policy=policy, policy_factory=policy_factory, total_frames=total_frames, device=device,
            storing_device=storing_device, env_device=env_device,
            policy_device=policy_device, collector_class=collector_class,
            max_frames_per_traj=max_frames_per_traj, init_random_frames=init_random_frames,
            reset_at_each_iter=reset_at_each_iter, postproc=postproc, split_trajs=split_trajs,
            exploration_type=exploration_type, reset_when_done=reset_when_done,
            update_at_each_batch=update_at_each_batch, preemptive_threshold=preemptive_threshold,
            num_threads=num_threads, num_sub_threads=num_sub_threads, cat_results=cat_results,
            set_truncated=set_truncated, use_buffers=use_buffers, replay_buffer=replay_buffer,
            extend_buffer=extend_buffer, local_init_rb=local_init_rb, trust_policy=trust_policy,
            compile_policy=compile_policy, cudagraph_policy=cudagraph_policy, no_cuda_sync=no_cuda_sync,
            weight_updater=weight_updater, weight_sync_schemes=weight_sync_schemes,
            weight_recv_schemes=weight_recv_schemes, track_policy_version=track_policy_version,
            worker_idx=worker_idx, worker_timeout=worker_timeout, max_worker_restarts=max_worker_restarts,
            restart_delay=restart_delay, preemption_grace=preemption_grace, mp_start_method=mp_start_method,
            pre_collect_hook=pre_collect_hook, post_collect_hook=post_collect_hook,
            trajs_per_batch=trajs_per_batch, trajs_per_write=trajs_per_write, traj_format=traj_format,
            replay_write_mode=replay_write_mode,
            track_traj_ids=track_traj_ids, compact_obs=compact_obs, init_fn=init_fn,
            auto_register_policy_transforms=auto_register_policy_transforms, autoscale=autoscale)
        self._build(options, options.worker_shares(frames))
