"""THE rollout loop on its own (no collector): the batch layout, the auto-reset invariant and
trajectory ids, exactly (docs/collection.md)."""

from __future__ import annotations

import torch

from rlharvest.envs import CountingEnv
from rlharvest.policies import RandomPolicy, wrap_policy
from rlharvest.rollout import LocalTrajectoryCounter, Rollout, RolloutSettings
from mocks import CountingPolicy


def rollout(env, time_steps=5, counter=None, **settings) -> Rollout:
    policy = wrap_policy(CountingPolicy(1.0), env, None)
    return Rollout(env, policy, RolloutSettings(time_steps=time_steps, **settings), counter or LocalTrajectoryCounter())


def column(batch, key):
    return batch.get(key).reshape(-1).tolist()


def test_auto_reset_invariant_and_trajectory_ids():
    batch = rollout(CountingEnv(max_steps=2)).collect()
    assert batch.names[-1] == "time" and batch.batch_size == torch.Size([5])
    # the root of step t is the state before acting; ("next", *) is its outcome, terminal state included
    assert column(batch, "observation") == [0, 1, 2, 0, 1]
    assert column(batch, ("next", "observation")) == [1, 2, 3, 1, 2]
    assert column(batch, ("next", "done")) == [False, False, True, False, False]
    assert column(batch, "done") == [False] * 5  # a finished sub-env is reset before the next step
    assert column(batch, ("collector", "traj_ids")) == [0, 0, 0, 1, 1]


def test_trajectories_continue_across_batches_and_ids_come_from_the_counter():
    counter = LocalTrajectoryCounter(start=10)
    loop = rollout(CountingEnv(max_steps=2), time_steps=2, counter=counter)
    first, second = column(loop.collect(), ("collector", "traj_ids")), column(loop.collect(), ("collector", "traj_ids"))
    assert first == [10, 10] and second == [10, 11]
    assert counter.state() == 12


def test_batched_env_renumbers_finished_rows_only():
    env = CountingEnv(max_steps=1, batch_size=(2,))
    batch = rollout(env, time_steps=3).collect()
    assert batch.batch_size == torch.Size([2, 3])
    assert batch.get(("collector", "traj_ids")).tolist() == [[0, 0, 2], [1, 1, 3]]


def test_between_steps_ends_the_batch_early_and_marks_the_rest():
    steps = iter(range(100))
    batch = rollout(CountingEnv(max_steps=10), time_steps=6).collect(between_steps=lambda: next(steps) == 2)
    assert column(batch, ("collector", "traj_ids")) == [0, 0, 0, -1, -1, -1]
    assert column(batch, "observation")[:3] == [0, 1, 2]


def test_max_frames_per_traj_truncates_and_counts_steps():
    batch = rollout(CountingEnv(max_steps=100), max_frames_per_traj=2).collect()
    assert column(batch, ("next", "truncated")) == [False, True, False, True, False]
    assert column(batch, "step_count") == [0, 1, 0, 1, 0]
    assert column(batch, ("collector", "traj_ids")) == [0, 0, 1, 1, 2]


def test_random_actions_and_versions_are_stamped():
    env = CountingEnv(max_steps=100)
    loop = Rollout(env, wrap_policy(RandomPolicy(env.full_action_spec), env, None),
                   RolloutSettings(time_steps=4, track_policy_version=True), LocalTrajectoryCounter())
    loop.policy_version = 3
    batch = loop.collect(random=True)
    assert column(batch, "policy_version") == [3] * 4
    assert set(column(batch, "action")) <= {0, 1}
