"""``autoscale=`` on RayCollector, on the session's local Ray (conftest.py; docs/elastic.md,
"Autoscaling"): an actor added while the learner starves (sync: the batch re-split between the two),
an actor let go while the learner is slow (async), every frame collected once, no actor left."""

from __future__ import annotations

import time

import pytest
from mocks import SlowCountingEnv, check_trajectories, counting_env_7, weight_policy

from rlharvest.collectors import Autoscale
from rlharvest.collectors.distributed import RayCollector

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240), pytest.mark.usefixtures("ray_session")]

LENIENT = {"window": 4, "cooldown": 4, "grow_above": 0.5, "shrink_below": 0.3}


def slow_env():
    return SlowCountingEnv(max_steps=7, delay=0.01)


def collect(collector, total: int, work_s: float = 0.0) -> tuple[list, dict]:
    """Every batch, and ``stats()`` taken with the last (iteration shuts a RayCollector down)."""
    batches, stats, frames = [], {}, 0
    for batch in collector:
        batches.append(batch.clone())
        frames += batch.numel()
        if frames >= total:
            stats = collector.stats()
        time.sleep(work_s)  # the learner's training step
    return batches, stats


def test_a_starving_learner_gets_a_new_actor_and_the_sync_batch_is_re_split():
    total = 12 * 12
    collector = RayCollector([slow_env], weight_policy(1.0), frames_per_batch=12, total_frames=total, sync=True,
                             remote_configs={"num_cpus": 0.5}, autoscale=Autoscale(1, 2, **LENIENT))
    batches, stats = collect(collector, total)
    decisions = stats["autoscale/decisions"]
    assert [(d["action"], d["workers"]) for d in decisions] == [("add", (1,))]
    added = decisions[0]["batch"]
    assert [tuple(b.shape) for b in batches] == [(1, 12)] * added + [(2, 6)] * (12 - added)
    assert stats["frames"] == total and stats["autoscale/collectors"] == 2
    assert stats["worker_1/host"] == stats["worker_0/host"]  # one local Ray
    check_trajectories(batches, total)


def test_a_slow_learner_lets_an_actor_go():
    total = 12 * 12
    collector = RayCollector([counting_env_7] * 2, weight_policy(1.0), frames_per_batch=12, total_frames=total,
                             sync=False, remote_configs={"num_cpus": 0.5}, autoscale=Autoscale(1, 2, **LENIENT))
    batches, stats = collect(collector, total, work_s=0.1)
    assert [(d["action"], d["reason"], d["workers"]) for d in stats["autoscale/decisions"]] == \
        [("remove", "worker_idle", (1,))]
    assert stats["autoscale/collectors"] == 1 and all(b.numel() == 12 for b in batches)
    check_trajectories(batches, total)
