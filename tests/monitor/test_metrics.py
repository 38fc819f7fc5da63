"""``Monitor``'s ``/metrics`` and ``/api/stats`` (docs/monitoring.md): the Prometheus text, parsed by
prometheus-client's own parser, follows a collection (frames, batches, each worker's frames, weight
updates, a killed worker's restart, autoscaling) on every kind of collector with workers and on
``Collector``."""

from __future__ import annotations

import os
import signal
import time

import pytest
from mocks import SlowCountingEnv, counting_env_7, wait_until, weight_policy
from process_check import process_gone
from scrape import api_stats, scrape, value

from rlharvest.collectors import AsyncBatchedCollector, Autoscale, Collector, MultiAsyncCollector, MultiSyncCollector
from rlharvest.collectors.distributed import RPCCollector
from rlharvest.collectors.engine import engine_of
from rlharvest.envs import CountingEnv
from rlharvest.monitor import Monitor
from rlharvest.transport.ports import free_port_block

pytestmark = pytest.mark.timeout(120)


def test_metrics_follow_a_collection_and_a_killed_workers_restart():
    collector = MultiSyncCollector([counting_env_7] * 2, weight_policy(1.0), frames_per_batch=8, total_frames=-1,
                                   max_worker_restarts=1)
    with Monitor(collector) as monitor:
        batches = iter(collector)
        for _ in range(3):
            next(batches)
        collector.update_policy_weights_()
        collector.update_policy_weights_()
        samples = scrape(monitor)
        assert value(samples, "rlharvest_frames_total") == 24 and value(samples, "rlharvest_batches_total") == 3
        assert [value(samples, "rlharvest_worker_frames_total", worker=w) for w in "01"] == [12, 12]
        assert value(samples, "rlharvest_workers_active") == 2 and value(samples, "rlharvest_worker_restarts_total") == 0
        assert value(samples, "rlharvest_policy_version") == 2
        assert value(samples, "rlharvest_weight_update_seconds_count") == 2
        assert value(samples, "rlharvest_weight_update_seconds_bucket", le="+Inf") == 2
        assert value(samples, "rlharvest_learner_wait_seconds_total") > 0
        assert {labels["host"] for labels, _ in samples["rlharvest_worker_info"]} == {os.uname().nodename}
        assert "rlharvest_autoscale_collectors" not in samples  # built without autoscale=

        pid = engine_of(collector).fleet.requests.handles[1].process.pid
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: process_gone(pid), timeout=10, what=f"worker 1 (pid {pid}) gone")
        wait_until(lambda: next(batches) is None or collector.events.counts()["restart"] == 1, 60, "the restart")
        samples = scrape(monitor)
        stats = collector.stats()
        assert value(samples, "rlharvest_worker_restarts_total") == 1
        assert value(samples, "rlharvest_worker_slot_restarts_total", worker="1") == 1
        assert value(samples, "rlharvest_fleet_events_total", kind="restart") == 1
        assert value(samples, "rlharvest_frames_total") == stats["frames"]
        # a replacement's frames count from its start
        assert value(samples, "rlharvest_worker_frames_total", worker="1") < value(
            samples, "rlharvest_worker_frames_total", worker="0")
        page = api_stats(monitor)
        assert [row["restarts"] for row in page["workers"]] == [0, 1]
        assert [event["kind"] for event in page["events"]] == ["start", "restart"]
        assert page["events"][1]["details"]["cause"] == "died"
        assert api_stats(monitor, since=page["last_seq"])["events"] == []
    collector.shutdown()


