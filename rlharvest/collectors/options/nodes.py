"""The options of the collectors with one node (or actor) per env constructor: ``DistributedCollector``
and ``DistributedSyncCollector`` (backend ``torchdist``), ``RPCCollector`` (``rpc``) and
``RayCollector`` (``ray``). Parsed once from their arguments; each knows how to build its backend and
its nodes' specs."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from ...config import CollectorConfig, positive_seconds
from ...protocol import WorkerSpec
from ...transport.base import Backend
from ...transport.ray import DEFAULT_REMOTE_CONFIG, as_replay_buffer
from ...transport.rendezvous import check_backend
from .._specs import per_worker, stateless_copy
from ..single import Collector

__all__ = ["NodeOptions", "TorchDistOptions", "RPCOptions", "RayOptions", "resolve_collector_class", "replicated",
           "remote_configs_of"]


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


def runs_one_env(collector_class: Any) -> bool:
    """Whether a node's ``collector_class`` takes one env (a ``Collector``, a subclass too), not a list."""
    return isinstance(collector_class, type) and issubclass(collector_class, Collector)


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
    frames_per_node: int
    """Frames each node collects per rollout."""
    collector_class: type
    """The collector each node runs."""
    collector_kwargs: tuple[dict, ...]
    """Each node's collector arguments: the user's ``collector_kwargs``, then this collector's own."""
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

    @staticmethod
    def parse_common(owner: str, *, sync: bool, create_env_fn: Any, policy: Any, policy_factory: Any,
                     frames_per_batch: Any, collector_class: Any, collector_kwargs: Any,
                     num_workers_per_collector: int, update_after_each_batch: bool, max_weight_update_interval: int,
                     update_interval: int | None, worker_timeout: Any, heartbeat_timeout: Any, weight_updater: Any,
                     weight_sync_schemes: dict | None, weight_recv_schemes: dict | None,
                     **config_arguments: Any) -> dict[str, Any]:
        """The fields every node collector shares, validated (a subclass's ``parse`` adds its own).

        Raises:
            TypeError, ValueError, RuntimeError: naming the argument that does not fit.
        """
        if not isinstance(create_env_fn, (list, tuple)) or not create_env_fn:
            raise TypeError("create_env_fn must be a non-empty list of env constructors, one per node.")
        count = len(create_env_fn)
        config = CollectorConfig.from_kwargs(owner, frames_per_batch=frames_per_batch, **config_arguments)
        if isinstance(config.frames_per_batch, tuple):
            raise TypeError(f"frames_per_batch must be an int for {owner} (nodes collect equal shares), got a list.")
        if update_after_each_batch and max_weight_update_interval > -1:
            raise RuntimeError("update_after_each_batch and max_weight_update_interval are conflicting instructions.")
        if update_interval is not None and (isinstance(update_interval, bool) or not isinstance(update_interval, int)
                                            or update_interval < 1):
            raise ValueError(f"update_interval must be an int >= 1 (or None), got {update_interval!r}")
        if weight_updater is not None and weight_sync_schemes is not None:
            raise TypeError("Pass either weight_updater or weight_sync_schemes, not both.")
        frames_per_node = config.split_frames(count, "exact" if sync else "whole")[0]
        config.check_workers(count)
        node_class = resolve_collector_class(collector_class)
        if runs_one_env(node_class) and num_workers_per_collector != 1:
            raise RuntimeError("num_workers_per_collector must be 1 when the nodes run a single Collector; use "
                               "collector_class='sync' or 'async' for several sub-workers per node.")
        user_kwargs = _per_node_kwargs(collector_kwargs, count)
        if not sync and config.init_random_frames:
            warnings.warn("init_random_frames with sync=False: each node decides on its own share, so random and "
                          "policy batches may interleave.", stacklevel=5)
        share = config.init_random_frames // count  # a node running free decides alone: its share
        node_kwargs = tuple({**entry, **config.for_worker(node, init_random_frames=share)}
                            for node, entry in enumerate(user_kwargs))
        factories = per_worker(policy_factory, count, "policy_factory") if policy_factory else None
        if policy is not None and factories is None and not _is_module(policy):
            warnings.warn("The policy is not an nn.Module and no policy_factory was given: update_policy_weights_ "
                          "will be a no-op.", stacklevel=5)
        tracker = config.track_policy_version or any(e.get("track_policy_version") for e in user_kwargs) or None
        return dict(config=config, sync=bool(sync), env_fns=tuple(create_env_fn), policy=policy,
                    policy_factories=tuple(factories) if factories is not None else None,
                    frames_per_node=frames_per_node, collector_class=node_class, collector_kwargs=node_kwargs,
                    num_workers_per_collector=int(num_workers_per_collector),
                    update_after_each_batch=bool(update_after_each_batch),
                    max_weight_update_interval=int(max_weight_update_interval), update_interval=update_interval,
                    track_versions=tracker, worker_timeout=positive_seconds("worker_timeout", worker_timeout),
                    heartbeat_timeout=positive_seconds("heartbeat_timeout", heartbeat_timeout),
                    weight_updater=weight_updater, weight_sync_schemes=weight_sync_schemes,
                    weight_recv_schemes=weight_recv_schemes)

    @property
    def runs_one_env(self) -> bool:
        """Each node's collector is a Collector (a subclass too): one env, not a list of them."""
        return runs_one_env(self.collector_class)

    @property
    def num_nodes(self) -> int:
        return len(self.env_fns)

    def build_backend(self, count: int) -> Backend:  # pragma: no cover - every subclass has its backend
        raise NotImplementedError

    def node_spec(self, node: int, *, env_fn: Any, collector_kwargs: dict, factory: Callable | None,
                  schemes: dict, stateless: bool, num_nodes: int) -> WorkerSpec:
        """Node ``node``'s spec: its env constructor (repeated per sub-worker for multi-process node
        classes), its collector's arguments, and its policy (a stateless copy when its weights
        arrive through ``schemes`` and ``stateless``)."""
        if not self.runs_one_env:
            env_fn = [env_fn] * self.num_workers_per_collector
        policy = None
        if factory is None and self.policy is not None:
            policy = stateless_copy(self.policy) if schemes and stateless else self.policy
        return WorkerSpec(worker_idx=node, collector_class=self.collector_class, create_env_fn=env_fn,
                          collector_kwargs=dict(collector_kwargs, frames_per_batch=self.frames_per_node),
                          policy=policy, policy_factory=factory, weight_recv_schemes=schemes or None, num_threads=1,
                          # a node running free decides alone: its share of the random warm-up
                          init_random_frames=self.config.init_random_frames // num_nodes,
                          preemption_grace=self.config.preemption_grace)


