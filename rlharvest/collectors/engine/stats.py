"""``stats()``, once for every collector: a typed snapshot the engine's parts fill, returned in TorchRL's
dict shape (flat keys, plain scalars; docs/restarts.md, "Watching a run").

A figure lives in the part that knows it: the counters (:class:`~.state.Tally`), throughput and times
(``progress.py``), each worker's figures from its replies (``worker_figures.py``), restarts
(``restarts.py``), and every :class:`StatsSource` the engine lists (a backend's extras, the autoscaler):
adding a figure means adding it to one of those (or one more source); every collector reports it the
same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from .broadcast import WorkerBroadcast
from .fleet import Fleet
from .progress import LatencyHistogram, ProgressMeter
from .state import Lifecycle, Tally
from .output import BatchOutput
from .weights import WeightPublisher
from .worker_figures import WorkerFigures

__all__ = ["StatsSnapshot", "StatsSource", "WORKER_VIEWS", "FleetStats", "LocalStats", "WorkerCensus", "ASKED_WHEN_VIEWED",
           "ASKED_EVERY_TIME", "check_view", "check_timeout"]

#: what ``stats(workers=...)`` accepts
WORKER_VIEWS = ("aggregate", "per_worker", "both")


def check_view(workers: str) -> None:
    """Raises: ValueError for another value than :data:`WORKER_VIEWS`."""
    if workers not in WORKER_VIEWS:
        raise ValueError(f"workers must be one of 'aggregate', 'per_worker' or 'both', got {workers!r}")


@dataclass
class StatsSnapshot:
    """One moment of a collector, as its parts know it."""

    frames: int
    """Frames collected so far."""
    batches: int
    """Batches yielded (or written) so far."""
    total_frames: int | None
    """The frame budget; None when endless."""
    completed: bool
    requested_frames_per_batch: int
    policy_version: Any = None
    """The current version when versions are tracked (an int), else None."""
    progress: dict[str, float | int] = field(default_factory=dict)
    """Throughput, policy lag and weight-update latency (``ProgressMeter.stats``)."""
    times: dict[str, float] = field(default_factory=dict)
    """Seconds per part of collection (``env``, ``policy``, ``transport``, ``waiting``)."""
    fleet: dict[str, int | str] | None = None
    """Collectors with workers: ``workers``, ``workers_alive``, restarts, ``workers_removed``..."""
    per_worker: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Each worker's own snapshot, by index (asked of the workers)."""
    collected: dict[str, int] = field(default_factory=dict)
    """Frames stepped, of complete and pending trajectories, written to the replay buffer; complete
    trajectories (``BatchOutput.progress``: TorchRL's next release)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Figures of optional parts (the autoscaler's ``autoscale/...``)."""
    weight_version: int = 0
    """Weight updates published so far (the policy version, tracked or not)."""
    weight_syncs: LatencyHistogram | None = None
    """Every weight update's latency so far, in buckets (what the monitor exports; not in :meth:`as_dict`)."""
    worker_states: dict[int, str] = field(default_factory=dict)
    """Each active worker's state (not in :meth:`as_dict`): ``"starting"`` (no batch taken from it
    yet), ``"collecting"`` or ``"failed"`` (found dead, not replaced yet)."""

    def as_dict(self, workers: str = "aggregate") -> dict[str, Any]:
        """The flat dict TorchRL's ``stats()`` returns: this collector's figures (``"aggregate"``),
        each worker's as ``worker_<i>/<key>`` (``"per_worker"``), or both."""
        check_view(workers)
        stats: dict[str, Any] = {}
        if workers != "per_worker":
            stats.update(frames=int(self.frames), batches=int(self.batches))
            if self.total_frames is not None:
                stats["total_frames"] = int(self.total_frames)
            stats["completed"] = bool(self.completed)
            stats["requested_frames_per_batch"] = int(self.requested_frames_per_batch)
            stats.update(self.collected)
            if isinstance(self.policy_version, int):
                stats["policy_version"] = self.policy_version
            stats.update(self.progress)
            stats.update({f"time_{part}_s": seconds for part, seconds in self.times.items()})
        if self.fleet is not None:
            stats.update(self.fleet)
            if workers != "per_worker" and "worker_frames" in self.extra:
                stats["worker_frames"] = self.extra["worker_frames"]
        if workers != "aggregate":
            for worker, snapshot in sorted(self.per_worker.items()):
                stats.update({f"worker_{worker}/{key}": value for key, value in snapshot.items()})
        if workers != "per_worker":
            stats.update({key: value for key, value in self.extra.items() if key != "worker_frames"})
        return stats


