"""Workers that leave a running collection (docs/elastic.md): ``remove_collectors`` on worker
processes, MultiSyncCollector and MultiAsyncCollector. The nodes' version is in
tests/collectors/distributed/test_elastic_nodes.py."""

from __future__ import annotations

import time

import psutil
import pytest
from mocks import check_trajectories, counting_env_7 as counting_env, weight_policy

from rlharvest.collectors import AsyncCollector, MultiAsyncCollector, MultiSyncCollector

pytestmark = pytest.mark.timeout(90)


def worker_pid(collector, worker: int) -> int:
    return collector._requests.handles[worker].process.pid


def test_a_sync_batch_shrinks_by_the_removed_share_and_indices_stay():
    collector = MultiSyncCollector([counting_env] * 3, weight_policy(1.0), frames_per_batch=12, total_frames=120)
    batches = []
    for batch in collector:
        batches.append(batch.clone())
        if len(batches) == 2:
            pid = worker_pid(collector, 1)
            start = time.perf_counter()
            collector.remove_collectors([1])
            seconds = time.perf_counter() - start
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            assert collector.active_workers == [0, 2] and collector.num_workers == 3
            assert collector.requested_frames_per_batch == 8
            stats = collector.stats()
            assert (stats["workers"], stats["workers_alive"], stats["workers_removed"]) == (2, 2, 1)
            assert len(collector) == 2 + 96 // 8
    collector.shutdown()
    assert [tuple(b.shape) for b in batches] == [(3, 4)] * 2 + [(2, 4)] * 12
    check_trajectories(batches, 120)
    assert seconds < 10.0


def test_an_async_worker_leaves_with_its_rollout_in_flight_dropped_whole():
    collector = MultiAsyncCollector([counting_env] * 2, weight_policy(1.0), frames_per_batch=8, total_frames=160)
    batches = []
    for batch in collector:
        batches.append(batch.clone())
        if len(batches) == 3:
            collector.remove_collectors(0)
            assert collector.active_workers == [1] and collector.stats()["workers"] == 1
            assert collector.requested_frames_per_batch == 8
    collector.shutdown()
    assert all(b.numel() == 8 for b in batches) and len(batches) == 20
    check_trajectories(batches, 160)


def test_a_removed_worker_takes_no_more_commands_and_the_others_answer_all():
    with MultiSyncCollector([counting_env] * 3, weight_policy(1.0), frames_per_batch=6, total_frames=-1) as collector:
        collector.next()
        collector.remove_collectors([0])
        assert collector.set_seed(3) is not None
        assert len(collector.get_distant_attr("frames_per_batch")) == 2
        collector.update_policy_weights_(weight_policy(1.0))
        collector.reset()
        stats = collector.stats("per_worker")
        assert "worker_1/frames" in stats and "worker_0/frames" not in stats
        batch = collector.next()
        assert tuple(batch.shape) == (2, 2)
        with pytest.raises(ValueError, match="removed"):
            collector.update_policy_weights_(weight_policy(1.0), worker_ids=[0])


def test_removing_is_refused_naming_what_is_wrong():
    with MultiSyncCollector([counting_env] * 2, weight_policy(1.0), frames_per_batch=4, total_frames=-1) as collector:
        with pytest.raises(ValueError, match="does not exist"):
            collector.remove_collectors([5])
        with pytest.raises(ValueError, match="worker 1 is the last one"):
            collector.remove_collectors([0, 1])
        with pytest.raises(ValueError, match="indices must be"):
            collector.remove_collectors([True])
        collector.remove_collectors([0])
        with pytest.raises(ValueError, match="removed already"):
            collector.remove_collectors([0])
        with pytest.raises(ValueError, match="worker 1 is the last one"):
            collector.remove_collectors(1)
    with AsyncCollector(counting_env, weight_policy(1.0), frames_per_batch=4, total_frames=-1) as collector:
        with pytest.raises(ValueError, match="last one"):
            collector.remove_collectors(0)
    collector = MultiSyncCollector([counting_env] * 2, weight_policy(1.0), frames_per_batch=4, total_frames=-1,
                                   postproc=lambda batch: collector.remove_collectors([0]))
    with pytest.raises(RuntimeError, match="between two batches"):
        collector.next()
    collector.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        collector.remove_collectors([0])