def _is_module(policy: Any) -> bool:
    import torch

    return isinstance(policy, torch.nn.Module)


@dataclass(frozen=True)
class TorchDistOptions(NodeOptions):
    """``DistributedCollector``: nodes in torch.distributed process groups, started by a launcher."""

    launcher: str = "submitit"
    """``"mp"``, ``"submitit"``, ``"submitit_delayed"`` or ``"external"`` (nodes join, docs/elastic.md)."""
    backend: str = "gloo"
    """The process groups' backend (``"gloo"``, ``"nccl"``, ``"mpi"``, ``"ucc"``)."""
    network: Any = None
    """Addresses, ports, key and timeouts (:class:`~rlharvest.collectors.distributed._network.NetworkConfig`)."""
    slurm_kwargs: dict = field(default_factory=dict)
    """``DEFAULT_SLURM_CONF`` with the user's ``slurm_kwargs`` on top."""
    mp_start_method: str | None = None

    @classmethod
    def parse(cls, owner: str, *, launcher: str, backend: str, tcp_port: Any, bind_address: Any, authkey: Any,
              handshake_timeout: Any, slurm_kwargs: dict | None, mp_start_method: str | None,
              **common: Any) -> TorchDistOptions:
        """Validate ``DistributedCollector``'s arguments, once.

        Raises:
            TypeError, ValueError, RuntimeError, ImportError: naming the argument that does not fit.
        """
        from ..distributed._network import NetworkConfig
        from ..distributed.slurm import DEFAULT_SLURM_CONF

        _check_launcher(launcher, external=True)
        if launcher == EXTERNAL:
            _check_external(backend, slurm_kwargs, mp_start_method)
        check_backend(backend)
        shared = cls.parse_common(owner, **common)
        network = NetworkConfig.parse(launcher=launcher, tcp_port=tcp_port, bind_address=bind_address,
                                      authkey=authkey, worker_timeout=shared["worker_timeout"],
                                      heartbeat_timeout=shared["heartbeat_timeout"],
                                      handshake_timeout=handshake_timeout)
        return cls(**shared, launcher=launcher, backend=backend, network=network,
                   slurm_kwargs={**DEFAULT_SLURM_CONF, **(slurm_kwargs or {})}, mp_start_method=mp_start_method)

    def build_backend(self, count: int) -> Backend:
        from ...transport.torchdist import TorchDistBackend
        from ...worker.nodes import node_main

        return TorchDistBackend(count, node_main, self.network, launcher=self.launcher, backend=self.backend,
                                slurm_kwargs=self.slurm_kwargs, start_method=self.mp_start_method)


