"""Trajectory ids in the rollout loop: the counters that hand them out, the steps of a batch in which
sub-envs ended, and the ids those ends give (docs/collection.md).

A batched env's sub-envs that end in a step get new ids from the next step on. The loop notes the
ends as they happen (:class:`EpisodeEnds`) and hands the new ids out when it writes the chunk of steps
(:func:`trajectory_ids`): one counter call and one host sync a chunk, not one per step in which rows
ended. One env renumbers as it ends (an int, no tensor work).
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

__all__ = ["TrajectoryCounter", "LocalTrajectoryCounter", "EpisodeEnds", "trajectory_ids"]


class TrajectoryCounter:
    """Hands out trajectory ids: ``take(n)`` returns the first of ``n`` fresh consecutive ids."""

    def take(self, n: int) -> int:
        raise NotImplementedError

    def peek(self) -> int:
        """The next id ``take`` would hand out."""
        raise NotImplementedError

    def advance_to(self, value: int) -> None:
        """Never hand out ids below ``value`` (after a state dict is loaded: ids stay unique)."""
        raise NotImplementedError


class LocalTrajectoryCounter(TrajectoryCounter):
    """A thread-safe in-process counter."""

    def __init__(self, start: int = 0) -> None:
        self._next = start
        self._lock = threading.Lock()

    def take(self, n: int) -> int:
        with self._lock:
            first = self._next
            self._next += n
            return first

    def peek(self) -> int:
        return self._next

    state = peek

    def advance_to(self, value: int) -> None:
        with self._lock:
            self._next = max(self._next, int(value))


class EpisodeEnds:
    """The steps of the batch being collected in which sub-envs ended.

    ``chunk`` holds ``(step in the chunk, rows)`` until the chunk is written (:meth:`written`);
    :meth:`ended` says which sub-envs ended in the batch so far, folding the ends only when asked.

    Args:
        batch_size: the env's batch shape (empty: one env, whose ``rows`` are bools).

    Example:
        >>> ends = EpisodeEnds(torch.Size([2]))
        >>> ends.add(3, torch.tensor([False, True]))
        >>> ends.written()
        >>> ends.ended().tolist(), ends.chunk
        ([False, True], [])
    """

    def __init__(self, batch_size: torch.Size) -> None:
        self.batch_size = batch_size
        self.start()

    def start(self) -> EpisodeEnds:
        """A new batch: nothing ended yet (returns this object)."""
        self.chunk: list[tuple[int, torch.Tensor]] = []
        self._seen, self._unfolded, self._ended = 0, [], None
        return self

    def add(self, step: int, rows) -> None:
        """Sub-envs ended at ``step`` of the chunk (``rows``: which ones)."""
        self.chunk.append((step, rows))

    def written(self) -> None:
        """The chunk is written: its ends leave :attr:`chunk`; :meth:`ended` still counts them."""
        self._unfolded.extend(self.chunk[self._seen:])
        self.chunk, self._seen = [], 0

    def ended(self):
        """The sub-envs that ended in the batch so far: a bool tensor of the batch shape (a bool for one env)."""
        pending = self._unfolded + self.chunk[self._seen:]
        self._unfolded, self._seen = [], len(self.chunk)
        if not self.batch_size:
            self._ended = bool(self._ended) or bool(pending)
            return self._ended
        for _, rows in pending:
            rows = rows.reshape(self.batch_size)
            self._ended = rows if self._ended is None else self._ended | rows
        return self._ended if self._ended is not None else torch.zeros(self.batch_size, dtype=torch.bool)


def trajectory_ids(start: torch.Tensor, ends: list[tuple[int, torch.Tensor]], steps: int,
                   take: Callable[[int], int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The trajectory ids of ``steps`` steps of a batched env, and those of the step after them.

    Args:
        start: the ids at the first step, of the env's batch shape.
        ends: ``(step, rows)`` of each step in which some sub-envs ended (``rows``: a bool tensor of
            the batch shape), in step order.
        steps: how many steps.
        take: hands out ``n`` fresh ids, returning the first (a trajectory counter's ``take``).

    A sub-env that ended at step ``t`` is in a new trajectory from step ``t + 1`` on. New ids are
    handed out in the order of the steps, row-major within a step, all at once: one ``take`` and one
    host sync for the whole chunk, where handing them out as the rows end took ~13 us a step in which
    some ended. Returns ``(ids, after)``: ``ids`` has one tensor per step (the same one for the steps
    of a stretch in which no sub-env ended).

    Example:
        >>> ended = torch.tensor([True, False])
        >>> ids, after = trajectory_ids(torch.tensor([0, 1]), [(1, ended)], 3, lambda n: 2)
        >>> [step.tolist() for step in ids], after.tolist()
        ([[0, 1], [0, 1], [2, 1]], [2, 1])
    """
    if not ends:
        return [start] * steps, start
    rows = start.numel()
    # (ends, rows): the order ids are given in; on the ids' device (the env's flags may be elsewhere)
    ended = torch.stack([mask.reshape(rows) for _, mask in ends]).to(start.device)
    ranks = ended.reshape(-1).cumsum(0)
    first = take(int(ranks[-1]))  # the chunk's one host sync
    given = ranks.add_(first - 1).view(len(ends), *start.shape).unbind(0)
    current, ids = start, []
    for (step, _), rows_ended, new in zip(ends, ended.view(len(ends), *start.shape).unbind(0), given):
        ids += [current] * (step + 1 - len(ids))
        current = torch.where(rows_ended, new, current)
    ids += [current] * (steps - len(ids))
    return ids, current
