"""RayCollector: one Ray actor per env constructor, each running the worker loop around its own collector.

Everything but where the workers run is DistributedCollector's: arguments, trajectory ids
(``k * W + i``), automatic weight pushes (``update_after_each_batch``,
``max_weight_update_interval``), ``start()``/``pause()`` into a replay buffer, and the collector
logic of RemoteCollectorBase. The actors are the workers of the ``ray`` backend
(``rlharvest.transport.ray``); weights go through RayWeightSyncScheme (docs/ray.md).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterator

from tensordict import TensorDictBase

from ...config import positive_seconds
from ...protocol import Command
from ...transport.base import Backend
from ...transport.ray import DEFAULT_REMOTE_CONFIG, RayBackend, ensure_ray, require_ray
from ...worker import run_worker
from .._signatures import bind_arguments, derived_signature, keyword, method_signature
from .generic import DistributedCollector

__all__ = ["RayCollector"]

#: DistributedCollector's arguments that say where nodes run: a Ray cluster decides that
_NOT_RAY = ("slurm_kwargs", "backend", "update_interval", "launcher", "tcp_port", "mp_start_method", "bind_address",
            "authkey", "handshake_timeout")


def _replicated(value: Any, name: str, count: int) -> list:
    """``value`` for each of ``count`` collectors: a list of that length, or one value repeated."""
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} must hold one entry per collector ({count}), got {len(value)}.")
        return list(value)
    return [value] * count


def _remote_configs(value: Any, count: int) -> list[dict]:
    configs = _replicated(DEFAULT_REMOTE_CONFIG if value is None else value, "remote_configs", count)
    for config in configs:
        if not isinstance(config, dict):
            raise TypeError(f"remote_configs must be a dict or a list of dicts (ray.remote options), got "
                            f"{type(config).__name__}.")
    return [dict(config) for config in configs]


class _ActorBuffer:
    """A replay buffer that is itself a Ray actor, written through its ``extend`` method."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def extend(self, data: TensorDictBase) -> Any:
        return require_ray().get(self.actor.extend.remote(data))

    def __getattr__(self, name: str) -> Any:
        return require_ray().get(getattr(self.actor, name).remote())


