"""RayCollector: one Ray actor per env constructor, each running the worker loop around its own collector.

Everything but where the workers run is :class:`~.nodes.NodeCollector`'s: trajectory ids
(``k * W + i``; in segments once actors are added, ``collectors/_traj_ids.py``), automatic weight
pushes (``update_after_each_batch``, ``max_weight_update_interval``), ``start()``/``pause()`` into a
replay buffer, and the collector logic of RemoteCollectorBase. The actors are the workers of the
``ray`` backend (``rlharvest.transport.ray``); weights go through RayWeightSyncScheme (docs/ray.md).
Workers join and leave a running collection (:meth:`RayCollector.add_collectors`, as TorchRL, and
``remove_collectors``, as every collector with workers: docs/elastic.md).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any, Callable, Iterator, Sequence

from tensordict import TensorDictBase

from ...protocol import Command
from ...transport.ray import ensure_ray, require_ray
from .._signatures import bind_arguments, derived_signature, keyword, method_signature
from ..options.nodes import RayOptions, remote_configs_of
from .torchdist import DistributedCollector
from .nodes import NodeCollector

__all__ = ["RayCollector"]

#: the key of the collector's own part of a checkpoint, in the first actor's state dict
COLLECTOR_KEY = "rlharvest_collector"

#: DistributedCollector's arguments that say where nodes run: a Ray cluster decides that
_NOT_RAY = ("slurm_kwargs", "backend", "update_interval", "launcher", "tcp_port", "mp_start_method", "bind_address",
            "authkey", "handshake_timeout")

class RayCollector(NodeCollector):
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
        keyword("trajs_per_batch", annotation="int | None"), keyword("traj_format", annotation="str | None"),
        keyword("pre_collect_hook"),
        keyword("post_collect_hook")])

    noun = "actor"

    def __init__(self, *args, **kwargs) -> None:
        arguments = bind_arguments(type(self).__name__, self.__signature__, args, kwargs)
        self._construct(arguments)

    __init__.__signature__ = method_signature(__signature__)

    # ------------------------------------------------------------------ construction
    def _parse(self, arguments: dict[str, Any]) -> RayOptions:
        options = RayOptions.parse(type(self).__name__, **arguments)
        ensure_ray(options.ray_init_config)
        return options

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
        pool = self._requests
        return [handle.actor for handle in pool.handles] if pool is not None and not self._closed else []

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
        count = len(create_env_fn) if isinstance(create_env_fn, (list, tuple)) else 1
        self._add_nodes(create_env_fn, num_envs, policy, collector_kwargs,
                        lambda: remote_configs_of(remote_configs, count, f"new {self.noun} (one per entry of "
                                                                         "create_env_fn)"))

    def stats(self, workers: str = "aggregate", *, timeout: float | None = 10.0) -> dict[str, int | float | bool]:
        """Progress as plain scalars, as :meth:`MultiCollector.stats <rlharvest.collectors.MultiCollector.stats>`,
        with TorchRL's Ray additions: every call asks each actor for its own snapshot (so that a hung
        actor cannot block a monitoring thread, it waits at most ``timeout`` seconds), and
        ``workers_alive`` counts the actors that answered. ``"aggregate"`` and ``"both"`` add
        ``worker_frames``, the sum of the actors' ``frames`` (how many frames they collected, including
        those a replay buffer received directly); ``"per_worker"`` and ``"both"`` add each actor's snapshot
        as ``worker_<i>/<key>``.

        Args:
            workers: ``"aggregate"``, ``"per_worker"`` or ``"both"``.
            timeout: seconds to wait for the actors' snapshots (None: no limit); an actor that does not
                answer in time, or died, is left out.

        Raises:
            ValueError: for another ``workers`` value, or a negative ``timeout``.

        Example:
            >>> collector.stats(timeout=1.0)["worker_frames"]          # doctest: +SKIP
            200
        """
        if workers not in ("aggregate", "per_worker", "both"):
            raise ValueError(f"workers must be one of 'aggregate', 'per_worker' or 'both', got {workers!r}")
        if timeout is not None and (isinstance(timeout, bool) or not timeout >= 0):
            raise ValueError(f"timeout must be a non-negative number of seconds or None, got {timeout!r}")
        snapshots = self._broadcast.stats_within(timeout) if self._broadcast is not None and not self._closed else {}
        stats = super().stats("aggregate") if workers != "per_worker" else {}
        active = self.active_workers
        stats["workers"] = len(active)
        stats["workers_alive"] = len(snapshots)
        if self._fleet is not None:  # kept here, no actor is asked
            stats.update(self._fleet.restarts.stats(self.num_workers))
            stats["workers_removed"] = self.num_workers - len(active)
        if workers != "per_worker" and snapshots:
            stats["worker_frames"] = int(sum(snapshot.get("frames", 0) for snapshot in snapshots.values()))
        if workers != "aggregate":
            for actor, snapshot in sorted(snapshots.items()):
                stats.update({f"worker_{actor}/{key}": value for key, value in snapshot.items()})
        return stats

    # ------------------------------------------------------------------ iteration
    def _iterate(self) -> Iterator[TensorDictBase | None]:
        yield from super()._iterate()
        if self._reached_total():  # TorchRL's RayCollector releases its actors at the end of iteration
            self.shutdown()

    # ------------------------------------------------------------------ state
    def state_dict(self, *, env_state: bool = True) -> list[dict]:
        """One state dict per actor, in actor order, as TorchRL's; the first also holds, under
        ``"rlharvest_collector"``, this collector's own part (counters, layout, seeds, trajectory-id map,
        batches not yielded yet, replay buffer): the list is a complete checkpoint that
        :meth:`load_state_dict` continues exactly (docs/checkpoints.md). Rollouts in flight are
        waited for first.

        Args:
            env_state: False leaves the envs' states and the episodes in flight out.
        """
        full = super().state_dict(env_state=env_state)
        states = [full.pop(f"worker{worker}") for worker in self.active_workers]
        if states:
            states[0] = {**states[0], COLLECTOR_KEY: full}
        return states

    def load_state_dict(self, state_dict: dict | list[dict], **kwargs) -> None:
        """Continue from :meth:`state_dict`'s list (the collector's part included: exactly, as every
        collector), or load TorchRL's: one state dict into every actor, or the ``i``-th of a list into
        actor ``i`` (counters and weights; the collector's counters stay).

        Raises:
            ValueError: for a list that does not hold one state dict per actor.
            CheckpointMismatchError: for a checkpoint of a newer format or of other arguments.
        """
        states = list(state_dict) if isinstance(state_dict, (list, tuple)) else [state_dict] * self.num_workers
        if len(states) != self.num_workers:
            raise ValueError(f"load_state_dict takes one state dict or {self.num_workers} (one per actor), "
                             f"got {len(states)}.")
        collector_part = states[0].get(COLLECTOR_KEY) if isinstance(state_dict, (list, tuple)) else None
        states = [{key: value for key, value in state.items() if key != COLLECTOR_KEY} for state in states]
        if collector_part is not None:
            full = {**collector_part, **{f"worker{worker}": state for worker, state in zip(self.active_workers, states)}}
            super().load_state_dict(full)
            return
        self._drain_async()
        for worker, state in enumerate(states):
            raised = self._requests.request(worker, Command.LOAD_STATE_DICT, state)
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

    def __repr__(self) -> str:
        mode = "sync" if self._sync else "async"
        return f"RayCollector(actors={self.num_workers}, {mode}, frames={self._frames})"
