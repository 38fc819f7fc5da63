"""``Autoscale``: what a user asks of a collector that sizes its own fleet (docs/elastic.md,
"Autoscaling"), validated once, and what each collector's options check of it at construction.

The controller that acts on it is an engine part (``collectors/engine/autoscale.py``); this module
holds only the user's arguments and the checks that need the collector's other arguments (its
launcher, whether its batches are synchronous, what its workers run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from ..._utils import positive_int

__all__ = ["Autoscale", "ELASTIC_LAUNCHERS", "parse_autoscale"]

#: launchers that can start a node while collecting (``"external"`` through ``Autoscale.on_scale``)
ELASTIC_LAUNCHERS = ("mp", "submitit", "external")


def _fraction(name: str, value: Any, low: float, high: float) -> float:
    """A threshold in ``[low, high)``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value < high:
        raise ValueError(f"Autoscale: {name} must be a fraction in [{low:g}, {high:g}), got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Autoscale:
    """How a collector sizes its fleet while collecting: a worker is added while the learner starves
    for data, one is removed while workers sit idle holding batches nobody takes, always within
    ``[min_collectors, max_collectors]`` (docs/elastic.md, "Autoscaling"). Passed as ``autoscale=``
    to ``MultiSyncCollector``, ``MultiAsyncCollector``, ``DistributedCollector``, ``RPCCollector`` and
    ``RayCollector``; with ``sync=True`` a batch keeps ``frames_per_batch``, re-split among the workers.

    The signals are fractions over the recent batches: ``learner_wait`` is the share of the learner's
    time spent waiting inside the iterator for a batch, ``worker_idle`` the share of the workers' time
    spent idle holding a finished batch. Hysteresis keeps the count from flapping: adding and removing
    have separate thresholds, a removal must leave the remaining workers spare time (predicted from
    the signals), the fleet never shrinks back to a count at which the learner starved until the
    pace has changed, and after every decision ``cooldown`` batches (``window`` before a removal)
    are measured before the next (:class:`Autoscaler` lists the rules).

    Args:
        min_collectors: the fewest workers (>= 1).
        max_collectors: the most workers (>= ``min_collectors``).
        window: the signals are computed over the last ``window`` batches, never reaching back before
            the last decision (batches measured with another count of workers).
        cooldown: batches measured after a decision (or from the start) before the next add
            (``max(cooldown, window)`` before a removal); a failed add doubles it, up to 8 times.
        grow_above: workers are added while ``learner_wait`` is above this.
        shrink_above: asynchronous collection: workers are removed while the others, doing their
            share too, would still be idle more than this fraction of their time (``1 - (1 -
            worker_idle) * n / m > shrink_above`` with ``n`` workers now and ``m`` left).
        shrink_below: workers are removed only while ``learner_wait`` is below this (``<
            grow_above``: the band between them is where nothing changes). Synchronous collection
            (workers never hold a batch) decides on the learner alone: workers are removed while the
            learner would wait less than this with the batch split among those left (each wait
            times ``n / m``).
        join_timeout: ``launcher="external"``: seconds the nodes asked of ``on_scale`` have to join
            before the autoscaler may ask again.
        env_fn: the env constructor of added workers (None: the first slot's).
        on_scale: ``launcher="external"``, where the collector cannot start nodes:
            ``on_scale(wanted_nodes, join_command)`` is called instead of adding nodes, with the
            number of nodes wanted in all and the argv a node runs to join. Removing is still done
            by the collector.

    Raises:
        ValueError: naming the argument, its value and what is allowed.

    Example:
        >>> Autoscale(1, 8).cooldown
        8
        >>> Autoscale(3, 2)
        Traceback (most recent call last):
        ...
        ValueError: Autoscale: max_collectors must be an int >= min_collectors (3), got 2
    """

    min_collectors: int
    """The fewest workers."""
    max_collectors: int
    """The most workers."""
    window: int = 16
    """Batches the signals are computed over."""
    cooldown: int = 8
    """Batches measured after a decision before the next."""
    grow_above: float = 0.10
    """``learner_wait`` above which a worker is added."""
    shrink_above: float = 0.20
    """Asynchronous: the ``worker_idle`` the others must keep once a worker is removed."""
    shrink_below: float = 0.05
    """``learner_wait`` (sync: with one worker fewer) below which a worker may be removed."""
    join_timeout: float = 300.0
    """``launcher="external"``: seconds requested nodes have to join."""
    env_fn: Callable | None = None
    """The env constructor of added workers (None: the first slot's)."""
    on_scale: Callable[[int, list], Any] | None = None
    """``launcher="external"``: ``on_scale(wanted_nodes, join_command)`` starts nodes."""

    def __post_init__(self) -> None:
        positive_int("min_collectors", self.min_collectors, owner="Autoscale")
        if isinstance(self.max_collectors, bool) or not isinstance(self.max_collectors, int) \
                or self.max_collectors < self.min_collectors:
            raise ValueError(f"Autoscale: max_collectors must be an int >= min_collectors ({self.min_collectors}), "
                             f"got {self.max_collectors!r}")
        positive_int("window", self.window, owner="Autoscale")
        positive_int("cooldown", self.cooldown, owner="Autoscale")
        _fraction("grow_above", self.grow_above, 0.0, 1.0)
        if self.grow_above == 0.0:
            raise ValueError("Autoscale: grow_above must be a fraction in (0, 1), got 0.0")
        _fraction("shrink_above", self.shrink_above, 0.0, 1.0)
        _fraction("shrink_below", self.shrink_below, 0.0, self.grow_above)
        if isinstance(self.join_timeout, bool) or not isinstance(self.join_timeout, (int, float)) \
                or not 0 < self.join_timeout < math.inf:
            raise ValueError(f"Autoscale: join_timeout must be a positive, finite number of seconds, "
                             f"got {self.join_timeout!r}")
        for name in ("env_fn", "on_scale"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise ValueError(f"Autoscale: {name} must be callable or None, got {value!r}")


def parse_autoscale(value: Any, *, sync: bool, typed_workers: bool, launcher: str | None = None,
                    backend: str | None = None, joins: bool = False, legacy_updater: bool = False,
                    distinct_factories: bool = False) -> Autoscale | None:
    """``autoscale=`` of a collector, checked against its other arguments once, at construction.

    Args:
        value: what the user gave (None: the fleet keeps its size).
        sync: whether every batch holds one rollout of every worker (its frames are re-split among
            the workers whenever their number changes, which needs rlharvest's ``Collector`` in each).
        typed_workers: whether the workers run rlharvest's ``Collector`` (not a class of the user's own,
            nor a multi-process collector per node).
        launcher: the collector's ``launcher`` (None for worker processes and actors).
        backend: the process groups' backend, where there are some.
        joins: whether nodes join from anywhere (``launcher="external"`` of ``DistributedCollector``): the
            fleet grows through ``on_scale``.
        legacy_updater: a legacy ``weight_updater`` serves only the workers it started with.
        distinct_factories: one different ``policy_factory`` per worker: a new worker's is unknown.

    Raises:
        TypeError: for a value that is neither an ``Autoscale`` nor None.
        ValueError: naming the argument that cannot go with autoscaling.

    Example:
        >>> parse_autoscale(Autoscale(1, 4), sync=False, typed_workers=True, launcher="submitit_delayed")
        Traceback (most recent call last):
        ...
        ValueError: autoscale needs a launcher that can start nodes while collecting ('mp', 'submitit', 'external'), got launcher='submitit_delayed'
    """
    if value is None:
        return None
    if not isinstance(value, Autoscale):
        raise TypeError(f"autoscale must be an Autoscale(min_collectors, max_collectors, ...) or None, got "
                        f"{type(value).__name__}")
    if launcher is not None and launcher not in ELASTIC_LAUNCHERS:
        raise ValueError(f"autoscale needs a launcher that can start nodes while collecting "
                         f"({', '.join(map(repr, ELASTIC_LAUNCHERS))}), got launcher={launcher!r}")
    if backend in ("mpi", "ucc"):
        raise ValueError(f"autoscale needs a backend whose nodes can join and leave (gloo, nccl), got "
                         f"backend={backend!r}")
    if launcher == "external" and not joins:
        raise ValueError("autoscale with launcher='external' needs nodes that join with a join command "
                         "(DistributedCollector): use launcher='mp' or 'submitit' here.")
    if joins and value.on_scale is None:
        raise ValueError("autoscale with launcher='external' needs Autoscale(on_scale=...): the collector cannot "
                         "start nodes there, on_scale(wanted_nodes, join_command) does.")
    if not joins and value.on_scale is not None:
        raise ValueError("Autoscale(on_scale=...) is for launcher='external' only: this collector starts its "
                         "workers itself.")
    if sync and not typed_workers:
        raise ValueError("autoscale with sync=True re-splits frames_per_batch among the workers whenever their "
                         "number changes: it needs workers running rlharvest's Collector (collector_class None or "
                         "'single'), not a collector class of your own or a multi-process one.")
    if legacy_updater:
        raise ValueError("autoscale adds workers, which needs weight sync schemes: a legacy weight_updater serves "
                         "only the workers it started with.")
    if distinct_factories:
        raise ValueError("autoscale cannot choose the policy_factory of the workers it adds: give one "
                         "policy_factory for every worker (or none).")
    return value
