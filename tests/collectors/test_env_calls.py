"""Envs reconfigured while they run (docs/collection.md, "Reconfiguring running envs"): ``setattr_env``,
``call_env`` and ``getattr_env`` on Collector, MultiSyncCollector and MultiAsyncCollector, and what a
setting survives: a worker killed and replaced, a worker added, a checkpoint. The nodes' version is in
tests/collectors/distributed/test_env_calls_nodes.py.

``TaskEnv`` observes its ``value`` at every step, so each frame says which value its env had."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from mocks import TaskEnv, wait_until
from process_check import process_gone

from rlharvest import WorkerError
from rlharvest.collectors import Collector, MultiAsyncCollector, MultiSyncCollector
from rlharvest.envs import GymEnv, ParallelEnv, SerialEnv

pytestmark = pytest.mark.timeout(120)


def values(batch) -> set[int]:
    """The values the envs had at the steps of ``batch`` (each step's ``next`` observation: a frame's
    root observation may come from the step before)."""
    return set(batch["next", "observation"].flatten().tolist())


def kill(collector, worker: int) -> None:
    pid = collector.worker_pids()[worker]
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: process_gone(pid), timeout=10.0, what=f"worker {worker}'s exit")


# ---------------------------------------------------------------------------------- Collector
def test_a_collector_sets_reads_and_calls_its_env():
    collector = Collector(TaskEnv(value=1), frames_per_batch=4, total_frames=-1)
    assert values(collector.next()) == {1}
    collector.setattr_env("value", 3)
    assert collector.getattr_env("value") == 3
    assert values(collector.next()) == {3}
    assert collector.call_env("task", 2) == [6]
    assert collector.call_env("task", scale=3) == [9]
    collector.shutdown()


def test_dotted_names_reach_into_a_gym_env():
    collector = Collector(GymEnv("CartPole-v1"), frames_per_batch=4, total_frames=-1)
    collector.setattr_env("env.unwrapped.gravity", 3.5)
    assert collector.getattr_env("env.unwrapped.gravity") == 3.5
    assert collector.getattr_env("env").unwrapped.gravity == 3.5
    collector.shutdown()


@pytest.mark.parametrize("batched", [SerialEnv, ParallelEnv])
def test_each_sub_env_of_a_batched_env_is_set(batched):
    collector = Collector(batched(3, TaskEnv), frames_per_batch=6, total_frames=-1)
    collector.setattr_env("value", 5)
    assert collector.getattr_env("value") == [5, 5, 5]
    assert collector.call_env("task", 2) == [[10, 10, 10]]
    assert collector.getattr_env("num_workers") == 3  # the batched env's own attribute first
    assert values(collector.next()) == {5}
    collector.shutdown()


def test_bad_names_and_workers_are_refused():
    collector = Collector(TaskEnv(), frames_per_batch=4, total_frames=-1)
    with pytest.raises(AttributeError, match="valeu"):
        collector.setattr_env("valeu", 3)  # a misspelt name is not added silently
    with pytest.raises(ValueError, match="name"):
        collector.setattr_env("", 3)
    with pytest.raises(ValueError, match="worker_ids=1"):
        collector.setattr_env("value", 3, worker_ids=1)
    assert collector.getattr_env("value") == 0
    collector.shutdown()


def test_a_collector_checkpoint_carries_its_settings():
    collector = Collector(TaskEnv(value=1), frames_per_batch=4, total_frames=-1)
    collector.setattr_env("value", 8)
    state = collector.state_dict(env_state=False)
    collector.shutdown()
    resumed = Collector(TaskEnv(value=1), frames_per_batch=4, total_frames=-1)
    resumed.load_state_dict(state)
    assert resumed.getattr_env("value") == 8
    assert values(resumed.next()) == {8}
    resumed.shutdown()


# ---------------------------------------------------------------------------------- workers
def test_every_frame_after_setattr_env_has_it_and_calls_come_in_worker_order():
    collector = MultiSyncCollector([TaskEnv] * 3, frames_per_batch=12, total_frames=-1)
    assert values(collector.next()) == {0}
    collector.setattr_env("value", 4)
    assert all(values(collector.next()) == {4} for _ in range(3))
    collector.setattr_env("value", 7, worker_ids=[0, 2])
    batch = collector.next()
    assert [values(batch[w]) for w in range(3)] == [{7}, {4}, {7}]
    assert collector.call_env("task", 10) == [70, 40, 70]
    assert collector.call_env("task", worker_ids=1) == [4]
    assert collector.getattr_env("value") == 7
    collector.shutdown()


def test_a_failing_call_names_its_worker_and_keeps_its_type():
    collector = MultiSyncCollector([TaskEnv] * 2, frames_per_batch=8, total_frames=-1)
    with pytest.raises(WorkerError, match="worker 1") as raised:
        collector.call_env("fail", worker_ids=[1])
    assert isinstance(raised.value, KeyError)
    with pytest.raises(AttributeError, match="worker 0"):
        collector.setattr_env("valeu", 3)
    with pytest.raises(ValueError, match=r"worker_ids=\[2\].*\[0, 1\]"):
        collector.setattr_env("value", 3, worker_ids=[2])
    assert collector.call_env("task") == [0, 0]
    collector.shutdown()


def test_async_frames_after_setattr_env_all_have_it():
    collector = MultiAsyncCollector([TaskEnv] * 2, frames_per_batch=4, total_frames=-1)
    for _ in range(3):
        collector.next()
    collector.setattr_env("value", 6)  # the rollouts in flight predate it: dropped
    assert all(values(collector.next()) == {6} for _ in range(6))
    collector.shutdown()


@pytest.mark.parametrize("collector_class", [MultiSyncCollector, MultiAsyncCollector])
def test_a_killed_worker_is_replaced_with_its_settings(collector_class):
    collector = collector_class([TaskEnv] * 2, frames_per_batch=8, total_frames=-1, max_worker_restarts=1)
    collector.next()
    collector.setattr_env("value", 3)
    collector.setattr_env("value", 5, worker_ids=[1])
    kill(collector, 1)
    wait_until(lambda: collector.next() is not None and collector.stats()["restarts"] == 1, what="the restart")
    assert collector.call_env("task") == [3, 5]
    assert all(values(collector.next()) <= {3, 5} for _ in range(4))
    collector.shutdown()


def test_an_added_worker_starts_with_what_every_worker_was_given():
    collector = MultiAsyncCollector([TaskEnv] * 2, frames_per_batch=4, total_frames=-1, max_worker_restarts=1)
    collector.next()
    collector.setattr_env("value", 2)
    collector.setattr_env("value", 9, worker_ids=[0])  # worker 0's own: not what new workers get
    collector.add_collectors([TaskEnv])
    assert collector.call_env("task") == [9, 2, 2]
    collector.setattr_env("value", 4, worker_ids=[2])
    kill(collector, 2)
    wait_until(lambda: collector.next() is not None and collector.stats()["restarts"] == 1, what="the restart")
    assert collector.call_env("task") == [9, 2, 4]
    collector.shutdown()


def test_a_checkpoint_keeps_the_settings_for_replacements_and_new_workers():
    def build():
        return MultiSyncCollector([TaskEnv] * 2, frames_per_batch=8, total_frames=-1, max_worker_restarts=1)

    collector = build()
    collector.next()
    collector.setattr_env("value", 4)
    collector.setattr_env("value", 6, worker_ids=[1])
    state = collector.state_dict(env_state=False)
    collector.shutdown()
    resumed = build()
    resumed.load_state_dict(state)
    assert resumed.call_env("task") == [4, 6]
    batch = resumed.next()
    assert [values(batch[w]) for w in range(2)] == [{4}, {6}]
    kill(resumed, 1)
    wait_until(lambda: resumed.next() is not None and resumed.stats()["restarts"] == 1, what="the restart")
    resumed.add_collectors([TaskEnv])
    assert resumed.call_env("task") == [4, 6, 4]
    assert resumed.state_dict()["rlharvest_resume"]["env_settings"]["common"] == [("value", 4)]
    resumed.shutdown()


def test_sub_envs_in_workers_are_set_and_a_replacement_sets_its_own():
    collector = MultiSyncCollector([lambda: SerialEnv(2, TaskEnv)] * 2, frames_per_batch=8, total_frames=-1,
                                   max_worker_restarts=1)
    collector.setattr_env("value", 3)
    assert collector.call_env("task") == [[3, 3], [3, 3]]
    kill(collector, 0)
    wait_until(lambda: collector.next() is not None and collector.stats()["restarts"] == 1, what="the restart")
    assert collector.getattr_env("value") == [3, 3]
    assert values(collector.next()) == {3}
    collector.shutdown()


def test_async_set_seed_right_after_the_first_batch_goes_on_collecting():
    # set_seed drops the rollouts in flight, among them a worker's first batch, which carries the
    # worker's shared buffer: dropped unread, the worker's next batch had nowhere to be read from
    collector = MultiAsyncCollector([TaskEnv] * 2, frames_per_batch=4, total_frames=-1)
    collector.next()
    collector.set_seed(3)
    assert all(collector.next().numel() == 4 for _ in range(6))
    collector.shutdown()
