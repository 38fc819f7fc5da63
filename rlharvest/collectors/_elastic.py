"""Workers that join and leave a running collector (docs/elastic.md): the collector's half.

:class:`ElasticWorkers` is a base of :class:`~rlharvest.collectors.remote.RemoteCollectorBase`:
``remove_collectors`` (the fleet makes the workers leave, :meth:`Fleet.remove`), the shared part of
``add_collectors`` (:meth:`ElasticWorkers._add_workers`, over :meth:`Fleet.grow`; each face parses
its own arguments), and what a sync batch looks like once the workers changed
(``requested_frames_per_batch``, ``len()``).
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from typing import TYPE_CHECKING, Callable, Sequence

from ._specs import wrap_callable

if TYPE_CHECKING:  # annotations only: these modules import this one's users
    from ..config import CollectorConfig
    from ._fleet import Fleet
    from ._requests import WorkerRequests
    from .broadcast import WorkerBroadcast

__all__ = ["ElasticWorkers"]


def _caller_outside_package() -> int:
    """The ``stacklevel`` of a warning raised by the caller of this function that points at the first
    frame outside rlharvest (the user's call, however deep inside the package the warning is raised)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


class ElasticWorkers:
    """Joining and leaving for a collector with workers: a base of ``RemoteCollectorBase``, which
    defines everything declared below that this class reads."""

    config: CollectorConfig
    noun: str
    _fleet: Fleet | None
    _broadcast: WorkerBroadcast | None
    _requests: WorkerRequests | None
    _sync: bool
    _closed: bool
    _frames: int
    _iter: int
    _policy_version: int
    _pre_collect_hook: Callable[[], None] | None
    _post_collect_hook: Callable | None
    requested_frames_per_batch: int
    active_workers: list[int]
    is_running: Callable[[], bool]

    #: while a batch is being collected (not suspended at a yield): workers cannot join or leave then
    _collecting = False
    #: between a batch's yield and the iteration resuming (when workers may join or leave)
    _suspended = False
    #: ``(batches, frames)`` when the workers of a sync collection changed: ``len()`` counts batches of
    #: the former size up to there
    _resize_point: tuple[int, int] | None = None

    def remove_collectors(self, indices: int | Sequence[int], timeout: float | None = None) -> None:
        """Make the workers ``indices`` leave the collection, gracefully.

        Each stops at a rollout boundary: between two batches nothing is in flight; with ``sync=False``
        its rollout in flight is cut short and dropped whole (never counted), so no frame is doubled
        and ``total_frames`` stays exact. Its process (node, actor) is gone when this returns: it is
        asked to close, and terminated if it has not within ``timeout`` seconds (default
        ``worker_timeout``). The other workers keep their indices: a removed index stays an empty
        slot (``num_workers`` counts slots, ``active_workers`` lists the workers collecting,
        ``stats()["workers"]`` counts them). With ``sync=True`` the next batch stacks one rollout of
        each remaining worker: it shrinks by the removed workers' share, and
        ``requested_frames_per_batch`` and ``len()`` follow.

        Args:
            indices: a worker index, or a list of them.
            timeout: seconds the workers have to stop and close (None: ``worker_timeout``).

        Raises:
            ValueError: for an index that is not a current worker, or when no worker would be left.
            RuntimeError: after shutdown, while running free (:meth:`start`), or from inside the
                collector's own iteration (a ``postproc``, another thread).

        Example:
            >>> from rlharvest.collectors import MultiSyncCollector
            >>> from rlharvest.envs import CountingEnv
            >>> collector = MultiSyncCollector([CountingEnv] * 2, frames_per_batch=8, total_frames=16)
            >>> collector.remove_collectors([1])
            >>> collector.active_workers, collector.requested_frames_per_batch
            ([0], 4)
            >>> collector.shutdown()
        """
        self._check_resizable("remove")
        indices = self._fleet.check_removable(indices)
        self._fleet.remove(indices, timeout, running_free=self._workers_run_free())
        self._resized()

    def _workers_run_free(self) -> bool:
        """Whether the workers push batches unasked during iteration (they are paused before leaving)."""
        return False

    def _check_resizable(self, verb: str) -> None:
        if self._closed or self._fleet is None or self._requests is None:
            raise RuntimeError(f"{type(self).__name__} is shut down: it cannot {verb} {self.noun}s.")
        if self._collecting:
            raise RuntimeError(f"{type(self).__name__} cannot {verb} {self.noun}s while a batch is being collected "
                               "(from a postproc, a hook or another thread): call it between two batches.")
        if self.is_running():
            raise RuntimeError(f"{type(self).__name__} is running free (start()): {verb} {self.noun}s before "
                               "start() or after async_shutdown().")

    def _frames_share(self, worker: int) -> int:
        """Frames ``worker`` adds to every sync batch."""
        raise NotImplementedError

    def _resized_frames_per_batch(self) -> int | None:
        """Frames of a sync batch once workers joined or left (the shares of the current workers);
        None while the workers are those of construction, or with ``sync=False``."""
        if self._sync and self._resize_point is not None:
            return sum(self._frames_share(worker) for worker in self.active_workers)
        return None

    def _resized(self) -> None:
        """Bookkeeping once workers joined or left: a sync batch holds the current workers' shares from
        the next batch on; ``len()`` counts the batches of the former size so far."""
        if not self._sync:
            return
        self._resize_point = (self._iter + 1, self._frames)
        remaining = self.config.total_frames - self._frames
        if not self.config.endless and remaining > 0 and remaining % self.requested_frames_per_batch:
            warnings.warn(f"{remaining} frames remain to total_frames={self.config.total_frames}, not a multiple of the "
                          f"{self.requested_frames_per_batch} of a batch of {len(self.active_workers)} {self.noun}s: "
                          "the last batch collects the excess.", stacklevel=_caller_outside_package())

    def __len__(self) -> int:
        point = self._resize_point
        if point is None or self.config.endless:
            return super().__len__()
        batches, frames = point  # batches of the former sizes so far, then of the current one
        return batches + math.ceil(max(0, self.config.total_frames - frames) / self.requested_frames_per_batch)

    def _add_workers(self, specs: list, options: list | None = None) -> None:
        """Start ``specs`` as workers after the others (:meth:`Fleet.grow`): on the current weights and
        policy version, with the hooks set since construction, seeded by continuing the chain of the
        last :meth:`set_seed` (docs/backends.md, "Adding workers").

        Raises:
            RuntimeError: after shutdown, or while running free.
        """
        self._check_resizable("add")
        hooks = {name: wrap_callable(hook) for name, hook in (("pre_collect_hook", self._pre_collect_hook),
                                                               ("post_collect_hook", self._post_collect_hook))
                 if hook is not None}
        specs = [spec.replacement(policy_version=self._policy_version,
                                  collector_kwargs={**spec.collector_kwargs, **hooks}) for spec in specs]
        first = len(self._fleet)
        self._fleet.grow(specs, options)  # the others' rollouts in flight go on meanwhile
        chain = self._broadcast.seed_chain
        if chain is None:
            return
        try:
            self._broadcast.seed([spec.worker_idx for spec in specs], *chain)
        except BaseException:  # a new worker failed at once: as if it had failed to start
            self._fleet.shrink(first)
            raise
