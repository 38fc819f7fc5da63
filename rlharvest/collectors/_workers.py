"""The members every public collector with workers shows (TorchRL's, and rlharvest's elastic ones),
written once here and named in each face's class body (``remove_collectors = _workers.remove_collectors``):
each is one call to the part that acts, so no face needs a base class between it and TorchRL's
(docs/architecture.md).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, cast

from .base import BaseCollector
from .engine.engine import CollectionEngine

__all__ = ["worker_pids", "num_workers", "active_workers", "restart_causes", "remove_collectors",
           "add_collectors", "worker_policy_versions"]


def _fleet_engine(collector: BaseCollector, action: str | None = None) -> CollectionEngine:
    """The engine with workers behind ``collector`` (open, when ``action`` is named)."""
    return cast(CollectionEngine, collector._open(action) if action is not None else collector._engine)


def worker_pids(self: BaseCollector) -> list[int | None]:
    """The process id of each worker that is a process of this machine (a worker process, an ``"mp"``
    node), None for the others (a SLURM job, a Ray actor, a thread). For monitoring, and for tests that
    inject faults (docs/restarts.md).

    Example:
        >>> collector.worker_pids()                              # doctest: +SKIP
        [41236, 41237]
    """
    return _fleet_engine(self).fleet.pids()


def _num_workers(self: BaseCollector) -> int:
    """Worker slots: every index given so far, those of workers that left included."""
    return len(_fleet_engine(self).fleet)


def _active_workers(self: BaseCollector) -> list[int]:
    """The indices of the workers collecting now (those that left are not there), in order."""
    return _fleet_engine(self).fleet.active


def _restart_causes(self: BaseCollector) -> tuple:
    """Why each worker was replaced, or left on a preemption (kind ``"preempted"``), so far, oldest first
    (docs/restarts.md, docs/elastic.md)."""
    return _fleet_engine(self).fleet.restarts.history()


num_workers = property(_num_workers)
active_workers = property(_active_workers)
restart_causes = property(_restart_causes)


def remove_collectors(self: BaseCollector, indices: int | Sequence[int], timeout: float | None = None) -> None:
    """Make the workers ``indices`` leave the collection, gracefully (docs/elastic.md).

    Each stops at a rollout boundary: between two batches nothing is in flight; with ``sync=False`` its
    rollout in flight is cut short and dropped whole (never counted), so no frame is doubled and
    ``total_frames`` stays exact. Its process (node, actor) is gone when this returns: it is asked to
    close, and terminated if it has not within ``timeout`` seconds (default ``worker_timeout``). The
    other workers keep their indices: a removed index stays an empty slot (``num_workers`` counts slots,
    ``active_workers`` lists the workers collecting, ``stats()["workers"]`` counts them). With
    ``sync=True`` the next batch stacks one rollout of each remaining worker: it shrinks by the removed
    workers' share, and ``requested_frames_per_batch`` and ``len()`` follow.

    Args:
        indices: a worker index, or a list of them.
        timeout: seconds the workers have to stop and close (None: ``worker_timeout``).

    Raises:
        ValueError: for an index that is not a current worker, or when no worker would be left.
        RuntimeError: after shutdown, while running free (:meth:`start`), or from inside the collector's
            own iteration (a ``postproc``, another thread).

    Example:
        >>> from rlharvest.collectors import MultiSyncCollector
        >>> from rlharvest.envs import CountingEnv
        >>> collector = MultiSyncCollector([CountingEnv] * 2, frames_per_batch=8, total_frames=16)
        >>> collector.remove_collectors([1])
        >>> collector.active_workers, collector.requested_frames_per_batch
        ([0], 4)
        >>> collector.shutdown()
    """
    _fleet_engine(self, "remove_collectors()").membership.remove(indices, timeout)


def add_collectors(self: BaseCollector, create_env_fn: Callable | Sequence[Callable], num_envs: int | None = None,
                   policy: Any = None, collector_kwargs: dict | Sequence[dict] | None = None) -> None:
    """Add one worker per entry of ``create_env_fn`` to the running collector (docs/elastic.md).

    The new workers take the indices after every slot (``W``, ``W + 1``, ..., removed workers' slots
    included), start on the weights of the last update and the current policy version, with seeds that
    continue the chain of the last :meth:`set_seed`, and trajectory ids never used before. From the
    next batch on they collect like the others: with ``sync=True`` each adds one rollout of the first
    worker's share of ``frames_per_batch`` to every batch (``requested_frames_per_batch`` and ``len()``
    follow); asynchronously each yields batches of ``frames_per_batch`` frames.

    Args:
        create_env_fn: an env constructor, or a list of them (one per new worker).
        num_envs: envs per new worker (1 for worker processes and nodes running a single ``Collector``).
        policy: None or this collector's policy, or a list of those (one per new worker).
        collector_kwargs: a dict of extra arguments for every new worker's collector, or one per new
            worker (``frames_per_batch`` other than the worker's share is refused).

    Raises:
        ValueError: for an argument that does not fit (named in the message).
        NotImplementedError: when this collector's backend or weight sender cannot grow.
        RuntimeError: after shutdown, while running free, or from inside the collector's own iteration.
        WorkerError: naming a new worker that failed to start (the new workers are then stopped; the
            collector goes on with the others, as it was).

    Example:
        >>> from rlharvest.collectors import MultiSyncCollector
        >>> from rlharvest.envs import CountingEnv
        >>> collector = MultiSyncCollector([CountingEnv], frames_per_batch=4, total_frames=-1)
        >>> collector.add_collectors([CountingEnv])
        >>> collector.active_workers, collector.requested_frames_per_batch
        ([0, 1], 8)
        >>> collector.shutdown()
    """
    _fleet_engine(self, "add_collectors()").add_workers(create_env_fn, num_envs, policy, collector_kwargs)


def worker_policy_versions(self: BaseCollector) -> dict[int, int | str | None]:
    """The policy version each current worker reports, ``{worker index: version}`` (None entries when
    versions are not tracked): asked of every worker, after their rollouts in flight answered. Unlike
    :attr:`policy_version`, it shows workers apart after an update to some of them (docs/weights.md,
    "Versions").

    Example:
        >>> from rlharvest.collectors import MultiSyncCollector
        >>> from rlharvest.envs import CountingEnv
        >>> collector = MultiSyncCollector([CountingEnv] * 2, frames_per_batch=8, total_frames=-1,
        ...                                track_policy_version=True)
        >>> collector.worker_policy_versions()
        {0: 0, 1: 0}
        >>> collector.shutdown()
    """
    return _fleet_engine(self, "worker_policy_versions()").calls.policy_versions()
