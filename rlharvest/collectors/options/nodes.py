"""The options every collector with one node (or actor) per env constructor shares:
``DistributedCollector`` and ``DistributedSyncCollector`` (``torchdist.py``), ``RPCCollector``
(``rpc.py``) and ``RayCollector`` (``ray.py``). Parsed once from their arguments; what differs between
them (the backend, where nodes run, the ready objects they hand the engine) is what each adds."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar, Mapping

from ..._utils import positive_int, wrap_callable, user_stacklevel
from ...config import CollectorConfig, positive_seconds
from ...config_views import BatchShares, FramesPerBatch
from ...protocol import WorkerSpec
from ...transport.base import Backend
from ...weight_update.schemes import WeightSyncScheme
from ...weight_update.torchrl_schemes import own_schemes
from ..engine.contract import Startup, WorkerSetup
from ..engine.extras import EngineExtra
from ..engine.fleet import Fleet
from ..engine.gather import FirstReadyBatches, Gathering, Stacked
from ..engine.running import PUSHED_TO_A_RECEIVER, FreeRun
from ..engine.schedule import WeightPushes
from ..engine.served import PolicyServer
from ..engine.events import FleetEvents
from ..engine.state import Lifecycle
from ..engine.stats import ASKED_WHEN_VIEWED, WorkerCensus
from ..engine.traj_ids import PerWorkerIds, TrajectoryIds
from .autoscale import Autoscale, parse_autoscale
from .common import check_env_constructors, has_weights, held_here, per_worker, stateless_copy, typed_class
from .local import LocalOptions
from .mp import NodeProcesses, WorkerProcessOptions

__all__ = ["NodeOptions", "resolve_collector_class", "replicated"]


def resolve_collector_class(collector_class: Any, named: Mapping[str, type]) -> type:
    """``"single"``, ``"sync"``, ``"async"`` (the classes ``named``) or a class.

    Raises:
        ValueError: for an unknown name or something not callable.
    """
    if isinstance(collector_class, str):
        if collector_class not in named:
            raise ValueError(f"collector_class must be one of {sorted(named)} or a collector class, "
                             f"got {collector_class!r}")
        return named[collector_class]
    if collector_class is None:
        return named["single"]
    if not callable(collector_class):
        raise ValueError(f"collector_class must be a class or one of {sorted(named)}, got {collector_class!r}")
    return collector_class


def replicated(value: Any, name: str, count: int, per: str = "collector") -> list:
    """``value`` for each of ``count`` collectors: a list of that length, or one value repeated.

    Raises:
        ValueError: for a list of another length.
    """
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} must hold one entry per {per} ({count}), got {len(value)}.")
        return list(value)
    return [value] * count


def _per_node_kwargs(collector_kwargs: Any, count: int) -> list[dict]:
    if isinstance(collector_kwargs, (list, tuple)):
        if len(collector_kwargs) != count:
            raise ValueError(f"collector_kwargs must hold exactly one dict per node ({count}), "
                             f"got {len(collector_kwargs)}.")
        return [dict(entry) for entry in collector_kwargs]
    return [dict(collector_kwargs or {}) for _ in range(count)]


@dataclass(frozen=True)
class NodeOptions:
    """What every collector with one node per env constructor is built from, validated."""

    config: CollectorConfig
    """The arguments every collector shares."""
    sync: bool
    """Stack one rollout of every node per batch (True), or serve the first ready (False)."""
    env_fns: tuple[Any, ...]
    """One env constructor per node."""
    policy: Any
    """The user's policy: what nodes run, and the main-side source of their weights."""
    policy_factories: tuple[Callable | None, ...] | None
    """One policy factory per node, or None."""
    collector_class: type
    """The collector each node runs."""
    named_classes: dict
    """What ``"single"``, ``"sync"`` and ``"async"`` stand for (rlharvest's collectors, given by the face)."""
    collector_kwargs: tuple[dict, ...]
    """Each node's collector arguments given by the user (validated into ``node_configs``)."""
    node_configs: tuple[CollectorConfig, ...]
    """Each node's collector config, typed: this collector's arguments with the user's on top (its
    share of frames is added to its spec)."""
    node_options: tuple[Any, ...]
    """Each node's collector options, typed, when the node runs one of rlharvest's collectors
    (``LocalOptions`` or ``WorkerProcessOptions``, without its share of frames); None for a class of
    the user's own."""
    num_workers_per_collector: int
    """Env copies (sub-workers) of a node running a multi-process collector."""
    update_after_each_batch: bool
    """Push weights before every request (sync) or re-launch (async)."""
    max_weight_update_interval: int
    """Push weights to a node after this many batches without an update (-1: never)."""
    update_interval: int | None
    """Push the policy's weights every this many batches (None: never by itself)."""
    track_versions: Any
    """The version tracker: ``track_policy_version``, or the nodes' own (``collector_kwargs``)."""
    worker_timeout: float
    """Seconds a node may go without answering or progressing."""
    heartbeat_timeout: float
    """Seconds without a heartbeat before a node is declared dead."""
    weight_updater: Any
    """A legacy weight updater (exclusive with ``weight_sync_schemes``)."""
    weight_sync_schemes: dict | None
    """``{model_id: scheme}`` (None: the backend's default)."""
    weight_recv_schemes: dict | None
    """Schemes through which this collector itself receives weights."""
    autoscale: Autoscale | None = None
    """How the fleet sizes itself while collecting (docs/elastic.md, "Autoscaling"), or None."""

    #: seconds nodes have to close at shutdown
    shutdown_timeout = 10.0
    #: ``update_policy_weights_()`` reads the policy given (nodes build theirs from a factory)
    factory_fallback = False
    cat_results = "stack"
    preemptive_threshold = None
    workers_write_buffer = False
    assembles_trajectories = True
    #: nodes get a stateless policy and receive its weights from the scheme's initial sync
    stateless_nodes = True
    #: how errors and ``stats()`` name a node
    noun = "node"
    #: ``shutdown(close_env=False)`` keeps the nodes' envs open (their collectors close them or not)
    refuses_keep_env = False
    shutdown_after_total = False
    startup = Startup()
    census: ClassVar[WorkerCensus] = ASKED_WHEN_VIEWED

    @classmethod
    def parse_common(cls, owner: str, *, sync: bool, create_env_fn: Any, policy: Any, policy_factory: Any,
                     collector_class: Any, collector_classes: Mapping[str, type],
                     collector_kwargs: Any, num_workers_per_collector: int, update_after_each_batch: bool,
                     max_weight_update_interval: int, update_interval: int | None, worker_timeout: Any,
                     heartbeat_timeout: Any, weight_updater: Any, weight_sync_schemes: dict | None,
                     weight_recv_schemes: dict | None, autoscale: Any = None, launcher: str | None = None,
                     group_backend: str | None = None, joins: bool = False,
                     **config_arguments: Any) -> NodeOptions:
        """The fields every node collector shares, validated, as a :class:`NodeOptions` (each backend's
        ``parse`` widens it with its own fields, :meth:`widened`). ``frames_per_batch`` is not among
        them: the face parses it apart and :meth:`worker_shares` splits it (docs/architecture.md).

        Raises:
            TypeError, ValueError, RuntimeError: naming the argument that does not fit.
        """
        if not isinstance(create_env_fn, (list, tuple)) or not create_env_fn:
            raise TypeError("create_env_fn must be a non-empty list of env constructors, one per node.")
        check_env_constructors(create_env_fn, cls.noun)
        count = len(create_env_fn)
        config = CollectorConfig.from_kwargs(owner, **config_arguments)
        if update_after_each_batch and max_weight_update_interval > -1:
            raise RuntimeError("update_after_each_batch and max_weight_update_interval are conflicting instructions.")
        positive_int("update_interval", update_interval, allow_none=True)
        weight_sync_schemes = own_schemes(weight_sync_schemes, "weight_sync_schemes")
        weight_recv_schemes = own_schemes(weight_recv_schemes, "weight_recv_schemes", receiving=True)
        if weight_updater is not None and weight_sync_schemes is not None:
            raise TypeError("Pass either weight_updater or weight_sync_schemes, not both.")
        config.check_workers(count)
        node_class = resolve_collector_class(collector_class, collector_classes)
        single = collector_classes["single"]
        runs_one = isinstance(node_class, type) and issubclass(node_class, single)
        if runs_one and num_workers_per_collector != 1:
            raise RuntimeError("num_workers_per_collector must be 1 when the nodes run a single Collector; use "
                               "collector_class='sync' or 'async' for several sub-workers per node.")
        user_kwargs = _per_node_kwargs(collector_kwargs, count)
        if not sync and config.init_random_frames:
            warnings.warn("init_random_frames with sync=False: each node decides on its own share, so random and "
                          "policy batches may interleave.", stacklevel=user_stacklevel())
        factories = per_worker(policy_factory, count, "policy_factory") if policy_factory else None
        if policy is not None and factories is None and not has_weights(policy) and not _is_module(policy):
            warnings.warn("The policy is not an nn.Module and no policy_factory was given: update_policy_weights_ "
                          "will be a no-op.", stacklevel=user_stacklevel())
        scaling = parse_autoscale(autoscale, sync=bool(sync), typed_workers=typed_class(node_class, [single]),
                                  launcher=launcher, backend=group_backend, joins=joins,
                                  legacy_updater=weight_updater is not None,
                                  distinct_factories=factories is not None and len({id(f) for f in factories}) > 1)
        tracker = config.track_policy_version or any(e.get("track_policy_version") for e in user_kwargs) or None
        node_configs = tuple(_node_config(config, node, count, entry, owner, typed_class(node_class, [single]))
                             for node, entry in enumerate(user_kwargs))
        node_options = tuple(_node_options(node_class, collector_classes, node_config, entry, num_workers_per_collector,
                                           owner) for node_config, entry in zip(node_configs, user_kwargs))
        return NodeOptions(
            config=config, sync=bool(sync), env_fns=tuple(create_env_fn), policy=policy,
            policy_factories=tuple(factories) if factories is not None else None,
            collector_class=node_class, named_classes=dict(collector_classes), collector_kwargs=tuple(user_kwargs),
            node_configs=node_configs, node_options=node_options, num_workers_per_collector=int(num_workers_per_collector),
            update_after_each_batch=bool(update_after_each_batch),
            max_weight_update_interval=int(max_weight_update_interval), update_interval=update_interval,
            track_versions=tracker, worker_timeout=positive_seconds("worker_timeout", worker_timeout),
            heartbeat_timeout=positive_seconds("heartbeat_timeout", heartbeat_timeout),
            weight_updater=weight_updater, weight_sync_schemes=weight_sync_schemes,
            weight_recv_schemes=weight_recv_schemes, autoscale=scaling)

    @classmethod
    def widened(cls, common: NodeOptions, **own: Any):
        """An instance of this backend's options: ``common``'s fields and the backend's ``own``."""
        return cls(**{f.name: getattr(common, f.name) for f in fields(NodeOptions)}, **own)

    # ------------------------------------------------------------------ what the engine reads
    @property
    def num_workers(self) -> int:
        return len(self.env_fns)

    @property
    def single_collector(self) -> type:
        """rlharvest's ``Collector`` (a node runs one env when its class is a ``Collector``)."""
        return self.named_classes["single"]

    @property
    def runs_one_env(self) -> bool:
        """Each node's collector is a Collector (a subclass too): one env, not a list of them."""
        return isinstance(self.collector_class, type) and issubclass(self.collector_class, self.single_collector)

    @property
    def typed_nodes(self) -> bool:
        """Whether nodes build rlharvest's ``Collector`` from typed options."""
        return typed_class(self.collector_class, [self.single_collector])

    @property
    def gathering(self) -> Gathering:
        """Stacked batches, or the first ready: take a node's batch, yield it, (update), then ask that node
        again, so that weights the caller changed before the next batch reach the node before it collects
        again (docs/weights.md)."""
        return Stacked() if self.sync else FirstReadyBatches(relaunch_after_yield=True)

    @property
    def pushes(self) -> WeightPushes:
        """``update_after_each_batch``, ``update_interval``, ``max_weight_update_interval``, counted per node."""
        return WeightPushes(before_each_batch=self.update_after_each_batch, every=self.update_interval,
                            max_interval=self.max_weight_update_interval, per_target_counters=True,
                            skip_before_first=True)

    @property
    def free_run(self) -> FreeRun | None:
        """``start()``: the nodes run free and push every batch to a thread here that writes it."""
        return PUSHED_TO_A_RECEIVER

    def trajectory_ids(self) -> TrajectoryIds:
        """Each node counts its own trajectory ids, mapped to collector-wide ones here."""
        return PerWorkerIds(self.num_workers)

    def extras(self, backend: Backend, fleet: Fleet, life: Lifecycle, events: FleetEvents) -> list[EngineExtra]:
        """Parts a backend adds (none by default)."""
        return []

    def served_policy(self, backend: Backend) -> PolicyServer | None:
        return None

    @property
    def version_tracker(self) -> Any:
        return self.track_versions

    def worker_shares(self, frames: FramesPerBatch) -> BatchShares:
        """Each node's (equal) share of ``frames``: a sync batch is split evenly between them, an async
        batch is one node's whole.

        Raises:
            TypeError: for a per-node list (nodes collect equal shares).
            RuntimeError: for a sync batch that does not split evenly.
        """
        if frames.per_worker:
            raise TypeError(f"frames_per_batch must be an int ({self.noun}s collect equal shares), got a list.")
        return frames.shares(self.num_workers, "exact" if self.sync else "whole")

    def default_scheme(self, backend: Backend) -> dict:
        """The scheme of this backend when the user gave none (none for a policy without weights)."""
        weighted = has_weights(self.policy) or self.policy_factories is not None
        scheme_class = WeightSyncScheme.class_for(backend.default_scheme())
        return {"policy": scheme_class(backend=self.group_backend, sync=True)} if weighted else {}

    @property
    def group_backend(self) -> str | None:
        """The process groups' backend (``"gloo"``, ...); None where there are none."""
        return None

    def prepare(self, backend: Backend) -> WorkerSetup:
        """The sender schemes (the user's, the backend's default, or a legacy updater's transport)."""
        legacy = self.weight_updater is not None
        schemes = self.weight_sync_schemes
        if legacy or schemes is None:
            schemes = self.default_scheme(backend)
        schemes = held_here(dict(schemes or {}), buffer_here=self.config.replay_buffer is not None)
        return WorkerSetup(policy=self.policy, schemes=schemes, legacy=legacy)

    def worker_specs(self, setup: WorkerSetup, shares: BatchShares, first: int = 0) -> list[WorkerSpec]:
        """One spec per node from index ``first`` on, each with its share of ``shares``."""
        return [self.node_spec(node, setup, shares.share(node)) for node in range(first, self.num_workers)]

    def node_spec(self, node: int, setup: WorkerSetup, frames: int) -> WorkerSpec:
        """Node ``node``'s spec: its env constructor (repeated per sub-worker for multi-process node
        classes), its collector's typed options or arguments with ``frames`` per batch, and its policy (a
        stateless copy when its weights arrive through the schemes and ``stateless_nodes``)."""
        env_fn = self.env_fns[node]
        if not self.runs_one_env:
            env_fn = [env_fn] * self.num_workers_per_collector
        factory = self.policy_factories[node] if self.policy_factories else None
        policy = None
        schemes = setup.schemes
        if factory is None and self.policy is not None:
            policy = stateless_copy(self.policy) if schemes and self.stateless_nodes else self.policy
        options = self.node_options[node]
        if options is not None:
            arguments: dict[str, Any] = {"options": _with_frames(options, frames)}
        else:  # a class of the user's own (or a multi-process one): the arguments the user gave, and ours
            share = self.config.init_random_frames // len(self.node_configs)
            arguments = {"collector_kwargs": {**self.collector_kwargs[node], **self.config.for_worker(
                node, init_random_frames=share), "frames_per_batch": frames}}
        return WorkerSpec(worker_idx=node, collector_class=self.collector_class, create_env_fn=env_fn,
                          policy=policy, policy_factory=factory, weight_recv_schemes=schemes or None, num_threads=1,
                          # a node running free decides alone: its share of the random warm-up
                          init_random_frames=self.config.init_random_frames // len(self.node_configs),
                          preemption_grace=self.config.preemption_grace, **arguments)

    def added(self, first: int, create_env_fn: Any, num_envs: Any, policy: Any, collector_kwargs: Any,
              backend_options: Any, setup: WorkerSetup,
              shares: BatchShares) -> tuple[NodeOptions, list[WorkerSpec], Any]:
        """``add_collectors``: these options grown by the new nodes, their specs, and what the backend
        needs of each (``backend_options``, checked by the backend's options).

        Raises:
            ValueError: for an argument that does not fit (named in the message).
        """
        noun = self.noun
        env_fns = list(create_env_fn) if isinstance(create_env_fn, (list, tuple)) else [create_env_fn]
        check_env_constructors(env_fns, noun)
        if not env_fns or any(env_fn is None for env_fn in env_fns):
            raise ValueError(f"create_env_fn must be an env constructor or a non-empty list of them (one per new "
                             f"{noun}), got {create_env_fn!r}.")
        count = len(env_fns)
        sub_workers = self._new_num_envs(num_envs, noun)
        kwargs = self._new_collector_kwargs(collector_kwargs, count, noun, shares.share(0))
        extra = self.added_backend_options(backend_options, count)
        factory = self._new_policy(policy, count, noun)
        try:
            self.config.check_workers(first + count)
        except (RuntimeError, ValueError) as err:
            raise ValueError(f"add_collectors: {err} The collector was built with one value per {noun}: it cannot "
                             f"tell the new {noun}s' values.") from None
        share = self.config.init_random_frames // (first + count)
        single = self.typed_nodes
        configs = tuple(_node_config(self.config, first + k, first + count, entry, "collector_kwargs", single,
                                     random_share=share) for k, entry in enumerate(kwargs))
        options = tuple(_node_options(self.collector_class, self.named_classes, node_config, entry, sub_workers,
                                      "collector_kwargs") for node_config, entry in zip(configs, kwargs))
        grown = dataclasses.replace(
            self, env_fns=self.env_fns + tuple(env_fns), collector_kwargs=self.collector_kwargs + tuple(kwargs),
            node_configs=self.node_configs + configs, node_options=self.node_options + options,
            num_workers_per_collector=sub_workers if not self.runs_one_env else self.num_workers_per_collector,
            policy_factories=self.policy_factories + (factory,) * count if self.policy_factories else None)
        return grown, grown.worker_specs(setup, shares, first=first), extra

    def added_backend_options(self, backend_options: Any, count: int) -> Any:
        """What the backend needs of each new node (Ray: ``remote_configs``); None by default.

        Raises:
            ValueError: for options this backend does not take.
        """
        if backend_options is not None:
            raise ValueError("this collector's add_collectors takes no backend options.")
        return None

    def scaled_backend_options(self, count: int) -> Any:
        """What the backend needs of ``count`` nodes the autoscaler adds (None: what it gives new nodes
        by default)."""
        return None

    def _new_num_envs(self, num_envs: int | None, noun: str) -> int:
        if num_envs is None:
            return self.num_workers_per_collector
        positive_int("num_envs", num_envs)
        if self.runs_one_env and num_envs != 1:
            raise ValueError(f"num_envs must be 1 when the {noun}s run a single Collector, got {num_envs}: build "
                             f"the collector with collector_class='sync' or 'async' for several envs per {noun}.")
        return num_envs

    def _new_collector_kwargs(self, collector_kwargs: Any, count: int, noun: str, share: int) -> list[dict]:
        entries = replicated({} if collector_kwargs is None else collector_kwargs, "collector_kwargs", count,
                             f"new {noun} (one per entry of create_env_fn)")
        for index, entry in enumerate(entries):
            if not isinstance(entry, dict):
                raise ValueError(f"collector_kwargs must be a dict or a list of dicts (one per new {noun}), got "
                                 f"{type(entry).__name__} at index {index}.")
            frames = entry.get("frames_per_batch", share)
            if frames != share:
                raise ValueError(f"collector_kwargs[{index}]['frames_per_batch']={frames!r}: every {noun} "
                                 f"collects {share} frames per rollout (leave it out).")
        return [dict(entry) for entry in entries]

    def _new_policy(self, policy: Any, count: int, noun: str) -> Callable | None:
        """The policy factory of the new nodes (None: they run this collector's policy)."""
        per = f"new {noun} (one per entry of create_env_fn)"
        policies = replicated(policy, "policy", count, per) if isinstance(policy, (list, tuple)) else [policy]
        if any(entry is not None and entry is not self.policy for entry in policies):
            raise ValueError("policy must be None or this collector's policy (local_policy()), or a list of those: "
                             f"every {noun} runs the weights this collector sends.")
        factories = {id(factory): factory for factory in self.policy_factories or []}
        if len(factories) > 1:
            raise ValueError(f"add_collectors cannot choose the new {noun}s' policy_factory: this collector was "
                             f"built with a different one per {noun}.")
        return next(iter(factories.values()), None)

    def build_backend(self) -> Backend:  # pragma: no cover - every backend's options build theirs
        raise NotImplementedError


