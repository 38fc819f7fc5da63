"""The engine's autoscaling part (docs/elastic.md, "Autoscaling"): it owns the :class:`~.autoscale.Autoscaler`
of a collector built with ``autoscale=``, measures for it from inside the iteration, and carries out its
decisions through the engine's membership (the adds and removes it is given).

What it measures, per yielded batch (the controller reads no clock):

* the learner's wait: from the learner asking for the batch (the iterator resumed) to the batch being
  ready; its work: from the previous batch's yield to asking for this one;
* the seconds workers held finished batches nobody had taken: for each rollout, from its request to
  its reply being taken, less the seconds the rollout took (``WorkerFigures``, from the replies);
  asynchronously also the time a worker waited to be asked again after its batch was taken (nodes
  are asked only once their batch was yielded).

The time decisions take (workers starting or leaving) counts as neither. With ``sync=True`` a batch
keeps the ``frames_per_batch`` the user asked for: whenever the number of workers changes, each is
told its new share (``Command.RESIZE``, rounded up to the env batch by the worker), and its spec keeps
it for a replacement. Asynchronously each batch is one worker's ``frames_per_batch`` whatever the count.

With ``launcher="external"`` the fleet grows through the user's ``on_scale``: the slots it asks nodes
for are opened for joining, and nodes that joined them are taken between two batches.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

from ...protocol import Command
from ..options.autoscale import Autoscale
from .autoscale import Autoscaler
from .events import FleetEvents
from .extras import ExternalJoins
from .fleet import Fleet
from .state import Lifecycle, Tally
from .worker_figures import WorkerFigures

__all__ = ["FleetScaler"]


class FleetScaler:
    """The :class:`~.autoscale.ScalingTarget` of an engine, and what feeds its controller.

    Args:
        config: the user's ``Autoscale``.
        fleet: the workers (their shares are told to them, and kept in their specs).
        figures: each worker's figures (the seconds workers held finished batches).
        tally: frames so far, against ``total_frames`` (no decision once it is reached).
        life: whether the collector is open.
        add: ``add(env_fns, backend_options)`` adds one worker per env constructor (``add_collectors``).
        grow: ``grow(env_fns)`` takes in as many nodes that joined the slots opened for them.
        remove: ``remove(indices)`` makes those workers leave (``remove_collectors``).
        requested: the ``frames_per_batch`` the user asked for (a sync batch keeps it).
        share: ``share(worker)``: the frames ``worker`` was built to collect per rollout.
        backend_options: what the backend needs of ``count`` workers the autoscaler adds.
        env_fn: the env constructor of the first slot (``Autoscale.env_fn`` otherwise).
        joins: nodes that join from anywhere (``launcher="external"``), or None.
        events: where the autoscaler's decisions are published (and logged).
        sync: whether every batch holds one rollout of every worker.
        clock: seconds, for the learner's wait and work.
    """

    def __init__(self, config: Autoscale, fleet: Fleet, figures: WorkerFigures, tally: Tally, life: Lifecycle, *,
                 add: Callable[[list, Any], None], grow: Callable[[list], None],
                 remove: Callable[[list[int]], None], requested: Callable[[], int], share: Callable[[int], int],
                 backend_options: Callable[[int], Any], env_fn: Callable, joins: ExternalJoins | None = None,
                 events: FleetEvents | None = None, sync: bool = True,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.config = config
        self.fleet = fleet
        self.figures = figures
        self.tally = tally
        self.life = life
        self._add, self._grow, self._remove = add, grow, remove
        self.requested = requested
        self.share = share
        self.backend_options = backend_options
        self.env_fn = config.env_fn if config.env_fn is not None else env_fn
        self.joins = joins
        self.events = events
        self.sync = sync
        self._clock = clock
        self.controller: Autoscaler | None = None
        self._asked: float | None = None
        self._yielded: float | None = None
        self._recorded = False
        #: sync: the share each worker was told (``RESIZE``) and the frames it collects, by worker
        self._told: dict[int, int] = {}
        self._frames: dict[int, int] = {}
        #: sync: the workers the last split was made for
        self._split_for: tuple[int, ...] | None = None

    def start(self) -> None:
        """Once the engine's workers are started: the controller (with the join command where nodes join)."""
        command = self.joins.command() if self.joins is not None else None
        config = self.config if command is None else dataclasses.replace(self.config, on_scale=self._on_scale)
        self.controller = Autoscaler(config, self, sync=self.sync, join_command=command, events=self.events)

    # ------------------------------------------------------------------ ScalingTarget
    def active_workers(self) -> list[int]:
        return list(self.fleet.active)

    def add_workers(self, count: int) -> list[int]:
        """Start ``count`` workers on ``Autoscale.env_fn`` or the first slot's env constructor.

        Raises:
            WorkerError: a new worker failed to start (the collector goes on as it was).
        """
        before = set(self.fleet.active)
        self._add([self.env_fn] * count, self.backend_options(count))
        return [worker for worker in self.fleet.active if worker not in before]

    def remove_workers(self, indices: list[int]) -> None:
        self._remove(indices)

    # ------------------------------------------------------------------ measurements (CollectionEngine.iterate)
    def asked(self) -> None:
        """The learner asks for the next batch (the iterator starts or resumes)."""
        self._asked = self._clock()

    def restarted(self) -> None:
        """A new iteration starts: the time since the last one was not the learner's work."""
        self._yielded = None
        self.asked()

    def batch_ready(self) -> None:
        """A batch is about to be yielded: record what was measured, let the controller decide, and
        re-split a sync batch among the workers now collecting."""
        now = self._clock()
        # sync: workers are asked all at once, and idle meanwhile only while holding their batch; async:
        # a worker asked again only after its batch was yielded is idle until then too
        held = self.figures.take_held() if self.sync else self.figures.take_idle()
        if self._asked is not None and (self._yielded is not None or not self._recorded):
            # the very first batch is recorded (and not used: it waited for the workers to start) so that
            # the controller's batches are the collector's; a later iteration's first is not measured
            work = max(0.0, self._asked - self._yielded) if self._yielded is not None else 0.0
            self.controller.record(now - self._asked, work, held)
            self._recorded = True
        self._take_joined()
        if not self.tally.reached_total():
            self.controller.decide()
        self.resplit()
        self._yielded = self._clock()

    # ------------------------------------------------------------------ batches keep their size (sync)
    def frames_of(self, worker: int) -> int:
        """Frames ``worker`` adds to a sync batch (``BatchSizes.share``)."""
        return self._frames.get(worker, self.share(worker))

    def resplit(self) -> None:
        """Sync, between two batches: when the workers changed, tell each its share of
        ``frames_per_batch`` (rounded up: ``ceil(frames_per_batch / workers)``) from the next batch on."""
        active = tuple(self.fleet.active)
        if not self.sync or not active or active == self._split_for or self.life.closed:
            return
        share = math.ceil(self.requested() / len(active))
        requests = self.fleet.requests
        for worker in active:
            if self._told.get(worker, self.share(worker)) == share:
                continue
            frames = requests.request(worker, Command.RESIZE, share)
            requests.handles[worker].batch_resized()
            self._told[worker], self._frames[worker] = share, int(frames)
            spec = self.fleet.specs[worker]
            if spec is not None and spec.options is not None:  # a replacement starts at this share
                config = dataclasses.replace(spec.options.config, frames_per_batch=int(frames))
                self.fleet.remember(worker, options=dataclasses.replace(spec.options, config=config))
        self._split_for = active

    # ------------------------------------------------------------------ launcher="external"
    def _on_scale(self, wanted: int, command: list[str]) -> None:
        """Open the slots the nodes asked for will join (empty slots first), then ask ``on_scale``."""
        self.joins.open_slots(wanted)
        self.config.on_scale(wanted, command)

    def _take_joined(self) -> None:
        """Slots opened for ``on_scale`` whose node joined, in order, become workers."""
        if self.joins is None:
            return
        count = self.joins.take_joined()
        if count:
            self._grow([self.env_fn] * count)

    # ------------------------------------------------------------------ stats()
    def stats(self) -> dict[str, Any]:
        return self.controller.stats() if self.controller is not None else {}
