"""What ``stats()`` reports beyond counters: throughput and policy lag, measured where batches are
yielded (docs/restarts.md, "Watching a run").

Recording costs one clock read and one deque append per batch, plus one reduction over the batch's
``policy_version`` entry when versions are tracked: cheap enough for every batch.
"""

from __future__ import annotations

import collections
import time
from typing import Any

from tensordict import TensorDictBase

__all__ = ["ProgressMeter"]

#: batches the recent throughput is measured over
RECENT_BATCHES = 16


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
        """``frames_per_s`` (since the first batch), ``frames_per_s_recent`` (last batches) and, when
        versions are tracked, ``policy_lag`` (versions the last batch's oldest frame is behind)."""
        stats: dict[str, float | int] = {}
        if self._first is not None:
            (start, first), (now, frames) = self._first, self._marks[-1]
            stats["frames_per_s"] = (frames - first) / (now - start) if now > start else 0.0
            (then, before) = self._marks[0]
            stats["frames_per_s_recent"] = (frames - before) / (now - then) if now > then else 0.0
        if self.policy_lag is not None:
            stats["policy_lag"] = self.policy_lag
        return stats
