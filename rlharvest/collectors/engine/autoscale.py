"""The autoscaler's controller: a fleet that sizes itself to keep the learner fed (docs/elastic.md,
"Autoscaling").

:class:`Autoscaler` is fed by its owner (the engine's :class:`~.scaling.FleetScaler`) at every batch
boundary with what it measured (:meth:`Autoscaler.record`), then asked to decide
(:meth:`Autoscaler.decide`). It acts through :class:`ScalingTarget`, a small Protocol the owner
implements, and reports its figures as flat ``stats()`` keys. What the user asks for is
:class:`~rlharvest.collectors.options.autoscale.Autoscale`.

The controller reads no clock to measure anything: every duration comes from its owner, so it is
deterministic under test (fake measurements, a fake clock for the decisions' time stamps).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from ...errors import WorkerError
from ..options.autoscale import Autoscale
from .autoscale_signals import Sample, check_seconds, fleet_demand, fleet_signals
from .events import EventKind, FleetEvents

__all__ = ["Autoscaler", "ScalingDecision", "ScalingTarget"]

logger = logging.getLogger("rlharvest.autoscale")

#: the longest a failed add may push the next one back, in multiples of ``cooldown``
MAX_BACKOFF = 8
#: how far the demand (rollout seconds per second of learner work) must fall before the fleet
#: shrinks back to a count at which the learner starved: by half, well beyond the noise of a window
PACE_CHANGE = 0.5
#: synchronous: the share of its predicted drop in the learner's wait per batch an add must bring,
#: else it is undone (per-batch costs that do not shrink with more workers left the wait where it was)
MIN_GAIN = 0.5


class ScalingTarget(Protocol):
    """What the autoscaler's owner (the collector) does for it, between two batches."""

    def active_workers(self) -> list[int]:
        """The indices of the workers collecting now, in order."""

    def add_workers(self, count: int) -> list[int]:
        """Start ``count`` workers (``Autoscale.env_fn`` or the first slot's env) and return their
        indices; raise ``WorkerError`` when one fails to start (the collector goes on as it was)."""

    def remove_workers(self, indices: list[int]) -> None:
        """Make the workers ``indices`` leave at a rollout boundary (``remove_collectors``)."""


