"""Weights pushed without being asked: before each batch, every k batches, or to a worker left without
an update for too long (docs/weights.md, "Automatic updates"). One part for every collector with
workers; what it does is the rules its options hand over (:class:`WeightPushes`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

__all__ = ["WeightPushes", "WeightSchedule"]


@dataclass(frozen=True)
class WeightPushes:
    """When the engine pushes the policy's weights to the workers without being asked."""

    before_each_batch: bool = False
    """Before every sync request, or before an async worker is asked again (``update_at_each_batch``,
    ``update_after_each_batch``)."""
    every: int | None = None
    """Every this many yielded batches, to the workers that served them (``update_interval``)."""
    max_interval: int = -1
    """To a worker left without an update for more than this many batches (-1: never;
    ``max_weight_update_interval``)."""
    free_running: bool = False
    """Workers run free during iteration (``DistributedSyncCollector``): the weights are pushed
    without acknowledgement before batches 0, k, 2k, ... (k = ``every``), the version counted here."""
    per_target_counters: bool = False
    """Count batches since each worker's last update (nodes); a checkpoint keeps the counters."""
    name_targets: bool = True
    """A push before a sync batch names the workers it updates (False: one update of every worker)."""
    skip_before_first: bool = False
    """Async: no push before a worker's first rollout (its initial weights are fresh)."""


class WeightSchedule:
    """When the engine pushes weights by itself.

    Args:
        pushes: the rules (from the options).
        push: ``push(workers)`` sends the policy's weights to ``workers`` (None: every worker at
            once), as the engine's ``update_policy_weights_(worker_ids=workers)``.
        num_workers: worker slots at the start.
    """

    def __init__(self, pushes: WeightPushes, push: Callable[[Optional[list[int]]], None], num_workers: int) -> None:
        self.rules = pushes
        self.push = push
        #: batches served since each worker's last update (nodes' ``max_weight_update_interval``)
        self.since_update = [0] * num_workers
        #: batches yielded so far (``update_interval`` counts them)
        self.yielded = 0

    def before_batch(self, workers: list[int]) -> None:
        """Sync: before every request of ``workers`` (``update_at_each_batch``/``update_after_each_batch``)."""
        if self.rules.before_each_batch:
            self.push(workers if self.rules.name_targets else None)

    def before_relaunch(self, worker: int, started: bool) -> None:
        """Async: before ``worker`` is asked again (not before its first rollout unless ``started``)."""
        if self.rules.before_each_batch and (started or not self.rules.skip_before_first):
            self.push([worker])

    def after_yield(self, served: list[int], active: list[int], done: bool) -> None:
        """A batch from ``served`` was yielded: push where ``update_interval`` or
        ``max_weight_update_interval`` says (nothing once ``done``)."""
        if self.rules.per_target_counters:
            for worker in served:
                self.since_update[worker] += 1
        self.yielded += 1
        if done:
            return
        every = self.rules.every
        if every and self.yielded % every == 0 and not self.rules.free_running:
            self.push(served)
        if self.rules.max_interval >= 0:
            late = [w for w in active if self.since_update[w] > self.rules.max_interval]
            if late:
                self.push(late)

    def free_running_due(self) -> bool:
        """Workers running free: whether the weights are pushed before this batch (batches 0, k, 2k...)."""
        return self.rules.free_running and self.yielded % (self.rules.every or 1) == 0

    def updated(self, workers: list[int]) -> None:
        """Any update of ``workers`` (asked by the user too) resets their counters."""
        for worker in workers:
            if isinstance(worker, int) and 0 <= worker < len(self.since_update):
                self.since_update[worker] = 0

    def grow(self, count: int, mid_batch: bool) -> None:
        """``count`` workers joined; a sync batch yielded but not accounted for yet (``mid_batch``)
        counts every worker, the new ones included."""
        self.since_update.extend([-1 if mid_batch else 0] * count)

    def state(self) -> dict:
        return {"batches_since_update": list(self.since_update), "yielded": int(self.yielded)}

    def restore(self, state: dict) -> None:
        """Continue from :meth:`state` (a checkpoint of a collector without these counters keeps ours)."""
        if "batches_since_update" in state:
            self.since_update = list(state["batches_since_update"])
            self.yielded = int(state["yielded"])
