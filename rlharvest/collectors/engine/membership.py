"""Workers that join and leave a running collector (docs/elastic.md): adding, removing, a preempted
worker's leave, nodes that join from anywhere, and what a sync batch holds once the workers changed.

One code path for every backend: new workers start through :meth:`Fleet.grow` from specs their
options built, leaving ones through :meth:`Fleet.remove`; the engine calls :meth:`Membership.resized`
whenever the set of workers changed (a leave on SIGTERM too).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Sequence

from ..._utils import user_stacklevel, wrap_callable
from ...protocol import Command


__all__ = ["Membership"]


class Membership:
    """Who collects, and what a sync batch holds because of it.

    Args:
        engine: the engine whose fleet, counters and options this part reads.
        share: ``share(worker)``: frames ``worker`` adds to every sync batch.
    """

    def __init__(self, engine: Any, share: Callable[[int], int]) -> None:
        self.engine = engine
        self.share = share
        #: while a batch is being collected (not suspended at a yield): workers cannot join or leave then
        self.collecting = False
        #: between a batch's yield and the iteration resuming (when workers may join or leave)
        self.suspended = False
        #: ``(batches, frames)`` when the workers of a sync collection changed: ``len()`` counts batches
        #: of the former size up to there
        self.resize_point: tuple[int, int] | None = None

    # ------------------------------------------------------------------ checks
    def check_resizable(self, verb: str) -> None:
        """Raises: RuntimeError after shutdown, during a batch, or while running free."""
        engine = self.engine
        noun, name = engine.traits.noun, engine.name
        if engine.closed or engine.fleet is None or engine.fleet.requests is None:
            raise RuntimeError(f"{name} is shut down: it cannot {verb} {noun}s.")
        if self.collecting:
            raise RuntimeError(f"{name} cannot {verb} {noun}s while a batch is being collected (from a postproc, a "
                               "hook or another thread): call it between two batches.")
        if engine.is_running():
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
        fleet = self.engine.fleet
        indices = fleet.check_removable(indices)
        fleet.remove(indices, timeout, running_free=self.engine.workers_pushing())
        self.resized()

    # ------------------------------------------------------------------ joining
    def add(self, specs: list, backend_options: list | None) -> None:
        """Start ``specs`` as workers after the others (:meth:`Fleet.grow`): on the current weights and
        policy version, with the hooks set since construction, seeded by continuing the chain of the
        last ``set_seed`` (docs/backends.md, "Adding workers").

        Raises:
            RuntimeError: see :meth:`check_resizable`. WorkerError: a new worker failed to start (the new
                workers are stopped; the collector goes on as it was).
        """
        engine = self.engine
        hooks = {name: wrap_callable(hook) for name, hook in engine.hooks.items() if hook is not None}
        specs = [spec.with_hooks(hooks).replacement(policy_version=engine.weights.version) for spec in specs]
        fleet = engine.fleet
        first = len(fleet)
        fleet.grow(specs, backend_options)  # the others' rollouts in flight go on meanwhile
        chain = engine.broadcast.seed_chain
        if chain is None:
            return
        try:
            engine.broadcast.seed([spec.worker_idx for spec in specs], *chain)
        except BaseException:  # a new worker failed at once: as if it had failed to start
            fleet.shrink(first)
            raise

    def add_collectors(self, create_env_fn: Any, num_envs: int | None, policy: Any, collector_kwargs: Any,
                    backend_options: Any = None) -> None:
        """``add_collectors``: the options check and build the new workers' specs; the membership
        starts them (docs/elastic.md).

        Raises:
            ValueError: for an argument that does not fit. NotImplementedError: when the backend or a
                weight sender cannot grow. RuntimeError: see :meth:`Membership.check_resizable`.
        """
        if self.engine.traits.external_joins:
            raise NotImplementedError("launcher='external': the slots are the entries of create_env_fn, filled by the "
                                      "nodes that join (join_command()); add_collectors cannot add slots to it.")
        self.grow(create_env_fn, num_envs, policy, collector_kwargs, backend_options)

    def grow(self, create_env_fn: Any, num_envs: int | None, policy: Any, collector_kwargs: Any,
             backend_options: Any = None) -> None:
        """What :meth:`add_collectors` does once its arguments are accepted; the autoscaler also grows a
        ``launcher="external"`` collector by the nodes that joined the slots it opened.

        Raises:
            as :meth:`add_collectors`.
        """
        engine = self.engine
        self.check_resizable("add")
        if engine.weights.updater is not None:
            raise ValueError(f"add_collectors needs weight sync schemes: this collector was built with a legacy "
                             f"weight_updater, which serves the {engine.traits.noun}s it started with only.")
        first = engine.num_workers
        grown, specs, extra_options = engine.options.added(first, create_env_fn, num_envs, policy, collector_kwargs,
                                                         backend_options, engine.setup)
        engine.fleet.check_growable()
        previous = engine.options
        engine.options, engine.config = grown, grown.config
        try:
            self.add(specs, extra_options)
        except BaseException:
            engine.options, engine.config = previous, previous.config
            raise
        count = len(specs)
        if engine.loop.pushing:  # the new workers run free like the others
            for spec in specs:
                engine.requests.request(spec.worker_idx, Command.RUN_FREE)
        engine.ids.grow(count)
        engine.schedule.grow(count, mid_batch=engine.traits.sync and self.suspended)
        for extra in engine.extras:
            extra.grown(count)
        self.resized()

    # ------------------------------------------------------------------ what a sync batch holds
    def resized_frames_per_batch(self) -> int | None:
        """Frames of a sync batch once workers joined or left (the shares of the current workers);
        None while the workers are those of construction, or when batches are not synchronous."""
        if self.engine.traits.sync and self.resize_point is not None:
            return sum(self.share(worker) for worker in self.engine.active_workers)
        return None

    def resized(self) -> None:
        """Bookkeeping once workers joined or left: a sync batch holds the current workers' shares from
        the next batch on (autoscaling: ``frames_per_batch`` re-split among them); ``len()`` counts the
        batches of the former size so far."""
        engine = self.engine
        if not engine.traits.sync:
            return
        scaler = engine.scaler
        if scaler is not None and not self.collecting:  # else at the end of the batch being collected
            scaler.resplit()
        self.resize_point = (engine.iter + 1, engine.frames)
        if scaler is not None:  # batches keep their size: nothing to warn about
            return
        config = engine.config
        remaining = config.total_frames - engine.frames
        per_batch = engine.requested_frames_per_batch
        if not config.endless and remaining > 0 and remaining % per_batch:
            warnings.warn(f"{remaining} frames remain to total_frames={config.total_frames}, not a multiple of the "
                          f"{per_batch} of a batch of {len(engine.active_workers)} {engine.traits.noun}s: the last "
                          "batch collects the excess.", stacklevel=user_stacklevel())

    def num_batches(self, default: Callable[[], int]) -> int:
        """``len()``: ``default()`` while the workers never changed, else the batches of the former sizes
        so far plus those of the current size to ``total_frames``."""
        point = self.resize_point
        if point is None or self.engine.config.endless:
            return default()
        batches, frames = point
        remaining = max(0, self.engine.config.total_frames - frames)
        return batches + math.ceil(remaining / self.engine.requested_frames_per_batch)

    def state(self) -> Any:
        return list(self.resize_point) if self.resize_point is not None else None

    def restore(self, state: Any) -> None:
        self.resize_point = tuple(state) if state is not None else None
