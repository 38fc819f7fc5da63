"""Checkpoints with TorchRL's envs and policies (docs/checkpoints.md): TorchRL has no general protocol
for an env's state; rlharvest captures TorchRL's GymEnv (the gymnasium env it wraps), whose episodes
continue exactly after a load, also as the sub-envs of rlharvest's SerialEnv/ParallelEnv. Other
TorchRL envs (transformed, batched) restart their episodes, with new trajectory ids and one warning
naming the env; the rest of the checkpoint (weights, counters, generators) is restored, and a
checkpoint of TorchRL's own format still loads."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from collector_kinds import make_collector
from torchrl_objects import gym_env, q_value_actor, transformed_env

from rlharvest.checkpoint import CHECKPOINT_KEY, EpisodeRestartWarning

pytestmark = pytest.mark.timeout(120)
TRAJ_IDS = ("collector", "traj_ids")


@pytest.mark.parametrize("kind", ["collector", "multisync"])
def test_a_torchrl_env_restarts_its_episode_with_one_warning(kind):
    def make():
        return make_collector(kind, transformed_env, q_value_actor(), frames_per_batch=20, total_frames=200)

    source = make()
    iterator = iter(source)
    seen = set()
    for _ in range(2):
        seen |= set(next(iterator)[TRAJ_IDS].flatten().tolist())
    state = source.state_dict()
    source.shutdown()
    part = state[CHECKPOINT_KEY] if kind == "collector" else state["worker0"][CHECKPOINT_KEY]
    assert "not an rlharvest env" in part["env_unavailable"] and "episode" not in part
    restored = make()
    try:
        with pytest.warns(EpisodeRestartWarning, match="torchrl.envs") as caught:
            restored.load_state_dict(state)
        assert len([w for w in caught if issubclass(w.category, EpisodeRestartWarning)]) == (1 if kind == "collector"
                                                                                             else 2)
        assert restored.state_dict()["frames"] == 40
        ids = set(next(iter(restored))[TRAJ_IDS].flatten().tolist())
    finally:
        restored.shutdown()
    assert not ids & seen and min(ids) >= int(state["traj_pool"]["traj_id"])


@pytest.mark.parametrize("kind", ["collector", "multisync"])
def test_a_torchrl_gym_env_continues_its_episodes_exactly(kind):
    """TorchRL's GymEnv: the wrapped gymnasium env's layers (TimeLimit's count, CartPole's physics and
    np_random) are captured, so the batches after the load are the uninterrupted run's, bit for bit
    (an epsilon-greedy policy: the process's generators are restored too)."""
    check_exact_resume(kind, gym_env)


def rlharvest_batched(kind: str):
    """rlharvest's SerialEnv or ParallelEnv of two TorchRL GymEnvs."""
    from rlharvest.envs import ParallelEnv, SerialEnv

    return {"serial": SerialEnv, "parallel": ParallelEnv}[kind](2, gym_env)


@pytest.mark.parametrize("kind, batched", [("collector", "serial"), ("collector", "parallel"),
                                           ("multisync", "parallel")])
def test_torchrl_gym_envs_in_rlharvest_batched_envs_continue_exactly(kind, batched):
    """rlharvest's SerialEnv/ParallelEnv ask each sub-env for its state where it runs: a TorchRL
    GymEnv's is captured as above, so its episodes continue bit for bit there too."""
    check_exact_resume(kind, functools.partial(rlharvest_batched, batched))


def check_exact_resume(kind: str, env_fn) -> None:
    def make():
        collector = make_collector(kind, env_fn, q_value_actor(), frames_per_batch=20, total_frames=200)
        collector.set_seed(4)
        return collector

    source = make()
    iterator = iter(source)
    for _ in range(3):
        next(iterator)
    state = source.state_dict()
    expected = [next(iterator).clone() for _ in range(4)]
    source.shutdown()
    part = state[CHECKPOINT_KEY] if kind == "collector" else state["worker0"][CHECKPOINT_KEY]
    assert "env" in part and "env_unavailable" not in part
    restored = make()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", EpisodeRestartWarning)
            restored.load_state_dict(state)
        resumed = iter(restored)
        got = [next(resumed).clone() for _ in range(4)]
    finally:
        restored.shutdown()
    skip = {TRAJ_IDS} if kind == "multisync" else set()  # a shared counter: new ids in the order workers get there
    for want, have in zip(expected, got, strict=True):
        keys = set(want.keys(True, True)) - skip
        assert keys == set(have.keys(True, True)) - skip
        for key in keys:
            assert torch.equal(want.get(key), have.get(key)), key
    assert got[0][TRAJ_IDS].flatten()[0] == expected[0][TRAJ_IDS].flatten()[0]  # the episode in flight goes on


def test_a_torchrl_format_checkpoint_still_loads():
    source = make_collector("collector", gym_env, q_value_actor(), frames_per_batch=20, total_frames=100)
    next(iter(source))
    state = {key: value for key, value in source.state_dict().items() if key != CHECKPOINT_KEY}
    source.shutdown()
    restored = make_collector("collector", gym_env, q_value_actor(), frames_per_batch=20, total_frames=100)
    try:
        restored.load_state_dict(state)  # TorchRL's keys only: counters and weights, episodes restart
        assert restored.state_dict()["frames"] == 20
        weights = restored.state_dict()["policy_state_dict"]
        assert all(torch.equal(weights[name], value) for name, value in state["policy_state_dict"].items())
        assert len(list(restored)) == 4
    finally:
        restored.shutdown()


def _torchrl_buffer():
    from torchrl.data import LazyTensorStorage, SamplerWithoutReplacement, TensorDictReplayBuffer

    return TensorDictReplayBuffer(storage=LazyTensorStorage(20), sampler=SamplerWithoutReplacement(), batch_size=4)


def test_a_torchrl_replay_buffer_is_restored_through_its_state_dict():
    """A TorchRL buffer's own state_dict (storage, writer cursor, the sampler's permutation in progress)
    is in the checkpoint: after the load, the buffer and its samples are the uninterrupted run's."""
    from rlharvest.collectors import Collector
    from rlharvest.envs import CountingEnv

    def make():
        collector = Collector(CountingEnv(max_steps=5, batch_size=(2,)), None, frames_per_batch=6, total_frames=90,
                              replay_buffer=_torchrl_buffer())
        collector.set_seed(3)
        return collector

    def run(collector, batches):
        iterator = iter(collector)
        for _ in range(batches):
            next(iterator)
        return collector.replay_buffer.sample().clone()  # advances the sampler's permutation

    source = make()
    run(source, 2)
    state = source.state_dict()
    expected = [run(source, 3), run(source, 7)]
    contents = source.replay_buffer[:].clone()
    source.shutdown()
    assert "packed" in state[CHECKPOINT_KEY]["replay_buffer"]
    restored = make()
    restored.load_state_dict(state)
    got = [run(restored, 3), run(restored, 7)]
    try:
        # TorchRL's buffer counts items along the batch's first dim (the env's): 2 per batch, 24 written into
        # 20 places: the same places were overwritten (the writer's cursor was restored)
        assert len(restored.replay_buffer) == len(contents) == 20 and (restored.replay_buffer[:] == contents).all()
        for want, have in zip(expected, got, strict=True):
            assert (want == have).all()
    finally:
        restored.shutdown()
