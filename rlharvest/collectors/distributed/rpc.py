"""RPCCollector: nodes driven over torch.distributed.rpc (TensorPipe).

Its nodes are the workers of the ``rpc`` backend (``rlharvest.transport.rpc``): they run the worker loop
in pull mode (one RPC per command) and receive weights through RPCWeightSyncScheme. A face over
:class:`~rlharvest.collectors.engine.engine.CollectionEngine`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ...config_views import BatchShares, FramesPerBatch
from ...policies import ExplorationType
from .. import _workers
from ..base import BaseCollector
from ..engine.engine import CollectionEngine
from ..engine.extras import RPCReferences
from ..options.autoscale import Autoscale
from ..options.rpc import RPCOptions
from ..single import Collector
from . import _node_api

__all__ = ["RPCCollector"]


class RPCCollector(BaseCollector):
    """Collect with one node per env constructor, commanded over torch RPC.

    Takes DistributedCollector's arguments except ``update_interval``, plus:

    Keyword Args:
        visible_devices: one device per node (device map for tensors sent to that node).
        tensorpipe_options: merged over ``{"num_worker_threads": 16, "rpc_timeout": 10000,
            "_transports": ["uv"]}``.
        trajs_per_batch, trajs_per_write, traj_format: batches of complete trajectories, assembled on
            this process from the nodes' batches, as :class:`~rlharvest.collectors.Collector` does
            (docs/trajectories.md).

    ``bind_address`` is where the store listens (DistributedCollector's default: loopback with
    ``"mp"``, where TensorPipe listens on loopback too). torch RPC authenticates nobody, whatever the
    address: see docs/security.md before exposing its ports.

    Remote references to the node collectors are in ``collector_rrefs`` (``collector_infos``
    holds their RPC worker infos), e.g. to attach an ``RPCWeightUpdater``.

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> collector = RPCCollector([CountingEnv] * 2, frames_per_batch=10, total_frames=20,
        ...                          launcher="mp", sync=True)                   # doctest: +SKIP
        >>> [tuple(b.shape) for b in collector]                                  # doctest: +SKIP
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
        sync: bool = False,
        slurm_kwargs: dict | None = None,
        backend: str = 'gloo',
        update_after_each_batch: bool = False,
        max_weight_update_interval: int = -1,
        launcher: str = 'submitit',
        tcp_port: int | None = None,
        visible_devices: Sequence | None = None,
        tensorpipe_options: dict | None = None,
        trajs_per_batch: int | None = None,
        trajs_per_write: int | None = None,
        traj_format: str | None = None,
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
        mp_start_method: str | None = None,
        bind_address: str | None = None,
        autoscale: Autoscale | None = None,
    ) -> None:
        frames = FramesPerBatch.parse(frames_per_batch)  # apart from the options: only what sizes batches reads it
        options = RPCOptions.parse(
            type(self).__name__, collector_classes=_node_api.NODE_CLASSES,
            create_env_fn=create_env_fn, policy=policy, policy_factory=policy_factory,
            total_frames=total_frames, device=device,
            storing_device=storing_device, env_device=env_device, policy_device=policy_device,
            max_frames_per_traj=max_frames_per_traj, init_random_frames=init_random_frames,
            reset_at_each_iter=reset_at_each_iter, postproc=postproc, split_trajs=split_trajs,
            exploration_type=exploration_type, collector_class=collector_class,
            collector_kwargs=collector_kwargs, num_workers_per_collector=num_workers_per_collector,
            sync=sync, slurm_kwargs=slurm_kwargs, backend=backend,
            update_after_each_batch=update_after_each_batch,
            max_weight_update_interval=max_weight_update_interval, launcher=launcher, tcp_port=tcp_port,
            visible_devices=visible_devices, tensorpipe_options=tensorpipe_options,
            trajs_per_batch=trajs_per_batch, trajs_per_write=trajs_per_write, traj_format=traj_format,
            weight_updater=weight_updater, weight_sync_schemes=weight_sync_schemes,
            weight_recv_schemes=weight_recv_schemes, replay_buffer=replay_buffer,
            track_policy_version=track_policy_version, worker_timeout=worker_timeout,
            heartbeat_timeout=heartbeat_timeout, max_worker_restarts=max_worker_restarts,
            restart_delay=restart_delay, preemption_grace=preemption_grace, mp_start_method=mp_start_method,
            bind_address=bind_address, autoscale=autoscale
        )
        self._build(options, options.worker_shares(frames))

    # ------------------------------------------------------------------ every collector with workers (``_workers.py``)
    def _build(self, options: RPCOptions, shares: BatchShares) -> None:
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
    slurm_kwargs = _node_api.slurm_kwargs
    tcp_port = _node_api.tcp_port
    visible_devices = _node_api.visible_devices
    tensorpipe_options = _node_api.tensorpipe_options

    @property
    def collector_rrefs(self) -> list:
        """A remote reference to each node's collector (e.g. for an ``RPCWeightUpdater``), in node order."""
        return self._engine.extra(RPCReferences).rrefs

    @property
    def collector_infos(self) -> list:
        """The RPC worker info of each node, in node order."""
        return self._engine.extra(RPCReferences).infos
