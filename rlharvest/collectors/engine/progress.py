"""What ``stats()`` reports beyond counters: throughput, policy lag, where the time goes and how
long weight updates take (docs/restarts.md, "Watching a run").

Recording costs one clock read and one deque append per batch, plus one reduction over the batch's
``policy_version`` entry when versions are tracked: cheap enough for every batch.
"""

from __future__ import annotations

import bisect
import collections
import statistics
import time
from dataclasses import dataclass
from typing import Any

from tensordict import TensorDictBase

__all__ = ["LatencyHistogram", "ProgressMeter", "WEIGHT_SYNC_BUCKETS"]

#: batches the recent throughput is measured over
RECENT_BATCHES = 16
#: weight updates the median latency is taken over
RECENT_UPDATES = 64
#: the parts ``time_<part>_s`` splits collection time into
TIME_PARTS = ("env", "policy", "transport", "waiting")
#: upper bounds, in seconds, of the buckets every weight update's latency is counted in (from a
#: shared-memory swap on one host to a relay across hosts)
WEIGHT_SYNC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class LatencyHistogram:
    """Every weight update's latency so far, counted in buckets (what a Prometheus histogram exposes).

    Example:
        >>> meter = ProgressMeter()
        >>> meter.record_weight_sync(0.003)
        >>> histogram = meter.weight_sync_histogram()
        >>> histogram.count, histogram.cumulative[histogram.bounds.index(0.005)]
        (1, 1)
    """

    bounds: tuple[float, ...]
    """The buckets' upper bounds, in seconds (the last bucket, +Inf, is :attr:`count`)."""
    cumulative: tuple[int, ...]
    """Updates that took at most each bound."""
    count: int
    sum_s: float
    """Seconds of every update, summed."""


class ProgressMeter:
    """Frames over time, and how far behind the current policy the last batch was.

    Example:
        >>> meter = ProgressMeter()
        >>> meter.record(0, None, 0)
        >>> meter.record(100, None, 0)
        >>> sorted(meter.stats())
        ['frames_per_s', 'frames_per_s_recent']
    """

    def __init__(self) -> None:
        self._marks: collections.deque = collections.deque(maxlen=RECENT_BATCHES + 1)
        self._first: tuple[float, int] | None = None
        self.policy_lag: int | None = None
        #: seconds per part of collection (``TIME_PARTS``), cumulative
        self.seconds = dict.fromkeys(TIME_PARTS, 0.0)
        self._weight_syncs: collections.deque = collections.deque(maxlen=RECENT_UPDATES)
        #: every update ever, per bucket of :data:`WEIGHT_SYNC_BUCKETS` (the last one: above them all)
        self._sync_buckets = [0] * (len(WEIGHT_SYNC_BUCKETS) + 1)
        self._sync_seconds = 0.0

    def add_seconds(self, part: str, seconds: float) -> None:
        self.seconds[part] += seconds

    def record_weight_sync(self, seconds: float) -> None:
        """A weight update completed in ``seconds`` (sent, and acknowledged where the scheme waits)."""
        self._weight_syncs.append(seconds)
        self._sync_buckets[bisect.bisect_left(WEIGHT_SYNC_BUCKETS, seconds)] += 1
        self._sync_seconds += seconds

    def weight_sync_histogram(self) -> LatencyHistogram:
        """Every weight update's latency since the collector started, in :data:`WEIGHT_SYNC_BUCKETS`."""
        buckets, cumulative, total = list(self._sync_buckets), [], 0
        for count in buckets[:-1]:
            total += count
            cumulative.append(total)
        return LatencyHistogram(WEIGHT_SYNC_BUCKETS, tuple(cumulative), total + buckets[-1], self._sync_seconds)

    def record(self, frames: int, batch: Any, version: Any) -> None:
        """A batch was yielded; ``frames`` counts every frame so far, ``version`` is the policy's now."""
        now = time.monotonic()
        if self._first is None:
            self._first = (now, frames)
        self._marks.append((now, frames))
        if isinstance(batch, TensorDictBase) and isinstance(version, int):
            versions = batch.get("policy_version", None)
            if versions is not None and versions.numel():
                self.policy_lag = max(0, version - int(versions.min()))

    def stats(self) -> dict[str, float | int]:
        """``frames_per_s`` (since the first batch), ``frames_per_s_recent`` (last batches), when
        versions are tracked ``policy_lag`` (versions the last batch's oldest frame is behind), and
        after a weight update ``weight_sync_s_last`` and ``weight_sync_s_median`` (last updates)."""
        stats: dict[str, float | int] = {}
        if self._first is not None:
            (start, first), (now, frames) = self._first, self._marks[-1]
            stats["frames_per_s"] = (frames - first) / (now - start) if now > start else 0.0
            (then, before) = self._marks[0]
            stats["frames_per_s_recent"] = (frames - before) / (now - then) if now > then else 0.0
        if self.policy_lag is not None:
            stats["policy_lag"] = self.policy_lag
        if self._weight_syncs:
            stats["weight_sync_s_last"] = self._weight_syncs[-1]
            stats["weight_sync_s_median"] = statistics.median(self._weight_syncs)
        return stats