@dataclass(frozen=True)
class ScalingDecision:
    """One decision of the autoscaler, kept in ``stats()["autoscale/decisions"]``."""

    time: float
    """Wall-clock time (``time.time()``) of the decision."""
    elapsed_s: float
    """Seconds since the autoscaler started (its clock)."""
    batch: int
    """Batches recorded when it was taken."""
    action: str
    """``"add"`` or ``"remove"``."""
    reason: str
    """``"learner_wait"``, ``"worker_idle"``, ``"no_gain"`` (an add undone), ``"min_collectors"`` or
    ``"max_collectors"``."""
    collectors: int
    """Workers collecting before the decision."""
    wanted: int
    """Workers wanted after it."""
    learner_wait: float
    """The signal the decision saw (over the batches since the last decision, up to ``window``)."""
    worker_idle: float
    """The signal the decision saw."""
    workers: tuple[int, ...] = ()
    """The indices added or removed (empty when nodes were asked of ``on_scale``)."""
    seconds: float = 0.0
    """Seconds the action took (the autoscaler's clock)."""
    error: str | None = None
    """Why an add failed (the count stayed), else None."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Autoscaler:
    """Decides, at batch boundaries, whether the collector adds or removes a worker.

    Its owner calls :meth:`record` once per yielded batch with what it measured, then :meth:`decide`
    (between two batches, when workers may join and leave); :meth:`stats` gives the flat
    ``"autoscale/..."`` keys of the collector's ``stats()``.

    The rules (thresholds from :class:`Autoscale`; ``n`` workers collecting now):

    1. Bounds first: below ``min_collectors`` the missing workers are added, above
       ``max_collectors`` the extra ones removed, at the next decision.
    2. Then nothing until ``cooldown`` batches were recorded since the last decision; the signals
       are computed over those batches (the last ``window`` of them).
    3. Add workers while ``learner_wait > grow_above``: as many as the measured demand calls for
       to bring the wait to ``grow_above`` (asynchronously the demand is the seconds of rollouts
       per second of the learner's work; synchronously each wait shrinks by ``n / m``), at least
       one and at most ``n`` (the fleet at most doubles: an estimate made while starving can be
       off, and the next window corrects it).
    4. Remove workers, once ``window`` batches were measured since the last decision (adding is
       urgent, removing is not), while ``learner_wait < shrink_below`` and the others could take
       their work: as many as leave the others idle more than ``shrink_above`` of their time
       (asynchronous: ``1 - (1 - worker_idle) * n / m``), or the learner waiting less than
       ``shrink_below`` with the batch split among those left (synchronous: each wait times
       ``n / m``).
    5. Never back to a count at which the learner starved, until the demand (which does not depend
       on the count) has fallen by half since: timings that jitter around a count that is just
       enough would otherwise undo the add they called for a window later, over and over.
    6. Synchronously, an add must bring the learner's wait per batch down by at least half of what it
       predicted (``n / m``); else it is undone at the next decision (reason ``"no_gain"``) and the
       fleet grows no further than that count until the wait per batch there doubles (longer
       rollouts to share): what a sync batch costs besides its rollouts (commands, transport,
       stacking) does not shrink with more workers, and can keep the wait above ``grow_above`` at
       any count.

    The workers removed are those with the highest indices, the newest: the workers of construction
    stay, and with ``launcher="external"`` the nodes that joined last leave first.

    A count that changes by itself (a worker preempted, a node that joined) starts the measurements
    afresh, as a decision does; after workers joined, asynchronously, as many batches as there are
    workers are not used (the new ones deliver their first batch a rollout later). With
    ``launcher="external"`` (``join_command`` given) an add calls
    ``on_scale(wanted_nodes, join_command)``; no decision is taken until the nodes asked for joined
    or ``join_timeout`` seconds passed. An add that fails (``WorkerError``: a new worker did not
    start) is recorded with its error and logged at WARNING; the count stays, and the next decision
    waits twice as many batches (up to 8 times ``cooldown``). Every decision is kept in
    :attr:`decisions` and logged at INFO on the ``rlharvest.autoscale`` logger.

    Args:
        config: the user's :class:`Autoscale`.
        target: the owner, which adds and removes workers (:class:`ScalingTarget`).
        sync: whether every batch holds one rollout of every worker (the learner waits for all).
        join_command: ``launcher="external"``: the argv a node runs to join (``on_scale`` is called
            with it instead of ``target.add_workers``).
        clock: seconds, for the decisions' ``elapsed_s`` and ``seconds`` and for ``join_timeout``.
        events: where each decision is published (and logged); a log of its own by default.

    Raises:
        ValueError: ``join_command`` without ``config.on_scale``.

    Example:
        >>> class Fleet:
        ...     workers = [0]
        ...     def active_workers(self): return list(self.workers)
        ...     def add_workers(self, count):
        ...         new = list(range(self.workers[-1] + 1, self.workers[-1] + 1 + count))
        ...         self.workers += new
        ...         return new
        ...     def remove_workers(self, indices): self.workers = [w for w in self.workers if w not in indices]
        >>> fleet = Fleet()
        >>> autoscaler = Autoscaler(Autoscale(1, 4, cooldown=2), fleet, sync=False)
        >>> for _ in range(3):  # the learner waits 0.3 s for each batch, works 0.1 s
        ...     autoscaler.record(wait_s=0.3, work_s=0.1, idle_s=0.0)
        >>> autoscaler.decide().action, fleet.workers
        ('add', [0, 1])
    """

    def __init__(self, config: Autoscale, target: ScalingTarget, *, sync: bool,
                 join_command: Sequence[str] | None = None, clock: Callable[[], float] = time.monotonic,
                 events: FleetEvents | None = None) -> None:
        if join_command is not None and config.on_scale is None:
            raise ValueError("Autoscaler: join_command (launcher='external') needs Autoscale(on_scale=...).")
        self.config = config
        self.target = target
        self.sync = bool(sync)
        self.events = events if events is not None else FleetEvents()
        self._join_command = list(join_command) if join_command is not None else None
        self._clock = clock
        self._start = clock()
        self._samples: collections.deque[Sample] = collections.deque(maxlen=config.window)
        self._epoch = 0
        self._since_decision = 0
        self._batches = 0
        #: workers at the last batch, and batches still to skip after workers joined (asynchronous)
        self._workers: int | None = None
        self._settling = 0
        self._cooldown = config.cooldown
        self._failed_adds = 0
        #: ``(count, demand)``: the learner starved with one worker fewer than ``count`` at that demand
        self._floor: tuple[int, float] | None = None
        #: synchronous: ``(count before, count after, wait per batch before)`` of the last add, until judged
        self._last_add: tuple[int, int, float] | None = None
        #: synchronous: ``(count, wait per batch there)``: no add beyond ``count`` (an add there gained nothing)
        self._ceiling: tuple[int, float] | None = None
        #: ``launcher="external"``: ``(wanted, asked at)`` while the nodes asked for have not joined
        self._pending: tuple[int, float] | None = None
        #: every decision so far, oldest first
        self.decisions: list[ScalingDecision] = []

    # ------------------------------------------------------------------ measurements
    def record(self, wait_s: float, work_s: float, idle_s: float) -> None:
        """One yielded batch's measurements. Not used: the first batch (it waited for the workers to
        start) and, asynchronously, as many batches as there are workers after workers joined (the
        new ones deliver their first batch a rollout later).

        Args:
            wait_s: seconds the learner waited inside the iterator for this batch (from asking for it
                to getting it).
            work_s: seconds between the previous batch's yield and asking for this one (the learner's
                own work).
            idle_s: seconds workers sat idle holding a finished batch nobody had taken, since the
                previous batch, summed over workers.

        Raises:
            ValueError: naming a measurement that is negative or not finite.
        """
        sample = (check_seconds("wait_s", wait_s), check_seconds("work_s", work_s), check_seconds("idle_s", idle_s))
        workers = len(self.target.active_workers())
        self._batches += 1
        previous, self._workers = self._workers, workers
        if self._batches == 1:
            return
        if previous is not None and workers != previous:
            if self._samples and self._samples[-1].epoch == self._epoch:
                self._new_epoch()  # the fleet changed by itself: what came before measured another one
            if workers > previous and not self.sync:
                # a new worker delivers its first batch a rollout later: until each worker could have
                # delivered one, the learner waits for a fleet that is not there yet
                self._settling = workers
        if self._settling:
            self._settling -= 1
            return
        self._samples.append(Sample(*sample, workers=workers, epoch=self._epoch))
        self._since_decision += 1

    def _new_epoch(self) -> None:
        self._epoch += 1
        self._since_decision = 0

    def signals(self) -> tuple[float, float]:
        """``(learner_wait, worker_idle)`` over the batches since the last decision (up to ``window``)."""
        return fleet_signals([s for s in self._samples if s.epoch == self._epoch])

    # ------------------------------------------------------------------ decisions
    def decide(self) -> ScalingDecision | None:
        """Take a decision if one is due, and act on it through the target (or ``on_scale``).

        Call it between two batches, after :meth:`record`. Returns the decision, or None.

        Raises:
            Exception: whatever ``on_scale`` or ``target.remove_workers`` raised (an add's
                ``WorkerError`` is recorded instead).
        """
        active = self.target.active_workers()
        count = len(active)
        if self._pending is not None:
            wanted, asked = self._pending
            if count < wanted and self._clock() - asked < self.config.join_timeout:
                return None
            self._pending = None
            if count != self._workers:
                # the nodes joined since the last batch was measured: what came before measured another fleet
                self._workers = count
                self._new_epoch()
                return None
        choice = self._bounds(count)
        cooling = self._since_decision < self._cooldown
        if choice is None and not cooling:
            choice = self._rule(count)
        elif choice is not None and cooling and self._failed_adds:
            choice = None  # a bound that failed to be met retries no faster than a rule would
        return self._act(active, *choice) if choice is not None else None

    def _bounds(self, count: int) -> tuple[str, str, int] | None:
        if count < self.config.min_collectors:
            return "add", "min_collectors", self.config.min_collectors
        if count > self.config.max_collectors:
            return "remove", "max_collectors", self.config.max_collectors
        return None

    def _rule(self, count: int) -> tuple[str, str, int] | None:
        samples = [s for s in self._samples if s.epoch == self._epoch]
        learner_wait, _ = fleet_signals(samples)
        undo = self._no_gain(samples, count)
        if undo is not None:
            return "remove", "no_gain", undo
        most = self.config.max_collectors if self._ceiling is None else min(self.config.max_collectors,
                                                                               self._ceiling[0])
        if learner_wait > self.config.grow_above and count < most:
            return "add", "learner_wait", min(most, self._grown(samples, count))
        if count <= self.config.min_collectors or learner_wait >= self.config.shrink_below \
                or self._since_decision < max(self._cooldown, self.config.window):
            return None
        wanted = self._shrunk(samples, count, max(self.config.min_collectors, self._lowest()))
        if wanted < count:
            return "remove", "learner_wait" if self.sync else "worker_idle", wanted
        return None

    def _grown(self, samples: list[Sample], count: int) -> int:
        """The count that would feed the learner by the measured demand, between one more worker and
        twice as many (an estimate made while starving can be off: the next window corrects it)."""
        if self.sync:  # the learner waits for the batch, split among the workers
            wait, work = sum(s.wait_s for s in samples), sum(s.work_s for s in samples)
            goal = self.config.grow_above
            needed = count * wait * (1.0 - goal) / (goal * work) if work > 0 else math.inf
        else:  # the workers a learner that never waits keeps busy
            needed = fleet_demand(samples, sync=False) * (1.0 - self.config.grow_above)
        needed = math.ceil(needed) if math.isfinite(needed) else 2 * count
        return min(2 * count, max(count + 1, needed))

    def _shrunk(self, samples: list[Sample], count: int, lowest: int) -> int:
        """The fewest workers, down to ``lowest``, that the predictions say keep the learner fed: each
        worker's share grows by ``count / wanted``."""
        learner_wait, worker_idle = fleet_signals(samples)
        wait, work = sum(s.wait_s for s in samples), sum(s.work_s for s in samples)
        wanted = count
        while wanted > lowest:
            scale = count / (wanted - 1)
            if self.sync:
                fed = wait + work > 0 and wait * scale / (wait * scale + work) < self.config.shrink_below
            else:
                fed = 1.0 - (1.0 - worker_idle) * scale > self.config.shrink_above
            if not fed:
                break
            wanted -= 1
        return wanted

    def _no_gain(self, samples: list[Sample], count: int) -> int | None:
        """Synchronous: the count to go back to when the last add did not bring the learner's wait per
        batch down by ``MIN_GAIN`` of its prediction (rule 6), else None; lifts the ceiling once the wait
        per batch at it doubled."""
        if not self.sync or not samples:
            return None
        wait = sum(s.wait_s for s in samples) / len(samples)
        if self._ceiling is not None and count >= self._ceiling[0] and wait > 2 * self._ceiling[1]:
            self._ceiling = None  # longer rollouts to share: more workers may help again
        last, self._last_add = self._last_add, None
        if last is None or count != last[1]:
            return None
        before, after, wait_before = last
        predicted_drop = wait_before * (1.0 - before / after)
        if predicted_drop <= 0 or wait_before - wait >= MIN_GAIN * predicted_drop:
            return None
        self._ceiling = (before, wait_before)
        self._floor = None  # the count it starved at is the best there is
        return max(before, self.config.min_collectors)

    def _lowest(self) -> int:
        """The fewest workers the learner did not starve with at about today's demand: ``PACE_CHANGE``
        keeps timings that jitter around a count that is just enough from undoing the add they called
        for. The demand does not depend on the count, so it is measured over the whole window."""
        if self._floor is None:
            return 1
        if fleet_demand(list(self._samples), self.sync) > (1.0 - PACE_CHANGE) * self._floor[1]:
            return self._floor[0]
        self._floor = None  # the pace changed: what starved the learner before says nothing now
        return 1

    def _act(self, active: list[int], action: str, reason: str, wanted: int) -> ScalingDecision:
        learner_wait, worker_idle = self.signals()
        if reason == "learner_wait" and action == "add":  # the learner starved with len(active) workers
            demand = fleet_demand(list(self._samples), self.sync)
            # the floor only rises until the pace changes; its demand is the lowest seen (an estimate
            # made just after an add can be high, and a high reference would lift the floor too soon)
            floor = len(active) + 1
            self._floor = (floor, demand) if self._floor is None else (max(floor, self._floor[0]),
                                                                       min(demand, self._floor[1]))
        epoch = [s for s in self._samples if s.epoch == self._epoch]
        if self.sync and action == "add" and reason == "learner_wait" and epoch:
            self._last_add = (len(active), wanted, sum(s.wait_s for s in epoch) / len(epoch))
        started = self._clock()
        workers: tuple[int, ...] = ()
        error = None
        if action == "remove":
            workers = tuple(sorted(active)[wanted - len(active):])  # the newest
            self.target.remove_workers(list(workers))
        elif self._join_command is not None:
            self.config.on_scale(wanted, list(self._join_command))
            self._pending = (wanted, self._clock())
        else:
            try:
                workers = tuple(self.target.add_workers(wanted - len(active)))
            except WorkerError as err:
                error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        decision = ScalingDecision(time=time.time(), elapsed_s=started - self._start, batch=self._batches,
                                   action=action, reason=reason, collectors=len(active), wanted=wanted,
                                   learner_wait=learner_wait, worker_idle=worker_idle, workers=workers,
                                   seconds=self._clock() - started, error=error)
        self.decisions.append(decision)
        if error is not None or not workers and self._join_command is None:
            self._last_add = None  # nothing was added: nothing to judge
        self._failed_adds = self._failed_adds + 1 if error is not None else 0
        self._cooldown = self.config.cooldown * min(2 ** self._failed_adds, MAX_BACKOFF)
        self._new_epoch()
        self._log(decision)
        return decision

    def _log(self, decision: ScalingDecision) -> None:
        figures = (f"{decision.reason}; learner waited {decision.learner_wait:.0%} of its time, workers idle "
                   f"{decision.worker_idle:.0%}, over the last {self._last_epoch_batches()} batches")
        level = logging.INFO
        if decision.error is not None:
            level = logging.WARNING
            message = (f"autoscale: adding {decision.wanted - decision.collectors} worker(s) failed, "
                       f"{decision.collectors} collecting ({figures}); next decision in {self._cooldown} batches: "
                       f"{decision.error}")
        elif decision.action == "add" and not decision.workers:
            message = (f"autoscale: asked on_scale for {decision.wanted} nodes, {decision.collectors} collecting "
                       f"({figures})")
        else:
            message = (f"autoscale: {decision.action} workers {list(decision.workers)}, {decision.collectors} -> "
                       f"{decision.wanted} collecting ({figures})")
        details = {key: value for key, value in decision.as_dict().items() if key != "workers"}
        self.events.publish(EventKind.AUTOSCALE, message, workers=decision.workers, details=details,
                            logger=logger, level=level)

    def _last_epoch_batches(self) -> int:
        """Batches the last decision was taken on (the epoch before the current one)."""
        return sum(1 for s in self._samples if s.epoch == self._epoch - 1)

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict[str, Any]:
        """The flat ``stats()`` keys: ``"autoscale/collectors"`` (workers collecting now),
        ``"autoscale/learner_wait"`` and ``"autoscale/worker_idle"`` (over the last ``window``
        batches), ``"autoscale/adds"`` and ``"autoscale/removes"`` (decisions so far, failed adds
        included) and ``"autoscale/decisions"`` (a list of :meth:`ScalingDecision.as_dict`)."""
        learner_wait, worker_idle = fleet_signals(list(self._samples))
        return {
            "autoscale/collectors": len(self.target.active_workers()),
            "autoscale/learner_wait": learner_wait,
            "autoscale/worker_idle": worker_idle,
            "autoscale/adds": sum(d.action == "add" for d in self.decisions),
            "autoscale/removes": sum(d.action == "remove" for d in self.decisions),
            "autoscale/decisions": [d.as_dict() for d in self.decisions],
        }
