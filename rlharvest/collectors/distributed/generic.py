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
from typing import Any, Callable, Sequence

import torch
from tensordict import TensorDictBase

from ..._utils import TRAJ_IDS
from ...errors import WorkerError
from ...policies import ExplorationType
from ...protocol import Command, WorkerSpec
from ...weight_update.schemes import WeightSyncScheme
from .._signatures import constructor_arguments
from .._specs import has_weights
from .._traj_ids import TrajIdMap
from ..base import BaseCollector
from ..options.nodes import NodeOptions, TorchDistOptions, resolve_collector_class
from ..remote import RemoteCollectorBase, valid_part
from ..single import Collector
from ._pushed_batches import PushedBatchReceiver

__all__ = ["DistributedCollector", "resolve_collector_class"]

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
    #: whether the constructor returns only once every node is built
    _wait_until_built = True
    #: running free (:meth:`start`): the thread writing the nodes' pushed batches into the buffer
    _receiver: PushedBatchReceiver | None = None

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
        self._construct(constructor_arguments(locals()))  # first thing: parsed at once into typed options

    def _construct(self, arguments: dict[str, Any]) -> None:
        """Build from the constructor's arguments (faces with a signature of their own come here too)."""
        self._closed = True
        self._build(self._parse(arguments))
        self._closed = False
        if self._options.weight_recv_schemes is not None:
            self.register_scheme_receiver(self._options.weight_recv_schemes)

    def _parse(self, arguments: dict[str, Any]) -> NodeOptions:
        """This face's typed options from its constructor's arguments."""
        return TorchDistOptions.parse(type(self).__name__, **arguments)

    # ------------------------------------------------------------------ construction
    def _build(self, options: NodeOptions) -> None:
        """Build this collector from its validated options: the backend, the weight schemes, the nodes."""
        super().__init__()
        self._options = options
        self.config = options.config
        self._sync = options.sync
        self._worker_idx = None
        # Take a node's batch, yield it, (update), then re-launch that node: weights the caller
        # changed before the next batch reach the node before it collects again (docs/weights.md).
        self._relaunch_after_yield = True
        # Per-node arguments, grown by RayCollector.add_collectors.
        self.env_constructors = list(options.env_fns)
        self.collector_kwargs = list(options.collector_kwargs)
        self.policy_factory = list(options.policy_factories) if options.policy_factories else None
        self.policy = options.policy
        self.update_interval = options.update_interval
        count = options.num_nodes
        self.policy_weights = self._main_weights(self.policy)
        self._batches_since_update = [0] * count
        self._traj_ids = TrajIdMap(count)
        self._yielded = 0
        self._version_tracker = options.track_versions
        self._backend = options.build_backend(count)
        self._setup_schemes(options.weight_updater, options.weight_sync_schemes)
        self._start_nodes(count)

    # ------------------------------------------------------------------ what the options hold
    @property
    def collector_class(self) -> type:
        return self._options.collector_class

    @property
    def num_workers_per_collector(self) -> int:
        return self._options.num_workers_per_collector

    @property
    def update_after_each_batch(self) -> bool:
        return self._options.update_after_each_batch

    @property
    def max_weight_update_interval(self) -> int:
        return self._options.max_weight_update_interval

    @property
    def _frames_per_node(self) -> int:
        return self._options.frames_per_node

    @property
    def _worker_timeout(self) -> float:
        return self._options.worker_timeout

    @property
    def backend(self) -> str | None:
        """The process groups' backend (``"gloo"``, ...); None where there are none (Ray)."""
        return getattr(self._options, "backend", None)

    @property
    def launcher(self) -> str | None:
        """How nodes are started (``"mp"``, ``"submitit"``, ...); None where a cluster places them (Ray)."""
        return getattr(self._options, "launcher", None)

    @property
    def slurm_kwargs(self) -> dict | None:
        return getattr(self._options, "slurm_kwargs", None)

    @property
    def _net(self):
        return getattr(self._options, "network", None)

    @property
    def tcp_port(self) -> str | None:
        return str(self._net.tcp_port) if self._net is not None else None

    def _main_weights(self, policy) -> TensorDictBase | None:
        if isinstance(policy, torch.nn.Module):
            from tensordict import TensorDict

            return TensorDict.from_module(policy).data
        return None

    def _default_schemes(self, sync: bool) -> dict:
        weighted = has_weights(self.policy) or self.policy_factory is not None
        scheme_class = WeightSyncScheme.class_for(self._backend.default_scheme())
        return {"policy": scheme_class(backend=self.backend, sync=sync)} if weighted else {}

    def _setup_schemes(self, weight_updater, schemes) -> None:
        if weight_updater is None and schemes is None:
            schemes = self._default_schemes(sync=True)
        self._legacy = weight_updater is not None
        self._sender_schemes = dict(schemes or {})
        if self._legacy:
            self._sender_schemes = self._default_schemes(sync=True)  # the legacy updater's transport
            self._weight_sync_schemes = None
        else:
            self._weight_sync_schemes = self._sender_schemes

    def _start_nodes(self, count: int) -> None:
        try:
            for model_id, scheme in self._sender_schemes.items():
                scheme.init_on_sender(model_id=model_id, context=self, num_workers=count)
            self._start_fleet([self._node_spec(node) for node in range(count)], self._worker_timeout,
                              wait=self._wait_until_built)
        except BaseException:  # the fleet stopped what it started
            for scheme in self._sender_schemes.values():
                scheme.shutdown()
            raise
        if self._legacy:
            self.weight_updater = self._options.weight_updater

    def _node_spec(self, node: int) -> WorkerSpec:
        return self._options.node_spec(
            node, env_fn=self.env_constructors[node], collector_kwargs=self.collector_kwargs[node],
            factory=self.policy_factory[node] if self.policy_factory else None, schemes=self._sender_schemes,
            stateless=self._stateless_nodes, num_nodes=self.num_workers)

    @property
    def num_workers(self) -> int:
        return len(self.env_constructors)

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
        ids = batch.get(TRAJ_IDS, None)
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
        acknowledgement when ``wait``; the scheme's own ``sync`` stays as it was for later sends)."""
        scheme = self._sender_schemes.get("policy")
        if scheme is None:
            return
        scheme.send(weights=weights, worker_ids=[worker], wait=wait)

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
        self._requests.broadcast(Command.RUN_FREE)
        self._running_free = True
        self._receiver = PushedBatchReceiver(self)
        self._receiver.start()

    def _replace_free_node(self, err: WorkerError) -> None:
        """Running free: replace the node ``err`` names (as the restart policy allows, else raise),
        and set its replacement running free too. Called by the receiver thread."""
        with self._free_lock:
            while True:
                worker = self._fleet.recover(err)
                try:
                    self._requests.request(worker, Command.RUN_FREE)
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
        receiver = self._receiver
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
        receiver = self._receiver
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
