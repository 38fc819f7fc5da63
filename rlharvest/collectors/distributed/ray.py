"""RayCollector: one Ray actor per env constructor, each running the worker loop around its own collector.

The actors are the workers of the ``ray`` backend (``rlharvest.transport.ray``); weights go through
RayWeightSyncScheme (docs/ray.md). Everything else is the engine's
(:class:`~rlharvest.collectors.engine.engine.CollectionEngine`): trajectory ids, automatic weight
pushes, ``start()``/``pause()`` into a replay buffer, actors that join and leave (docs/elastic.md).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

from ...config_views import BatchShares, FramesPerBatch
from ...policies import ExplorationType
from ...protocol import Command
from ...transport.ray import ensure_ray, require_ray
from .. import _workers
from ..base import BaseCollector
from ..engine.engine import CollectionEngine
from ..engine.checkpoint import as_actor_list, from_actor_list
from ..options.autoscale import Autoscale
from ..options.ray import RayOptions
from ..single import Collector
from . import _node_api

__all__ = ["RayCollector"]


class RayCollector(BaseCollector):
    """Collect with one Ray actor per entry of ``create_env_fn``.

    Takes DistributedCollector's arguments except those saying where nodes run (``launcher``,
    ``backend``, ``tcp_port``, ``slurm_kwargs``, ...), plus:

    Keyword Args:
        ray_init_config: ``ray.init`` arguments, used only when Ray is not initialised yet.
        remote_configs: ``ray.remote`` options of each actor (one dict, or one per collector);
            default ``{"num_cpus": 1}``, which fits any machine, GPU or not.
        num_collectors: how many actors; a single ``create_env_fn``, ``collector_kwargs`` or
            ``remote_configs`` is then repeated for each.
        trust_policy, no_cuda_sync, trajs_per_batch, traj_format, pre_collect_hook, post_collect_hook:
            forwarded to every actor's collector (``traj_format`` is rlharvest's addition, as
            RPCCollector's: without it ``trajs_per_batch`` warns that its default will change).
        replay_write_mode, trajs_per_write: what goes to ``replay_buffer``: ``"trajectory"`` complete
            trajectories only (``trajs_per_write`` per ``extend``), ``"rollout"`` every batch whole;
            None: ``"trajectory"`` with ``trajs_per_batch``, else ``"rollout"`` (TorchRL's next
            release; docs/trajectories.md). Trajectories are assembled on this process from the
            actors' batches.
        use_env_creator: accepted for compatibility (env constructors travel through Ray as they are).

    Batches: ``sync=True`` stacks one rollout of every actor, in actor order; ``sync=False`` yields
    the first ready. ``replay_buffer`` with :meth:`start`: actors collect continuously and this
    process writes their batches into the buffer (any buffer, including one that is a Ray actor).
    Iteration shuts the collector down once ``total_frames`` are collected, as TorchRL's does.

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> collector = RayCollector([CountingEnv] * 2, frames_per_batch=8, total_frames=16,
        ...                          sync=True)                              # doctest: +SKIP
        >>> [tuple(b.shape) for b in collector]                              # doctest: +SKIP
        [(2, 4), (2, 4)]
    """

    def __init__(
        self,
        create_env_fn: Sequence[Callable],
        policy: Callable | None = None,
        *,
        policy_factory: Callable | Sequence[Callable] | None = None,
        frames_per_batch: int,
        total_frames: int = -1,
        device=None,
        storing_device=None,
        env_device=None,
        policy_device=None,
        max_frames_per_traj: int = -1,
        init_random_frames: int = -1,
        reset_at_each_iter: bool = False,
        postproc: Callable | None = None,
        split_trajs: bool = False,
        exploration_type=ExplorationType.RANDOM,
        collector_class: Any = Collector,
        collector_kwargs: dict | Sequence[dict] | None = None,
        num_workers_per_collector: int = 1,
        sync: bool = False,
        ray_init_config: dict | None = None,
        remote_configs: dict | list[dict] | None = None,
        num_collectors: int | None = None,
        update_after_each_batch: bool = False,
        max_weight_update_interval: int = -1,
        weight_updater=None,
        weight_sync_schemes: dict | None = None,
        weight_recv_schemes: dict | None = None,
        replay_buffer=None,
        track_policy_version: Any = False,
        worker_timeout: float = 120.0,
        heartbeat_timeout: float = 10.0,
        max_worker_restarts: int = 0,
        restart_delay: float = 0.0,
        preemption_grace: float = 5.0,
        trust_policy: bool | None = None,
        use_env_creator: bool = False,
        no_cuda_sync: bool | None = None,
        trajs_per_batch: int | None = None,
        trajs_per_write: int | None = None,
        replay_write_mode: str | None = None,
        traj_format: str | None = None,
        pre_collect_hook=None,
        post_collect_hook=None,
        autoscale: Autoscale | None = None,
    ) -> None:
        frames = FramesPerBatch.parse(frames_per_batch)  # apart from the options: only what sizes batches reads it
        options = RayOptions.parse(
            type(self).__name__, collector_classes=_node_api.NODE_CLASSES,
            create_env_fn=create_env_fn, policy=policy, policy_factory=policy_factory,
            total_frames=total_frames, device=device,
            storing_device=storing_device, env_device=env_device, policy_device=policy_device,
            max_frames_per_traj=max_frames_per_traj, init_random_frames=init_random_frames,
            reset_at_each_iter=reset_at_each_iter, postproc=postproc, split_trajs=split_trajs,
            exploration_type=exploration_type, collector_class=collector_class,
            collector_kwargs=collector_kwargs, num_workers_per_collector=num_workers_per_collector,
            sync=sync, ray_init_config=ray_init_config, remote_configs=remote_configs,
            num_collectors=num_collectors, update_after_each_batch=update_after_each_batch,
            max_weight_update_interval=max_weight_update_interval, weight_updater=weight_updater,
            weight_sync_schemes=weight_sync_schemes, weight_recv_schemes=weight_recv_schemes,
            replay_buffer=replay_buffer, track_policy_version=track_policy_version,
            worker_timeout=worker_timeout, heartbeat_timeout=heartbeat_timeout,
            max_worker_restarts=max_worker_restarts, restart_delay=restart_delay,
            preemption_grace=preemption_grace, trust_policy=trust_policy, use_env_creator=use_env_creator,
            no_cuda_sync=no_cuda_sync, trajs_per_batch=trajs_per_batch, trajs_per_write=trajs_per_write,
            replay_write_mode=replay_write_mode, traj_format=traj_format, pre_collect_hook=pre_collect_hook, post_collect_hook=post_collect_hook, autoscale=autoscale
        )
        self._build(options, options.worker_shares(frames))

    # ------------------------------------------------------------------ every collector with workers (``_workers.py``)
    worker_pids = _workers.worker_pids
    num_workers = _workers.num_workers
    active_workers = _workers.active_workers
    restart_causes = _workers.restart_causes
    remove_collectors = _workers.remove_collectors

    # ------------------------------------------------------------------ every collector with nodes (``_node_api.py``)
    policy = _node_api.policy
    policy_factory = _node_api.policy_factory
    policy_weights = _node_api.policy_weights
    collector_class = _node_api.collector_class
    collector_kwargs = _node_api.collector_kwargs
    num_workers_per_collector = _node_api.num_workers_per_collector
    update_after_each_batch = _node_api.update_after_each_batch
    max_weight_update_interval = _node_api.max_weight_update_interval
    push_legacy_weights = _node_api.push_legacy_weights

    def _build(self, options: RayOptions, shares: BatchShares) -> None:
        ensure_ray(options.ray_init_config)
        self._engine = CollectionEngine(options, shares, self)  # the face holds it while the workers start
        self._engine.start()

    # ------------------------------------------------------------------ TorchRL's Ray API
    @property
    def num_collectors(self) -> int:
        return len(self._engine.fleet)

    @property
    def remote_collectors(self) -> list:
        """The Ray actor handles of the workers, in worker order (each runs one collector); None in the
        slot of an actor that left (``remove_collectors``, preempted and not replaced)."""
        return [getattr(handle, "actor", None) for handle in self._engine.fleet.handles()]

    def local_policy(self):
        """The policy of this process (the source of the actors' weights)."""
        return self.policy

    def stop_remote_collectors(self) -> None:
        """Stop every actor (the collector cannot collect afterwards)."""
        self.shutdown()

    def add_collectors(self, create_env_fn: Callable | Sequence[Callable], num_envs: int | None = None,
                       policy: Any = None, collector_kwargs: dict | Sequence[dict] | None = None,
                       remote_configs: dict | Sequence[dict] | None = None) -> None:
        """Add one actor per entry of ``create_env_fn`` to the running collector.

        The new actors take the indices after the others (``W``, ``W + 1``, ...), start on the weights
        of the last update and the current policy version, with seeds that continue the chain of the
        last :meth:`set_seed`, and share the collector's restart budget. From the next batch on they
        collect like the others: with ``sync=True`` each adds one rollout of ``frames_per_batch / W``
        frames (the share fixed at construction) to every batch, so batches grow to
        ``(W', frames_per_batch / W)`` and ``requested_frames_per_batch`` with them; with
        ``sync=False`` each yields batches of ``frames_per_batch`` frames. Trajectory ids stay unique
        across every actor, old and new (docs/ray.md, "Adding actors").

        Args:
            create_env_fn: an env constructor, or a list of them (one per new actor).
            num_envs: envs per new actor: 1 with ``collector_class="single"``, else how many
                sub-workers its collector runs (default: ``num_workers_per_collector``).
            policy: None or this collector's policy (``local_policy()``), or a list of those, one per
                new actor: every actor runs the weights this collector sends.
            collector_kwargs: a dict for every new actor's collector, or one dict per new actor.
            remote_configs: the new actors' ``ray.remote`` options (a dict for all, or one per new
                actor; default ``{"num_cpus": 1}``).

        Raises:
            ValueError: for an argument that does not fit (named in the message).
            RuntimeError: after shutdown, while running free (:meth:`start`), or from inside the
                collector's own iteration (a ``postproc``, another thread).
            WorkerError: naming a new actor that failed to start (the new actors are then stopped;
                the collector goes on with the others).

        Example:
            >>> collector = RayCollector([CountingEnv], frames_per_batch=4, sync=True)   # doctest: +SKIP
            >>> collector.add_collectors([CountingEnv])                                 # doctest: +SKIP
            >>> collector.num_collectors, collector.requested_frames_per_batch          # doctest: +SKIP
            (2, 8)
        """
        self._open("add_collectors()").add_workers(create_env_fn, num_envs, policy, collector_kwargs, remote_configs)

    # ------------------------------------------------------------------ state (TorchRL's list of actor states)
    def state_dict(self, *, env_state: bool = True) -> list[dict]:
        """One state dict per actor, in actor order, as TorchRL's; the first also holds, under
        ``"rlharvest_collector"``, this collector's own part (counters, layout, seeds, trajectory-id map,
        batches not yielded yet, replay buffer): the list is a complete checkpoint that
        :meth:`load_state_dict` continues exactly (docs/checkpoints.md).

        Args:
            env_state: False leaves the envs' states and the episodes in flight out.
        """
        return as_actor_list(super().state_dict(env_state=env_state), self.active_workers)

    def load_state_dict(self, state_dict: dict | list[dict], **kwargs) -> None:
        """Continue from :meth:`state_dict`'s list (exactly, as every collector), or load TorchRL's: one
        state dict into every actor, or the ``i``-th of a list into actor ``i`` (counters and weights; the
        collector's counters stay).

        Raises:
            ValueError: for a list that does not hold one state dict per actor.
            CheckpointMismatchError: for a checkpoint of a newer format or of other arguments.
        """
        engine = self._open("load_state_dict()")
        states = list(state_dict) if isinstance(state_dict, (list, tuple)) else [state_dict] * self.num_workers
        if len(states) != self.num_workers:
            raise ValueError(f"load_state_dict takes one state dict or {self.num_workers} (one per actor), "
                             f"got {len(states)}.")
        full = from_actor_list(states, self.active_workers) if isinstance(state_dict, (list, tuple)) else None
        if full is not None:
            super().load_state_dict(full)
            return
        engine.loop.drain()
        for worker, state in enumerate(states):
            raised = engine.fleet.requests.request(worker, Command.LOAD_STATE_DICT, state)
            for category, message in raised or ():  # an actor's episode that restarts (docs/checkpoints.md)
                warnings.warn(message, category, stacklevel=2)

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, timeout: float | None = None, shutdown_ray: bool = False, close_env: bool = True,
                 raise_on_error: bool = True) -> None:
        """Stop the actors (idempotent); with ``shutdown_ray``, shut Ray down too (every actor of the
        cluster's session goes with it, replay buffers included)."""
        try:
            super().shutdown(timeout=timeout, close_env=close_env, raise_on_error=raise_on_error)
        finally:
            if shutdown_ray:
                require_ray().shutdown()

    def async_shutdown(self, timeout: float | None = None, close_env: bool = True, shutdown_ray: bool = False) -> None:
        """Stop a collector started with :meth:`start` (a plain method). TorchRL's positional
        ``async_shutdown(shutdown_ray)`` is understood: a bool first argument is ``shutdown_ray``."""
        if isinstance(timeout, bool):
            timeout, shutdown_ray = None, timeout
        self.shutdown(timeout=timeout, shutdown_ray=shutdown_ray, close_env=close_env)
