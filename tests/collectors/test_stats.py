"""What stats() reports beyond TorchRL 0.14's keys (docs/restarts.md, "Watching a run"): the time
split (env, policy, transport, waiting) and weight-sync latency, in process, in worker processes
and on nodes."""

from __future__ import annotations

import json

import pytest
from mocks import weight_policy

from rlharvest.collectors import Collector, MultiAsyncCollector, MultiSyncCollector
from rlharvest.collectors.distributed import DistributedCollector
from rlharvest.envs import CountingEnv
from rlharvest.rollout import RolloutTimes
from rlharvest.transport.ports import free_port_block

pytestmark = pytest.mark.timeout(90)

PARTS = ("env", "policy", "transport", "waiting")


def test_a_batch_is_split_by_its_timed_step():
    times = RolloutTimes()
    times.add(2.0, probe_policy=1.0, probe_total=4.0)
    assert (times.env, times.policy) == (1.5, 0.5)
    times.add(1.0, probe_policy=0.0, probe_total=0.0)  # cut short before its timed step: all env
    assert (times.env, times.policy) == (2.5, 0.5)


def test_in_process_the_time_is_the_rollouts_and_updates_are_timed():
    collector = Collector(CountingEnv(max_steps=50), weight_policy(1.0), frames_per_batch=16, total_frames=64)
    before = collector.stats()
    assert "weight_sync_s_last" not in before and all(before[f"time_{part}_s"] == 0.0 for part in PARTS)
    list(collector)
    stats = collector.stats()
    assert stats["time_env_s"] > 0 and stats["time_policy_s"] > 0
    assert stats["time_transport_s"] == stats["time_waiting_s"] == 0.0  # nothing crosses a process boundary
    assert collector.time_split() == {part: stats[f"time_{part}_s"] for part in PARTS}
    for _ in range(3):
        collector.update_policy_weights_()
    stats = collector.stats()
    assert stats["weight_sync_s_last"] >= 0 and stats["weight_sync_s_median"] >= 0
    assert json.loads(json.dumps(stats)) == stats
    collector.shutdown()


def _make(kind: str):
    envs = [lambda: CountingEnv(max_steps=50)] * 2
    if kind == "distributed":
        return DistributedCollector(envs, weight_policy(1.0), frames_per_batch=16, total_frames=96, launcher="mp",
                                    tcp_port=free_port_block(3), sync=True)
    collector_class = MultiSyncCollector if kind == "sync" else MultiAsyncCollector
    return collector_class(envs, weight_policy(1.0), frames_per_batch=16, total_frames=96)


@pytest.mark.parametrize("kind", ["sync", "async", "distributed"])
def test_workers_report_their_env_and_policy_time(kind):
    collector = _make(kind)
    try:
        batches = 0
        for _ in collector:
            batches += 1
            if batches == 2:
                collector.update_policy_weights_()  # waits for every worker's acknowledgement
        stats = collector.stats()
    finally:
        collector.shutdown()
    # the workers' rollouts, reported with their batches; the main process waited and moved batches
    assert stats["time_env_s"] > 0 and stats["time_policy_s"] > 0
    assert stats["time_waiting_s"] > 0 and stats["time_transport_s"] > 0
    assert stats["weight_sync_s_last"] > 0 and stats["weight_sync_s_median"] == stats["weight_sync_s_last"]
