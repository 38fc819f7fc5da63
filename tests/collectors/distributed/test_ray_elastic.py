"""RayCollector.remove_collectors on a real local Ray (the session's ``ray_cluster``, conftest.py):
an actor leaves at a rollout boundary, the others keep their indices (docs/elastic.md)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from mocks import check_trajectories, counting_env_7, wait_until, weight_policy
from process_check import process_gone
from ray_check import live_actors

from rlharvest.collectors.distributed import RayCollector

pytestmark = [pytest.mark.ray, pytest.mark.timeout(150), pytest.mark.usefixtures("ray_session")]


@pytest.mark.parametrize("sync", [True, False])
def test_an_actor_leaves_and_the_others_keep_their_indices(ray_cluster, sync):
    collector = RayCollector([counting_env_7] * 2, weight_policy(1.0), frames_per_batch=8 if sync else 4,
                             total_frames=48, sync=sync, remote_configs={"num_cpus": 0.5})
    batches, timings = [], []
    for batch in collector:
        batches.append(batch.clone())
        if len(batches) == 2:
            before = len(live_actors(ray_cluster))
            start = time.perf_counter()
            collector.remove_collectors([0])  # the first: the other keeps index 1
            timings.append(time.perf_counter() - start)
            wait_until(lambda: len(live_actors(ray_cluster)) == before - 1, 10.0, "the removed actor's end")
            assert collector.active_workers == [1] and collector.stats()["workers"] == 1
    if sync:
        assert [tuple(b.shape) for b in batches] == [(2, 4)] * 2 + [(1, 4)] * 8
    check_trajectories(batches, 48)
    print(f"RayCollector sync={sync}: remove_collectors took {timings[0]:.3f} s")


# ---------------------------------------------------------------------------------- preemption (SIGTERM)
def actor_pid(ray, collector, worker: int) -> int:
    """The process id of actor ``worker`` (a local Ray: a process of this machine), asked of the actor."""
    return ray.get(collector.remote_collectors[worker].pid.remote(), timeout=30)


def test_a_preempted_actor_is_replaced_without_spending_a_restart(ray_cluster):
    # sync only (async is covered without restarts below): each Ray test here takes a minute under load
    sync, total = True, 64
    collector = RayCollector([counting_env_7] * 2, weight_policy(1.0), frames_per_batch=8, total_frames=total,
                             sync=sync, remote_configs={"num_cpus": 0.5}, max_worker_restarts=1, preemption_grace=2.0)
    batches = []
    for batch in collector:
        batches.append(batch.clone())
        if len(batches) == 2:
            pid = actor_pid(ray_cluster, collector, 1)
            os.kill(pid, signal.SIGTERM)  # the actor's process leaves by itself (Ray's handler would end it at once)
            wait_until(lambda: process_gone(pid), 30.0, "the preempted actor's exit")
        if len(batches) == total // 8:  # the last: iteration then shuts a RayCollector down, as TorchRL's
            stats = collector.stats()
    causes = collector.restart_causes
    collector.shutdown()
    assert (stats["preemptions"], stats["restarts"], stats["workers"]) == (1, 0, 2)
    assert [(cause.worker, cause.kind) for cause in causes] == [(1, "preempted")]
    if sync:
        assert [tuple(b.shape) for b in batches] == [(2, 4)] * 8
    check_trajectories(batches, total)


def test_a_preempted_actor_without_restarts_leaves_the_others_collecting(ray_cluster):
    collector = RayCollector([counting_env_7] * 2, weight_policy(1.0), frames_per_batch=4, total_frames=60, sync=False,
                             remote_configs={"num_cpus": 0.5}, preemption_grace=2.0)
    batches = []
    for batch in collector:
        batches.append(batch.clone())
        if len(batches) == 2:
            os.kill(actor_pid(ray_cluster, collector, 0), signal.SIGTERM)
        if sum(b.numel() for b in batches) >= 60:  # the last: iteration then shuts a RayCollector down
            stats = collector.stats()
    collector.shutdown()
    assert (stats["preemptions"], stats["restarts"], stats["workers"]) == (1, 0, 1)
    assert "preempted: " in stats["worker_0/restart_causes"]
    check_trajectories(batches, 60)
