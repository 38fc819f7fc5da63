"""What an engine keeps of each worker from its replies, no worker asked (docs/restarts.md, "Watching
a run"): the frames it delivered, the pace of its rollouts, how long it held finished batches nobody
had taken, how many policy versions its last batch was behind when it was taken, and its host. A
straggler shows as a low ``rollout_frames_per_s`` or a high ``policy_lag`` beside the others'; the
autoscaler reads the held seconds (docs/elastic.md, "Autoscaling").

Recording costs two clock reads and a few additions per rollout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

__all__ = ["WorkerFigures"]


@dataclass
class _Figures:
    frames: int = 0
    rollout_s: float = 0.0
    held_s: float = 0.0
    policy_lag: int | None = None
    host: str | None = None
    #: when its last batch was taken
    taken_at: float | None = None


class WorkerFigures:
    """Per-worker figures from the requests sent and the replies taken.

    Args:
        version: the collector's policy version now (``WeightPublisher.version``).

    Example:
        >>> from rlharvest.protocol import Reply
        >>> figures = WorkerFigures(lambda: 3)
        >>> figures.sent(0, request_id=7)
        >>> figures.taken(0, Reply(7, 0, frames=10, times=(0.0, 0.0), host="node-a"))
        >>> {key: value for key, value in figures.stats([0]).items() if key != "worker_0/held_s"}
        {'worker_0/frames': 10, 'worker_0/policy_lag': 0, 'worker_0/host': 'node-a'}
    """

    def __init__(self, version: Callable[[], int], clock: Callable[[], float] = time.perf_counter) -> None:
        self._version = version
        self._clock = clock
        #: ``worker -> (request id, sent at, policy version then)`` of its last rollout asked for
        self._sent: dict[int, tuple[int, float, int]] = {}
        self._figures: dict[int, _Figures] = {}
        self._held = self._idle = 0.0

    def sent(self, worker: int, request_id: int) -> None:
        """A rollout was asked of ``worker`` (``WorkerRequests.on_collect``)."""
        self._sent[worker] = (request_id, self._clock(), self._version())

    def taken(self, worker: int, reply: Any) -> None:
        """``worker``'s BATCH reply was taken by the collector: the time since its request, less the
        seconds its rollout took (the reply's ``times``), is the time it held a finished batch."""
        now = self._clock()
        figures = self._figures.setdefault(worker, _Figures())
        previous, figures.taken_at = figures.taken_at, now
        figures.frames += int(reply.frames)
        rollout = sum(reply.times) if reply.times is not None else None
        if rollout is not None:
            figures.rollout_s += rollout
        if reply.host is not None:
            figures.host = reply.host
        sent = self._sent.pop(worker, None)
        if sent is None or sent[0] != reply.request_id:
            return
        figures.policy_lag = max(0, self._version() - sent[2])
        if rollout is not None:
            held = max(0.0, now - sent[1] - rollout)
            figures.held_s += held
            self._held += held
            # idle: held, and before that not asked since its last batch was taken (a worker asked
            # again only after its batch was yielded waits for the learner meanwhile)
            start = previous if previous is not None and previous < sent[1] else sent[1]
            self._idle += max(0.0, now - start - rollout)

    def take_held(self) -> float:
        """Seconds workers held finished batches, summed, since the last call (of either)."""
        held, self._held, self._idle = self._held, 0.0, 0.0
        return held

    def take_idle(self) -> float:
        """Seconds workers were not collecting between two of their batches being taken (holding a
        finished batch, or not asked for the next yet), summed, since the last call (of either)."""
        idle, self._held, self._idle = self._idle, 0.0, 0.0
        return idle

    def forget(self, worker: int) -> None:
        """``worker`` is replaced or leaves: its successor starts afresh."""
        self._sent.pop(worker, None)
        self._figures.pop(worker, None)

    def stats(self, workers: Iterable[int]) -> dict[str, Any]:
        """``worker_<i>/frames``, ``/rollout_frames_per_s`` (frames per second of its own rollouts),
        ``/held_s`` (seconds it held finished batches), ``/policy_lag`` (versions its last batch was behind
        when taken: those published after it was asked for) and ``/host``, for each of ``workers`` that
        delivered a batch."""
        stats: dict[str, Any] = {}
        for worker in workers:
            figures = self._figures.get(worker)
            if figures is None:
                continue
            prefix = f"worker_{worker}/"
            stats[prefix + "frames"] = figures.frames
            if figures.rollout_s > 0:
                stats[prefix + "rollout_frames_per_s"] = figures.frames / figures.rollout_s
            stats[prefix + "held_s"] = figures.held_s
            if figures.policy_lag is not None:
                stats[prefix + "policy_lag"] = figures.policy_lag
            if figures.host is not None:
                stats[prefix + "host"] = figures.host
        return stats
