"""What ``stats()`` reports beyond counters: throughput, policy lag, where the time goes and how
long weight updates take (docs/restarts.md, "Watching a run").

Recording costs one clock read and one deque append per batch, plus one reduction over the batch's
``policy_version`` entry when versions are tracked: cheap enough for every batch.
"""

from __future__ import annotations

import collections
import statistics
import time
from typing import Any

from tensordict import TensorDictBase

__all__ = ["ProgressMeter"]

#: batches the recent throughput is measured over
RECENT_BATCHES = 16
#: weight updates the median latency is taken over
RECENT_UPDATES = 64
#: the parts ``time_<part>_s`` splits collection time into
TIME_PARTS = ("env", "policy", "transport", "waiting")


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

    def add_seconds(self, part: str, seconds: float) -> None:
        self.seconds[part] += seconds

    def record_weight_sync(self, seconds: float) -> None:
        """A weight update completed in ``seconds`` (sent, and acknowledged where the scheme waits)."""
        self._weight_syncs.append(seconds)

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
