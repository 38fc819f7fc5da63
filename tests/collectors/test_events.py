"""A collector's fleet events (``collector.events``, engine/events.py): each change of the workers is
published once, in order, with the workers it concerns, and counted; the log lines users read come
from the same events."""

from __future__ import annotations

import logging
import os
import signal

import pytest
from mocks import counting_env_7 as counting_env, wait_until, weight_policy
from process_check import process_gone

from rlharvest.collectors import Collector, MultiSyncCollector
from rlharvest.collectors.engine import engine_of
from rlharvest.collectors.engine.events import EventKind, FleetEvents

pytestmark = pytest.mark.timeout(90)


def test_restart_add_remove_and_shutdown_are_published_in_order_and_logged(caplog):
    collector = MultiSyncCollector([counting_env] * 2, weight_policy(1.0), frames_per_batch=8, total_frames=-1,
                                   max_worker_restarts=1)
    seen = []
    collector.events.subscribe(seen.append)
    with caplog.at_level(logging.INFO, logger="rlharvest"):
        for index, _ in enumerate(collector):
            if index == 1:
                pid = engine_of(collector).fleet.requests.handles[1].process.pid
                os.kill(pid, signal.SIGKILL)
                wait_until(lambda: process_gone(pid), timeout=10, what=f"worker 1 (pid {pid}) gone")
            elif index == 3:
                assert collector.events.counts()[EventKind.RESTART] == 1
                collector.add_collectors([counting_env])
            elif index == 5:
                collector.remove_collectors([2])
            elif index == 7:
                break
    events = collector.events
    collector.shutdown()
    kinds = [event.kind for event in events.since(0)]
    assert kinds == [EventKind.START, EventKind.RESTART, EventKind.ADD, EventKind.REMOVE, EventKind.SHUTDOWN]
    assert [event.seq for event in events.since(0)] == [1, 2, 3, 4, 5]
    restart, add, remove = events.since(0)[1:4]
    assert restart.workers == (1,) and restart.details["cause"] == "died"
    assert (add.workers, remove.workers) == ((2,), (2,))
    assert [event.kind for event in events.since(3)] == [EventKind.REMOVE, EventKind.SHUTDOWN]
    assert [event.seq for event in seen] == [2, 3, 4, 5]  # subscribed after the start
    assert "restarting worker 1 (restart 1 of 1): died failure" in caplog.text
    assert "added workers [2]" in caplog.text and "removed workers [2]" in caplog.text
    assert restart.as_dict()["kind"] == "restart" and restart.as_dict()["workers"] == [1]


def test_a_single_process_collector_has_an_empty_log():
    collector = Collector(counting_env, weight_policy(1.0), frames_per_batch=8, total_frames=16)
    assert [batch.numel() for batch in collector] == [8, 8]
    assert collector.events.since(0) == [] and set(collector.events.counts().values()) == {0}
    collector.shutdown()


def test_the_ring_is_bounded_but_counts_are_not_and_a_failing_subscriber_is_only_logged(caplog):
    events = FleetEvents(capacity=3)

    def broken(event):
        raise RuntimeError("a reader's bug")

    events.subscribe(broken)
    with caplog.at_level(logging.ERROR, logger="rlharvest"):
        for worker in range(5):
            events.publish(EventKind.ADD, f"added workers [{worker}]", workers=(worker,))
    assert [event.workers for event in events.since(0)] == [(2,), (3,), (4,)]
    assert events.counts()[EventKind.ADD] == 5 and events.last_seq == 5
    assert caplog.text.count("a fleet-event subscriber raised on add") == 5