class StatsSource(Protocol):
    """A part that adds figures to ``stats()`` (flat keys, plain scalars)."""

    def stats(self) -> dict[str, Any]:
        """This part's figures now."""


def check_timeout(timeout: float | None) -> None:
    """Raises: ValueError for a negative (or non-numeric) ``timeout``."""
    if timeout is not None and (isinstance(timeout, bool) or not timeout >= 0):
        raise ValueError(f"timeout must be a non-negative number of seconds or None, got {timeout!r}")


class WorkerCensus(Protocol):
    """When ``stats()`` asks the workers for their own snapshots, and who counts as alive."""

    def answers(self, broadcast: WorkerBroadcast, active: list[int], view: str,
                timeout: float | None) -> dict[int, dict]:
        """``{worker: its stats()}`` asked for this ``view`` (none when not asked)."""

    def alive(self, answers: dict[int, dict], fleet: Fleet, active: list[int]) -> int:
        """How many workers are alive."""

    def figures(self, answers: dict[int, dict]) -> dict[str, Any]:
        """What the answers add to the aggregate."""


class _AskedWhenViewed:
    """The workers are asked only for a per-worker view; alive: not found dead."""

    def answers(self, broadcast: WorkerBroadcast, active: list[int], view: str,
                timeout: float | None) -> dict[int, dict]:
        return dict(zip(active, broadcast.worker_stats())) if view != "aggregate" else {}

    def alive(self, answers: dict[int, dict], fleet: Fleet, active: list[int]) -> int:
        requests = fleet.requests
        return sum(not requests.is_dead(w) for w in active) if requests is not None else 0

    def figures(self, answers: dict[int, dict]) -> dict[str, Any]:
        return {}


class _AskedEveryTime:
    """Every ``stats()`` asks each worker (within ``timeout``); alive: those that answered; their frames
    summed as ``worker_frames`` (``RayCollector``, as TorchRL's)."""

    def answers(self, broadcast: WorkerBroadcast, active: list[int], view: str,
                timeout: float | None) -> dict[int, dict]:
        return broadcast.stats_within(timeout)

    def alive(self, answers: dict[int, dict], fleet: Fleet, active: list[int]) -> int:
        return len(answers)

    def figures(self, answers: dict[int, dict]) -> dict[str, Any]:
        if not answers:
            return {}
        return {"worker_frames": int(sum(answer.get("frames", 0) for answer in answers.values()))}


ASKED_WHEN_VIEWED: WorkerCensus = _AskedWhenViewed()
ASKED_EVERY_TIME: WorkerCensus = _AskedEveryTime()


