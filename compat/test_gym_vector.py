"""TorchRL's GymWrapper over a gymnasium vector env, in rlharvest's collectors: every stored transition a
real step, continuity, fresh states after an end, in this process and in worker processes.

TorchRL accepts the SAME_STEP and DISABLED autoreset modes (it refuses NEXT_STEP when the wrapper is
built, and gymnasium's CartPoleVectorEnv by an AttributeError); rlharvest drives what it accepts
through the TensorDict protocol (``step_and_maybe_reset``, then a ``"_reset"`` mask for what it
truncates itself, which TorchRL's VecGymEnvTransform refuses for a SAME_STEP env whatever the
collector)."""

from __future__ import annotations

import functools

import pytest
import torch
from cartpole_checks import NUM_ENVS, cartpole_vector, check_batches, collect_checked
from torchrl.envs import GymWrapper

from rlharvest.collectors import Collector, MultiAsyncCollector, MultiSyncCollector

pytestmark = pytest.mark.timeout(180)

ACCEPTED = [(vectorization, mode) for vectorization in ("sync", "async") for mode in ("SAME_STEP", "DISABLED")]


def wrapped_vector(vectorization: str, mode: str) -> GymWrapper:
    """CartPole sub-envs with a 25-step time limit in TorchRL's GymWrapper, seeded (module-level: pickles)."""
    env = GymWrapper(cartpole_vector(vectorization, mode))
    env.set_seed(0)
    return env


@pytest.mark.parametrize("vectorization, mode", ACCEPTED)
def test_every_transition_is_a_real_step_in_a_collector(vectorization, mode):
    torch.manual_seed(0)
    _, totals = collect_checked(Collector(wrapped_vector(vectorization, mode), frames_per_batch=NUM_ENVS * 100,
                                          total_frames=NUM_ENVS * 200))
    assert totals["ends"] >= 10


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
    assert check_batches(batches)["ends"] >= 5


def test_max_frames_per_traj_resets_the_truncated_sub_envs_of_a_disabled_env():
    torch.manual_seed(0)
    collector = Collector(wrapped_vector("sync", "DISABLED"), frames_per_batch=NUM_ENVS * 60,
                          total_frames=NUM_ENVS * 60, max_frames_per_traj=7)
    try:
        batch = collector.next()
    finally:
        collector.shutdown()
    check_batches([batch])
    assert batch["next", "truncated"].any()

