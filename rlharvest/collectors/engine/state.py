"""What several parts of one collector read and none owns alone: its counters against its budget
(:class:`Tally`), whether it is open (:class:`Lifecycle`), and what its batches hold
(:class:`BatchSizes`: the frames of one sync batch once workers joined or left, docs/elastic.md, and how
many batches ``len()`` counts). The engine makes one of each and hands it to the parts that read it
(docs/architecture.md)."""

from __future__ import annotations

import math
from typing import Callable

from ...config_views import FrameBudget

__all__ = ["Tally", "Lifecycle", "BatchSizes"]


class Tally:
    """Frames collected and batches yielded so far, against ``total_frames``.

    Args:
        budget: ``total_frames`` and the random warm-up (``init_random_frames``, the replay buffer
            whose writes count it).

    Example:
        >>> from rlharvest.config_views import FrameBudget
        >>> tally = Tally(FrameBudget(total_frames=8))
        >>> tally.frames += 8
        >>> tally.reached_total(), tally.batches
        (True, 0)
    """

    def __init__(self, budget: FrameBudget) -> None:
        self.budget = budget
        #: frames collected so far (TorchRL's ``_frames``)
        self.frames = 0
        #: index of the last batch (-1 before the first; TorchRL's ``_iter``)
        self.iter = -1

    @property
    def batches(self) -> int:
        """Batches yielded (or written) so far."""
        return self.iter + 1

    def reached_total(self) -> bool:
        """Whether ``total_frames`` were collected (never for an endless collector)."""
        return not self.budget.endless and self.frames >= self.budget.total_frames

    def random_phase(self) -> bool:
        """Whether the next batch takes random actions (``init_random_frames``)."""
        return self.budget.in_random_phase(self.frames)

    def frames_left(self) -> int:
        """Frames still to collect to ``total_frames`` (-1 when endless), for checkpoints."""
        budget = self.budget
        return -1 if budget.endless else max(0, int(budget.total_frames - self.frames))


class Lifecycle:
    """Whether a collector is open: closed until its workers are up, and again once it is shut down.

    Args:
        name: how messages name the collector (its class's name).

    Example:
        >>> life = Lifecycle("MultiSyncCollector")
        >>> life.check_open("iterating")
        Traceback (most recent call last):
        ...
        RuntimeError: MultiSyncCollector is shut down: iterating is not possible any more (build a new collector).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        #: closed until construction succeeds (the workers are up), and again once shut down
        self.closed = True
        #: whether iteration (or ``start()``) began: profiling cannot be enabled any more
        self.started = False

    def check_open(self, action: str) -> None:
        """Raises: RuntimeError naming ``action`` once the collector is shut down."""
        if self.closed:
            raise RuntimeError(f"{self.name} is shut down: {action} is not possible any more (build a new collector).")


class BatchSizes:
    """The size of a collector's batches, as the workers collecting now make it.

    Args:
        tally: the frames and batches so far, against ``total_frames``.
        requested: the ``frames_per_batch`` of a batch (read at each call: the options grow with the
            workers, a ``Collector`` inside a node is resized).
        sync: whether every batch holds one rollout of every worker (only then do workers that join or
            leave change a batch's size).
        share: ``share(worker)``: frames ``worker`` adds to every sync batch (the autoscaler's re-split
            share, when it re-splits).
        active: the indices of the workers collecting now.

    Example:
        >>> from rlharvest.config_views import FrameBudget
        >>> tally = Tally(FrameBudget(total_frames=32))
        >>> sizes = BatchSizes(tally, lambda: 8, sync=True, share=lambda worker: 4, active=lambda: [0, 1, 2])
        >>> sizes.frames_per_batch(), sizes.num_batches()
        (8, 4)
        >>> sizes.resized()  # a third worker joined before the first batch: batches of 12 frames from now on
        >>> sizes.frames_per_batch(), sizes.num_batches()
        (12, 3)
    """

    def __init__(self, tally: Tally, requested: Callable[[], int], *, sync: bool = False,
                 share: Callable[[int], int] | None = None, active: Callable[[], list[int]] | None = None) -> None:
        self.tally = tally
        self.requested = requested
        self.sync = sync
        self.share = share if share is not None else (lambda worker: requested())
        self.active = active if active is not None else list
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
        budget = self.tally.budget
        if budget.endless:
            raise RuntimeError(f"Non-terminating collector (total_frames={budget.total_frames}): len() is "
                               "undefined.")
        point = self.resize_point
        if point is None:
            return budget.num_batches(self.requested())
        batches, frames = point
        remaining = max(0, budget.total_frames - frames)
        return batches + math.ceil(remaining / self.frames_per_batch())
