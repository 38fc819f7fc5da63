"""``/metrics``: a collector's figures as Prometheus metric families, built at each scrape from one
read of the collector (docs/monitoring.md lists every metric).

The values are the collector's own counters, not samples the monitor took, so they are exact and a
monitor attached late reports everything since the collector started. Needs ``prometheus-client``
(the ``monitor`` extra).
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector as PrometheusCollector

from ..collectors.base import BaseCollector
from ..collectors.engine.events import EventKind
from .reading import FleetReader, Reading

__all__ = ["FleetMetrics"]

#: collection time split (``stats()``'s ``time_<part>_s``) exported per part
_TIME_PARTS = ("env", "policy", "transport")


class FleetMetrics(PrometheusCollector):
    """A Prometheus collector of an rlharvest collector's figures: register it in any registry.

    Args:
        collector: the rlharvest collector (or a :class:`~rlharvest.monitor.reading.FleetReader` of it).

    Example:
        >>> from prometheus_client import CollectorRegistry, generate_latest
        >>> from rlharvest.collectors import Collector
        >>> from rlharvest.envs import CountingEnv
        >>> collector = Collector(CountingEnv(), frames_per_batch=4, total_frames=8)
        >>> _ = [batch for batch in collector]
        >>> registry = CollectorRegistry()
        >>> registry.register(FleetMetrics(collector))
        >>> b"rlharvest_frames_total 8.0" in generate_latest(registry)
        True
        >>> collector.shutdown()
    """

    def __init__(self, collector: BaseCollector | FleetReader) -> None:
        self.reader = collector if isinstance(collector, FleetReader) else FleetReader(collector)

    def describe(self) -> list:
        return []  # registering reads nothing: the collector is read at scrapes only

    def collect(self) -> Iterator[Any]:
        reading = self.reader.read()
        yield from _progress(reading)
        yield from _fleet(reading)
        yield from _workers(reading)
        yield from _weights(reading)
        if reading.autoscaled:
            yield from _autoscale(reading)


def _counter(name: str, documentation: str, value: float, unit: str = "") -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value, unit=unit)


def _gauge(name: str, documentation: str, value: float, unit: str = "") -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value, unit=unit)


def _progress(reading: Reading) -> Iterator[Any]:
    stats, snapshot = reading.stats, reading.snapshot
    info = GaugeMetricFamily("rlharvest_collector", "The collector watched (always 1).",
                             labels=["collector", "state"])
    info.add_metric([reading.collector, "shut down" if reading.closed else "running"], 1)
    yield info
    yield _counter("rlharvest_frames", "Frames collected.", snapshot.frames)
    yield _counter("rlharvest_batches", "Batches yielded (or written to the replay buffer).", snapshot.batches)
    if snapshot.total_frames is not None:
        yield _gauge("rlharvest_frames_budget", "total_frames: the frames the collector collects in all.",
                     snapshot.total_frames)
    yield _gauge("rlharvest_frames_per_second", "Frames per second over the last 16 batches.",
                 stats.get("frames_per_s_recent", 0.0))
    yield _counter("rlharvest_learner_wait_seconds", "Seconds the learner's loop waited for batches.",
                   reading.learner_wait_s)
    parts = CounterMetricFamily("rlharvest_collection_seconds", "Seconds of collection, by part: env steps, "
                                "policy, and batches crossing a process boundary.", labels=["part"])
    for part in _TIME_PARTS:
        parts.add_metric([part], snapshot.times.get(part, 0.0))
    yield parts
    if "policy_lag" in stats:
        yield _gauge("rlharvest_policy_lag", "Policy versions the oldest frame of the last batch is behind.",
                     stats["policy_lag"])


def _fleet(reading: Reading) -> Iterator[Any]:
    stats, counts = reading.stats, reading.event_counts
    yield _gauge("rlharvest_workers_active", "Workers (or nodes) of the fleet now: neither removed nor left.",
                 stats.get("workers", 1))
    yield _gauge("rlharvest_workers_alive", "Active workers found alive.", stats.get("workers_alive", 1))
    yield _counter("rlharvest_worker_restarts", "Failed workers replaced (what max_worker_restarts limits).",
                   stats.get("restarts", 0))
    yield _counter("rlharvest_worker_preemptions", "Workers that left on SIGTERM (preempted).",
                   stats.get("preemptions", 0))
    yield _counter("rlharvest_joins", "Nodes that joined a slot (launcher='external').", counts[EventKind.JOIN])
    yield _counter("rlharvest_joins_refused", "Nodes refused when they came to join (launcher='external').",
                   counts[EventKind.JOIN_REFUSED])
    events = CounterMetricFamily("rlharvest_fleet_events", "Changes of the fleet, by kind (collector.events).",
                                 labels=["kind"])
    for kind in EventKind:
        events.add_metric([kind.value], counts[kind])
    yield events


def _workers(reading: Reading) -> Iterator[Any]:
    info = GaugeMetricFamily("rlharvest_worker_info", "Each active worker (always 1): its host and state.",
                             labels=["worker", "host", "state"])
    frames = CounterMetricFamily("rlharvest_worker_frames", "Frames each active worker delivered since it started.",
                                 labels=["worker"])
    restarts = CounterMetricFamily("rlharvest_worker_slot_restarts", "Failed workers replaced, per slot.",
                                   labels=["worker"])
    held = CounterMetricFamily("rlharvest_worker_held_seconds", "Seconds each worker held finished batches "
                               "nobody had taken.", labels=["worker"])
    speed = GaugeMetricFamily("rlharvest_worker_rollout_frames_per_second", "Frames per second of each worker's "
                              "own rollouts (a straggler's is lower).", labels=["worker"])
    lag = GaugeMetricFamily("rlharvest_worker_policy_lag", "Policy versions published between the request of each "
                            "worker's last batch and the batch being taken.", labels=["worker"])
    for row in reading.workers:
        worker = str(row.index)
        info.add_metric([worker, row.host or "", row.state], 1)
        if row.frames is not None:
            frames.add_metric([worker], row.frames)
        restarts.add_metric([worker], row.restarts)
        held.add_metric([worker], row.held_s)
        if row.rollout_frames_per_s is not None:
            speed.add_metric([worker], row.rollout_frames_per_s)
        if row.policy_lag is not None:
            lag.add_metric([worker], row.policy_lag)
    yield from (info, frames, restarts, held, speed, lag)


def _weights(reading: Reading) -> Iterator[Any]:
    yield _gauge("rlharvest_policy_version", "The policy version: weight updates published so far.",
                 reading.policy_version)
    histogram = reading.snapshot.weight_syncs
    if histogram is None:
        return
    buckets = [(_bound(bound), count) for bound, count in zip(histogram.bounds, histogram.cumulative)]
    yield HistogramMetricFamily("rlharvest_weight_update_seconds", "Seconds each update_policy_weights_() took "
                                "(sent, and acknowledged where the scheme waits).",
                                buckets=buckets + [("+Inf", histogram.count)], sum_value=histogram.sum_s)


def _autoscale(reading: Reading) -> Iterator[Any]:
    stats = reading.stats
    yield _gauge("rlharvest_autoscale_collectors", "Workers collecting now, as the autoscaler counts them.",
                 stats.get("autoscale/collectors", 0))
    yield _gauge("rlharvest_autoscale_learner_wait_ratio", "Share of the learner's time spent waiting for "
                 "batches over the autoscaler's window.", stats.get("autoscale/learner_wait", 0.0))
    yield _gauge("rlharvest_autoscale_worker_idle_ratio", "Share of the workers' time spent idle over the "
                 "autoscaler's window.", stats.get("autoscale/worker_idle", 0.0))
    decisions = CounterMetricFamily("rlharvest_autoscale_decisions", "The autoscaler's decisions, by action.",
                                    labels=["action"])
    decisions.add_metric(["add"], stats.get("autoscale/adds", 0))
    decisions.add_metric(["remove"], stats.get("autoscale/removes", 0))
    yield decisions


def _bound(seconds: float) -> str:
    return repr(float(seconds))
