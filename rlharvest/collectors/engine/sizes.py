"""What a batch holds: the frames of one sync batch (the current workers' shares once workers joined or
left, docs/elastic.md), and how many batches ``len()`` counts to ``total_frames``."""

from __future__ import annotations

import math
from typing import Callable

from .state import Tally

__all__ = ["BatchSizes"]


class BatchSizes:
    """The size of a collector's batches, as the workers collecting now make it.

    Args:
        requested: the ``frames_per_batch`` the user asked for (read at each call: the options grow
            with the workers).
        share: ``share(worker)``: frames ``worker`` adds to every sync batch (the autoscaler's re-split
            share, when it re-splits).
        active: the indices of the workers collecting now.
        sync: whether every batch holds one rollout of every worker (only then do workers that join or
            leave change a batch's size).
        tally: the frames and batches so far, against ``total_frames``.

    Example:
        >>> from rlharvest.config import CollectorConfig
        >>> tally = Tally(CollectorConfig(frames_per_batch=8, total_frames=32))
        >>> sizes = BatchSizes(lambda: 8, lambda worker: 4, lambda: [0, 1, 2], sync=True, tally=tally)
        >>> sizes.frames_per_batch(), sizes.num_batches()
        (8, 4)
        >>> sizes.resized()  # a third worker joined before the first batch: batches of 12 frames from now on
        >>> sizes.frames_per_batch(), sizes.num_batches()
        (12, 3)
    """

    def __init__(self, requested: Callable[[], int], share: Callable[[int], int], active: Callable[[], list[int]],
                 sync: bool, tally: Tally) -> None:
        self.requested = requested
        self.share = share
        self.active = active
        self.sync = sync
        self.tally = tally
        #: ``(batches, frames)`` when the workers of a sync collection changed: ``len()`` counts batches
        #: of the former size up to there
        self.resize_point: tuple[int, int] | None = None

    def frames_per_batch(self) -> int:
        """Frames of the next batch: the user's ``frames_per_batch``, or once workers joined or left a
        sync collection, the shares of the current workers."""
        if self.sync and self.resize_point is not None:
            return sum(self.share(worker) for worker in self.active())
        return self.requested()

    def resized(self) -> None:
        """The workers of a sync collection changed: batches hold the current workers' shares from the
        next batch on, and ``len()`` counts the batches of the former size so far."""
        if self.sync:
            self.resize_point = (self.tally.iter + 1, self.tally.frames)

    def num_batches(self) -> int:
        """``len()``: the batches to ``total_frames`` (of the former sizes so far, then of the current one).

        Raises:
            RuntimeError: for an endless collector.
        """
        config = self.tally.config
        if config.endless:
            raise RuntimeError(f"Non-terminating collector (total_frames={config.total_frames}): len() is "
                               "undefined.")
        point = self.resize_point
        if point is None:
            return config.num_batches(self.requested())
        batches, frames = point
        remaining = max(0, config.total_frames - frames)
        return batches + math.ceil(remaining / self.frames_per_batch())
