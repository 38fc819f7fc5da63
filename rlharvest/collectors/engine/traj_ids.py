"""Collector-wide trajectory ids for workers that count their own (nodes, RPC nodes, Ray actors).

Worker ``i`` numbers its trajectories ``0, 1, 2, ...`` (a replacement continues past its
predecessor's ids); the parent maps each local id ``k`` to a collector-wide one. With a fixed set of
``W`` workers that is ``k * W + i``. When workers are added (``RayCollector.add_collectors``), the
ids already handed out must keep their values (a trajectory that spans batches keeps its id) and
the new ones must not collide with any of them, so the map is kept per worker as *segments*:

* a segment ``(first, base, stride)`` maps local id ``k >= first`` to ``base + (k - first) * stride + i``;
* growing from ``W`` to ``W'`` workers starts, for every existing worker, a new segment at one past the
  largest local id it has had mapped so far, and gives each new worker one segment, all with stride
  ``W'`` and the same ``base``: one past every id any worker has been given so far.

Segments of one growth hold ids in ``[base, next base)``, each worker on its own residue of the
stride, so no id repeats; a local id the parent has not mapped yet (a rollout in flight) goes to the
newest segment, consistently for every batch it appears in. docs/collection.md, "Trajectory ids".
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from tensordict import TensorDictBase

from ..._utils import TRAJ_IDS
from ...checkpoint import pack, unpack

__all__ = ["TrajIdMap", "TrajectoryIds", "SharedIds", "PerWorkerIds"]


class TrajectoryIds(Protocol):
    """How a collector's workers' trajectory ids become unique across them (:class:`SharedIds` or
    :class:`PerWorkerIds`, as the collector's options choose)."""

    counter: Any
    """The counter the workers share (TorchRL's ``traj_pool``), or None."""

    def remap(self, batch: TensorDictBase, worker: int) -> TensorDictBase:
        """``batch`` of ``worker`` with collector-wide ids."""

    def replacement_changes(self, worker: int) -> dict:
        """What a worker replacing ``worker`` starts with to keep ids unique."""

    def grow(self, count: int) -> None:
        """``count`` workers were added."""

    def state(self) -> dict:
        """What a checkpoint keeps."""

    def restore(self, section: dict) -> None:
        """Continue from a checkpoint's section."""


class TrajIdMap:
    """Maps every worker's own trajectory ids to ids unique across the collector's workers.

    Args:
        num_workers: how many workers the collector starts with.

    Example:
        >>> ids = TrajIdMap(2)
        >>> ids.map_(torch.tensor([0, 1, -1]), worker=1).tolist()
        [1, 3, -1]
        >>> ids.grow(1)
        >>> ids.map_(torch.tensor([1, 2]), worker=1).tolist(), ids.map_(torch.tensor([0]), worker=2).tolist()
        ([3, 5], [6])
    """

    def __init__(self, num_workers: int) -> None:
        #: per worker, its segments ``(first local id, base, stride)``, oldest first
        self._segments = [[(0, 0, num_workers)] for _ in range(num_workers)]
        #: per worker, one past the largest local id it has had mapped
        self._next = [0] * num_workers

    def __len__(self) -> int:
        return len(self._segments)

    def next_local(self, worker: int) -> int:
        """One past the largest local id of ``worker`` mapped so far: where its replacement starts."""
        return self._next[worker]

    def map_(self, ids: torch.Tensor, worker: int) -> torch.Tensor:
        """Map ``worker``'s local ``ids`` in place (-1, a step not collected, stays -1); returns them.

        Called for every worker's batch in the parent, so it stays at a few tensor operations per
        segment: every segment starts at a local id >= 0, so ``ids >= first`` already leaves -1 out,
        and the largest id (-1 below every collected one) says whether any step was collected."""
        if ids.numel():
            largest = int(ids.max())
            if largest != -1:
                self._next[worker] = max(self._next[worker], largest + 1)
        mapped = ids
        for first, base, stride in self._segments[worker]:  # later segments override earlier ones
            shifted = torch.add(base - first * stride + worker, ids, alpha=stride)
            mapped = torch.where(ids >= first, shifted, mapped)
        ids.copy_(mapped)
        return ids

    def grow(self, count: int) -> None:
        """Make room for ``count`` more workers (indices after the current ones)."""
        total = len(self._segments) + count
        base = max(self._bound(worker) for worker in range(len(self._segments)))
        for worker, segments in enumerate(self._segments):
            first = self._next[worker]
            if first <= segments[-1][0]:  # its newest segment mapped nothing: it is replaced
                segments.pop()
            segments.append((first, base, total))
        self._segments.extend([(0, base, total)] for _ in range(count))
        self._next.extend([0] * count)

    def _bound(self, worker: int) -> int:
        """One past every collector-wide id ``worker`` was given (its newest segment's base if none)."""
        first, base, stride = self._segments[worker][-1]
        return base + max(0, self._next[worker] - first) * stride


class SharedIds:
    """Every worker draws its trajectory ids from one counter the collector shares with them (worker
    processes): ids are unique as they arrive, also across replacements.

    Args:
        counter: the shared counter (``Backend.trajectory_counter()``), or None.
    """

    def __init__(self, counter=None) -> None:
        self.counter = counter

    def remap(self, batch, worker: int):
        return batch

    def replacement_changes(self, worker: int) -> dict:
        return {}

    def grow(self, count: int) -> None:
        """New workers draw from the same counter."""

    def state(self) -> dict:
        return {}

    def restore(self, section: dict) -> None:
        """Nothing beyond the counter (``"traj_pool"``, TorchRL's key)."""


class PerWorkerIds:
    """Every worker counts its own ids; the collector maps them (:class:`TrajIdMap`): node ``i``'s local
    id ``k`` becomes ``k * W + i`` (segments after growth), -1 stays -1. A replacement starts past every
    id its predecessor handed out.

    Args:
        num_workers: workers at the start.
    """

    counter = None

    def __init__(self, num_workers: int) -> None:
        self.map = TrajIdMap(num_workers)

    def remap(self, batch, worker: int):
        ids = batch.get(TRAJ_IDS, None)
        if ids is not None:
            self.map.map_(ids, worker)
        return batch

    def replacement_changes(self, worker: int) -> dict:
        return {"traj_offset": self.map.next_local(worker)}

    def grow(self, count: int) -> None:
        self.map.grow(count)

    def state(self) -> dict:
        return {"traj_ids": pack(vars(self.map))}

    def restore(self, section: dict) -> None:
        if "traj_ids" in section:
            vars(self.map).update(unpack(section["traj_ids"]))
