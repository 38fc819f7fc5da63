"""NodeCollector: what every collector with one node (or actor) per env constructor shares.

``DistributedCollector`` (nodes in torch.distributed process groups), ``DistributedSyncCollector``
(free-running torch.distributed nodes), ``RPCCollector`` (torch RPC) and ``RayCollector`` (Ray
actors) are faces over it: each parses its own arguments into its options (``options/nodes.py``),
which build its backend; the rest is here. Nodes count their own trajectory ids, mapped to
collector-wide ids (``_traj_ids.py``); weights are pushed automatically every ``update_interval``
batches, after each batch, or to nodes left without an update for ``max_weight_update_interval``
batches; running free, nodes push every batch and a thread of this process writes them into the
replay buffer.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Sequence

import torch
from tensordict import TensorDictBase

from ..._utils import TRAJ_IDS
from ...checkpoint import pack, unpack
from ...errors import WorkerError
from ...protocol import Command, WorkerSpec
from ...weight_update.schemes import WeightSyncScheme
from .._specs import has_weights
from .._traj_ids import TrajIdMap
from ..base import BaseCollector
from ..options.nodes import NodeOptions, replicated
from ..remote import RemoteCollectorBase, valid_part
from ._joins import JoinKey, admit_rejoined, join_argv
from ._pushed_batches import PushedBatchReceiver

__all__ = ["NodeCollector"]


class NodeCollector(RemoteCollectorBase):
    """Base of the collectors with one node (or actor) per env constructor (docs/collection.md).

    A face defines its constructor (TorchRL's signature), calls :meth:`_construct` with the
    arguments, and :meth:`_parse` turns them into its options.
    """

    noun = "node"
    #: nodes get a stateless policy and receive its weights from the scheme's initial sync
    _stateless_nodes = True
    #: whether the constructor returns only once every node is built
    _wait_until_built = True
    #: running free (:meth:`start`): the thread writing the nodes' pushed batches into the buffer
    _receiver: PushedBatchReceiver | None = None
    #: running free: held while a node is replaced by the receiver or weights are sent from here
    _free_lock: threading.RLock | None = None
    _supports_run_free = True
    #: ``launcher="external"``: the file holding the key joining nodes read (``join_command()``)
    _join_key: JoinKey | None = None

    def _construct(self, arguments: dict[str, Any]) -> None:
        """Build from the constructor's arguments (faces with a signature of their own come here too)."""
        self._closed = True
        self._build(self._parse(arguments))
        self._closed = False
        if self._options.weight_recv_schemes is not None:
            self.register_scheme_receiver(self._options.weight_recv_schemes)

    def _parse(self, arguments: dict[str, Any]) -> NodeOptions:
        """This face's typed options from its constructor's arguments."""
        raise NotImplementedError

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
    def _runs_one_env(self) -> bool:
        return self._options.runs_one_env

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
        joining = self.launcher == "external"  # nodes join later: the first use waits for them
        try:
            for model_id, scheme in self._sender_schemes.items():
                scheme.init_on_sender(model_id=model_id, context=self, num_workers=count)
            if joining:
                self._join_key = JoinKey(self._net.authkey)
                self._backend.open_joins(join_argv(self._net.advertised_host, self._net.tcp_port, self._join_key.path))
            self._start_fleet([self._node_spec(node) for node in range(count)], self._worker_timeout,
                              wait=self._wait_until_built, deferred=joining)
        except BaseException:  # the fleet stopped what it started
            for scheme in self._sender_schemes.values():
                scheme.shutdown()
            if self._join_key is not None:
                self._join_key.remove()
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

    def join_command(self) -> list[str]:
        """The argv of a node that joins this collector from any host (``launcher="external"``).

        ``[sys.executable, "-m", "rlharvest", "node", "--join", "HOST:PORT", "--key-file", PATH]``: PATH is a
        file (mode 0600) holding this collector's key, written at construction and removed at
        shutdown; copy it to the node's host (same path, or change the argument), never onto a
        command line. A node that joins takes the first empty slot (docs/elastic.md).

        Raises:
            RuntimeError: when this collector's launcher is not ``"external"``, or after shutdown.
        """
        if self.launcher != "external":
            raise RuntimeError(f"join_command() needs launcher='external' (nodes that join from anywhere); this "
                               f"collector's launcher is {self.launcher!r}, which starts its nodes itself.")
        if self._closed or self._join_key is None:
            raise RuntimeError(f"{type(self).__name__} is shut down: no node can join it.")
        return join_argv(self._net.advertised_host, self._net.tcp_port, self._join_key.path)

    def _admit_rejoined(self) -> None:
        """``launcher="external"``: empty slots that a node joined meanwhile take it (``_joins.py``)."""
        if admit_rejoined(self._backend, self._fleet):
            self._resized()

    def _replacement_changes(self, worker: int) -> dict:
        # a node counts its own trajectory ids: its replacement starts past every id it handed out
        return {**super()._replacement_changes(worker), "traj_offset": self._traj_ids.next_local(worker)}

    # ------------------------------------------------------------------ collector hooks
    @property
    def requested_frames_per_batch(self) -> int:
        """Frames per batch: ``frames_per_batch``; with ``sync=True``, once nodes joined or left, the
        share fixed at construction (``frames_per_batch / W``) of every current node."""
        resized = self._resized_frames_per_batch()
        return self.config.frames_per_batch if resized is None else resized

    def _frames_share(self, worker: int) -> int:
        return self._frames_per_node

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
            self._push(self.active_workers)

    def _before_relaunch(self, worker: int) -> None:
        if self.update_after_each_batch and self._iter >= 0:
            self._push([worker])

    def _after_yield(self, worker: int | None) -> None:
        self._admit_rejoined()
        served = self.active_workers if worker is None else [worker]
        for node in served:
            self._batches_since_update[node] += 1
        self._yielded += 1
        if self._reached_total():
            return
        if self.update_interval and self._yielded % self.update_interval == 0:
            self._push(served)
        if self.max_weight_update_interval >= 0:
            late = [n for n in self.active_workers if self._batches_since_update[n] > self.max_weight_update_interval]
            if late:
                self._push(late)

    def _push(self, workers: list[int]) -> None:
        if self._sender_schemes or self.weight_updater is not None:
            self.update_policy_weights_(worker_ids=workers)

    def update_policy_weights_(self, policy_or_weights: Any = None, *, worker_ids=None, **kwargs) -> None:
        super().update_policy_weights_(policy_or_weights, worker_ids=worker_ids, **kwargs)
        targets = self.active_workers if worker_ids is None else (
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

    # ------------------------------------------------------------------ nodes that join (docs/elastic.md)
    def add_collectors(self, create_env_fn: Callable | Sequence[Callable], num_envs: int | None = None,
                       policy: Any = None, collector_kwargs: dict | Sequence[dict] | None = None) -> None:
        """Add one node per entry of ``create_env_fn`` to the running collector, through its launcher.

        RayCollector's semantics (docs/ray.md, "Adding actors"; docs/elastic.md): the new nodes take the
        indices after every slot, start on the weights of the last update and the current policy
        version, with seeds continuing the chain of the last :meth:`set_seed` and trajectory ids never
        used before; with ``sync=True`` each adds one rollout of ``frames_per_batch / W`` frames to
        every batch from the next one on. Needs a growable backend and weight sender (RPC nodes,
        torchdist nodes with a pair backend, gloo or nccl; not nodes started elsewhere:
        ``"submitit_delayed"``, ``"external"``).

        Args:
            create_env_fn: an env constructor, or a list of them (one per new node).
            num_envs: envs per new node (1 when nodes run a single ``Collector``).
            policy: None or this collector's policy, or a list of those.
            collector_kwargs: a dict for every new node's collector, or one dict per new node.

        Raises:
            ValueError: for an argument that does not fit (named in the message).
            NotImplementedError: when this collector's backend or weight sender cannot grow.
            RuntimeError: after shutdown, while running free, or from inside the collector's iteration.
            WorkerError: naming a new node that failed to start (the new nodes are then stopped; the
                collector goes on with the others).

        Example:
            >>> collector = RPCCollector([CountingEnv], frames_per_batch=4, sync=True)   # doctest: +SKIP
            >>> collector.add_collectors([CountingEnv])                                 # doctest: +SKIP
            >>> collector.active_workers, collector.requested_frames_per_batch          # doctest: +SKIP
            ([0, 1], 8)
        """
        if self.launcher == "external":
            raise NotImplementedError("launcher='external': the slots are the entries of create_env_fn, filled by the "
                                      "nodes that join (join_command()); add_collectors cannot add slots to it.")
        self._add_nodes(create_env_fn, num_envs, policy, collector_kwargs, lambda: None)

    def _add_nodes(self, create_env_fn: Any, num_envs: int | None, policy: Any, collector_kwargs: Any,
                   backend_options: Callable[[], list | None]) -> None:
        """``add_collectors`` of every face; ``backend_options()``: what the backend needs of each new
        node (validated after the other arguments), or None."""
        self._check_resizable("add")
        env_fns = list(create_env_fn) if isinstance(create_env_fn, (list, tuple)) else [create_env_fn]
        if not env_fns or any(env_fn is None for env_fn in env_fns):
            raise ValueError(f"create_env_fn must be an env constructor or a non-empty list of them (one per new "
                             f"{self.noun}), got {create_env_fn!r}.")
        count, first = len(env_fns), self.num_workers
        sub_workers = self._new_num_envs(num_envs)
        kwargs = self._new_collector_kwargs(collector_kwargs, count)
        options = backend_options()
        factory = self._new_policy(policy, count)
        self._check_new_count(first + count)
        self._fleet.check_growable()
        specs = self._register_new(env_fns, kwargs, factory, sub_workers)
        try:
            self._add_workers(specs, options)
        except BaseException:
            for per_node in (self.env_constructors, self.collector_kwargs, self.policy_factory or []):
                del per_node[first:]
            raise
        self._grown(count)

    def _register_new(self, env_fns: list, kwargs: list[dict], factory: Callable | None, sub_workers: int) -> list:
        """Append the new nodes' per-node arguments (undone by the caller if they fail to start);
        returns their worker specs."""
        first, count = self.num_workers, len(env_fns)
        self.env_constructors.extend(env_fns)
        self.collector_kwargs.extend({**entry, **self.config.for_worker(
            first + k, init_random_frames=self.config.init_random_frames // (first + count))}
            for k, entry in enumerate(kwargs))
        if self.policy_factory:
            self.policy_factory.extend([factory] * count)
        specs = [self._node_spec(node) for node in range(first, first + count)]
        if not self._runs_one_env:
            specs = [dataclasses.replace(spec, create_env_fn=[env_fn] * sub_workers)
                     for spec, env_fn in zip(specs, env_fns)]
        return specs

    def _new_num_envs(self, num_envs: int | None) -> int:
        if num_envs is None:
            return self.num_workers_per_collector
        if isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1:
            raise ValueError(f"num_envs must be an int >= 1, got {num_envs!r}.")
        if self._runs_one_env and num_envs != 1:
            raise ValueError(f"num_envs must be 1 when the {self.noun}s run a single Collector, got {num_envs}: build "
                             f"the collector with collector_class='sync' or 'async' for several envs per {self.noun}.")
        return num_envs

    def _new_collector_kwargs(self, collector_kwargs: Any, count: int) -> list[dict]:
        entries = replicated({} if collector_kwargs is None else collector_kwargs, "collector_kwargs", count,
                             f"new {self.noun} (one per entry of create_env_fn)")
        for index, entry in enumerate(entries):
            if not isinstance(entry, dict):
                raise ValueError(f"collector_kwargs must be a dict or a list of dicts (one per new {self.noun}), got "
                                 f"{type(entry).__name__} at index {index}.")
            frames = entry.get("frames_per_batch", self._frames_per_node)
            if frames != self._frames_per_node:
                raise ValueError(f"collector_kwargs[{index}]['frames_per_batch']={frames!r}: every {self.noun} "
                                 f"collects {self._frames_per_node} frames per rollout (leave it out).")
        return [dict(entry) for entry in entries]

    def _new_policy(self, policy: Any, count: int) -> Callable | None:
        """The policy factory of the new nodes (None: they run this collector's policy)."""
        per = f"new {self.noun} (one per entry of create_env_fn)"
        policies = replicated(policy, "policy", count, per) if isinstance(policy, (list, tuple)) else [policy]
        if any(entry is not None and entry is not self.policy for entry in policies):
            raise ValueError("policy must be None or this collector's policy (local_policy()), or a list of those: "
                             f"every {self.noun} runs the weights this collector sends.")
        factories = {id(factory): factory for factory in self.policy_factory or []}
        if len(factories) > 1:
            raise ValueError(f"add_collectors cannot choose the new {self.noun}s' policy_factory: this collector was "
                             f"built with a different one per {self.noun}.")
        return next(iter(factories.values()), None)

    def _check_new_count(self, total: int) -> None:
        """Per-node arguments of the constructor (devices, ...) leave the new nodes' values unknown."""
        try:
            self.config.check_workers(total)
        except (RuntimeError, ValueError) as err:
            raise ValueError(f"add_collectors: {err} The collector was built with one value per {self.noun}: "
                             f"it cannot tell the new {self.noun}s' values.") from None

    def _grown(self, count: int) -> None:
        """Bookkeeping once ``count`` nodes joined: trajectory ids, update counters, batch layout."""
        self._traj_ids.grow(count)
        # a sync batch yielded but not yet accounted for (suspended at its yield) counts every node
        self._batches_since_update.extend([-1 if self._sync and self._suspended else 0] * count)
        self._resized()

    # ------------------------------------------------------------------ running free
    def start(self) -> None:
        """Nodes collect continuously and push every batch; the main process writes them into the
        replay buffer (in a background thread) until :meth:`async_shutdown`.

        Raises:
            NotImplementedError: on node collectors that cannot run free.
            RuntimeError: without a replay buffer, or when already running.
        """
        if not self._supports_run_free:
            return super().start()
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

    # ------------------------------------------------------------------ checkpoints (docs/checkpoints.md)
    def _checkpoint_extra(self) -> dict:
        """The map of the nodes' trajectory ids and the weight-update counters."""
        return {"traj_ids": pack(vars(self._traj_ids)), "batches_since_update": list(self._batches_since_update),
                "yielded": int(self._yielded)}

    def _restore_checkpoint_extra(self, section: dict) -> None:
        vars(self._traj_ids).update(unpack(section["traj_ids"]))
        self._batches_since_update = list(section["batches_since_update"])
        self._yielded = int(section["yielded"])

    # ------------------------------------------------------------------ shutdown
    def _check_shutdown_args(self, close_env: bool) -> None:
        """Nodes always close their envs when they stop; close_env is accepted either way."""

    def _shutdown_impl(self, timeout: float | None, close_env: bool) -> None:
        try:
            super()._shutdown_impl(timeout, close_env)
        finally:
            if self._join_key is not None:
                self._join_key.remove()