class FleetStats:
    """The snapshot of a collector with workers: its counters and progress, the fleet's figures (kept
    here, no worker is asked), each worker's own snapshot when its census asks, and what its sources add.

    Args:
        tally: frames and batches so far, against ``total_frames``.
        progress: throughput, lag, weight-update latency and where the time goes.
        weights: the policy version (tracked or not).
        frames_per_batch: the frames of the next batch.
        fleet: the workers (restarts, who left, who is found dead).
        figures: each worker's figures, kept from its replies.
        broadcast: asks the workers for their own snapshots.
        life: whether the collector is open (a closed one asks nobody).
        census: when the workers are asked, and who counts as alive.
        sources: the parts that add figures (a backend's extras, the autoscaler).
        steps_only: the workers send steps, not batches (env workers of a policy server): they are
            collecting from their start.
        output: the batches' way out (complete trajectories, replay-buffer writes), or None.
    """

    def __init__(self, tally: Tally, progress: ProgressMeter, weights: WeightPublisher,
                 frames_per_batch: Callable[[], int], fleet: Fleet, figures: WorkerFigures,
                 broadcast: WorkerBroadcast, life: Lifecycle, census: WorkerCensus = ASKED_WHEN_VIEWED,
                 sources: Sequence[StatsSource] = (), steps_only: bool = False,
                 output: BatchOutput | None = None) -> None:
        self.output = output
        self.tally = tally
        self.progress = progress
        self.weights = weights
        self.frames_per_batch = frames_per_batch
        self.fleet = fleet
        self.figures = figures
        self.broadcast = broadcast
        self.life = life
        self.census = census
        self.sources = list(sources)
        self.steps_only = steps_only

    def snapshot(self, workers: str = "aggregate", timeout: float | None = 10.0) -> StatsSnapshot:
        """Raises: ValueError for another ``workers`` view or a negative ``timeout``."""
        check_view(workers)
        check_timeout(timeout)
        tally, budget, fleet, progress = self.tally, self.tally.budget, self.fleet, self.progress
        open_ = not self.life.closed
        requests = fleet.current_requests
        if self.output is not None and open_ and requests is not None:  # workers writing the replay buffer
            self.output.count_advertised((worker, requests.handles[worker]) for worker in requests.active())
        snapshot = StatsSnapshot(
            frames=tally.frames, batches=tally.batches, total_frames=None if budget.endless else budget.total_frames,
            completed=tally.reached_total(), requested_frames_per_batch=self.frames_per_batch(),
            policy_version=self.weights.acknowledged_version, progress=progress.stats(), times=dict(progress.seconds),
            weight_version=self.weights.version, weight_syncs=progress.weight_sync_histogram(),
            collected=self.output.progress(tally.frames) if self.output is not None else {})
        active = fleet.active
        answers = self.census.answers(self.broadcast, active, workers, timeout) if open_ else {}
        alive = self.census.alive(answers, fleet, active) if open_ else 0
        slots = len(fleet)
        snapshot.fleet = {"workers": len(active), "workers_alive": alive, **fleet.restarts.stats(slots),
                          "workers_removed": slots - len(active), **self.figures.stats(active)}
        snapshot.extra.update(self.census.figures(answers))
        snapshot.per_worker = answers
        requests = fleet.requests if open_ else None
        snapshot.worker_states = {
            worker: "failed" if requests is not None and requests.is_dead(worker)
            else "collecting" if self.steps_only or f"worker_{worker}/frames" in snapshot.fleet else "starting"
            for worker in active}
        for source in self.sources:
            snapshot.extra.update(source.stats())
        return snapshot

    def time_split(self) -> dict[str, float]:
        """Seconds per part of collection (the workers' env and policy seconds come with their replies)."""
        return dict(self.progress.seconds)


class LocalStats:
    """The snapshot of a ``Collector``: its counters and progress, and where its rollouts' time goes.

    Args:
        tally: frames and batches so far, against ``total_frames``.
        progress: throughput, lag, weight-update latency and where the time goes.
        weights: the policy version (tracked or not).
        frames_per_batch: the frames of its batches.
        rollout_seconds: the seconds its rollouts spent in the env and in the policy.
        output: the batches' way out (complete trajectories, replay-buffer writes).
    """

    def __init__(self, tally: Tally, progress: ProgressMeter, weights: WeightPublisher,
                 frames_per_batch: Callable[[], int], rollout_seconds: Callable[[], tuple[float, float]],
                 output: BatchOutput) -> None:
        self.output = output
        self.tally = tally
        self.progress = progress
        self.weights = weights
        self.frames_per_batch = frames_per_batch
        self.rollout_seconds = rollout_seconds

    def snapshot(self, workers: str = "aggregate", timeout: float | None = None) -> StatsSnapshot:
        """Raises: ValueError for another ``workers`` view."""
        check_view(workers)
        tally, budget = self.tally, self.tally.budget
        return StatsSnapshot(
            frames=tally.frames, batches=tally.batches, total_frames=None if budget.endless else budget.total_frames,
            completed=tally.reached_total(), requested_frames_per_batch=self.frames_per_batch(),
            policy_version=self.weights.policy_version, progress=self.progress.stats(), times=self.time_split(),
            weight_version=self.weights.version, weight_syncs=self.progress.weight_sync_histogram(),
            collected=self.output.progress(tally.frames))

    def time_split(self) -> dict[str, float]:
        split = dict(self.progress.seconds)
        env, policy = self.rollout_seconds()
        split["env"] += env
        split["policy"] += policy
        return split
