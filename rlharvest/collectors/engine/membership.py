"""Workers that join and leave a running collector (docs/elastic.md): adding, removing, a preempted
worker's leave, nodes that join from anywhere, and what a sync batch holds once the workers changed.

One code path for every backend: new workers start through :meth:`Fleet.grow` from specs their
options built, leaving ones through :meth:`Fleet.remove`; :meth:`Membership.resized` runs whenever the
set of workers changed (a leave on SIGTERM too).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Protocol, Sequence

from ..._utils import user_stacklevel, wrap_callable
from ...protocol import Command, EnvSettings, WorkerSpec
from .broadcast import WorkerBroadcast
from .extras import EngineExtra
from .fleet import Fleet
from .loops import BatchLoop
from .state import BatchSizes, Lifecycle
from .schedule import WeightSchedule
from .traj_ids import TrajectoryIds
from .weights import WeightPublisher

__all__ = ["Membership"]


class Resplit(Protocol):
    """The autoscaler's part that keeps a sync batch's size as workers change (``scaling.py``)."""

    def resplit(self) -> None:
        """Tell each current worker its share of ``frames_per_batch``."""


class Membership:
    """Who collects, and what a sync batch holds because of it.

    Args:
        fleet: the workers.
        loop: the collector's batches (where the iteration is; whether workers run free for it).
        broadcast: commands to every worker (the seed chain new workers continue).
        weights: the publisher (the version new workers start at; a legacy updater refuses growth).
        schedule: the automatic weight pushes (counters per worker).
        ids: the trajectory-id map (room for new workers).
        sizes: what a sync batch holds.
        extras: the parts a backend adds (told of new workers; may refuse ``add_collectors``).
        hooks: the pre/post-collect hooks new workers get.
        life: the collector's name, and whether it is open.
        is_running: whether the collector runs free (``start()``): workers cannot join or leave then.
        scaler: the autoscaler's part (re-splits sync batches), or None.
        noun: how messages name a worker.
        env_settings: what new workers' envs start with (``setattr_env`` on every worker so far).
    """

    def __init__(self, fleet: Fleet, loop: BatchLoop, broadcast: WorkerBroadcast, weights: WeightPublisher,
                 schedule: WeightSchedule, ids: TrajectoryIds, sizes: BatchSizes, extras: Sequence[EngineExtra],
                 hooks: dict, life: Lifecycle, is_running: Callable[[], bool], scaler: Resplit | None = None,
                 noun: str = "worker", env_settings: Callable[[], EnvSettings] = tuple) -> None:
        self.fleet = fleet
        self.env_settings = env_settings
        self.loop = loop
        self.broadcast = broadcast
        self.weights = weights
        self.schedule = schedule
        self.ids = ids
        self.sizes = sizes
        self.extras = extras
        self.hooks = hooks
        self.life = life
        self.is_running = is_running
        self.scaler = scaler
        self.noun = noun

    # ------------------------------------------------------------------ checks
    def check_resizable(self, verb: str) -> None:
        """Raises: RuntimeError after shutdown, during a batch, or while running free."""
        noun, name = self.noun, self.life.name
        if self.life.closed or self.fleet.requests is None:
            raise RuntimeError(f"{name} is shut down: it cannot {verb} {noun}s.")
        if self.loop.collecting:
            raise RuntimeError(f"{name} cannot {verb} {noun}s while a batch is being collected (from a postproc, a "
                               "hook or another thread): call it between two batches.")
        if self.is_running():
            raise RuntimeError(f"{name} is running free (start()): {verb} {noun}s before start() or after "
                               "async_shutdown().")

    # ------------------------------------------------------------------ leaving
    def remove(self, indices: int | Sequence[int], timeout: float | None) -> None:
        """``remove_collectors``: the workers ``indices`` leave gracefully (docs/elastic.md).

        Raises:
            ValueError: for an index that is not a current worker, or when no worker would be left.
            RuntimeError: see :meth:`check_resizable`.
        """
        self.check_resizable("remove")
        indices = self.fleet.check_removable(indices)
        self.fleet.remove(indices, timeout, running_free=self.loop.pushing)
        self.resized()

    # ------------------------------------------------------------------ joining
    def check_grow(self) -> None:
        """Before the options are grown by new workers (``add_collectors``; the autoscaler also grows a
        ``launcher="external"`` collector by the nodes that joined the slots it opened).

        Raises:
            ValueError: with a legacy weight updater. RuntimeError: see :meth:`check_resizable`.
        """
        self.check_resizable("add")
        if self.weights.updater is not None:
            raise ValueError(f"add_collectors needs weight sync schemes: this collector was built with a legacy "
                             f"weight_updater, which serves the {self.noun}s it started with only.")

    def check_add(self) -> None:
        """Raises: NotImplementedError when a part of the backend refuses ``add_collectors`` (slots that
        nodes fill by joining)."""
        for extra in self.extras:
            extra.check_add()

    def start_added(self, specs: list[WorkerSpec], backend_options: Any) -> None:
        """Start the new workers :meth:`prepare` made the specs of, and bring them to where the others
        are (running free, counted, in the batches' size).

        Raises:
            WorkerError: a new worker failed to start (the new workers are stopped; the collector goes
                on as it was).
        """
        self._start(specs, backend_options)
        count = len(specs)
        if self.loop.pushing:  # the new workers run free like the others
            for spec in specs:
                self.fleet.requests.request(spec.worker_idx, Command.RUN_FREE)
        self.ids.grow(count)
        self.schedule.grow(count, mid_batch=self.sizes.sync and self.loop.suspended)
        for extra in self.extras:
            extra.grown(count)
        self.resized()

    def _start(self, specs: list[WorkerSpec], backend_options: list | None) -> None:
        """Start ``specs`` as workers after the others (:meth:`Fleet.grow`): on the current weights and
        policy version, with the hooks set since construction and the env settings given to every worker, seeded by continuing the chain of the
        last ``set_seed`` (docs/backends.md, "Adding workers").

        Raises:
            WorkerError: a new worker failed to start (the new workers are stopped; the collector goes
                on as it was).
        """
        hooks = {name: wrap_callable(hook) for name, hook in self.hooks.items() if hook is not None}
        settings = self.env_settings()
        specs = [spec.with_hooks(hooks).replacement(policy_version=self.weights.version, env_settings=settings)
                 for spec in specs]
        fleet = self.fleet
        first = len(fleet)
        fleet.grow(specs, backend_options)  # the others' rollouts in flight go on meanwhile
        chain = self.broadcast.seed_chain
        if chain is None:
            return
        try:
            self.broadcast.seed([spec.worker_idx for spec in specs], *chain)
        except BaseException:  # a new worker failed at once: as if it had failed to start
            fleet.shrink(first)
            raise

    # ------------------------------------------------------------------ what a sync batch holds
    def resized(self) -> None:
        """Bookkeeping once workers joined or left: a sync batch holds the current workers' shares from
        the next batch on (autoscaling: ``frames_per_batch`` re-split among them); ``len()`` counts the
        batches of the former size so far."""
        sizes = self.sizes
        if not sizes.sync:
            return
        scaler = self.scaler
        if scaler is not None and not self.loop.collecting:  # else at the end of the batch being collected
            scaler.resplit()
        sizes.resized()
        if scaler is not None:  # batches keep their size: nothing to warn about
            return
        tally = sizes.tally
        budget = tally.budget
        remaining = budget.total_frames - tally.frames
        per_batch = sizes.frames_per_batch()
        if not budget.endless and remaining > 0 and remaining % per_batch:
            warnings.warn(f"{remaining} frames remain to total_frames={budget.total_frames}, not a multiple of the "
                          f"{per_batch} of a batch of {len(self.fleet.active)} {self.noun}s: the last "
                          "batch collects the excess.", stacklevel=user_stacklevel())
