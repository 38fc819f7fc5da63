"""Workers that join, leave and are preempted in a running collection (docs/elastic.md):
``add_collectors``, ``remove_collectors`` and SIGTERM on worker processes, MultiSyncCollector and
MultiAsyncCollector. The nodes' version is in
tests/collectors/distributed/test_elastic_nodes.py."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from mocks import SlowCountingEnv, check_trajectories, counting_env_7 as counting_env, wait_until, weight_policy
from process_check import process_gone

from rlharvest import WorkerError
from rlharvest.collectors import AsyncCollector, MultiAsyncCollector, MultiSyncCollector
from rlharvest.envs import CountingEnv
from rlharvest.collectors.engine import engine_of

pytestmark = pytest.mark.timeout(90)

IDS = ("collector", "traj_ids")


def worker_pid(collector, worker: int) -> int:
    return engine_of(collector).fleet.requests.handles[worker].process.pid


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
            assert process_gone(pid)
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


# ---------------------------------------------------------------------------------- workers that join
def set_weight(policy, value: float) -> None:
    with torch.no_grad():
        policy.module.weight.fill_(value)


def test_a_sync_batch_grows_by_the_new_workers_share_on_the_current_weights():
    policy = weight_policy(1.0)
    collector = MultiSyncCollector([counting_env] * 2, policy, frames_per_batch=8, total_frames=88,
                                   track_policy_version=True)
    collector.set_seed(11)
    batches, ids_before = [], set()
    for batch in collector:
        batches.append(batch.clone())
        if len(batches) == 2:
            ids_before = set(torch.cat([b.get(IDS).flatten() for b in batches]).tolist())
            set_weight(policy, 2.0)
            collector.update_policy_weights_()
            version = collector.policy_version
            start = time.perf_counter()
            collector.add_collectors([counting_env])
            seconds = time.perf_counter() - start
            assert collector.active_workers == [0, 1, 2] and collector.requested_frames_per_batch == 12
            assert collector.stats()["workers"] == 3 and len(collector) == 2 + 72 // 12
    collector.shutdown()
    assert [tuple(b.shape) for b in batches] == [(2, 4)] * 2 + [(3, 4)] * 6
    after = batches[2:]
    assert all((b["policy_version"] == version).all() for b in after)  # its first frame too
    seen = check_trajectories(after, 72, step=2)
    new_row = set(after[0][2].get(IDS).tolist())
    assert not new_row & ids_before and not new_row & set(after[0][:2].get(IDS).flatten().tolist())
    assert len(seen) > 3
    print(f"MultiSyncCollector: add_collectors took {seconds:.3f} s")


def test_added_workers_continue_the_seed_chain():
    with MultiSyncCollector([counting_env] * 2, weight_policy(1.0), frames_per_batch=4, total_frames=-1) as collector:
        last = collector.set_seed(5)
        collector.add_collectors([counting_env])
        assert engine_of(collector).fleet.specs[2].seed == last


def test_an_async_worker_joins_and_yields_whole_batches():
    collector = MultiAsyncCollector([counting_env], weight_policy(1.0), frames_per_batch=4, total_frames=80)
    batches = []
    for batch in collector:
        batches.append(batch.clone())
        if len(batches) == 2:
            collector.add_collectors(counting_env)
            collector.remove_collectors(0)  # a join, then a leave: the new one carries on alone
            assert collector.active_workers == [1]
    collector.shutdown()
    assert all(b.numel() == 4 for b in batches) and len(batches) == 20
    check_trajectories(batches, 80)


def test_a_worker_that_fails_to_start_leaves_the_collector_as_it_was():
    def broken():
        raise ValueError("this env cannot be built")

    with MultiSyncCollector([counting_env] * 2, weight_policy(1.0), frames_per_batch=4, total_frames=-1) as collector:
        collector.next()
        with pytest.raises(WorkerError, match="cannot be built"):
            collector.add_collectors([counting_env, broken])
        assert collector.active_workers == [0, 1] and collector.requested_frames_per_batch == 4
        assert tuple(collector.next().shape) == (2, 2)
        collector.add_collectors([counting_env])  # the slots of the failed ones are taken again
        assert collector.active_workers == [0, 1, 2] and tuple(collector.next().shape) == (3, 2)


def test_adding_is_refused_naming_the_argument():
    with MultiSyncCollector([counting_env] * 2, weight_policy(1.0), frames_per_batch=4, total_frames=-1) as collector:
        with pytest.raises(ValueError, match="create_env_fn"):
            collector.add_collectors([])
        with pytest.raises(ValueError, match="num_envs"):
            collector.add_collectors([counting_env], num_envs=2)
        with pytest.raises(ValueError, match="frames_per_batch"):
            collector.add_collectors([counting_env], collector_kwargs={"frames_per_batch": 3})
        with pytest.raises(ValueError, match="policy"):
            collector.add_collectors([counting_env], policy=weight_policy(1.0))
    with MultiSyncCollector([CountingEnv] * 2, weight_policy(1.0), frames_per_batch=4, total_frames=-1,
                            create_env_kwargs=[{"max_steps": 5}, {"max_steps": 7}]) as collector:
        with pytest.raises(ValueError, match="create_env_kwargs.*one value per worker"):
            collector.add_collectors([CountingEnv])


# ---------------------------------------------------------------------------------- preemption (SIGTERM)
def slow_env():
    return SlowCountingEnv(max_steps=7, delay=0.01)


def preempt(collector, worker: int) -> None:
    os.kill(worker_pid(collector, worker), signal.SIGTERM)


@pytest.mark.parametrize("sync", [True, False])
def test_a_preempted_worker_is_replaced_without_spending_a_restart(sync, caplog):
    collector_class = MultiSyncCollector if sync else MultiAsyncCollector
    collector = collector_class([slow_env] * 2, weight_policy(1.0), frames_per_batch=40, total_frames=400,
                                max_worker_restarts=1, preemption_grace=0.1)
    batches = []
    with caplog.at_level("WARNING", logger="rlharvest.restarts"):
        for batch in collector:
            batches.append(batch.clone())
            if len(batches) == 2:
                preempt(collector, 1)  # async: its rollout in flight (0.4 s) outlasts the grace: handed back
    stats = collector.stats()
    collector.shutdown()
    assert (stats["preemptions"], stats["restarts"], stats["worker_1/preemptions"]) == (1, 0, 1)
    assert stats["worker_1/restart_causes"].startswith("preempted: ") and stats["workers"] == 2
    assert "preempted (not counted against max_worker_restarts); starting a replacement" in caplog.text
    assert all(b.numel() == 40 for b in batches)
    check_trajectories(batches, 400)


def test_a_preempted_worker_finishes_a_rollout_that_fits_its_grace_period():
    collector = MultiAsyncCollector([slow_env] * 2, weight_policy(1.0), frames_per_batch=20, total_frames=200,
                                    max_worker_restarts=1, preemption_grace=5.0)
    batches = []
    for batch in collector:
        batches.append(batch.clone())
        if len(batches) == 1:
            preempt(collector, 1)
    stats = collector.stats()
    collector.shutdown()
    assert stats["preemptions"] == 1 and "was finished" in stats["worker_1/restart_causes"]
    check_trajectories(batches, 200)


@pytest.mark.parametrize("sync", [True, False])
def test_without_restarts_collection_goes_on_without_the_preempted_worker(sync):
    collector_class = MultiSyncCollector if sync else MultiAsyncCollector
    collector = collector_class([counting_env] * 3, weight_policy(1.0), frames_per_batch=12 if sync else 4,
                                total_frames=120 if sync else 60, preemption_grace=0.5)
    batches = []
    for batch in collector:
        batches.append(batch.clone())
        if len(batches) == 2:
            pid = worker_pid(collector, 1)
            preempt(collector, 1)
            wait_until(lambda: process_gone(pid),
                       10.0, "the preempted worker's exit")
    stats = collector.stats()
    collector.shutdown()
    assert (stats["preemptions"], stats["workers"], stats["restarts"]) == (1, 2, 0)
    if sync:
        assert [tuple(b.shape) for b in batches] == [(3, 4)] * 2 + [(2, 4)] * 12
    check_trajectories(batches, 120 if sync else 60)


def test_preemption_grace_is_validated_naming_it():
    with pytest.raises(ValueError, match="preemption_grace"):
        MultiSyncCollector([counting_env], frames_per_batch=4, preemption_grace=-1.0)


def test_a_replacement_of_a_preempted_worker_that_dies_is_a_failure():
    with MultiSyncCollector([counting_env] * 2, weight_policy(1.0), frames_per_batch=8, total_frames=-1,
                            max_worker_restarts=1, preemption_grace=1.0) as collector:
        collector.next()
        preempt(collector, 1)
        while collector.stats()["preemptions"] == 0:
            collector.next()
        os.kill(worker_pid(collector, 1), signal.SIGKILL)
        while collector.stats()["restarts"] == 0:
            collector.next()
        stats = collector.stats()
    assert (stats["preemptions"], stats["restarts"]) == (1, 1)
    assert [cause.split(":")[0] for cause in stats["worker_1/restart_causes"].split("; ")] == ["preempted", "died"]


def test_an_async_collector_hands_its_one_worker_over_to_an_added_one():
    collector = AsyncCollector(counting_env, weight_policy(1.0), frames_per_batch=4, total_frames=40)
    batches = []
    for batch in collector:
        batches.append(batch.clone())
        if len(batches) == 3:
            collector.add_collectors(counting_env)
            collector.remove_collectors(0)
            assert collector.active_workers == [1] and collector.stats()["workers"] == 1
    collector.shutdown()
    check_trajectories(batches, 40)
