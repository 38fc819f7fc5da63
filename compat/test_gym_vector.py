"""TorchRL's GymWrapper over a gymnasium vector env, in rlharvest's collectors: every stored transition a
real step, continuity, fresh states after an end, in this process and in worker processes.

TorchRL accepts the SAME_STEP and DISABLED autoreset modes (it refuses NEXT_STEP when the wrapper is
built, and gymnasium's CartPoleVectorEnv by an AttributeError); rlharvest drives what it accepts
through the TensorDict protocol (``step_and_maybe_reset``, then a ``"_reset"`` mask for what it
truncates itself, which TorchRL's VecGymEnvTransform refuses for a SAME_STEP env whatever the
collector)."""

from __future__ import annotations

import functools

import gymnasium as gym
import pytest
import torch
from cartpole_checks import check_cartpole_rows, check_continues
from torchrl.envs import GymWrapper

from rlharvest.collectors import Collector, MultiAsyncCollector, MultiSyncCollector

pytestmark = pytest.mark.timeout(180)

NUM_ENVS = 3
ACCEPTED = [(vectorization, mode) for vectorization in ("sync", "async") for mode in ("SAME_STEP", "DISABLED")]


def wrapped_vector(vectorization: str, mode: str) -> GymWrapper:
    """CartPole sub-envs with a 25-step time limit in TorchRL's GymWrapper, seeded (module-level: pickles)."""
    vector = gym.make_vec("CartPole-v1", num_envs=NUM_ENVS, vectorization_mode=vectorization,
                          vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode[mode]}, max_episode_steps=25)
    env = GymWrapper(vector)
    env.set_seed(0)
    return env


def _check(batches: list) -> int:
    ends = 0
    for batch in batches:
        ends += check_cartpole_rows(batch.reshape(-1, batch.shape[-1]))["ends"]
    return ends


@pytest.mark.parametrize("vectorization, mode", ACCEPTED)
def test_every_transition_is_a_real_step_in_a_collector(vectorization, mode):
    torch.manual_seed(0)
    collector = Collector(wrapped_vector(vectorization, mode), frames_per_batch=NUM_ENVS * 100,
                          total_frames=NUM_ENVS * 200)
    try:
        batches = [batch.clone() for batch in collector]
    finally:
        collector.shutdown()
    assert _check(batches) >= 10
    check_continues(batches[0], batches[1])


@pytest.mark.parametrize("collector_cls", [MultiSyncCollector, MultiAsyncCollector])
@pytest.mark.parametrize("mode", ["SAME_STEP", "DISABLED"])
def test_every_transition_is_a_real_step_in_worker_processes(collector_cls, mode):
    make_env = functools.partial(wrapped_vector, "sync", mode)
    collector = collector_cls([make_env, make_env], None, frames_per_batch=2 * NUM_ENVS * 50,
                              total_frames=4 * NUM_ENVS * 50)
    try:
        batches = [batch.clone() for batch in collector]
    finally:
        collector.shutdown()
    assert _check(batches) >= 5


def test_max_frames_per_traj_resets_the_truncated_sub_envs_of_a_disabled_env():
    torch.manual_seed(0)
    collector = Collector(wrapped_vector("sync", "DISABLED"), frames_per_batch=NUM_ENVS * 60,
                          total_frames=NUM_ENVS * 60, max_frames_per_traj=7)
    try:
        batch = collector.next()
    finally:
        collector.shutdown()
    _check([batch])
    assert batch["next", "truncated"].any()