@dataclass(frozen=True)
class RPCOptions(NodeOptions):
    """``RPCCollector``: nodes in a torch RPC group, started by a launcher."""

    launcher: str = "submitit"
    network: Any = None
    slurm_kwargs: dict = field(default_factory=dict)
    mp_start_method: str | None = None
    visible_devices: tuple | None = None
    """One device per node (the device map of tensors sent to it)."""
    tensorpipe_options: dict = field(default_factory=dict)
    """Merged over rlharvest's TensorPipe defaults."""

    @classmethod
    def parse(cls, owner: str, *, launcher: str, tcp_port: Any, bind_address: Any, slurm_kwargs: dict | None,
              mp_start_method: str | None, visible_devices: Any, tensorpipe_options: dict | None,
              backend: str = "gloo", **common: Any) -> RPCOptions:
        """Validate ``RPCCollector``'s arguments, once (``backend`` is accepted and unused: TensorPipe
        carries everything).

        Raises:
            TypeError, ValueError, RuntimeError, ImportError: naming the argument that does not fit.
        """
        from ..distributed._network import NetworkConfig
        from ..distributed.slurm import DEFAULT_SLURM_CONF

        _check_launcher(launcher, external=True)
        if launcher == EXTERNAL:
            _check_external(backend, slurm_kwargs, mp_start_method)
        check_backend(backend)
        shared = cls.parse_common(owner, **common)
        count = len(shared["env_fns"])
        if visible_devices is not None and len(visible_devices) != count:
            raise ValueError(f"visible_devices must hold one device per node ({count}).")
        network = NetworkConfig.parse(launcher=launcher, tcp_port=tcp_port, bind_address=bind_address, authkey=None,
                                      worker_timeout=shared["worker_timeout"],
                                      heartbeat_timeout=shared["heartbeat_timeout"], needs_key=False)
        return cls(**shared, launcher=launcher, network=network,
                   slurm_kwargs={**DEFAULT_SLURM_CONF, **(slurm_kwargs or {})}, mp_start_method=mp_start_method,
                   visible_devices=tuple(visible_devices) if visible_devices is not None else None,
                   tensorpipe_options=dict(tensorpipe_options or {}))

    def build_backend(self, count: int) -> Backend:
        from ...transport.rpc import RPCBackend, node_name
        from ...worker.nodes import RPC_CALLS, node_main

        device_maps = None
        if self.visible_devices is not None:
            device_maps = {node_name(node + 1): {"cpu": str(device)} for node, device in enumerate(self.visible_devices)}
        return RPCBackend(count, node_main, RPC_CALLS, self.network, launcher=self.launcher,
                          tensorpipe_options=self.tensorpipe_options, device_maps=device_maps,
                          slurm_kwargs=self.slurm_kwargs, start_method=self.mp_start_method)


def replicated(value: Any, name: str, count: int, per: str = "collector") -> list:
    """``value`` for each of ``count`` collectors: a list of that length, or one value repeated."""
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} must hold one entry per {per} ({count}), got {len(value)}.")
        return list(value)
    return [value] * count


