"""Churn on worker processes (docs/elastic.md, "Churn"): while weights are updated every few batches,
workers are SIGKILLed, preempted (SIGTERM), added and removed at random, seeded; collection goes on
with nothing lost, doubled or torn, ``total_frames`` exact, and nothing held for a departed worker.

The nodes' and actors' churn is in ``distributed/test_churn_nodes.py``; the helpers (the events, the
checks, the samples) in ``tests/churn.py``, which ``benchmarks/soak.py`` runs for hours.
"""

from __future__ import annotations

import gc
import weakref

import pytest
from churn import Churn, FrameCheck, churn_frames, drive, leftovers, open_fds, resources
from mocks import counting_env_7, echo_weight_policy

from rlharvest.collectors import MultiAsyncCollector, MultiSyncCollector
from rlharvest.transport.mp import MPWorkerHandle

pytestmark = pytest.mark.timeout(120)

SHARE = 8  # frames of one worker's rollout
EVENTS = 14
WORKERS = 2  # at the samples


def handles_alive() -> weakref.WeakSet:
    """The worker handles this process holds now (earlier tests' collectors may still be referenced)."""
    gc.collect()
    return weakref.WeakSet(obj for obj in gc.get_objects() if isinstance(obj, MPWorkerHandle))


def new_handles(before: weakref.WeakSet) -> int:
    """How many worker handles alive now were not alive in ``before`` (a departed worker's slot keeps none)."""
    return sum(handle not in before for handle in handles_alive())


def assert_not_growing(report) -> None:
    """What departed workers held was released with them: with as many workers, as many descriptors
    and mappings after the last event as after the first few. A worker added after start-up has its
    own signal row and weight-version slot (one descriptor and one page each; the first workers share
    a table): up to two more per worker when the workers of the two samples differ in that way."""
    warm, end, slack = report.warm, report.end, 2 * WORKERS
    assert end["fds"] <= warm["fds"] + slack, (warm, end, report.events, report.new_fds)
    assert end["shm_files"] <= warm["shm_files"] + slack, (warm, end, report.events, report.new_fds)
    assert end["shm_bytes"] <= warm["shm_bytes"] + slack * 4096, (warm, end, report.events, report.new_fds)


@pytest.mark.filterwarnings("ignore:.*frames remain to total_frames")  # exact at the end: drive() leaves one worker
@pytest.mark.parametrize("collector_class", [MultiSyncCollector, MultiAsyncCollector])
def test_churn_loses_nothing_and_holds_nothing_for_departed_workers(collector_class):
    sync = collector_class is MultiSyncCollector
    policy = echo_weight_policy(1.0)
    total = churn_frames(SHARE, EVENTS, most=3) if sync else churn_frames(2 * SHARE, EVENTS, most=1)
    before, handles_before = open_fds(), handles_alive()
    collector = collector_class([counting_env_7] * 2, policy, frames_per_batch=2 * SHARE, total_frames=total,
                                max_worker_restarts=100, preemption_grace=2.0)
    try:
        churn = Churn(collector, counting_env_7, seed=20261205 + sync)
        check = FrameCheck()
        report = drive(collector, churn, check, policy, events=EVENTS, single_at_end=sync)
        assert check.frames == total  # exact, through every change of membership
        assert {"kill", "term", "add", "remove"} <= set(report.events), report.events
        causes = [cause.kind for cause in collector.restart_causes]
        assert causes.count("preempted") == report.events.count("term")
        assert len(causes) == report.events.count("kill") + report.events.count("term")
        assert_not_growing(report)
        assert report.end["children"] == 2
        assert new_handles(handles_before) == len(collector.active_workers)  # nothing kept of the departed
    finally:
        collector.shutdown()
    assert resources()["children"] == 0
    assert leftovers(before, report) == ([], {})  # a shut-down collector holds nothing, even referenced
    del collector, churn
    assert leftovers(before, report) == ([], {})
