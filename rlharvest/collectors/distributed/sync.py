"""DistributedSyncCollector: always synchronous, free-running nodes (docs/collection.md).

Nodes collect continuously and push every batch to the main process without waiting for instructions;
each yielded batch stacks the next batch of every node (``(W, ...)``), so nodes collect the next one
while the caller trains. Weights (when the policy is a module) are pushed without waiting before
batches 0, k, 2k, ... (k = ``update_interval``). ``update_policy_weights_``, ``set_seed`` and
checkpoints are refused (as TorchRL does): the nodes never stand still.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ...config_views import BatchShares, FramesPerBatch
from ...policies import ExplorationType
from .. import _workers
from ..base import BaseCollector
from ..engine.engine import CollectionEngine
from ..options.torchdist import TorchDistOptions
from ..single import Collector
from . import _node_api

__all__ = ["DistributedSyncCollector"]


class DistributedSyncCollector(BaseCollector):
    """Synchronous collection from free-running nodes over a torch.distributed process group.

    Takes DistributedCollector's arguments except ``sync``, ``update_after_each_batch`` and the
    weight updater/scheme arguments; ``update_interval`` defaults to 1. ``frames_per_batch`` and
    ``total_frames`` (unless -1, endless) must be divisible by the number of nodes.

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> collector = DistributedSyncCollector([CountingEnv] * 2, frames_per_batch=10,
        ...                                      total_frames=20, launcher="mp")    # doctest: +SKIP
        >>> [tuple(b.shape) for b in collector]                                      # doctest: +SKIP
        [(2, 5), (2, 5)]
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
        slurm_kwargs: dict | None = None,
        backend: str = 'gloo',
        max_weight_update_interval: int = -1,
        update_interval: int | None = 1,
        launcher: str = 'submitit',
        tcp_port: int | None = None,
        track_policy_version: Any = False,
        worker_timeout: float = 120.0,
        heartbeat_timeout: float = 10.0,
        max_worker_restarts: int = 0,
        restart_delay: float = 0.0,
        preemption_grace: float = 5.0,
        mp_start_method: str | None = None,
        bind_address: str | None = None,
        authkey: bytes | str | None = None,
        handshake_timeout: float = 5.0,
    ) -> None:
        frames = FramesPerBatch.parse(frames_per_batch)  # apart from the options: only what sizes batches reads it
        options = TorchDistOptions.parse_free_running(
            type(self).__name__, collector_classes=_node_api.NODE_CLASSES,
            create_env_fn=create_env_fn, policy=policy, policy_factory=policy_factory,
            total_frames=total_frames, device=device,
            storing_device=storing_device, env_device=env_device, policy_device=policy_device,
            max_frames_per_traj=max_frames_per_traj, init_random_frames=init_random_frames,
            reset_at_each_iter=reset_at_each_iter, postproc=postproc, split_trajs=split_trajs,
            exploration_type=exploration_type, collector_class=collector_class,
            collector_kwargs=collector_kwargs, num_workers_per_collector=num_workers_per_collector,
            slurm_kwargs=slurm_kwargs, backend=backend,
            max_weight_update_interval=max_weight_update_interval, update_interval=update_interval,
            launcher=launcher, tcp_port=tcp_port, track_policy_version=track_policy_version,
            worker_timeout=worker_timeout, heartbeat_timeout=heartbeat_timeout,
            max_worker_restarts=max_worker_restarts, restart_delay=restart_delay,
            preemption_grace=preemption_grace, mp_start_method=mp_start_method, bind_address=bind_address,
            authkey=authkey, handshake_timeout=handshake_timeout
        )
        self._build(options, options.worker_shares(frames))

    # ------------------------------------------------------------------ every collector with workers (``_workers.py``)
    def _build(self, options: TorchDistOptions, shares: BatchShares) -> None:
        self._engine = CollectionEngine(options, shares, self)  # the face holds it while the workers start
        self._engine.start()

    worker_pids = _workers.worker_pids
    num_workers = _workers.num_workers
    active_workers = _workers.active_workers
    restart_causes = _workers.restart_causes
    remove_collectors = _workers.remove_collectors
    add_collectors = _workers.add_collectors

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
    update_interval = _node_api.update_interval
    launcher = _node_api.launcher
    backend = _node_api.backend
    slurm_kwargs = _node_api.slurm_kwargs
    tcp_port = _node_api.tcp_port
    join_command = _node_api.join_command

