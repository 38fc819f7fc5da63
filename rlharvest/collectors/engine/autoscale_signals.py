"""The autoscaler's measurements and what it derives from them (docs/elastic.md, "Autoscaling"):
pure functions of the batches recorded, no clock, no worker."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["Sample", "check_seconds", "fleet_demand", "fleet_signals"]


@dataclass(frozen=True)
class Sample:
    """One batch, as :meth:`Autoscaler.record <rlharvest.collectors.engine.autoscale.Autoscaler.record>` got it."""

    wait_s: float
    """Seconds the learner waited for the batch."""
    work_s: float
    """Seconds the learner worked since the previous batch."""
    idle_s: float
    """Seconds workers sat idle holding finished batches since the previous batch, summed."""
    workers: int
    """Workers collecting meanwhile."""
    epoch: int
    """Decisions (and changes of the fleet) before it: samples of another epoch measured another fleet."""


def check_seconds(name: str, value: Any) -> float:
    """``value`` as seconds; ValueError naming ``name`` for a negative or non-finite one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


def fleet_demand(samples: Sequence[Sample], sync: bool) -> float:
    """Seconds of rollouts per second of the learner's work: the workers the learner would keep busy
    if it never waited. A worker is busy when not idle holding a batch, asynchronously; synchronously
    only while the learner waits (it asks nothing meanwhile)."""
    busy = sum(max(0.0, s.workers * (s.wait_s if sync else s.wait_s + s.work_s) - s.idle_s) for s in samples)
    work = sum(s.work_s for s in samples)
    return busy / work if work > 0 else math.inf


def fleet_signals(samples: Sequence[Sample]) -> tuple[float, float]:
    """``(learner_wait, worker_idle)`` over ``samples`` (0.0 for none)."""
    wait = sum(s.wait_s for s in samples)
    learner_time = sum(s.wait_s + s.work_s for s in samples)
    worker_time = sum(s.workers * (s.wait_s + s.work_s) for s in samples)
    idle = sum(s.idle_s for s in samples)
    return (wait / learner_time if learner_time > 0 else 0.0,
            min(1.0, idle / worker_time) if worker_time > 0 else 0.0)
