"""``autoscale=`` on the worker-process collectors (docs/elastic.md, "Autoscaling"): growth while the
learner starves, shrinking while it is slow, the bounds, sync batches keeping ``frames_per_batch``,
every frame collected once across the changes, the decisions in ``stats()`` and the log, nothing left
after shutdown (the autouse fixture)."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
from mocks import SlowCountingEnv, check_trajectories, counting_env_7, wait_until, weight_policy
from process_check import process_gone

from rlharvest.collectors import AsyncCollector, Autoscale, Collector, MultiAsyncCollector, MultiSyncCollector
from rlharvest.collectors.engine import engine_of

pytestmark = pytest.mark.timeout(120)

# Thresholds far from the defaults' edges: these tests check the mechanism on a loaded 2-core
# machine, where a rollout of a few steps can take 5 ms or 50 ms.
LENIENT = {"window": 4, "cooldown": 4, "grow_above": 0.5, "shrink_below": 0.3}


def slow_env():
    return SlowCountingEnv(max_steps=7, delay=0.01)


def slower_env():
    return SlowCountingEnv(max_steps=7, delay=0.04)


def collect(collector, batches: int | None = None, work_s: float = 0.0) -> list:
    """The collector's batches (``batches`` of them, or all), the learner working ``work_s`` on each."""
    out = []
    for batch in collector:
        out.append(batch.clone())
        if len(out) == batches:
            break
        time.sleep(work_s)  # the learner's training step
    return out


def rows_per_batch(decisions: list[dict], batches: int, start: int) -> list[int]:
    """The workers in each sync batch: a decision taken at batch ``k`` holds from batch ``k + 1``."""
    rows, count = [], start
    for batch in range(1, batches + 1):
        rows.append(count)
        count = next((d["wanted"] for d in decisions if d["batch"] == batch), count)
    return rows


@pytest.mark.parametrize("cls", [MultiAsyncCollector, MultiSyncCollector])
def test_a_starving_learner_grows_the_fleet_and_batches_keep_their_size(cls, caplog):
    # the learner takes each batch at once: it always waits for the workers
    # synchronously each add must shorten the batch by half of its prediction (rule 6): rollouts long
    # beside a batch's own costs (tens of ms on a loaded machine) make that hold at any load
    env = slow_env if cls is MultiAsyncCollector else slower_env
    collector = cls([env], weight_policy(1.0), frames_per_batch=12, total_frames=12 * 16,
                    autoscale=Autoscale(1, 3, **LENIENT))
    with caplog.at_level(logging.INFO, logger="rlharvest"):
        batches = collect(collector)
    stats = collector.stats()
    collector.shutdown()
    decisions = stats["autoscale/decisions"]
    # asynchronously the batches of a new worker's first rollout are not measured (one per worker)
    second = 11 if cls is MultiAsyncCollector else 9
    assert [(d["action"], d["workers"], d["batch"]) for d in decisions] == [("add", (1,), 5), ("add", (2,), second)]
    assert stats["autoscale/collectors"] == stats["workers"] == 3 and stats["autoscale/learner_wait"] > 0.5
    assert stats["autoscale/adds"] == 2 and stats["autoscale/removes"] == 0
    assert all(b.numel() == 12 for b in batches) and stats["frames"] == 12 * 16  # total_frames exact
    if cls is MultiSyncCollector:  # re-split among the workers: (1, 12), (2, 6), (3, 4)
        assert [b.shape[0] for b in batches] == rows_per_batch(decisions, 16, start=1)
        assert collector.requested_frames_per_batch == 12
    check_trajectories(batches, 12 * 16)
    records = [r.getMessage() for r in caplog.records if r.name == "rlharvest.autoscale"]
    assert records[0].startswith("autoscale: add workers [1], 1 -> 2 collecting (learner_wait; learner waited")
    assert len(records) == 2


@pytest.mark.parametrize("cls", [MultiAsyncCollector, MultiSyncCollector])
def test_a_slow_learner_shrinks_the_fleet_newest_first(cls):
    # (the predictions allow both removals at once; under load they may come one at a time)
    collector = cls([counting_env_7] * 3, weight_policy(1.0), frames_per_batch=12, total_frames=12 * 24,
                    autoscale=Autoscale(1, 3, **LENIENT))
    batches = collect(collector, work_s=0.1)
    stats = collector.stats()
    collector.shutdown()
    assert collector.active_workers == [0]
    decisions = stats["autoscale/decisions"]
    reason = "learner_wait" if cls is MultiSyncCollector else "worker_idle"
    assert {(d["action"], d["reason"]) for d in decisions} == {("remove", reason)}
    assert [w for d in decisions for w in reversed(d["workers"])] == [2, 1]  # the newest first
    assert len(batches) == 24 and all(b.numel() == 12 for b in batches)
    if cls is MultiSyncCollector:
        assert [b.shape[0] for b in batches] == rows_per_batch(decisions, 24, start=3)
    check_trajectories(batches, 12 * 24)


