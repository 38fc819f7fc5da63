"""Nodes that leave a running collection (docs/elastic.md): ``remove_collectors`` on
DistributedCollector, DistributedSyncCollector and RPCCollector with launcher="mp"."""

from __future__ import annotations

import time

import psutil
import pytest
from mocks import check_trajectories, counting_env_7 as counting_env, weight_policy

from rlharvest.collectors.distributed import DistributedCollector, DistributedSyncCollector, RPCCollector
from rlharvest.transport.ports import free_port_block

pytestmark = pytest.mark.timeout(150)


def make(collector_class, count: int, **kwargs):
    return collector_class([counting_env] * count, weight_policy(1.0), launcher="mp", tcp_port=free_port_block(3),
                           **kwargs)


def gone(process) -> bool:
    return not psutil.pid_exists(process.pid) or psutil.Process(process.pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize("sync", [True, False])
@pytest.mark.parametrize("collector_class", [DistributedCollector, RPCCollector])
def test_a_node_leaves_and_the_others_keep_their_indices(collector_class, sync):
    collector = make(collector_class, 3, frames_per_batch=12 if sync else 4, total_frames=96 if sync else 64, sync=sync)
    batches, timings = [], []
    for batch in collector:
        batches.append(batch.clone())
        if len(batches) == 2:
            node = collector._launched[1].process
            start = time.perf_counter()
            collector.remove_collectors([1])
            timings.append(time.perf_counter() - start)
            assert gone(node)
            assert collector.active_workers == [0, 2]
            stats = collector.stats()
            assert (stats["workers"], stats["workers_alive"]) == (2, 2)
            collector.update_policy_weights_()  # the weights go to the nodes still there
    collector.shutdown()
    if sync:
        assert [tuple(b.shape) for b in batches] == [(3, 4)] * 2 + [(2, 4)] * 9
    check_trajectories(batches, 96 if sync else 64)
    print(f"{collector_class.__name__} sync={sync}: remove_collectors took {timings[0]:.3f} s")


def test_a_free_running_node_is_paused_before_it_leaves():
    collector = make(DistributedSyncCollector, 2, frames_per_batch=8, total_frames=64)
    batches = []
    for batch in collector:
        batches.append(batch.clone())
        if len(batches) == 2:
            collector.remove_collectors(0)
            assert collector.active_workers == [1] and collector.requested_frames_per_batch == 4
    collector.shutdown()
    assert [b.numel() for b in batches] == [8, 8] + [4] * 12
    check_trajectories(batches, 64)
