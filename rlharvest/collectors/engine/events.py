"""What happened to a collector's fleet, published once and read by the log, ``stats()`` and the monitor
(docs/restarts.md, "Watching a run").

A part that changes the fleet (a failed worker replaced, a worker preempted, workers added or removed,
a node joining a slot or refused, an autoscaling decision) publishes one :class:`FleetEvent` to the collector's
:class:`FleetEvents`. Publishing writes the event's line to the part's logger (the messages users
already read), keeps the event in a bounded ring for whoever reads the timeline
(:meth:`FleetEvents.since`), counts it for good (:meth:`FleetEvents.counts`, which the ring's bound
never loses), and calls the subscribers.

Costs nothing per frame or per batch: events come with the fleet's changes only.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Union

__all__ = ["EventKind", "FleetEvent", "FleetEvents"]

#: a detail's value: what JSON and Prometheus labels carry
Detail = Union[str, int, float, bool, None]

#: events the ring keeps for the timeline (counts are kept for good)
CAPACITY = 1024


class EventKind(str, enum.Enum):
    """What changed. The values are the words the log, ``stats()`` and the monitor use."""

    START = "start"
    """The workers started."""
    RESTART = "restart"
    """A failed worker was replaced (``max_worker_restarts``, docs/restarts.md)."""
    PREEMPTION = "preemption"
    """A worker was preempted (SIGTERM): replaced where it can be, else its slot stays empty."""
    JOIN = "join"
    """A node joined a slot: the first node of a slot, or one taking an emptied slot back
    (``launcher="external"``, docs/elastic.md)."""
    JOIN_REFUSED = "join_refused"
    """A node that came to join was refused (every slot taken, or too many joining at once)."""
    ADD = "add"
    """Workers were added (``add_collectors``, the autoscaler)."""
    REMOVE = "remove"
    """Workers left gracefully (``remove_collectors``, the autoscaler)."""
    AUTOSCALE = "autoscale"
    """The autoscaler decided (its action and reason in the details)."""
    SHUTDOWN = "shutdown"
    """The collector shut its workers down."""


@dataclass(frozen=True)
class FleetEvent:
    """One change of the fleet.

    Example:
        >>> event = FleetEvent(1, 0.0, EventKind.RESTART, (2,), "restarting worker 2", {"cause": "died"})
        >>> event.as_dict()["kind"], event.as_dict()["workers"]
        ('restart', [2])
    """

    seq: int
    """Its place in the collector's events, from 1."""
    time: float
    """Wall-clock time (``time.time()``) it was published."""
    kind: EventKind
    workers: tuple[int, ...]
    """The worker indices it concerns (none for a decision that added no worker yet)."""
    message: str
    """The line the log shows."""
    details: Mapping[str, Detail] = field(default_factory=dict)
    """What else a reader may want (a restart's cause, a decision's reason and figures)."""

    def as_dict(self) -> dict[str, object]:
        """The event as plain JSON values."""
        return {"seq": self.seq, "time": self.time, "kind": self.kind.value, "workers": list(self.workers),
                "message": self.message, "details": dict(self.details)}


class FleetEvents:
    """A collector's events: published by its parts, read from any thread.

    Args:
        capacity: events kept for :meth:`since` (the oldest go first; :meth:`counts` keeps every one).
        clock: wall-clock seconds.

    Example:
        >>> events = FleetEvents()
        >>> seen = []
        >>> unsubscribe = events.subscribe(seen.append)
        >>> _ = events.publish(EventKind.ADD, "added workers [2]", workers=(2,))
        >>> [event.kind.value for event in events.since(0)], seen[0].workers, events.counts()[EventKind.ADD]
        (['add'], (2,), 1)
        >>> unsubscribe()
    """

    def __init__(self, capacity: int = CAPACITY, clock: Callable[[], float] = time.time) -> None:
        self._ring: collections.deque[FleetEvent] = collections.deque(maxlen=capacity)
        self._counts: collections.Counter[EventKind] = collections.Counter()
        self._subscribers: list[Callable[[FleetEvent], None]] = []
        self._clock = clock
        self._lock = threading.Lock()
        self._seq = 0

    def publish(self, kind: EventKind, message: str, *, workers: tuple[int, ...] = (),
                details: Mapping[str, Detail] | None = None, logger: logging.Logger | None = None,
                level: int = logging.INFO) -> FleetEvent:
        """Record an event, log ``message`` on ``logger`` (when given) at ``level``, and tell the
        subscribers (a subscriber that raises is logged and kept: it never fails the collector)."""
        if logger is not None:
            logger.log(level, "%s", message)
        with self._lock:
            self._seq += 1
            event = FleetEvent(self._seq, self._clock(), kind, tuple(workers), message, dict(details or {}))
            self._ring.append(event)
            self._counts[kind] += 1
            subscribers = list(self._subscribers)
        for subscriber in subscribers:
            try:
                subscriber(event)
            except Exception:  # a reader's bug must not stop the fleet
                logging.getLogger("rlharvest").exception("a fleet-event subscriber raised on %s", kind.value)
        return event

    def since(self, seq: int = 0) -> list[FleetEvent]:
        """The events kept whose ``seq`` is greater than ``seq``, oldest first."""
        with self._lock:
            return [event for event in self._ring if event.seq > seq]

    def counts(self) -> dict[EventKind, int]:
        """How many events of each kind were published (every kind present, zeros included)."""
        with self._lock:
            return {kind: self._counts[kind] for kind in EventKind}

    @property
    def last_seq(self) -> int:
        """The ``seq`` of the newest event (0 before any)."""
        return self._seq

    def subscribe(self, callback: Callable[[FleetEvent], None]) -> Callable[[], None]:
        """Call ``callback(event)`` on every event from now on (in the publishing thread: keep it short);
        returns the function that stops it."""
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe
