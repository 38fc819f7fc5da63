"""What the monitor reads of a collector: its typed ``stats()`` snapshot and its fleet events
(docs/monitoring.md), never a command to a worker of its own.

A read costs what ``collector.stats()`` costs (no worker is asked, but by ``RayCollector``, whose
``stats()`` asks its actors and is bounded by :attr:`FleetReader.timeout`). Reads are shared: the
page and every scrape within :attr:`FleetReader.max_age` seconds, or 20 times the read's own duration
if longer, get the same one (unless the fleet changed meanwhile: a restart is seen at once), and one
read runs at a time, so a monitor under many requests asks the collector at most 10 times a second,
and spends at most 5 % of its time reading.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..collectors.base import BaseCollector
from ..collectors.engine import engine_of
from ..collectors.evaluator import Evaluator
from ..collectors.engine.events import EventKind, FleetEvent
from ..collectors.engine.stats import StatsSnapshot

__all__ = ["FleetReader", "Reading", "WorkerRow", "plain"]

#: tries of a read that met the learner changing a figure under it
_TRIES = 3
#: a read is shared for at least this many times the seconds it took (so reads take at most 5 % of the time)
_SHARED_FOR = 20


@dataclass(frozen=True)
class WorkerRow:
    """One active worker as the page shows it (one row) and ``/metrics`` labels it."""

    index: int
    state: str
    """``"starting"`` (no batch taken yet), ``"collecting"``, ``"failed"`` (found dead, not replaced
    yet), or ``"in process"`` (``Collector``: the rollout runs in the learner's process)."""
    host: str | None = None
    frames: int | None = None
    """Frames it delivered since it started (a replacement starts from 0); None before its first batch,
    and for env workers that send steps, not batches (``AsyncBatchedCollector``)."""
    rollout_frames_per_s: float | None = None
    """Frames per second of its own rollouts."""
    held_s: float = 0.0
    """Seconds it held finished batches nobody had taken."""
    policy_lag: int | None = None
    """Policy versions published between the request of its last batch and the batch being taken."""
    policy_version: int | None = None
    """The version its last batch was asked with (the collector's version less the lag)."""
    restarts: int = 0
    preemptions: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(frozen=True)
class Reading:
    """One read of a collector."""

    time: float
    """Wall-clock seconds (``time.time()``) of the read."""
    collector: str
    """The collector's class name."""
    snapshot: StatsSnapshot
    stats: dict[str, Any]
    """``collector.stats()``: the snapshot's flat dict."""
    workers: tuple[WorkerRow, ...]
    event_counts: dict[EventKind, int]
    last_seq: int
    closed: bool
    autoscaled: bool = field(default=False)
    """Built with ``autoscale=``."""

    @property
    def learner_wait_s(self) -> float:
        """Seconds the learner's loop waited for batches: for workers (``time_waiting_s``), or, in
        ``Collector``, for the rollout it runs itself."""
        times = self.snapshot.times
        if self.snapshot.fleet is None:
            return times.get("env", 0.0) + times.get("policy", 0.0)
        return times.get("waiting", 0.0)

    @property
    def policy_version(self) -> int:
        """The policy version (the number of weight updates when versions are not tracked)."""
        version = self.snapshot.policy_version
        return version if isinstance(version, int) and not isinstance(version, bool) else self.snapshot.weight_version


class FleetReader:
    """Reads a collector for the monitor, from any thread.

    Args:
        collector: any rlharvest collector (it need not have started, and may shut down meanwhile).
        timeout: seconds a read may wait for workers that ``stats()`` asks (``RayCollector``).
        max_age: seconds a read is shared by the requests that come meanwhile.

    Raises:
        TypeError: for an object without ``stats()`` and ``events`` (not a collector), or an Evaluator.

    Example:
        >>> from rlharvest.collectors import MultiSyncCollector
        >>> from rlharvest.envs import CountingEnv
        >>> collector = MultiSyncCollector([CountingEnv] * 2, frames_per_batch=8, total_frames=16)
        >>> _ = [batch for batch in collector]
        >>> reading = FleetReader(collector).read()
        >>> reading.stats["frames"], [row.index for row in reading.workers]
        (16, [0, 1])
        >>> collector.shutdown()
    """

    def __init__(self, collector: BaseCollector, timeout: float = 1.0, max_age: float = 0.1) -> None:
        if isinstance(collector, Evaluator):
            raise TypeError("an Evaluator has no fleet to watch: each evaluation runs to its end on its own "
                            "collector. Monitor the collector you train with, and send the evaluator's results "
                            "to your logger with on_result= (docs/monitoring.md).")
        events = getattr(type(collector), "events", None)
        if not callable(getattr(type(collector), "stats", None)) or events is None:
            raise TypeError(f"the monitor watches an rlharvest collector (Collector, MultiSyncCollector, "
                            f"DistributedCollector, ...), got {type(collector).__name__}")
        self.name = type(collector).__name__
        self.timeout, self.max_age = timeout, max_age
        self._engine = engine_of(collector)
        self._events = collector.events
        self._lock = threading.Lock()
        self._last: Reading | None = None
        self._cost = 0.0
        self._host = socket.gethostname()

    def events_since(self, seq: int) -> list[FleetEvent]:
        """The fleet's events after ``seq`` (the last 1,024 are kept)."""
        return self._events.since(seq)

    def read(self) -> Reading:
        """The collector now, or the read of less than :attr:`max_age` seconds ago when no event came
        since (after shutdown: the last figures, marked closed)."""
        with self._lock:
            last = self._last
            fresh = last is not None and last.last_seq == self._events.last_seq and last.closed == self._engine.life.closed
            # a read that asks workers (RayCollector's) is shared for 20 times its own duration at least
            if fresh and (last.closed or time.time() - last.time < max(self.max_age, _SHARED_FOR * self._cost)):
                return last
            start = time.perf_counter()
            self._last = self._read(last)
            self._cost = time.perf_counter() - start
            return self._last

    def _read(self, last: Reading | None) -> Reading:
        engine = self._engine
        closed = bool(engine.life.closed)
        snapshot = None
        for attempt in range(_TRIES):
            try:
                snapshot = engine.stats.snapshot("aggregate", self.timeout)
                break
            except Exception:  # a dict the learner resized while it was read, or parts gone at shutdown
                if attempt == _TRIES - 1 and last is None:
                    raise
        if snapshot is None:  # the last figures stand
            snapshot, closed = last.snapshot, closed or last.closed
        counts = self._events.counts()
        return Reading(time=time.time(), collector=self.name, snapshot=snapshot, stats=snapshot.as_dict(),
                       workers=self._rows(snapshot, closed), event_counts=counts, last_seq=self._events.last_seq,
                       closed=closed or counts[EventKind.SHUTDOWN] > 0,
                       autoscaled=any(key.startswith("autoscale/") for key in snapshot.extra))

    def _rows(self, snapshot: StatsSnapshot, closed: bool) -> tuple[WorkerRow, ...]:
        if snapshot.fleet is None:  # Collector: one rollout loop, in this process
            return (WorkerRow(0, "shut down" if closed else "in process", self._host, int(snapshot.frames),
                              restarts=0, policy_version=_version(snapshot, 0)),)
        fleet = snapshot.fleet
        rows = []
        for worker, state in sorted(snapshot.worker_states.items()):
            prefix = f"worker_{worker}/"
            lag = fleet.get(prefix + "policy_lag")
            rows.append(WorkerRow(
                index=worker, state=state, host=fleet.get(prefix + "host"), frames=fleet.get(prefix + "frames"),
                rollout_frames_per_s=fleet.get(prefix + "rollout_frames_per_s"),
                held_s=float(fleet.get(prefix + "held_s", 0.0)), policy_lag=lag,
                policy_version=_version(snapshot, lag), restarts=int(fleet.get(prefix + "restarts", 0)),
                preemptions=int(fleet.get(prefix + "preemptions", 0))))
        return tuple(rows)


def _version(snapshot: StatsSnapshot, lag: int | None) -> int | None:
    version = snapshot.policy_version if isinstance(snapshot.policy_version, int) else snapshot.weight_version
    return None if lag is None else max(0, version - lag)


def plain(value: Any) -> Any:
    """``value`` in JSON's terms: tuples as lists, non-finite floats as None, anything else as text."""
    if isinstance(value, dict):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)
