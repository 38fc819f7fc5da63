"""setattr_env on RayCollector (docs/collection.md, "Reconfiguring running envs"): a setting reaches an
actor added afterwards and a killed actor's replacement, on a real local Ray (the session's
``ray_cluster``, conftest.py). ``TaskEnv`` observes its ``value`` at every step."""

from __future__ import annotations

import pytest
from mocks import TaskEnv, weight_policy

from rlharvest.collectors.distributed import RayCollector

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120), pytest.mark.usefixtures("ray_session")]


def test_an_added_actor_and_a_replacement_get_the_setting(ray_cluster):
    collector = RayCollector([TaskEnv], weight_policy(1.0), frames_per_batch=4, total_frames=-1, sync=True,
                             max_worker_restarts=1)
    try:
        iterator = iter(collector)
        next(iterator)
        collector.setattr_env("value", 3)
        collector.add_collectors([TaskEnv])
        collector.setattr_env("value", 7, worker_ids=[1])
        assert collector.call_env("task") == [3, 7]
        ray_cluster.kill(collector.remote_collectors[1])
        batch = next(iterator)
        assert collector.stats()["worker_1/restarts"] == 1
        assert [set(batch[w]["next", "observation"].flatten().tolist()) for w in range(2)] == [{3}, {7}]
        assert collector.call_env("task") == [3, 7]
    finally:
        collector.shutdown()
