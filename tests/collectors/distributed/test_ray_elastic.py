"""RayCollector.remove_collectors on a real local Ray (the session's ``ray_cluster``, conftest.py):
an actor leaves at a rollout boundary, the others keep their indices (docs/elastic.md)."""

from __future__ import annotations

import time

import pytest
from mocks import check_trajectories, counting_env_7, wait_until, weight_policy
from ray_check import live_actors

from rlharvest.collectors.distributed import RayCollector

pytestmark = [pytest.mark.ray, pytest.mark.timeout(150), pytest.mark.usefixtures("ray_session")]


@pytest.mark.parametrize("sync", [True, False])
def test_an_actor_leaves_and_the_others_keep_their_indices(ray_cluster, sync):
    collector = RayCollector([counting_env_7] * 3, weight_policy(1.0), frames_per_batch=12 if sync else 4,
                             total_frames=72 if sync else 48, sync=sync, remote_configs={"num_cpus": 0.5})
    batches, timings = [], []
    for batch in collector:
        batches.append(batch.clone())
        if len(batches) == 2:
            before = len(live_actors(ray_cluster))
            start = time.perf_counter()
            collector.remove_collectors([1])
            timings.append(time.perf_counter() - start)
            wait_until(lambda: len(live_actors(ray_cluster)) == before - 1, 10.0, "the removed actor's end")
            assert collector.active_workers == [0, 2] and collector.stats()["workers"] == 2
    if sync:
        assert [tuple(b.shape) for b in batches] == [(3, 4)] * 2 + [(2, 4)] * 6
    check_trajectories(batches, 72 if sync else 48)
    print(f"RayCollector sync={sync}: remove_collectors took {timings[0]:.3f} s")
