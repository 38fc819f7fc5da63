"""DistributedCollector: one node per env constructor, each with a torch.distributed group of its own.

The main process is rank 0, node ``i`` is rank ``i + 1``; the nodes are the workers of the
``torchdist`` backend (``rlharvest.transport.torchdist``), started through its launchers. Nodes run
the worker loop around their own collector (``collector_class``); batches come back as flat tensors
over each node's group, commands and replies travel on a TCP channel per node, weights through
DistributedWeightSyncScheme. All of the collector logic (sync/async iteration, weights, seeds,
profiling, shutdown) is the one of :class:`~rlharvest.collectors.remote.RemoteCollectorBase`.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Callable, Sequence

import torch
from tensordict import TensorDictBase

from ...config import CollectorConfig
from ...errors import WorkerError
from ...policies import ExplorationType
from ...protocol import Command, WorkerSpec
from ...transport.base import Backend
from ...transport.rendezvous import check_backend
from ...transport.torchdist import TorchDistBackend
from ...weight_update.schemes import WeightSyncScheme
from ...worker.nodes import node_main
from .. import _worker_args as setup
from .._fleet import Fleet
from .._restarts import RestartPolicy
from .._traj_ids import TrajIdMap
from ..base import BaseCollector
from ..remote import RemoteCollectorBase, valid_part
from ..single import Collector
from ._network import NetworkConfig
from ._pushed_batches import PushedBatchReceiver
from .launchers import DEFAULT_SLURM_CONF, LAUNCHERS

__all__ = ["DistributedCollector", "resolve_collector_class"]

_NON_MODULE_POLICY = ("The policy is not an nn.Module and no policy_factory was given: "
                      "update_policy_weights_ will be a no-op.")
_IDS = ("collector", "traj_ids")


def resolve_collector_class(collector_class: Any) -> type:
    """``"single"``, ``"sync"``, ``"async"`` or a class (an unknown string raises ValueError)."""
    from ..multi import MultiAsyncCollector, MultiSyncCollector

    names = {"single": Collector, "sync": MultiSyncCollector, "async": MultiAsyncCollector}
    if isinstance(collector_class, str):
        if collector_class not in names:
            raise ValueError(f"collector_class must be one of {sorted(names)} or a collector class, "
                             f"got {collector_class!r}")
        return names[collector_class]
    if collector_class is None:
        return Collector
    if not callable(collector_class):
        raise ValueError(f"collector_class must be a class or one of {sorted(names)}, got {collector_class!r}")
    return collector_class


class DistributedCollector(RemoteCollectorBase):
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
        launcher: ``"mp"``, ``"submitit"`` (default) or ``"submitit_delayed"``.
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
        mp_start_method: start method of ``"mp"`` nodes (platform default).
        bind_address: local address the collector's sockets listen on. Default: 127.0.0.1 with
            ``"mp"``, else the address this host's name resolves to (the one nodes are told);
            ``"0.0.0.0"`` listens on every interface. See docs/security.md.
        authkey: the key nodes must prove they hold (bytes or hex, 16+ bytes). Default:
            ``$RLHARVEST_AUTHKEY``, else a fresh one; ``"submitit_delayed"`` needs one of the two.
        handshake_timeout: seconds a connecting peer has to authenticate (strangers are dropped).

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> collector = DistributedCollector([CountingEnv] * 2, frames_per_batch=10, total_frames=20,
        ...                                  launcher="mp", sync=True)           # doctest: +SKIP
        >>> [tuple(b.shape) for b in collector]                                   # doctest: +SKIP
        [(2, 5), (2, 5)]
    """

    noun = "node"
    #: nodes get a stateless policy and receive its weights from the scheme's initial sync
    _stateless_nodes = True
    #: RPCCollector's trajs_per_batch / trajs_per_write / traj_format (assembled on this process)
    _trajectory_options: dict = {}
    #: whether the constructor returns only once every node is built
    _wait_until_built = True

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
        backend: str = "gloo",
        update_after_each_batch: bool = False,
        max_weight_update_interval: int = -1,
        update_interval: int | None = None,
        launcher: str = "submitit",
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
        mp_start_method: str | None = None,
        bind_address: str | None = None,
        authkey: bytes | str | None = None,
        handshake_timeout: float = 5.0,
    ) -> None:
        arguments = dict(locals())  # first: the arguments only (CollectorConfig takes its fields from them)
        self._closed = True
        self._setup(arguments)
        self._closed = False
        if weight_recv_schemes is not None:
            self.register_scheme_receiver(weight_recv_schemes)

    # ------------------------------------------------------------------ construction
    def _setup(self, arguments: dict) -> None:
        create_env_fn = arguments["create_env_fn"]
        if not isinstance(create_env_fn, (list, tuple)) or not create_env_fn:
            raise TypeError("create_env_fn must be a non-empty list of env constructors, one per node.")
        self.env_constructors = list(create_env_fn)
        count = len(self.env_constructors)
        self._sync = bool(arguments["sync"])
        self.config = config = CollectorConfig.from_arguments({**arguments, **self._trajectory_options})
        self._check_arguments(count, arguments)
        self._frames_per_node = config.split_frames(count, "exact" if self._sync else "whole")[0]
        config.check_workers(count)
        self.collector_class = resolve_collector_class(arguments["collector_class"])
        self.num_workers_per_collector = self._check_sub_workers(arguments["num_workers_per_collector"])
        self.update_after_each_batch = bool(arguments["update_after_each_batch"])
        self.max_weight_update_interval = int(arguments["max_weight_update_interval"])
        self.update_interval = arguments["update_interval"]
        # Take a node's batch, yield it, (update), then re-launch that node: weights the caller
        # changed before the next batch reach the node before it collects again (docs/weights.md).
        self._relaunch_after_yield = True
        self._setup_transport(arguments)
        self.collector_kwargs = self._node_kwargs(arguments["collector_kwargs"], count)
        self.policy = arguments["policy"]
        factory = arguments["policy_factory"]
        self.policy_factory = setup.per_worker(factory, count, "policy_factory") if factory else None
        self.policy_weights = self._main_weights(self.policy)
        self._batches_since_update = [0] * count
        self._traj_ids = TrajIdMap(count)
        self._yielded = 0
        self._worker_idx = None
        self._version_tracker = self._track_versions(arguments["collector_kwargs"])
        self._backend = self._make_backend(count)
        self._setup_schemes(arguments["weight_updater"], arguments["weight_sync_schemes"])
        self._start_nodes(count)

    def _setup_transport(self, arguments: dict) -> None:
        """Where nodes run and how they are reached (launcher, process-group backend, network)."""
        self.backend, self.launcher = arguments["backend"], arguments["launcher"]
        self._net = net = self._network(arguments)
        self.tcp_port = str(net.tcp_port)
        self._worker_timeout, self._heartbeat_timeout = net.worker_timeout, net.heartbeat_timeout
        self.slurm_kwargs = {**DEFAULT_SLURM_CONF, **(arguments["slurm_kwargs"] or {})}
        self._mp_start_method = arguments["mp_start_method"]

    def _check_transport_arguments(self, arguments: dict) -> None:
        launcher = arguments["launcher"]
        if launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {list(LAUNCHERS)}, got {launcher!r}")
        check_backend(arguments["backend"])
        if launcher in ("submitit", "submitit_delayed"):
            try:
                import submitit  # noqa: F401  (only whether it is there)
            except ImportError as err:
                raise ImportError(f"launcher={launcher!r} needs submitit: pip install 'rlharvest[slurm]'") from err

    def _check_arguments(self, count: int, arguments: dict) -> None:
        self._check_transport_arguments(arguments)
        if isinstance(self.config.frames_per_batch, tuple):
            raise TypeError(f"frames_per_batch must be an int for {type(self).__name__} (nodes collect equal "
                            "shares), got a list.")
        if arguments["update_after_each_batch"] and arguments["max_weight_update_interval"] > -1:
            raise RuntimeError("update_after_each_batch and max_weight_update_interval are conflicting instructions.")
        interval = arguments["update_interval"]
        if interval is not None and (not isinstance(interval, int) or interval < 1):
            raise ValueError(f"update_interval must be an int >= 1 (or None), got {interval!r}")
        if arguments["weight_updater"] is not None and arguments["weight_sync_schemes"] is not None:
            raise TypeError("Pass either weight_updater or weight_sync_schemes, not both.")

    def _track_versions(self, collector_kwargs) -> Any:
        """The version tracker: ``track_policy_version``, or the nodes' when given in ``collector_kwargs``."""
        entries = collector_kwargs if isinstance(collector_kwargs, (list, tuple)) else [collector_kwargs or {}]
        return self.config.track_policy_version or any(e.get("track_policy_version") for e in entries) or None

    def _network(self, arguments: dict) -> NetworkConfig:
        return NetworkConfig.parse(
            launcher=arguments["launcher"], tcp_port=arguments["tcp_port"], bind_address=arguments["bind_address"],
            authkey=arguments["authkey"], worker_timeout=arguments["worker_timeout"],
            heartbeat_timeout=arguments["heartbeat_timeout"], handshake_timeout=arguments["handshake_timeout"])

    def _check_sub_workers(self, num_workers_per_collector: int) -> int:
        if self._runs_one_env and num_workers_per_collector != 1:
            raise RuntimeError("num_workers_per_collector must be 1 when the nodes run a single Collector; use "
                               "collector_class='sync' or 'async' for several sub-workers per node.")
        return int(num_workers_per_collector)

    def _node_kwargs(self, collector_kwargs, count: int) -> list[dict]:
        """The node collectors' keyword arguments: the user's ``collector_kwargs``, then this
        collector's own arguments for its nodes (``CollectorConfig.for_worker``)."""
        if isinstance(collector_kwargs, (list, tuple)):
            if len(collector_kwargs) != count:
                raise ValueError(f"collector_kwargs must hold exactly one dict per node ({count}), "
                                 f"got {len(collector_kwargs)}.")
            kwargs = [dict(k) for k in collector_kwargs]
        else:
            kwargs = [dict(collector_kwargs or {}) for _ in range(count)]
        config = self.config
        if not self._sync and config.init_random_frames:
            warnings.warn("init_random_frames with sync=False: each node decides on its own share, so random and "
                          "policy batches may interleave.", stacklevel=4)
        share = config.init_random_frames // count  # a node running free decides alone: its share
        return [{**entry, **config.for_worker(node, init_random_frames=share)} for node, entry in enumerate(kwargs)]

    def _main_weights(self, policy) -> TensorDictBase | None:
        if isinstance(policy, torch.nn.Module):
            from tensordict import TensorDict

            return TensorDict.from_module(policy).data
        if not self.policy_factory and policy is not None:
            warnings.warn(_NON_MODULE_POLICY, stacklevel=4)
        return None

    def _make_backend(self, count: int) -> Backend:
        return TorchDistBackend(count, node_main, self._net, launcher=self.launcher, backend=self.backend,
                                slurm_kwargs=self.slurm_kwargs, start_method=self._mp_start_method)

    def _default_schemes(self, sync: bool) -> dict:
        has_weights = setup.has_weights(self.policy) or self.policy_factory is not None
        scheme_class = WeightSyncScheme.class_for(self._backend.default_scheme())
        return {"policy": scheme_class(backend=self.backend, sync=sync)} if has_weights else {}

    def _setup_schemes(self, weight_updater, schemes) -> None:
        if weight_updater is None and schemes is None:
            schemes = self._default_schemes(sync=True)
        self._legacy = weight_updater is not None
        self._pending_updater = weight_updater
        self._sender_schemes = dict(schemes or {})
        if self._legacy:
            self._sender_schemes = self._default_schemes(sync=True)  # the legacy updater's transport
            self._weight_sync_schemes = None
        else:
            self._weight_sync_schemes = self._sender_schemes

    def _start_nodes(self, count: int) -> None:
        restarts = RestartPolicy(self.config.max_worker_restarts, self.config.restart_delay, self.noun)
        self._fleet = Fleet(self._backend, self._sender_schemes, self._worker_timeout, restarts)
        self._register_live()
        try:
            for model_id, scheme in self._sender_schemes.items():
                scheme.init_on_sender(model_id=model_id, context=self, num_workers=count)
            self._fleet.start([self._node_spec(node) for node in range(count)], wait=self._wait_until_built)
        except BaseException:  # the fleet stopped what it started
            for scheme in self._sender_schemes.values():
                scheme.shutdown()
            raise
        if self._legacy:
            self.weight_updater = self._pending_updater

    def _node_spec(self, node: int) -> WorkerSpec:
        kwargs = dict(self.collector_kwargs[node], frames_per_batch=self._frames_per_node)
        env_fn = self.env_constructors[node]
        if not self._runs_one_env:
            env_fn = [env_fn] * self.num_workers_per_collector
        factory = self.policy_factory[node] if self.policy_factory else None
        policy = None
        if factory is None and self.policy is not None:
            stateless = self._sender_schemes and self._stateless_nodes
            policy = setup.stateless_copy(self.policy) if stateless else self.policy
        return WorkerSpec(worker_idx=node, collector_class=self.collector_class, create_env_fn=env_fn,
                          collector_kwargs=kwargs, policy=policy, policy_factory=factory,
                          weight_recv_schemes=self._sender_schemes or None, num_threads=1,
                          # a node running free decides alone: its share of the random warm-up
                          init_random_frames=self.config.init_random_frames // self.num_workers)

    @property
    def num_workers(self) -> int:
        return len(self.env_constructors)

    @property
    def _runs_one_env(self) -> bool:
        """Each node's collector is a Collector (a subclass too): one env, not a list of them."""
        cls = self.collector_class
        return isinstance(cls, type) and issubclass(cls, Collector)

    @property
    def _launched(self) -> list:
        """How the launcher sees each node (a process, a SLURM job)."""
        return self._backend.launched

    def _replacement_changes(self, worker: int) -> dict:
        # a node counts its own trajectory ids: its replacement starts past every id it handed out
        return {**super()._replacement_changes(worker), "traj_offset": self._traj_ids.next_local(worker)}

    # ------------------------------------------------------------------ collector hooks
    @property
    def requested_frames_per_batch(self) -> int:
        return self.config.frames_per_batch

    def _remap_traj_ids(self, batch: TensorDictBase, worker: int) -> TensorDictBase:
        """Node i's local id k becomes k * W + i (segments after growth: ``_traj_ids.py``); -1 stays -1
        (docs/collection.md, "Trajectory ids")."""
        ids = batch.get(_IDS, None)
        if ids is not None:
            self._traj_ids.map_(ids, worker)
        return batch

    def _nominal_frames(self, reply) -> int:
        return self._frames_per_node

    def _before_sync_batch(self) -> None:
        if self.update_after_each_batch:
            self._push(list(range(self.num_workers)))

    def _before_relaunch(self, worker: int) -> None:
        if self.update_after_each_batch and self._iter >= 0:
            self._push([worker])

    def _after_yield(self, worker: int | None) -> None:
        served = list(range(self.num_workers)) if worker is None else [worker]
        for node in served:
            self._batches_since_update[node] += 1
        self._yielded += 1
        if self._reached_total():
            return
        if self.update_interval and self._yielded % self.update_interval == 0:
            self._push(served)
        if self.max_weight_update_interval >= 0:
            late = [n for n, count in enumerate(self._batches_since_update) if count > self.max_weight_update_interval]
            if late:
                self._push(late)

    def _push(self, workers: list[int]) -> None:
        if self._sender_schemes or self.weight_updater is not None:
            self.update_policy_weights_(worker_ids=workers)

    def update_policy_weights_(self, policy_or_weights: Any = None, *, worker_ids=None, **kwargs) -> None:
        super().update_policy_weights_(policy_or_weights, worker_ids=worker_ids, **kwargs)
        targets = range(self.num_workers) if worker_ids is None else (
            [worker_ids] if isinstance(worker_ids, int) else worker_ids)
        for node in targets:
            if isinstance(node, int) and 0 <= node < self.num_workers:
                self._batches_since_update[node] = 0  # any update of a node resets its counter

    def push_legacy_weights(self, worker: int, weights, wait: bool = True) -> None:
        """Send ``weights`` to node ``worker`` for the legacy ``DistributedWeightUpdater`` (waits for the
        acknowledgement when ``wait``)."""
        scheme = self._sender_schemes.get("policy")
        if scheme is None:
            return
        scheme.sync = wait
        scheme.send(weights=weights, worker_ids=[worker])

    def get_model(self, model_id: str):
        if model_id == "policy":
            return self.policy
        return super().get_model(model_id)

    # ------------------------------------------------------------------ running free
    def start(self) -> None:
        """Nodes collect continuously and push every batch; the main process writes them into the
        replay buffer (in a background thread) until :meth:`async_shutdown`.

        Raises:
            RuntimeError: without a replay buffer, or when already running.
        """
        if self.config.replay_buffer is None:
            raise RuntimeError("start() requires a replay_buffer to write the collected data into.")
        if self._running_free:
            raise RuntimeError("The collector is already running free.")
        self._iteration_started = True
        self._drain_async()
        self._free_lock = threading.RLock()  # a node replaced by the receiver vs. weights sent from here
        self._pool.broadcast(Command.RUN_FREE)
        self._running_free = True
        self._receiver = PushedBatchReceiver(self)
        self._receiver.start()

    def _replace_free_node(self, err: WorkerError) -> None:
        """Running free: replace the node ``err`` names (as the restart policy allows, else raise),
        and set its replacement running free too. Called by the receiver thread."""
        with self._free_lock:
            while True:
                worker = self._restart_after(err)
                try:
                    self._pool.request(worker, Command.RUN_FREE)
                    return
                except WorkerError as again:  # the replacement failed at once: one more failure
                    err = again

    def _updating_weights(self, update, counted: bool = True) -> None:
        """Running free, the receiver thread owns the nodes: an update that meets a failed node counts
        as done for the survivors, and the receiver replaces that node (it meets the failure too),
        starting it with these weights and this version."""
        if not self._running_free:
            return super()._updating_weights(update, counted)
        with self._free_lock:
            try:
                update()
            except WorkerError:
                if not self._fleet.restarts.enabled:
                    raise
                if counted:
                    BaseCollector.increment_version(self)

    def _write_pushed(self, worker: int, reply) -> None:
        batch = self._remap_traj_ids(self._fetch(worker, reply), worker)
        self._write_to_buffer(valid_part(batch))
        self._frames += reply.frames

    def _pause_impl(self):
        receiver = getattr(self, "_receiver", None)
        if not self._running_free or receiver is None:
            raise RuntimeError("Collector cannot be paused.")
        receiver.pause_requested.set()
        if not receiver.paused.wait(60.0) or receiver.error is not None:
            raise receiver.error or TimeoutError("the nodes did not pause within 60 s.")
        try:
            yield
        finally:
            receiver.resume_requested.set()

    def _stop_background(self, timeout: float | None) -> None:
        receiver = getattr(self, "_receiver", None)
        if receiver is not None:
            receiver.stop_requested.set()
            receiver.resume_requested.set()
            receiver.join(timeout if timeout is not None else 60.0)
            self._receiver = None
            self._running_free = False
            if receiver.error is not None:
                raise receiver.error
        super()._stop_background(timeout)

    # ------------------------------------------------------------------ unsupported
    def state_dict(self) -> dict:
        raise NotImplementedError(f"{type(self).__name__} has no state_dict (nodes are remote).")

    def load_state_dict(self, state_dict: dict, **kwargs) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no load_state_dict (nodes are remote).")

    # ------------------------------------------------------------------ shutdown
    def _check_shutdown_args(self, close_env: bool) -> None:
        """Nodes always close their envs when they stop; close_env is accepted either way."""

    def __repr__(self) -> str:
        mode = "sync" if self._sync else "async"
        return f"DistributedCollector(nodes={self.num_workers}, {mode}, launcher={self.launcher!r}, frames={self._frames})"
