"""Profiling of rollouts with ``torch.profiler`` (``enable_profile``, docs/collection.md).

The same :class:`RolloutProfiler` runs wherever rollouts run: in the calling process for ``Collector``,
inside worker processes and distributed nodes for the others.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

__all__ = ["ProfileConfig", "RolloutProfiler"]


@dataclass
class ProfileConfig:
    """What to profile and where to write the trace.

    Example:
        >>> config = ProfileConfig(save_path="traces/w{worker_idx}.json", workers=[0, 2])
        >>> str(config.get_save_path(2)), config.should_profile_worker(1)
        ('traces/w2.json', False)
    """

    workers: list[int] = field(default_factory=lambda: [0])
    """Worker indices to profile (ignored by single-process collectors)."""
    num_rollouts: int = 3
    """Rollouts covered, warm-up included; profiling stops after this many."""
    warmup_rollouts: int = 1
    """Rollouts skipped before recording starts."""
    save_path: str | Path | None = None
    """Chrome-trace path; ``{worker_idx}`` is replaced. Default ``./collector_profile_{worker_idx}.json``."""
    activities: list[str] = field(default_factory=lambda: ["cpu", "cuda"])
    record_shapes: bool = True
    profile_memory: bool = False
    with_stack: bool = True
    with_flops: bool = False
    on_trace_ready: Callable | None = None
    """Receives the profiler instead of the Chrome-trace export when given."""

    def __post_init__(self) -> None:
        if self.workers is None:
            self.workers = [0]
        if self.activities is None:
            self.activities = ["cpu", "cuda"]
        if self.warmup_rollouts < 0:
            raise ValueError(f"warmup_rollouts must be >= 0, got {self.warmup_rollouts}.")
        if self.num_rollouts <= self.warmup_rollouts:
            raise ValueError(
                f"num_rollouts ({self.num_rollouts}) must be greater than warmup_rollouts "
                f"({self.warmup_rollouts})."
            )

    def get_save_path(self, worker_idx: int = 0) -> Path:
        if self.save_path is None:
            return Path(f"./collector_profile_{worker_idx}.json")
        return Path(str(self.save_path).replace("{worker_idx}", str(worker_idx)))

    def should_profile_worker(self, worker_idx: int) -> bool:
        return worker_idx in self.workers

    def get_activities(self) -> list:
        activities = []
        for name in self.activities:
            name = str(name).lower()
            if name == "cpu":
                activities.append(torch.profiler.ProfilerActivity.CPU)
            elif name == "cuda" and torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
        if not activities:
            warnings.warn(f"No usable profiler activity in {self.activities}: profiling is disabled.")
        return activities


class RolloutProfiler:
    """Wraps rollouts ``0 .. num_rollouts-1`` in a profiler that skips the warm-up ones."""

    def __init__(self, config: ProfileConfig, worker_idx: int = 0, label: str = "collector_rollout") -> None:
        self.config = config
        self.worker_idx = worker_idx
        self.label = label
        self.rollouts = 0
        self._profiler = None
        activities = config.get_activities()
        if not activities:
            return
        if config.on_trace_ready is not None:
            on_ready = config.on_trace_ready
        else:
            path = config.get_save_path(worker_idx)

            def on_ready(prof, path=path):
                path.parent.mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(path))

        with warnings.catch_warnings():
            # Warm-up rollouts are skipped with skip_first, not with the profiler's own warm-up.
            warnings.filterwarnings("ignore", message=".*warmup.*")
            schedule = torch.profiler.schedule(
                skip_first=config.warmup_rollouts,
                wait=0,
                warmup=0,
                active=config.num_rollouts - config.warmup_rollouts,
                repeat=1,
            )
        self._profiler = torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=on_ready,
            record_shapes=config.record_shapes,
            profile_memory=config.profile_memory,
            with_stack=config.with_stack,
            with_flops=config.with_flops,
        )
        self._profiler.start()

    @property
    def active(self) -> bool:
        return self._profiler is not None

    @contextlib.contextmanager
    def rollout(self):
        """Context for one rollout; stops (and exports) after the last profiled one."""
        if self._profiler is None:
            yield
            return
        with torch.profiler.record_function(self.label):
            yield
        self.rollouts += 1
        self._profiler.step()
        if self.rollouts >= self.config.num_rollouts:
            self.stop()

    def stop(self) -> None:
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.stop()
