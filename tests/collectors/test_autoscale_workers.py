"""The autoscaler on real worker processes, through the adapter over the collectors' public API
(``AutoscaledIteration``): growth while the learner starves, shrinking while it is slow, every frame
collected once across the changes, nothing left after shutdown (the autouse fixture)."""

from __future__ import annotations

import time

import pytest
from mocks import SlowCountingEnv, check_trajectories, counting_env_7, weight_policy

from rlharvest.collectors import MultiAsyncCollector, MultiSyncCollector
from rlharvest.collectors._autoscale_adapter import AutoscaledIteration
from rlharvest.collectors.autoscale import Autoscale

pytestmark = pytest.mark.timeout(120)

# Thresholds far from the defaults' edges: these tests check the mechanism on a loaded 2-core
# machine, where a rollout of a few steps can take 5 ms or 50 ms.
LENIENT = {"window": 4, "cooldown": 4, "grow_above": 0.5, "shrink_below": 0.3}


def slow_env():
    return SlowCountingEnv(max_steps=7, delay=0.01)


def collect(scaled: AutoscaledIteration, batches: int, work_s: float = 0.0) -> list:
    """``batches`` batches (or all, if fewer), the learner working ``work_s`` seconds on each."""
    out = []
    for batch in scaled:
        out.append(batch.clone())
        if len(out) == batches:
            break
        time.sleep(work_s)  # the learner's training step
    return out


@pytest.mark.parametrize("cls", [MultiAsyncCollector, MultiSyncCollector])
def test_a_starving_learner_grows_the_fleet_to_max_collectors(cls):
    # the learner takes each batch at once: it always waits for the workers
    collector = cls([slow_env], weight_policy(1.0), frames_per_batch=4, total_frames=-1)
    scaled = AutoscaledIteration(collector, Autoscale(1, 3, **LENIENT), create_env_fn=slow_env)
    try:
        batches = collect(scaled, 16)
        stats = scaled.stats()
    finally:
        collector.shutdown()
    assert collector.active_workers == [0, 1, 2]
    decisions = stats["autoscale/decisions"]
    # asynchronously the batches of the new worker's first rollout are not used (one per worker)
    second = 11 if cls is MultiAsyncCollector else 9
    assert [(d["action"], d["workers"], d["batch"]) for d in decisions] == [("add", (1,), 5), ("add", (2,), second)]
    assert stats["autoscale/collectors"] == stats["workers"] == 3 and stats["autoscale/learner_wait"] > 0.5
    if cls is MultiAsyncCollector:
        assert all(b.numel() == 4 for b in batches)  # one worker's batch, whatever the count
    else:
        assert [b.shape[0] for b in batches] == rows_per_batch(decisions, 16, start=1)  # each keeps its share
    check_trajectories(batches, sum(b.numel() for b in batches))


def rows_per_batch(decisions: list[dict], batches: int, start: int) -> list[int]:
    """The workers in each sync batch: a decision taken at batch ``k`` holds from batch ``k + 1``."""
    rows, count = [], start
    for batch in range(1, batches + 1):
        rows.append(count)
        count = next((d["wanted"] for d in decisions if d["batch"] == batch), count)
    return rows


@pytest.mark.parametrize("cls", [MultiAsyncCollector, MultiSyncCollector])
def test_a_slow_learner_shrinks_the_fleet_newest_first(cls):
    # (the predictions allow both removals at once; under load they may come one at a time)
    # asynchronously total_frames ends the run exactly; a sync batch shrinks with the workers
    total = 12 * 24 if cls is MultiAsyncCollector else -1
    collector = cls([counting_env_7] * 3, weight_policy(1.0), frames_per_batch=12, total_frames=total)
    scaled = AutoscaledIteration(collector, Autoscale(1, 3, **LENIENT), create_env_fn=counting_env_7)
    try:
        batches = collect(scaled, 24, work_s=0.1)
        stats = scaled.stats()
    finally:
        collector.shutdown()
    assert collector.active_workers == [0]
    decisions = stats["autoscale/decisions"]
    reason = "learner_wait" if cls is MultiSyncCollector else "worker_idle"
    assert {(d["action"], d["reason"]) for d in decisions} == {("remove", reason)}
    assert [w for d in decisions for w in reversed(d["workers"])] == [2, 1]  # the newest first
    assert len(batches) == 24
    if cls is MultiAsyncCollector:
        assert all(b.numel() == 12 for b in batches)
    else:
        assert [b.shape[0] for b in batches] == rows_per_batch(decisions, 24, start=3)
    check_trajectories(batches, sum(b.numel() for b in batches))


def test_the_adapter_needs_an_env_for_new_workers():
    collector = MultiAsyncCollector([counting_env_7], weight_policy(1.0), frames_per_batch=4, total_frames=8)
    try:
        with pytest.raises(ValueError, match="create_env_fn"):
            AutoscaledIteration(collector, Autoscale(1, 2))
    finally:
        collector.shutdown()
