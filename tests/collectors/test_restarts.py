"""Collection that survives failures (collectors/_restarts.py, docs/restarts.md): a failed worker is
replaced, its in-flight batch collected again, and every invariant of collection still holds."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
import torch
from mocks import (FailOnceEnv, FailOncePolicy, check_counting_batches, fail_once_envs, faulty_env_factory, wait_until,
                   weight_policy)
from process_check import process_gone

from rlharvest import WorkerError, WorkerTimeoutError
from rlharvest.collectors import AsyncCollector, MultiAsyncCollector, MultiSyncCollector
from rlharvest.collectors.engine.restarts import RestartLimitError, RestartPolicy
from rlharvest.data import ReplayBuffer
from rlharvest.envs import CountingEnv
from rlharvest.protocol import WorkerSpec

pytestmark = pytest.mark.timeout(90)

_IDS = ("collector", "traj_ids")
COLLECTORS = [MultiSyncCollector, MultiAsyncCollector]


def collect(collector) -> list:
    return [batch.clone() for batch in collector]


def collect_past_restart(collector, restarts: int = 1, extra: int = 4) -> list:
    """Batches of an endless collector until ``restarts`` restarts happened, then ``extra`` more (an
    async collector may serve the healthy worker's batches before the failure is met)."""
    batches = []
    while collector.stats()["restarts"] < restarts and len(batches) < 2000:
        batches.append(collector.next().clone())
    return batches + [collector.next().clone() for _ in range(extra)]


# ---------------------------------------------------------------------------------- the policy
def test_arguments_are_validated_naming_them():
    for bad, error in [(-1, ValueError), (1.5, TypeError), (True, TypeError)]:
        with pytest.raises(error, match="max_worker_restarts"):
            MultiSyncCollector([CountingEnv] * 2, frames_per_batch=8, max_worker_restarts=bad)
    for bad, error in [(-0.5, ValueError), (float("inf"), ValueError), ("1", TypeError)]:
        with pytest.raises(error, match="restart_delay"):
            MultiAsyncCollector([CountingEnv] * 2, frames_per_batch=8, max_worker_restarts=1, restart_delay=bad)


def test_policy_off_reraises_the_failure_itself():
    err = WorkerError("boom", worker_idx=0)
    with pytest.raises(WorkerError) as info:
        RestartPolicy(0).admit(err)
    assert info.value is err


def test_policy_counts_per_collector_and_lists_every_cause():
    policy = RestartPolicy(max_restarts=2)
    assert policy.admit(WorkerError("the worker died: killed", worker_idx=1)) == 1
    assert policy.admit(WorkerTimeoutError("no answer", worker_idx=0)) == 0
    with pytest.raises(RestartLimitError) as info:
        policy.admit(WorkerError("third", worker_idx=1))
    assert [(c.worker, c.kind) for c in info.value.causes] == [(1, "died"), (0, "timeout"), (1, "died")]
    assert "max_worker_restarts=2" in str(info.value) and "third" in str(info.value)
    assert policy.stats(2)["worker_1/restarts"] == 1 and policy.stats(2)["restarts"] == 2


def test_restart_seeds_are_deterministic_and_distinct():
    spec = WorkerSpec(1, None, None, seed=7)
    seeds = [spec.replacement(restart=k).start_seed() for k in range(4)]
    assert seeds[0] == 7 and len(set(seeds)) == 4
    assert seeds == [spec.replacement(restart=k).start_seed() for k in range(4)]
    assert WorkerSpec(0, None, None, seed=7, restart=1).start_seed() != seeds[1]  # per worker
    assert WorkerSpec(1, None, None, restart=1).start_seed() is not None  # unseeded workers too


# ---------------------------------------------------------------------------------- default: as before
@pytest.mark.parametrize("collector_class", COLLECTORS)
def test_without_restarts_the_first_failure_raises_as_before(collector_class):
    collector = collector_class(faulty_env_factory(bad=[1], mode="raise", after_steps=5), frames_per_batch=8,
                                total_frames=-1)
    with pytest.raises(WorkerError) as info:
        collect(collector)
    assert not isinstance(info.value, RestartLimitError) and isinstance(info.value, ValueError)
    assert info.value.worker_idx == 1


# ---------------------------------------------------------------------------------- failures survived
@pytest.mark.parametrize("mode", ["kill", "raise", "exit"])
@pytest.mark.parametrize("collector_class", COLLECTORS)
def test_a_failed_worker_is_replaced_and_no_frame_is_lost_or_doubled(tmp_path, collector_class, mode, caplog):
    marker = tmp_path / "fired"
    with collector_class(fail_once_envs(marker, at_step=11, mode=mode), weight_policy(1.0), frames_per_batch=8,
                         total_frames=-1, max_worker_restarts=1) as collector, \
            caplog.at_level(logging.WARNING, logger="rlharvest.restarts"):
        batches = collect_past_restart(collector)
        stats = collector.stats()
    assert marker.exists()
    check_counting_batches(batches, 8, 8 * len(batches))
    kind = {"kill": "died", "exit": "died", "raise": "exception"}[mode]
    assert [(c.worker, c.kind) for c in collector.restart_causes] == [(1, kind)]
    assert "restarting worker 1" in caplog.text
    assert stats["restarts"] == 1 and stats["worker_1/restarts"] == 1 and stats["worker_0/restarts"] == 0


@pytest.mark.parametrize("collector_class", COLLECTORS)
def test_a_worker_killed_from_outside_is_replaced(collector_class):
    with collector_class([lambda: CountingEnv(max_steps=50)] * 2, weight_policy(1.0), frames_per_batch=8,
                         total_frames=200, max_worker_restarts=2) as collector:
        batches = []
        for batch in collector:
            batches.append(batch.clone())
            if len(batches) == 3:
                victim = collector.worker_pids()[0]
                os.kill(victim, signal.SIGKILL)
                # The kernel ends a killed process when it next runs it; until then an async collector
                # may serve the other worker's batches to the end of the budget, and nothing is to restart.
                wait_until(lambda: process_gone(victim), 10, "the killed worker's exit")
        check_counting_batches(batches, 8, 200)
        assert [c.worker for c in collector.restart_causes] == [0]
    assert process_gone(victim)


def test_async_collector_restarts_its_worker(tmp_path):
    collector = AsyncCollector(lambda: FailOnceEnv(str(tmp_path / "fired"), 0, bad=0, at_step=7, mode="kill"),
                               weight_policy(1.0), frames_per_batch=4, total_frames=40, max_worker_restarts=1)
    check_counting_batches(collect(collector), 4, 40)
    assert collector.stats()["worker_0/restarts"] == 1
    collector.shutdown()


@pytest.mark.parametrize("collector_class", COLLECTORS)
def test_a_raising_policy_is_survived(tmp_path, collector_class):
    marker = tmp_path / "fired"
    collector = collector_class([lambda: CountingEnv(max_steps=6)] * 2, FailOncePolicy(marker, at_call=9),
                                frames_per_batch=8, total_frames=-1, max_worker_restarts=1)
    batches = collect_past_restart(collector)
    check_counting_batches(batches, 8, 8 * len(batches))
    causes = collector.restart_causes
    assert len(causes) == 1 and causes[0].kind == "exception" and "FailOncePolicy" in causes[0].traceback
    collector.shutdown()


def test_a_hanging_env_is_replaced_after_worker_timeout(tmp_path):
    collector = MultiSyncCollector(fail_once_envs(tmp_path / "fired", at_step=6, mode="hang"), weight_policy(1.0),
                                   frames_per_batch=8, total_frames=48, worker_timeout=1.5, max_worker_restarts=1)
    check_counting_batches(collect(collector), 8, 48)
    assert [(c.worker, c.kind) for c in collector.restart_causes] == [(1, "timeout")]
    collector.shutdown()


@pytest.mark.parametrize("collector_class", COLLECTORS)
def test_past_the_limit_every_cause_is_listed(collector_class):
    collector = collector_class(faulty_env_factory(bad=[1], mode="raise", after_steps=2), frames_per_batch=8,
                                total_frames=-1, max_worker_restarts=2)
    with pytest.raises(RestartLimitError) as info:
        collect(collector)
    causes = info.value.causes
    assert len(causes) == 3 and {c.worker for c in causes} == {1} and {c.kind for c in causes} == {"exception"}
    assert all("injected failure" in c.traceback for c in causes)
    assert str(info.value).count("worker 1 (exception)") == 3 and info.value.worker_idx == 1
    collector.shutdown()


# ---------------------------------------------------------------------------------- what a replacement gets
@pytest.mark.parametrize("collector_class", COLLECTORS)
def test_the_replacement_runs_the_current_weights_and_version(collector_class):
    policy = weight_policy(1.0)
    collector = collector_class([lambda: CountingEnv(max_steps=50)] * 2, policy, frames_per_batch=8,
                                total_frames=-1, max_worker_restarts=1, track_policy_version=True)
    with collector:
        collector.next()
        with torch.no_grad():
            policy.module.weight.fill_(0.0)
        collector.update_policy_weights_()
        os.kill(collector.worker_pids()[1], signal.SIGKILL)
        # An async collector may serve the surviving worker for a while before it meets the death:
        # collect until the restart happened (bounded), then a few batches more.
        # Asynchronous: one batch per worker may have been under way when the weights changed.
        deadline, after_restart, taken = time.monotonic() + 60.0, 0, 0
        while after_restart < 4:
            assert time.monotonic() < deadline, "the killed worker was never replaced"
            batch, taken = collector.next(), taken + 1
            if taken > 2 or collector_class is MultiSyncCollector:
                assert batch["policy_version"].flatten().unique().tolist() == [1] and (batch["action"] == 0).all()
            after_restart += bool(collector.stats()["restarts"])
        assert collector.stats()["restarts"] == 1


def test_a_restart_is_seeded_deterministically(tmp_path):
    def run(directory):
        collector = MultiSyncCollector(fail_once_envs(directory / "fired", at_step=5, mode="kill"),
                                       frames_per_batch=8, total_frames=48, max_worker_restarts=1)
        collector.set_seed(3)
        actions = [batch["action"][1].flatten().tolist() for batch in collector]
        collector.shutdown()
        return actions

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert run(tmp_path / "a") == run(tmp_path / "b")  # random actions: the same seeds, the same actions


def test_a_worker_written_buffer_gets_only_whole_batches(tmp_path):
    buffer = ReplayBuffer(capacity=1000)
    collector = MultiSyncCollector(fail_once_envs(tmp_path / "fired", at_step=11, mode="kill"), weight_policy(1.0),
                                   frames_per_batch=8, total_frames=80, replay_buffer=buffer, max_worker_restarts=1)
    assert all(batch is None for batch in collector)
    assert buffer.write_count == 80 and len(buffer) == 80
    frames = buffer[:]
    pairs = list(zip(frames[_IDS].tolist(), frames["observation"].flatten().tolist()))
    assert len(set(pairs)) == 80  # no frame twice, none partially written
    collector.shutdown()


def test_running_free_into_a_buffer_survives_a_killed_worker(tmp_path):
    from mocks import wait_until

    buffer = ReplayBuffer(capacity=10_000)
    collector = MultiAsyncCollector(fail_once_envs(tmp_path / "fired", at_step=30, mode="kill"), weight_policy(1.0),
                                    frames_per_batch=8, total_frames=-1, replay_buffer=buffer, max_worker_restarts=1)
    try:
        collector.start()
        wait_until(lambda: collector.stats()["restarts"] == 1 and buffer.write_count >= 200, what="a restart")
    finally:
        collector.async_shutdown()
    frames = buffer[:]
    pairs = list(zip(frames[_IDS].tolist(), frames["observation"].flatten().tolist()))
    assert len(set(pairs)) == len(pairs) == buffer.write_count  # whole batches only, no frame twice


def test_an_update_that_meets_a_dead_worker_replaces_it():
    policy = weight_policy(1.0)
    with MultiAsyncCollector([lambda: CountingEnv(max_steps=50)] * 2, policy, frames_per_batch=8, total_frames=-1,
                             max_worker_restarts=1, track_policy_version=True) as collector:
        collector.next()
        victim = collector.worker_pids()[0]
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: process_gone(victim), timeout=10.0, what="the killed worker's exit")
        with torch.no_grad():
            policy.module.weight.fill_(0.0)
        collector.update_policy_weights_()  # waits for the dead worker's acknowledgement: replaces it
        assert collector.stats()["restarts"] == 1 and collector.policy_version == 1
        batches = [collector.next() for _ in range(6)]
    assert batches[-1]["policy_version"].unique().tolist() == [1] and (batches[-1]["action"] == 0).all()