def remote_configs_of(value: Any, count: int, per: str = "collector") -> list[dict]:
    configs = replicated(DEFAULT_REMOTE_CONFIG if value is None else value, "remote_configs", count, per)
    for config in configs:
        if not isinstance(config, dict):
            raise TypeError(f"remote_configs must be a dict or a list of dicts (ray.remote options), got "
                            f"{type(config).__name__}.")
    return [dict(config) for config in configs]


@dataclass(frozen=True)
class RayOptions(NodeOptions):
    """``RayCollector``: Ray actors, wherever the cluster places them."""

    remote_configs: tuple[dict, ...] = ()
    """``ray.remote`` options of each actor."""
    ray_init_config: dict | None = None
    """``ray.init`` arguments, used only when Ray is not initialised yet."""

    @classmethod
    def parse(cls, owner: str, *, create_env_fn: Any, num_collectors: int | None, collector_kwargs: Any,
              remote_configs: Any, ray_init_config: dict | None, use_env_creator: bool, no_cuda_sync: bool | None,
              replay_buffer: Any, **common: Any) -> RayOptions:
        """Validate ``RayCollector``'s arguments, once: ``num_collectors`` repeats a single env
        constructor, ``collector_kwargs`` or ``remote_configs`` (``use_env_creator`` is accepted: env
        constructors travel through Ray as they are); a ``replay_buffer`` that is a Ray actor is
        written through its ``extend``.

        Raises:
            TypeError, ValueError: naming the argument that does not fit.
        """
        count = num_collectors
        if count is None:
            count = len(create_env_fn) if isinstance(create_env_fn, (list, tuple)) else 1
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"num_collectors must be a positive int, got {count!r}")
        env_fns = replicated(create_env_fn, "create_env_fn", count)
        if not isinstance(collector_kwargs, (list, tuple)):
            collector_kwargs = [dict(collector_kwargs or {}) for _ in range(count)]
        configs = remote_configs_of(remote_configs, count)
        return cls(**cls.parse_common(owner, create_env_fn=env_fns, collector_kwargs=collector_kwargs,
                                      no_cuda_sync=bool(no_cuda_sync), update_interval=None,
                                      replay_buffer=as_replay_buffer(replay_buffer), **common),
                   remote_configs=tuple(configs), ray_init_config=ray_init_config)

    def build_backend(self, count: int) -> Backend:
        from ...transport.ray import RayBackend
        from ...worker import run_worker

        return RayBackend(count, run_worker, list(self.remote_configs), heartbeat_timeout=self.heartbeat_timeout,
                          start_timeout=self.worker_timeout)


#: the launcher that starts no node: nodes join from anywhere (``join_command()``, docs/elastic.md)
EXTERNAL = "external"


def _check_launcher(launcher: str, external: bool = False) -> None:
    from ..distributed.slurm import LAUNCHERS

    allowed = list(LAUNCHERS) + ([EXTERNAL] if external else [])
    if launcher not in allowed:
        raise ValueError(f"launcher must be one of {allowed}, got {launcher!r}")
    if launcher in ("submitit", "submitit_delayed"):
        try:
            import submitit  # noqa: F401  (only whether it is there)
        except ImportError as err:
            raise ImportError(f"launcher={launcher!r} needs submitit: pip install 'rlharvest[slurm]'") from err


def _check_external(backend: str, slurm_kwargs: dict | None, mp_start_method: str | None) -> None:
    """``launcher="external"`` starts no node: options about starting nodes do not apply, and a node
    joins into a slot with a group of its own, which only pair backends form."""
    from ...transport.rendezvous import PAIR_BACKENDS

    if backend not in PAIR_BACKENDS:
        raise ValueError(f"launcher='external' needs backend in {list(PAIR_BACKENDS)} (each joining node forms a group "
                         f"of its own), got backend={backend!r}.")
    if slurm_kwargs:
        raise ValueError("slurm_kwargs does not apply with launcher='external': the collector starts no node "
                         "(start them with collector.join_command()).")
    if mp_start_method is not None:
        raise ValueError("mp_start_method does not apply with launcher='external': the collector starts no node "
                         "(start them with collector.join_command()).")
