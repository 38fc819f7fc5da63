"""The engine's autoscaling part (docs/elastic.md, "Autoscaling"): it owns the :class:`~.autoscale.Autoscaler`
of a collector built with ``autoscale=``, measures for it from inside the iteration, and carries out its
decisions through the engine's :class:`~.membership.Membership`.

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
from .extras import ExternalJoins

__all__ = ["FleetScaler"]


class FleetScaler:
    """The :class:`~.autoscale.ScalingTarget` of an engine, and what feeds its controller.

    Args:
        engine: the engine (its membership, fleet, figures, options and traits).
        config: the user's ``Autoscale``.
        clock: seconds, for the learner's wait and work.
    """

    def __init__(self, engine: Any, config: Autoscale, clock: Callable[[], float] = time.perf_counter) -> None:
        self.engine = engine
        self.config = config
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
        #: ``launcher="external"``: slots opened for nodes asked of ``on_scale``, not taken yet
        self._slots: list[int] = []

    def start(self) -> None:
        """Once the engine's workers are started: the controller (with the join command where nodes join)."""
        joins = self.engine.extra(ExternalJoins)
        command = joins.command() if joins is not None else None
        config = self.config if command is None else dataclasses.replace(self.config, on_scale=self._on_scale)
        self.controller = Autoscaler(config, self, sync=self.engine.traits.sync, join_command=command,
                                     events=self.engine.events)

    # ------------------------------------------------------------------ ScalingTarget
    def active_workers(self) -> list[int]:
        return list(self.engine.active_workers)

    def add_workers(self, count: int) -> list[int]:
        """Start ``count`` workers on ``Autoscale.env_fn`` or the first slot's env constructor.

        Raises:
            WorkerError: a new worker failed to start (the collector goes on as it was).
        """
        engine = self.engine
        before = set(engine.active_workers)
        engine.membership.add_collectors([self._env_fn()] * count, None, None, None,
                                         engine.options.scaled_backend_options(count))
        return [worker for worker in engine.active_workers if worker not in before]

    def remove_workers(self, indices: list[int]) -> None:
        self.engine.membership.remove(indices, None)

    def _env_fn(self) -> Any:
        return self.config.env_fn if self.config.env_fn is not None else self.engine.options.env_fns[0]

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
        engine = self.engine
        now = self._clock()
        # sync: workers are asked all at once, and idle meanwhile only while holding their batch; async:
        # a worker asked again only after its batch was yielded is idle until then too
        held = engine.figures.take_held() if engine.traits.sync else engine.figures.take_idle()
        if self._asked is not None and (self._yielded is not None or not self._recorded):
            # the very first batch is recorded (and not used: it waited for the workers to start) so that
            # the controller's batches are the collector's; a later iteration's first is not measured
            work = max(0.0, self._asked - self._yielded) if self._yielded is not None else 0.0
            self.controller.record(now - self._asked, work, held)
            self._recorded = True
        self._take_joined()
        if not engine.reached_total():
            self.controller.decide()
        self.resplit()
        self._yielded = self._clock()

    # ------------------------------------------------------------------ batches keep their size (sync)
    def frames_of(self, worker: int) -> int:
        """Frames ``worker`` adds to a sync batch (``Membership.share``)."""
        return self._frames.get(worker, self.engine.options.frames_share(worker))

    def resplit(self) -> None:
        """Sync, between two batches: when the workers changed, tell each its share of
        ``frames_per_batch`` (rounded up: ``ceil(frames_per_batch / workers)``) from the next batch on."""
        engine = self.engine
        active = tuple(engine.active_workers)
        if not engine.traits.sync or not active or active == self._split_for or engine.closed:
            return
        share = math.ceil(engine.options.requested_frames / len(active))
        requests = engine.requests
        for worker in active:
            if self._told.get(worker, engine.options.frames_share(worker)) == share:
                continue
            frames = requests.request(worker, Command.RESIZE, share)
            requests.handles[worker].batch_resized()
            self._told[worker], self._frames[worker] = share, int(frames)
            spec = engine.fleet.specs[worker]
            if spec is not None and spec.options is not None:  # a replacement starts at this share
                config = dataclasses.replace(spec.options.config, frames_per_batch=int(frames))
                engine.fleet.remember(worker, options=dataclasses.replace(spec.options, config=config))
        self._split_for = active

    # ------------------------------------------------------------------ launcher="external"
    def _on_scale(self, wanted: int, command: list[str]) -> None:
        """Open the slots the nodes asked for will join (empty slots first), then ask ``on_scale``."""
        engine = self.engine
        empty = len(engine.fleet.current_requests.retired) if engine.fleet.current_requests is not None else 0
        missing = wanted - len(engine.active_workers) - empty - len(self._slots)
        joins = engine.backend.joins
        for _ in range(max(0, missing)):
            index = len(engine.fleet) + len(self._slots)
            self._slots.append(index)
            joins.want(index)
        self.config.on_scale(wanted, command)

    def _take_joined(self) -> None:
        """Slots opened for ``on_scale`` whose node joined, in order, become workers (``Membership.grow``)."""
        if not self._slots:
            return
        joined = set(self.engine.backend.joins.joined(self._slots))
        count = 0
        while count < len(self._slots) and self._slots[count] in joined:
            count += 1
        if count:
            del self._slots[:count]
            self.engine.membership.grow([self._env_fn()] * count, None, None, None, None)

    # ------------------------------------------------------------------ stats()
    def stats(self) -> dict[str, Any]:
        return self.controller.stats() if self.controller is not None else {}
