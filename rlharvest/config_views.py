"""What one part of a collector reads of its arguments, typed (docs/architecture.md): the engine hands
each part only the fields it uses, never the whole :class:`~rlharvest.config.CollectorConfig`, so that a
part that does not size batches holds no batch size."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from ._utils import positive_int, user_stacklevel

__all__ = ["BatchShares", "FrameBudget", "FramesPerBatch", "OutputRules"]


@dataclass(frozen=True)
class FramesPerBatch:
    """``frames_per_batch`` as the user gave it, checked once: a positive int, or one per worker.

    Example:
        >>> FramesPerBatch.parse([4, 6]).requested, FramesPerBatch.parse(8).split(2, "share")
        (10, [4, 4])
    """

    value: int | tuple[int, ...]

    @classmethod
    def parse(cls, value: Any) -> FramesPerBatch:
        """Raises: TypeError, ValueError: naming ``frames_per_batch`` and the value given."""
        if value is None:
            raise TypeError("frames_per_batch is required.")
        if not isinstance(value, (list, tuple)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"frames_per_batch must be a positive int (or a list of one per worker), got "
                                f"{type(value).__name__} {value!r}")
            return cls(positive_int("frames_per_batch", value))
        for entry in value:
            if isinstance(entry, bool) or not isinstance(entry, int):
                raise TypeError(f"each value of frames_per_batch must be a positive int, got {type(entry).__name__} "
                                f"{entry!r}")
        return cls(tuple(positive_int("each value of frames_per_batch", entry) for entry in value))

    @property
    def requested(self) -> int:
        """Frames per batch the user asked for (the sum of a per-worker list)."""
        value = self.value
        return sum(value) if isinstance(value, tuple) else value

    @property
    def per_worker(self) -> bool:
        return isinstance(self.value, tuple)

    def shares(self, num_workers: int, mode: str) -> BatchShares:
        """The batch's frames and each worker's share (:meth:`split`)."""
        return BatchShares(self, tuple(self.split(num_workers, mode)))

    def split(self, num_workers: int, mode: str) -> list[int]:
        """Frames each worker collects per batch.

        Args:
            num_workers: how many workers share a batch.
            mode: ``"share"``: a synchronous batch is split across workers (rounded up, with a
                warning when uneven; a per-worker list is taken as given); ``"exact"``: the same,
                but an uneven split raises (nodes); ``"whole"``: every worker collects whole
                batches (asynchronous collection).

        Raises:
            ValueError: for a per-worker list of the wrong length.
            RuntimeError: for an uneven split in ``"exact"`` mode.
        """
        value = self.value
        if isinstance(value, tuple):
            if len(value) != num_workers:
                raise ValueError(
                    f"frames_per_batch must have exactly one value per worker ({num_workers}), got {len(value)}.")
            return list(value) if mode != "whole" else [sum(value)] * num_workers
        if mode == "whole":
            return [value] * num_workers
        each = math.ceil(value / num_workers)
        if each * num_workers == value:
            return [each] * num_workers
        multiples = " or ".join(str(m) for m in (value - value % num_workers, each * num_workers) if m)
        if mode == "exact":
            raise RuntimeError(f"Cannot dispatch {value} frames across {num_workers} nodes: a synchronous batch is "
                               f"split evenly between them; use a frames_per_batch divisible by {num_workers} "
                               f"({multiples}).")
        warnings.warn(f"frames_per_batch={value} is not divisible by the {num_workers} workers: each collects {each} "
                      f"frames, so every batch holds {each * num_workers} frames, not {value} (a multiple of "
                      f"{num_workers}, {multiples}, gives batches of exactly that size).", stacklevel=user_stacklevel())
        return [each] * num_workers


@dataclass(frozen=True)
class BatchShares:
    """``frames_per_batch`` as the user gave it, and what each worker collects per rollout (``shares``;
    a worker added later collects the first worker's share).

    Example:
        >>> shares = BatchShares(FramesPerBatch((3, 5)), shares=(3, 5))
        >>> shares.requested, shares.share(1), shares.share(4), shares.of_workers(3)
        (8, 5, 3, [3, 5, 3])
    """

    frames: FramesPerBatch
    shares: tuple[int, ...]

    @property
    def requested(self) -> int:
        """The frames of a batch the user asked for."""
        return self.frames.requested

    def share(self, worker: int) -> int:
        """Frames ``worker`` collects per rollout (its part of a sync batch)."""
        return self.shares[worker] if worker < len(self.shares) else self.shares[0]

    def of_workers(self, count: int) -> list[int]:
        """The shares of workers ``0 .. count - 1``."""
        return [self.share(worker) for worker in range(count)]


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
