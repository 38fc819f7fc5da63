"""``stats()``, once for every collector: a typed snapshot the engine's parts fill, returned in TorchRL's
dict shape (flat keys, plain scalars; docs/restarts.md, "Watching a run").

Adding a figure means adding a field here and filling it where it is known; every collector reports
it the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .progress import LatencyHistogram

__all__ = ["StatsSnapshot", "WORKER_VIEWS", "fleet_stats"]

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


def fleet_stats(engine: Any, workers: str = "aggregate", timeout: float | None = 10.0) -> StatsSnapshot:
    """The snapshot of a collector with workers: the engine's counters and progress, the fleet's figures
(kept here, no worker is asked), each worker's own snapshot when asked (``per_worker``/``both``, or
always where the traits say so), and what optional parts add.

Raises:
    ValueError: for another ``workers`` view or a negative ``timeout``.
"""
    check_view(workers)
    if timeout is not None and (isinstance(timeout, bool) or not timeout >= 0):
        raise ValueError(f"timeout must be a non-negative number of seconds or None, got {timeout!r}")
    snapshot = StatsSnapshot(
        frames=engine.frames, batches=engine.iter + 1,
        total_frames=None if engine.config.endless else engine.config.total_frames, completed=engine.reached_total(),
        requested_frames_per_batch=engine.requested_frames_per_batch, policy_version=engine.weights.policy_version,
        progress=engine.progress.stats(), times=dict(engine.progress.seconds), weight_version=engine.weights.version,
        weight_syncs=engine.progress.weight_sync_histogram())
    active = engine.active_workers
    asked = engine.traits.stats_asks_workers or workers != "aggregate"
    answers = _worker_stats(engine, timeout) if asked and not engine.closed and engine.broadcast is not None else {}
    requests = engine.requests if engine.fleet is not None and not engine.closed else None
    alive = len(answers) if engine.traits.stats_asks_workers else (
        sum(not requests.is_dead(w) for w in active) if requests is not None else 0)
    snapshot.fleet = {"workers": len(active), "workers_alive": alive}
    if engine.fleet is not None:  # kept here, no worker is asked
        snapshot.fleet.update(engine.fleet.restarts.stats(engine.num_workers))
        snapshot.fleet["workers_removed"] = engine.num_workers - len(active)
        snapshot.fleet.update(engine.figures.stats(active))  # kept from the replies
    if engine.traits.stats_asks_workers and answers:
        snapshot.extra["worker_frames"] = int(sum(answer.get("frames", 0) for answer in answers.values()))
    snapshot.per_worker = answers
    # env workers of a policy server send steps, not batches: they collect from their start
    steps_only = engine.traits.gather == "chunks"
    snapshot.worker_states = {
        worker: "failed" if requests is not None and requests.is_dead(worker)
        else "collecting" if steps_only or f"worker_{worker}/frames" in snapshot.fleet else "starting"
        for worker in active}
    for extra in engine.extras:
        snapshot.extra.update(extra.stats())
    if engine.scaler is not None:
        snapshot.extra.update(engine.scaler.stats())
    return snapshot


def _worker_stats(engine, timeout: float | None) -> dict[int, dict]:
    if engine.traits.stats_asks_workers:
        return engine.broadcast.stats_within(timeout)
    return dict(zip(engine.active_workers, engine.broadcast.worker_stats()))
