"""What one part of a collector reads of its arguments, typed (docs/architecture.md): the engine hands
each part only the fields it uses, never the whole :class:`~rlharvest.config.CollectorConfig`, so that a
part that does not size batches holds no batch size."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["FrameBudget", "OutputRules"]


@dataclass(frozen=True)
class FrameBudget:
    """What a collector's counters run against: ``total_frames`` (-1: endless) and the random warm-up
    (``init_random_frames``, counted in the replay buffer's writes when it counts them).

    Example:
        >>> budget = FrameBudget(total_frames=8)
        >>> budget.endless, budget.num_batches(3), budget.in_random_phase(0)
        (False, 3, False)
    """

    total_frames: int = -1
    total_frames_given: Any = None
    """``total_frames`` as the user gave it (``-5``, ``None``...), for messages."""
    init_random_frames: int = 0
    replay_buffer: Any = None
    """The replay buffer, whose writes count the random warm-up when it counts them."""

    @property
    def endless(self) -> bool:
        return self.total_frames < 0

    def in_random_phase(self, frames: int) -> bool:
        """Whether the next batch takes random actions (``init_random_frames``): counted in the replay
        buffer's writes when it counts them, else in ``frames``, the collector's."""
        target = self.init_random_frames
        if not target:
            return False
        buffer = self.replay_buffer
        if buffer is not None and hasattr(buffer, "write_count"):
            return buffer.write_count < target
        return frames < target

    def num_batches(self, frames_per_batch: int) -> int:
        """``len(collector)`` for batches of ``frames_per_batch`` frames.

        Raises:
            RuntimeError: for an endless collector.
        """
        if self.endless:
            raise RuntimeError(f"total_frames={self.total_frames_given!r} makes an endless collector (any negative "
                               "value, or None, means endless): len() is undefined.")
        return math.ceil(self.total_frames / frames_per_batch)


@dataclass(frozen=True)
class OutputRules:
    """What happens to a batch between its collection and the caller or the replay buffer
    (docs/collection.md, docs/trajectories.md): ``split_trajs``, ``postproc``, and the complete
    trajectories that ``trajs_per_batch`` or ``replay_write_mode="trajectory"`` assemble."""

    split_trajs: bool = False
    postproc: Callable | None = None
    trajs_per_batch: int | None = None
    trajs_per_write: int | None = None
    traj_format: str = "padded"
    replay_write_mode: str | None = None
    reset_at_each_iter: bool = False
    """The envs are reset at each batch: trajectories in flight are dropped."""

    @property
    def assembles_trajectories(self) -> bool:
        """Whether complete trajectories are assembled (``trajs_per_batch``, ``replay_write_mode="trajectory"``)."""
        return self.trajs_per_batch is not None or self.replay_write_mode == "trajectory"