@pytest.mark.parametrize("cls", [MultiAsyncCollector, MultiSyncCollector])
def test_an_autoscale_decision_shows_in_metrics_and_events(cls):
    def slow_env():
        return SlowCountingEnv(max_steps=7, delay=0.01 if cls is MultiAsyncCollector else 0.04)

    lenient = {"window": 4, "cooldown": 4, "grow_above": 0.5, "shrink_below": 0.3}  # test_autoscale_workers.py
    collector = cls([slow_env], weight_policy(1.0), frames_per_batch=12, total_frames=12 * 12,
                    autoscale=Autoscale(1, 3, **lenient))
    with Monitor(collector) as monitor:
        frames = sum(batch.numel() for batch in collector)
        samples = scrape(monitor)
        page = api_stats(monitor)
    collector.shutdown()
    assert value(samples, "rlharvest_frames_total") == frames == 12 * 12
    adds = value(samples, "rlharvest_autoscale_decisions_total", action="add")
    assert adds >= 1 and value(samples, "rlharvest_autoscale_collectors") == 1 + adds
    assert value(samples, "rlharvest_fleet_events_total", kind="autoscale") == adds
    decisions = [event for event in page["events"] if event["kind"] == "autoscale"]
    assert decisions[0]["details"]["action"] == "add" and decisions[0]["details"]["reason"] == "learner_wait"
    assert len(page["workers"]) == 1 + adds


def test_a_single_process_collector_has_one_row_and_its_own_counters():
    collector = Collector(counting_env_7, weight_policy(1.0), frames_per_batch=8, total_frames=32)
    with Monitor(collector) as monitor:
        for _ in collector:
            collector.update_policy_weights_()
        samples = scrape(monitor)
        page = api_stats(monitor)
    collector.shutdown()
    assert value(samples, "rlharvest_frames_total") == 32 and value(samples, "rlharvest_batches_total") == 4
    assert value(samples, "rlharvest_workers_active") == 1 and value(samples, "rlharvest_policy_version") == 4
    assert value(samples, "rlharvest_worker_frames_total", worker="0") == 32
    assert [(row["index"], row["frames"]) for row in page["workers"]] == [(0, 32)]
    assert page["events"] == []


def test_a_monitor_attached_late_reports_everything_since_the_start_and_survives_the_shutdown():
    collector = MultiAsyncCollector([counting_env_7] * 2, weight_policy(1.0), frames_per_batch=8, total_frames=48)
    frames = sum(batch.numel() for batch in collector)
    monitor = Monitor(collector)
    try:
        assert value(scrape(monitor), "rlharvest_frames_total") == frames == 48
        collector.shutdown()
        samples = scrape(monitor)
        assert value(samples, "rlharvest_frames_total") == 48
        assert value(samples, "rlharvest_collector", collector="MultiAsyncCollector", state="shut down") == 1
        page = api_stats(monitor)
        assert page["closed"] and page["events"][-1]["kind"] == "shutdown"
    finally:
        monitor.close()
        collector.shutdown()


def test_reads_are_shared_by_requests_that_come_together():
    collector = Collector(counting_env_7, weight_policy(1.0), frames_per_batch=8, total_frames=16)
    with Monitor(collector) as monitor:
        first = monitor.reader.read()
        assert monitor.reader.read() is first  # within max_age
        wait_until(lambda: time.time() - first.time > monitor.reader.max_age, 5, "the read's age")
        assert monitor.reader.read() is not first
    collector.shutdown()


def _async_batched():
    return AsyncBatchedCollector([CountingEnv] * 2, policy=weight_policy(1.0), frames_per_batch=8, total_frames=48)


def _rpc():
    return RPCCollector([counting_env_7] * 2, weight_policy(1.0), frames_per_batch=8, total_frames=48, launcher="mp",
                        tcp_port=free_port_block(3))


@pytest.mark.parametrize("make", [_async_batched, _rpc], ids=["AsyncBatchedCollector", "RPCCollector"])
def test_the_other_collectors_have_their_rows_and_counters(make):
    collector = make()
    with Monitor(collector) as monitor:
        frames = sum(batch.numel() for batch in collector)
        samples = scrape(monitor)
        page = api_stats(monitor)
    collector.shutdown()
    assert value(samples, "rlharvest_frames_total") == frames == 48
    assert [(row["index"], row["state"]) for row in page["workers"]] == [(0, "collecting"), (1, "collecting")]
    delivered = [row["frames"] for row in page["workers"]]
    # env workers of a policy server send steps, not batches: no frames of their own
    if isinstance(collector, AsyncBatchedCollector):
        assert delivered == [None, None]
    else:  # asynchronous nodes: which delivered how many of the 6 batches depends on their pace
        assert sum(delivered) == 48 and all(count % 8 == 0 for count in delivered)
