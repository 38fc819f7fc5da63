"""rlharvest's SerialEnv / ParallelEnv of TorchRL envs, and AsyncBatchedCollector with TorchRL's envs and
policies (docs/envs.md, "Batched envs")."""

from __future__ import annotations

import pytest
import torch
from collector_kinds import check_transitions
from torchrl_objects import gym_env, pendulum_env, probabilistic_actor, q_value_actor, transformed_env

from rlharvest.collectors import AsyncBatchedCollector, Collector
from rlharvest.envs import ParallelEnv, SerialEnv

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("batched", [SerialEnv, ParallelEnv])
@pytest.mark.parametrize("make_env", [gym_env, transformed_env])
def test_batched_envs_of_torchrl_envs(batched, make_env):
    env = batched(2, make_env)
    collector = Collector(env, q_value_actor(), frames_per_batch=80, total_frames=160)
    try:
        batches = list(collector)
    finally:
        collector.shutdown()
    assert env.is_closed
    for batch in batches:
        assert batch.shape == (2, 40) and batch.names[-1] == "time"
        check_transitions(batch, "multisync")  # row by row: auto-reset invariant and trajectory ids
        if make_env is transformed_env:  # the transforms' entries travel through the shared buffers
            steps, following = batch["step_count"].squeeze(-1), batch["next", "step_count"].squeeze(-1)
            assert (following == steps + 1).all() and ("next", "episode_reward") in batch.keys(True, True)


def test_parallel_env_gives_the_data_of_serial_env_with_torchrl_envs():
    def batches(batched):
        env = batched(2, transformed_env)
        env.set_seed(7)
        collector = Collector(env, q_value_actor(epsilon=None), frames_per_batch=60, total_frames=120)
        try:
            return [batch.clone() for batch in collector]
        finally:
            collector.shutdown()

    for serial, parallel in zip(batches(SerialEnv), batches(ParallelEnv)):
        assert set(serial.keys(True, True)) == set(parallel.keys(True, True))
        for key in serial.keys(True, True):
            assert torch.equal(serial.get(key), parallel.get(key)), key


@pytest.mark.parametrize("make_env, make_policy, outputs", [
    (gym_env, q_value_actor, {"action", "action_value", "chosen_action_value"}),
    (pendulum_env, probabilistic_actor, {"action", "loc", "scale"}),
])
def test_async_batched_collector_with_torchrl_envs_and_policies(make_env, make_policy, outputs):
    collector = AsyncBatchedCollector([make_env] * 3, policy=make_policy(), frames_per_batch=60, total_frames=180,
                                      env_backend="multiprocessing")
    try:
        batches = list(collector)
    finally:
        collector.shutdown()
    assert [batch.shape for batch in batches] == [torch.Size([60])] * 3
    for batch in batches:
        assert outputs | {"env_index", "policy_version", ("collector", "traj_ids")} <= set(batch.keys(True, True))
        for env in batch["env_index"].unique().tolist():
            check_transitions(batch[batch["env_index"] == env], "collector")  # each env's frames, in order
