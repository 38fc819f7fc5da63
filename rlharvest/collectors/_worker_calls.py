"""The collector methods a collector with workers answers by asking its workers.

Seeds (chained across workers), state dicts (one per worker), resets, hooks, ``map_fn``,
``get_distant_attr``, ``cascade_execute`` into ``workers[i]``, per-worker ``stats``, version bumps and
profiling: each drains the in-flight async rollouts first (nothing is lost, see
``RemoteCollectorBase._drain_async``), then sends one command per worker through the pool, and
remembers on the fleet what a replacement must start with (its seed, its hooks).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from tensordict import TensorDictBase

from ..profiling import ProfileConfig
from ..protocol import Command
from .base import BaseCollector, _argument_sets

__all__ = ["WorkerCallsMixin"]


class WorkerCallsMixin:
    """The per-worker half of the collector API (a base of ``RemoteCollectorBase``).

    It uses the collector's ``_pool`` and ``_fleet``, ``num_workers``, ``noun`` and ``_drain_async``.
    """

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """Seed worker 0 with ``seed`` and worker k with what worker k-1 returned; returns the last.

        Asynchronous collectors drop the batches in flight (collected before the seed): the next batch
        is the first of the seeded envs, as in TorchRL.
        """
        self._drop_async()
        seed = self._seed_workers(range(self.num_workers), seed, static_seed)
        if self._trajectories is not None:
            self._trajectories.drop_in_flight()  # the workers started fresh episodes: those never end
        return seed

    def _seed_workers(self, workers, seed: int, static_seed: bool) -> int:
        """Seed ``workers`` in order, each with what the one before returned; a replacement is seeded
        the same, and workers added later continue the chain. Returns the last seed."""
        for worker in workers:
            self._fleet.remember(worker, seed=seed, static_seed=static_seed)
            seed = self._pool.request(worker, Command.SEED, (seed, static_seed))
        self._seed_chain = (seed, static_seed)
        return seed

    def state_dict(self) -> dict:
        self._drain_async()
        state = {f"worker{w}": self._pool.request(w, Command.STATE_DICT) for w in range(self.num_workers)}
        state.update(frames=self._frames, iter=self._iter)
        counter = getattr(self, "_traj_counter", None)
        if counter is not None:
            state["traj_pool"] = {"traj_id": torch.tensor(counter.peek())}
        if self._version_tracker:
            state["policy_version"] = self._policy_version
        return state

    def load_state_dict(self, state_dict: dict, **kwargs) -> None:
        self._drain_async()
        for worker in range(self.num_workers):
            key = f"worker{worker}"
            if key in state_dict:
                self._pool.request(worker, Command.LOAD_STATE_DICT, state_dict[key])
        self._frames = state_dict["frames"]
        self._iter = state_dict["iter"]
        if "policy_version" in state_dict:
            self._policy_version = int(state_dict["policy_version"])
        counter = getattr(self, "_traj_counter", None)
        if counter is not None and "traj_pool" in state_dict:
            counter.advance_to(int(state_dict["traj_pool"]["traj_id"]))
            self._pool.broadcast(Command.RESET, None)  # episodes restart, with ids after the saved ones

    def reset(self, reset_idx: Sequence[bool] | None = None) -> None:
        """Reset every worker's envs, or those whose entry of ``reset_idx`` is True.

        With ``trajs_per_batch``, the trajectories held back (running, or complete but not yielded yet)
        are dropped, so later batches hold only steps collected after the reset.
        """
        if self._trajectories is not None:
            self._trajectories.flush()
        self._drain_async()
        workers = [w for w in range(self.num_workers) if reset_idx is None or reset_idx[w]]
        self._pool.broadcast(Command.RESET, None, workers)

    def get_distant_attr(self, attr: str) -> list[Any]:
        """The attribute at ``attr`` in every worker's collector, in worker order."""
        return self._pool.broadcast(Command.CASCADE, ("get_distant_attr", (attr,), {}))

    def map_fn(self, method_name: str, list_of_args: list[tuple] | None = None,
               list_of_kwargs: list[dict] | None = None) -> list[Any]:
        """Call ``method_name`` on worker ``i``'s collector with the ``i``-th arguments (one set per worker).

        Raises:
            ValueError: when the number of argument sets is not the number of workers.
        """
        calls = _argument_sets(list_of_args, list_of_kwargs, self.num_workers)
        self._drain_async()
        ids = {w: self._pool.send(w, Command.CASCADE, (method_name, *calls[w])) for w in range(self.num_workers)}
        return [self._pool.wait_for(w, ids[w]).value for w in range(self.num_workers)]

    def stats(self, workers: str = "aggregate") -> dict[str, int | float | bool]:
        """Progress as plain scalars: this collector's (``workers="aggregate"``, no worker is asked),
        each worker's as ``worker_<i>/<key>`` (``"per_worker"``), or both (``"both"``).

        Always there: ``workers``, ``workers_alive``, ``restarts`` (failed workers replaced, over the
        collector's life) and per worker ``worker_<i>/restarts`` and ``worker_<i>/restart_causes``
        (``"<kind>: <message>"`` of each, ``"; "``-separated). docs/restarts.md.

        Raises:
            ValueError: for another ``workers`` value.
        """
        if workers not in ("aggregate", "per_worker", "both"):
            raise ValueError(f"workers must be one of 'aggregate', 'per_worker' or 'both', got {workers!r}")
        stats: dict[str, int | float | bool] = super().stats() if workers != "per_worker" else {}
        stats["workers"] = self.num_workers
        stats["workers_alive"] = sum(not self._pool.is_dead(w) for w in range(self.num_workers)) if self._pool else 0
        if self._fleet is not None:  # kept here, no worker is asked
            stats.update(self._fleet.restarts.stats(self.num_workers))
        if workers != "aggregate":
            for worker, worker_stats in enumerate(self.map_fn("stats")):
                stats.update({f"worker_{worker}/{key}": value for key, value in worker_stats.items()})
        return stats

    def _set_hook(self, name: str, hook) -> None:
        """Hooks run where batches are collected: in the workers."""
        super()._set_hook(name, hook)
        if self._pool is not None:
            from ._worker_args import wrap_callable

            self._drain_async()
            self._pool.broadcast(Command.CASCADE, (f"set{name.rstrip('_')}", (wrap_callable(hook),), {}))
            for worker, spec in enumerate(self._fleet.specs):  # a replacement gets the same hook
                if spec is not None:
                    self._fleet.remember(worker, collector_kwargs={**spec.collector_kwargs,
                                                                   name.strip("_"): wrap_callable(hook)})

    def getattr_policy(self, name: str) -> Any:
        return self._pool.request(0, Command.GETATTR_POLICY, name)

    def getattr_env(self, name: str) -> Any:
        return self._pool.request(0, Command.GETATTR_ENV, name)

    def getattr_rb(self, name: str) -> Any:
        return getattr(self.config.replay_buffer, name)

    def cascade_execute(self, attr_path: str, *args, **kwargs) -> Any:
        """Like :meth:`BaseCollector.cascade_execute`; ``workers[i].<path>`` runs inside worker i's
        collector, and ``workers.<path>`` inside every worker (a list of results)."""
        head, _, rest = attr_path.partition(".")
        if head == "workers" or head.startswith("workers["):
            if not rest:
                raise ValueError(f"{attr_path!r}: give the path to run inside the worker after 'workers[i].'")
            workers = range(self.num_workers) if head == "workers" else [int(head[len("workers["):-1])]
            results = [self._pool.request(w, Command.CASCADE, (rest, args, kwargs)) for w in workers]
            return results if head == "workers" else results[0]
        return super().cascade_execute(attr_path, *args, **kwargs)

    def increment_version(self) -> None:
        super().increment_version()
        if self._pool is not None:
            self._drain_async()
            self._pool.broadcast(Command.CASCADE, ("increment_version", (), {}))

    def _after_weights_sent(self, work: dict) -> None:
        # Workers bumped their own versions when they applied the update: only ours moves here.
        if "policy" in work:
            BaseCollector.increment_version(self)

    def forward_initial_weights(self, model_id: str, weights: TensorDictBase) -> None:
        """Initial weights received from a parent continue down to our own workers (no version bump)."""
        scheme = (self._weight_sync_schemes or {}).get(model_id)
        if scheme is not None and self._pool is not None:
            scheme.send(weights=weights)

    # ------------------------------------------------------------------ profiling
    def _apply_profile_config(self, config: ProfileConfig) -> None:
        workers = [w for w in config.workers if 0 <= w < self.num_workers]
        replies = self._pool.broadcast(Command.ENABLE_PROFILE, config, workers, timeout=30.0)
        for worker, reply in zip(workers, replies):
            if reply != "profiling":
                raise RuntimeError(f"{self.noun} {worker} answered {reply!r} to enable_profile.")

    def _stop_profiling(self) -> None:
        if self._pool is not None:
            self._drain_async()
            self._pool.broadcast(Command.CASCADE, ("disable_profile", (), {}))
