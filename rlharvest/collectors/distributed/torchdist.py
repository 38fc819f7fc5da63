"""DistributedCollector: one node per env constructor, each with a torch.distributed group of its own.

The main process is rank 0, node ``i`` is rank ``i + 1``; the nodes are the workers of the ``torchdist``
backend (``rlharvest.transport.torchdist``), started through its launchers. Nodes run the worker loop
around their own collector (``collector_class``); batches come back as flat tensors over each node's
group, commands and replies travel on a TCP channel per node, weights through
DistributedWeightSyncScheme. A face over :class:`~rlharvest.collectors.engine.engine.CollectionEngine`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ...config_views import BatchShares, FramesPerBatch
from ...policies import ExplorationType
from .. import _workers
from ..base import BaseCollector
from ..engine.engine import CollectionEngine
from ..options.autoscale import Autoscale
from ..options.torchdist import TorchDistOptions
from ..single import Collector
from . import _node_api

__all__ = ["DistributedCollector"]


class DistributedCollector(BaseCollector):
    """Collect with one node per entry of ``create_env_fn``, over a torch.distributed process group.

    Args:
        create_env_fn: list of env constructors (or envs), one per node.
        policy: the policy run on every node, and the main-side source of weights.

    Keyword Args:
        policy_factory: callable or list of callables building the policy on the nodes.
        frames_per_batch: frames per yielded batch (split across nodes when ``sync=True``).
        total_frames: -1 (default) for endless.
        device, storing_device, env_device, policy_device: node devices (scalar or one per node).
        max_frames_per_traj, init_random_frames, reset_at_each_iter, exploration_type: forwarded.
        postproc, split_trajs: applied on the main process.
        collector_class: ``"single"``, ``"sync"``, ``"async"`` or a collector class run on each node.
        collector_kwargs: dict, or one dict per node, of extra arguments for the node collectors.
        num_workers_per_collector: env copies (sub-workers) per node for multi-process node classes.
        sync: stack one rollout of every node per batch (True) or serve the first ready (False).
        slurm_kwargs: merged over ``DEFAULT_SLURM_CONF`` for the submitit launcher.
        backend: ``"gloo"`` (default), ``"nccl"``, ``"mpi"`` or ``"ucc"``.
        update_after_each_batch: push weights before every request (sync) / re-launch (async).
        max_weight_update_interval: force an update of a node after this many batches without one.
        update_interval: push the main policy's weights every this many batches.
        launcher: ``"mp"``, ``"submitit"`` (default), ``"submitit_delayed"``, or ``"external"``: no
            node is started, nodes join from anywhere with :meth:`join_command` (docs/elastic.md).
        tcp_port: base port (``p``, ``p+1``, ``p+2`` are used), an int in 1..65533; 0 picks free
            ports (not with ``"submitit_delayed"``); default ``$TCP_PORT`` or 10003.
        weight_updater: legacy updater (exclusive with ``weight_sync_schemes``).
        weight_sync_schemes: ``{model_id: scheme}``; default ``{"policy": DistributedWeightSyncScheme()}``.
        weight_recv_schemes: schemes through which this collector itself receives weights.
        track_policy_version: every frame carries ``"policy_version"``, the version of the weights
            that collected it (the nodes count the updates they apply; docs/weights.md).
        worker_timeout: seconds a node may go without answering or progressing (TimeoutError).
        heartbeat_timeout: seconds without a heartbeat before a node is declared dead.
        max_worker_restarts: failed nodes replaced (a new node through the same launcher) before a
            failure raises; 0 (default): the first failure raises ``WorkerError``. docs/restarts.md.
        restart_delay: seconds to wait before a failed node's replacement starts.
        preemption_grace: seconds a node that receives SIGTERM has to finish its rollout before it
            hands it back and leaves: a leave, not a failure (docs/elastic.md; SLURM: ``--signal``).
        mp_start_method: start method of ``"mp"`` nodes (platform default).
        bind_address: local address the collector's sockets listen on. Default: 127.0.0.1 with
            ``"mp"``, else the address this host's name resolves to (the one nodes are told);
            ``"0.0.0.0"`` listens on every interface. See docs/security.md.
        authkey: the collector's key (bytes or hex, 16+ bytes of 8+ distinct values), every node
            key derives from it. Default: ``$RLHARVEST_AUTHKEY``, else a fresh one;
            ``"submitit_delayed"`` needs one of the two.
        handshake_timeout: seconds a connecting peer has to authenticate and send its hello (it
            must prove its key within 2 s of them; strangers are dropped).
        autoscale: an :class:`~rlharvest.collectors.Autoscale`: the fleet sizes itself while collecting
            (docs/elastic.md, "Autoscaling"; with ``"external"``, through ``Autoscale(on_scale=...)``).

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> collector = DistributedCollector([CountingEnv] * 2, frames_per_batch=10, total_frames=20,
        ...                                  launcher="mp", sync=True)           # doctest: +SKIP
        >>> [tuple(b.shape) for b in collector]                                   # doctest: +SKIP
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
        update_interval: int | None = None,
        launcher: str = 'submitit',
        tcp_port: int | None = None,
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
        authkey: bytes | str | None = None,
        handshake_timeout: float = 5.0,
        autoscale: Autoscale | None = None,
    ) -> None:
        frames = FramesPerBatch.parse(frames_per_batch)  # apart from the options: only what sizes batches reads it
        options = TorchDistOptions.parse(
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
            max_weight_update_interval=max_weight_update_interval, update_interval=update_interval,
            launcher=launcher, tcp_port=tcp_port, weight_updater=weight_updater,
            weight_sync_schemes=weight_sync_schemes, weight_recv_schemes=weight_recv_schemes,
            replay_buffer=replay_buffer, track_policy_version=track_policy_version,
            worker_timeout=worker_timeout, heartbeat_timeout=heartbeat_timeout,
            max_worker_restarts=max_worker_restarts, restart_delay=restart_delay,
            preemption_grace=preemption_grace, mp_start_method=mp_start_method, bind_address=bind_address,
            authkey=authkey, handshake_timeout=handshake_timeout, autoscale=autoscale
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