def _node_config(config: CollectorConfig, node: int, count: int, user: dict, owner: str, typed: bool,
                 random_share: int | None = None) -> CollectorConfig:
    """Node ``node``'s collector config: this collector's fields for a worker, its share of the random
    warm-up (a node running free decides alone), the user's ``collector_kwargs`` on top (validated
    here, once, when the node runs rlharvest's ``Collector``).

    Raises:
        TypeError: for a ``collector_kwargs`` entry no collector argument has.
    """
    share = config.init_random_frames // count if random_share is None else random_share
    node_config = config.worker_config(node, init_random_frames=share)
    if not typed:
        return node_config
    known = {f.name for f in fields(CollectorConfig)}
    unknown = sorted(set(user) - known)
    if unknown:
        raise TypeError(f"{owner}: collector_kwargs holds argument(s) {unknown} that Collector does not take.")
    ours = config.for_worker(node, init_random_frames=share)  # what this collector sets wins, as before
    wrapped = {name: wrap_callable(value) if name.endswith("_hook") else value
               for name, value in user.items() if name not in ours and name != "frames_per_batch"}
    return dataclasses.replace(node_config, **wrapped) if wrapped else node_config


def _node_options(node_class: Any, named: Mapping[str, type], config: CollectorConfig, user: dict,
                  sub_workers: int, owner: str) -> Any:
    """A node's typed options when it runs one of rlharvest's collectors: a ``Collector``'s (its config),
    or a worker-process collector's, parsed here from this collector's arguments and the user's
    ``collector_kwargs`` (the node parses nothing); None for a class of the user's own."""
    if typed_class(node_class, [named["single"]]):
        return LocalOptions(config=config, create_env_fn=None)
    multi = [named[name] for name in ("sync", "async") if name in named]
    if not typed_class(node_class, multi):
        return None
    ours = config.for_worker(0)  # the node's non-default collector arguments, this collector's first
    ours.pop("worker_idx", None)
    arguments = {**{k: v for k, v in user.items() if k != "frames_per_batch"}, **ours}
    return WorkerProcessOptions.parse(
        owner, sync=issubclass(node_class, named["sync"]), create_env_fn=[None] * sub_workers, num_workers=None,
        policy=None, policy_factory=None, default_collector=named["single"], **arguments)


def _with_frames(options: LocalOptions | WorkerProcessOptions, frames: int) -> LocalOptions | NodeProcesses:
    """A node's typed options with its share of ``frames`` per batch: in its ``Collector``'s config, or
    beside a worker-process collector's options (which hold none)."""
    if isinstance(options, WorkerProcessOptions):
        return NodeProcesses(options, FramesPerBatch(frames))
    return dataclasses.replace(options, config=options.config.with_frames(FramesPerBatch(frames)))


def _is_module(policy: Any) -> bool:
    import torch

    return isinstance(policy, torch.nn.Module)