def test_a_sync_batch_that_does_not_split_evenly_is_rounded_up():
    # 10 frames: 1 worker collects 10, 2 collect 5 each, 3 collect 4 each (12)
    collector = MultiSyncCollector([slow_env], weight_policy(1.0), frames_per_batch=10, total_frames=-1,
                                   autoscale=Autoscale(1, 3, **LENIENT))
    batches = collect(collector, 20)
    collector.shutdown()
    sizes = {b.shape[0]: b.numel() for b in batches}
    assert sizes == {1: 10, 2: 10, 3: 12}
    check_trajectories(batches, sum(b.numel() for b in batches))


@pytest.mark.parametrize("cls", [MultiAsyncCollector, MultiSyncCollector])
def test_a_count_outside_the_bounds_is_brought_back_after_the_first_batch(cls):
    collector = cls([counting_env_7], weight_policy(1.0), frames_per_batch=12, total_frames=-1,
                    autoscale=Autoscale(2, 4, **LENIENT))
    first = collect(collector, 1)
    assert collector.active_workers == [0, 1]  # min_collectors: added between the first two batches
    collector.shutdown()
    collector = cls([counting_env_7] * 3, weight_policy(1.0), frames_per_batch=12, total_frames=-1,
                    autoscale=Autoscale(1, 2, **LENIENT))
    batches = first + collect(collector, 3, work_s=0.05)
    stats = collector.stats()
    collector.shutdown()
    assert collector.active_workers == [0, 1]
    assert [(d["action"], d["reason"], d["workers"]) for d in stats["autoscale/decisions"]] == \
        [("remove", "max_collectors", (2,))]
    assert all(b.numel() == 12 for b in batches)


def test_new_workers_use_autoscales_env_fn_and_stats_name_each_workers_figures():
    collector = MultiAsyncCollector([slow_env], weight_policy(1.0), frames_per_batch=4, total_frames=-1,
                                    autoscale=Autoscale(2, 2, env_fn=counting_env_7))
    batches = collect(collector, 6)
    stats = collector.stats()
    collector.shutdown()
    envs = engine_of(collector).options.env_fns
    assert envs == (slow_env, counting_env_7)
    for worker in (0, 1):
        assert stats[f"worker_{worker}/frames"] > 0 and stats[f"worker_{worker}/rollout_frames_per_s"] > 0
        assert stats[f"worker_{worker}/held_s"] >= 0 and stats[f"worker_{worker}/policy_lag"] == 0
        assert isinstance(stats[f"worker_{worker}/host"], str)
    # the slow env's worker collects at a lower pace: a straggler shows
    assert stats["worker_0/rollout_frames_per_s"] < stats["worker_1/rollout_frames_per_s"]
    assert sum(stats[f"worker_{w}/frames"] for w in (0, 1)) == stats["frames"] == 24
    assert sum(b.numel() for b in batches) == 24


def test_a_worker_replaced_after_a_failure_collects_the_share_it_was_told():
    # worker 1, added by the autoscaler and told to collect 6 frames, is killed; its replacement,
    # built from the worker's spec, collects 6 frames too (12 could not be stacked with worker 0's 6)
    collector = MultiSyncCollector([counting_env_7], weight_policy(1.0), frames_per_batch=12, total_frames=12 * 6,
                                   max_worker_restarts=1, autoscale=Autoscale(2, 2))
    batches = []
    for batch in collector:
        batches.append(batch.clone())
        if len(batches) == 2:
            pid = collector.worker_pids()[1]
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: process_gone(pid))
    stats = collector.stats()
    collector.shutdown()
    assert stats["restarts"] == 1
    assert [tuple(b.shape) for b in batches] == [(1, 12)] + [(2, 6)] * 5
    check_trajectories(batches, 12 * 6)


def test_what_cannot_autoscale_is_refused_at_construction():
    class Mine(Collector):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

    with pytest.raises(ValueError, match="collector_class"):
        MultiSyncCollector([counting_env_7], frames_per_batch=4, collector_class=Mine, autoscale=Autoscale(1, 2))
    with pytest.raises(ValueError, match="policy_factory"):
        MultiAsyncCollector([counting_env_7] * 2, policy_factory=[lambda: weight_policy(1.0), lambda: weight_policy(2.0)],
                            frames_per_batch=4, autoscale=Autoscale(1, 2))
    with pytest.raises(TypeError, match="autoscale must be an Autoscale"):
        MultiAsyncCollector([counting_env_7], frames_per_batch=4, autoscale={"min_collectors": 1})
    with pytest.raises(ValueError, match="AsyncCollector runs exactly one worker"):
        AsyncCollector(counting_env_7, frames_per_batch=4, autoscale=Autoscale(1, 2))
    with pytest.raises(ValueError, match="min_collectors"):
        Autoscale(0, 2)