class RayCollector(DistributedCollector):
    """Collect with one Ray actor per entry of ``create_env_fn``.

    Takes DistributedCollector's arguments except those saying where nodes run (``launcher``,
    ``backend``, ``tcp_port``, ``slurm_kwargs``, ...), plus:

    Keyword Args:
        ray_init_config: ``ray.init`` arguments, used only when Ray is not initialised yet.
        remote_configs: ``ray.remote`` options of each actor (one dict, or one per collector);
            default ``{"num_cpus": 1}``, which fits any machine, GPU or not.
        num_collectors: how many actors; a single ``create_env_fn``, ``collector_kwargs`` or
            ``remote_configs`` is then repeated for each.
        trust_policy, no_cuda_sync, trajs_per_batch, pre_collect_hook, post_collect_hook: forwarded
            to every actor's collector.
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

    __signature__ = derived_signature(
        DistributedCollector.__init__, drop=_NOT_RAY, after="sync",
        add=(keyword("ray_init_config", annotation="dict | None"),
             keyword("remote_configs", annotation="dict | list[dict] | None"),
             keyword("num_collectors", annotation="int | None")))
    __signature__ = __signature__.replace(parameters=[
        *__signature__.parameters.values(), keyword("trust_policy", annotation="bool | None"),
        keyword("use_env_creator", False, "bool"), keyword("no_cuda_sync", annotation="bool | None"),
        keyword("trajs_per_batch", annotation="int | None"), keyword("pre_collect_hook"),
        keyword("post_collect_hook")])

    noun = "actor"

    def __init__(self, *args, **kwargs) -> None:
        arguments = bind_arguments(type(self).__name__, self.__signature__, args, kwargs)
        count = arguments.pop("num_collectors")
        env_fns = arguments["create_env_fn"]
        if count is None:
            count = len(env_fns) if isinstance(env_fns, (list, tuple)) else 1
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"num_collectors must be a positive int, got {count!r}")
        arguments["create_env_fn"] = _replicated(env_fns, "create_env_fn", count)
        if not isinstance(arguments["collector_kwargs"], (list, tuple)):
            arguments["collector_kwargs"] = [dict(arguments["collector_kwargs"] or {}) for _ in range(count)]
        self._remote_configs = _remote_configs(arguments.pop("remote_configs"), count)
        self._ray_init_config = arguments.pop("ray_init_config")
        arguments.pop("use_env_creator")
        if arguments["no_cuda_sync"] is None:
            arguments["no_cuda_sync"] = False
        arguments["update_interval"] = None
        ray = require_ray()
        if isinstance(arguments["replay_buffer"], ray.actor.ActorHandle):
            arguments["replay_buffer"] = _ActorBuffer(arguments["replay_buffer"])
        self._closed = True
        self._setup(arguments)
        self._closed = False
        if arguments["weight_recv_schemes"] is not None:
            self.register_scheme_receiver(arguments["weight_recv_schemes"])

    __init__.__signature__ = method_signature(__signature__)

    # ------------------------------------------------------------------ construction
    def _setup_transport(self, arguments: dict) -> None:
        self.backend = self.launcher = None
        self._worker_timeout = positive_seconds("worker_timeout", arguments["worker_timeout"])
        self._heartbeat_timeout = positive_seconds("heartbeat_timeout", arguments["heartbeat_timeout"])
        ensure_ray(self._ray_init_config)

    def _check_transport_arguments(self, arguments: dict) -> None:
        """Ray places the actors: there is no launcher to check."""

    def _make_backend(self, count: int) -> Backend:
        return RayBackend(count, run_worker, self._remote_configs, heartbeat_timeout=self._heartbeat_timeout,
                          start_timeout=self._worker_timeout)

    @property
    def _wait_until_built(self) -> bool:
        # Async: iteration starts each actor's first rollout as soon as it is built and yields the
        # first batch ready, so the constructor does not wait for the slowest actor (docs/ray.md).
        return self._sync

    # ------------------------------------------------------------------ TorchRL's Ray API
    @property
    def num_collectors(self) -> int:
        return self.num_workers

    @property
    def remote_collectors(self) -> list:
        """The Ray actor handles of the workers, in worker order (each runs one collector)."""
        pool = self._pool
        return [handle.actor for handle in pool.handles] if pool is not None and not self._closed else []

    def local_policy(self):
        """The policy of this process (the source of the actors' weights)."""
        return self.policy

    def stop_remote_collectors(self) -> None:
        """Stop every actor (the collector cannot collect afterwards)."""
        self.shutdown()

    def add_collectors(self, *args, **kwargs) -> None:
        """Not available: a RayCollector's actors are fixed when it is built (pass ``num_collectors``
        or one env constructor per actor).

        An actor added later would change what the running ones produce: trajectory ids are
        ``k * W + i`` for ``W`` actors, ``sync=True`` splits ``frames_per_batch`` evenly across the
        actors and stacks one rollout of each, and the workers, their weight channels and their
        restart budget are started as one set (docs/ray.md, "Adding actors").

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError("RayCollector fixes its actors when it is built (trajectory ids, the sync batch "
                                  "layout and weight sync depend on their number): pass num_collectors or one env "
                                  "constructor per actor, or build a second RayCollector.")

    # ------------------------------------------------------------------ iteration
    def _iterate(self) -> Iterator[TensorDictBase | None]:
        yield from super()._iterate()
        if self._reached_total():  # TorchRL's RayCollector releases its actors at the end of iteration
            self.shutdown()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> list[OrderedDict]:
        """One state dict per actor, in actor order."""
        self._drain_async()
        return [self._pool.request(worker, Command.STATE_DICT) for worker in range(self.num_workers)]

    def load_state_dict(self, state_dict: dict | list[dict], **kwargs) -> None:
        """Load one state dict into every actor, or the ``i``-th of a list into actor ``i``.

        Raises:
            ValueError: for a list that does not hold one state dict per actor.
        """
        states = list(state_dict) if isinstance(state_dict, (list, tuple)) else [state_dict] * self.num_workers
        if len(states) != self.num_workers:
            raise ValueError(f"load_state_dict takes one state dict or {self.num_workers} (one per actor), "
                             f"got {len(states)}.")
        self._drain_async()
        for worker, state in enumerate(states):
            self._pool.request(worker, Command.LOAD_STATE_DICT, state)

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

    def __repr__(self) -> str:
        mode = "sync" if self._sync else "async"
        return f"RayCollector(actors={self.num_workers}, {mode}, frames={self._frames})"
