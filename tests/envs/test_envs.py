"""The env protocol, specs and rlharvest's envs (docs/envs.md)."""

from __future__ import annotations

import gymnasium as gym
import pytest
import torch
from mocks import TorchRLStyleCountingEnv

from rlharvest import ExplorationType
from rlharvest.collectors import Collector
from rlharvest.envs import (
    Binary, Bounded, Categorical, Composite, ContinuousMockEnv, CountingEnv, GymEnv, OneHot, Unbounded, is_env,
)
from rlharvest.modules import RandomPolicy

pytestmark = pytest.mark.timeout(60)


def test_specs_rand_and_zero():
    assert Unbounded((2, 3)).rand().shape == (2, 3)
    bounded = Bounded(-1.0, 1.0, (100,))
    sample = bounded.rand()
    assert sample.min() >= -1 and sample.max() <= 1
    assert Bounded(0, 3, (50,), dtype=torch.int64).rand().max() <= 3
    assert Categorical(4, (10,)).rand().max() < 4
    one_hot = OneHot(3).rand((5,))
    assert one_hot.shape == (5, 3) and (one_hot.sum(-1) == 1).all()
    assert Binary(shape=(4,), dtype=torch.bool).zero().dtype == torch.bool
    composite = Composite(a=Unbounded((2,)), shape=())
    composite[("nested", "b")] = Categorical(2)
    assert set(composite.keys(True, True)) == {"a", ("nested", "b")}
    td = composite.rand()
    assert td["nested", "b"].shape == () and td["a"].shape == (2,)
    assert ("nested", "b") in composite and "zzz" not in composite
    assert Unbounded((2,)).expand(5).shape == (5, 2)


def test_counting_env_protocol():
    env = CountingEnv(max_steps=2)
    assert is_env(env) and env.batch_size == () and env.done_keys == ["done", "terminated"]
    td = env.reset()
    assert td["observation"].item() == 0 and not td["done"].any()
    for expected in (1, 2, 3):
        td["action"] = torch.ones(1, dtype=torch.int8)
        td = env.step(td)
        assert td["next", "observation"].item() == expected
        td = td["next"].exclude("reward")
    assert td["done"].all() and td["terminated"].all()
    assert env.set_seed(7) == 8 and env.set_seed(7, static_seed=True) == 7
    assert "step_count" not in env.fake_tensordict().keys()
    env.close()
    with pytest.raises(RuntimeError):
        env.close()
    env.close(raise_if_closed=False)


def test_batched_counting_env_partial_reset_and_step_and_maybe_reset():
    env = CountingEnv(max_steps=1, batch_size=(3,))
    td = env.reset()
    td["action"] = torch.tensor([[1], [0], [1]], dtype=torch.int8)
    stepped, root = env.step_and_maybe_reset(td)
    td = root
    td["action"] = torch.tensor([[1], [0], [0]], dtype=torch.int8)
    stepped, root = env.step_and_maybe_reset(td)
    assert stepped["next", "done"].squeeze(-1).tolist() == [True, False, False]
    assert root["observation"].squeeze(-1).tolist() == [0, 0, 1]   # row 0 was reset
    assert not root["done"].any()
    assert env.set_seed(0) == 3


def test_continuous_mock_env():
    env = ContinuousMockEnv(batch_size=(2,), episode_length=3)
    td = env.rollout(10)
    assert td.shape == (2, 3) and td["next", "truncated"][:, -1].all()
    assert env.rand_action()["action"].abs().max() <= 1


def test_gym_env_cartpole_one_hot_and_categorical():
    env = GymEnv("CartPole-v1")
    assert env.full_action_spec["action"].shape == (2,)
    assert env.set_seed(0) == 1
    first = env.reset()["observation"]
    env.set_seed(0)
    assert torch.equal(env.reset()["observation"], first)
    td = env.reset()
    td["action"] = torch.tensor([0, 1])
    out = env.step(td)
    assert out["next", "observation"].dtype == torch.float32
    assert set(out["next"].keys()) == {"observation", "reward", "done", "terminated", "truncated"}
    categorical = GymEnv("CartPole-v1", categorical_action_encoding=True)
    assert categorical.full_action_spec["action"].shape == ()
    assert categorical.rand_action()["action"].dtype == torch.int64
    env.close()


@pytest.mark.parametrize("categorical", [False, True])
def test_gym_env_hands_gymnasium_the_action_torchrl_would(categorical, monkeypatch):
    """One env's discrete actions reach gymnasium as Python ints read without numpy (a faster path), as
    TorchRL's GymEnv reads them: a one-hot by value.long().argmax(-1), the first largest entry once truncated
    to integers (ties, negative values, bools, ints, floats, a tensor that requires grad), a categorical
    action by int(value)."""
    env = GymEnv("CartPole-v1", categorical_action_encoding=categorical)
    sent = []
    step = env.env.step
    monkeypatch.setattr(env.env, "step", lambda action: (sent.append(action), step(action))[1])
    env.reset()
    if categorical:
        actions = [torch.tensor(1), torch.tensor(0, dtype=torch.int32), torch.tensor(0.7), torch.tensor(1.7)]
        expected = [1, 0, 0, 1]
    else:
        actions = [torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0]), torch.tensor([-3.0, -2.0]),
                   torch.tensor([True, False]), torch.tensor([0, 1]), torch.tensor([0.2, 0.7], requires_grad=True),
                   torch.tensor([1.2, 1.9]), torch.tensor([-1.5, 0.2])]
        expected = [1, 0, 1, 0, 1, 0, 0, 1]
        assert expected == [int(a.detach().long().argmax(-1)) for a in actions]  # TorchRL's OneHot.to_numpy
    for action in actions:
        env._step_arrays({"action": action})
    assert sent == expected and all(type(a) is int for a in sent)
    env.close()


def test_a_vector_gym_env_reads_one_hot_floats_as_torchrl_would(monkeypatch):
    env = GymEnv("CartPole-v1", num_envs=3)
    sent = []
    step = env.env.step
    monkeypatch.setattr(env.env, "step", lambda action: (sent.append(action.tolist()), step(action))[1])
    env.reset()
    env._step_arrays({"action": torch.tensor([[1.2, 1.9], [-1.5, 0.2], [0.2, 0.7]])})
    assert sent == [[0, 1, 0]]  # value.long().argmax(-1), not the argmax of the floats: [1, 1, 1]
    env.close()


def test_gym_env_terminated_vs_truncated():
    env = GymEnv("CartPole-v1", max_episode_steps=5)
    collector = Collector(env, frames_per_batch=10, total_frames=10,
                          policy=RandomPolicy(env.full_action_spec))
    batch = collector.next()
    done, truncated, terminated = (batch["next", k].squeeze(-1) for k in ("done", "truncated", "terminated"))
    assert torch.equal(done, truncated | terminated)
    assert truncated[4] or terminated[:5].any()
    collector.shutdown()


def test_gym_env_box_actions():
    env = GymEnv("Pendulum-v1")
    spec = env.full_action_spec["action"]
    assert spec.shape == (1,) and spec.dtype == torch.float32
    collector = Collector(env, frames_per_batch=20, total_frames=20)
    batch = collector.next()
    assert batch["action"].shape == (20, 1) and batch["next", "observation"].shape == (20, 3)
    collector.shutdown()


@pytest.mark.parametrize("mode", ["same_step", "next_step", "from_id"])
def test_gym_vector_env_is_a_batched_env(mode):
    if mode == "from_id":
        env = GymEnv("CartPole-v1", num_envs=3, max_episode_steps=7)
    else:
        autoreset = gym.vector.AutoresetMode.SAME_STEP if mode == "same_step" else gym.vector.AutoresetMode.NEXT_STEP
        vec = gym.make_vec("CartPole-v1", num_envs=3, vectorization_mode="sync",
                           vector_kwargs={"autoreset_mode": autoreset}, max_episode_steps=7)
        env = GymEnv(vec)
    assert env.batch_size == (3,)
    env.set_seed(0)
    collector = Collector(env, frames_per_batch=60, total_frames=60)
    batch = collector.next()
    assert batch.shape == (3, 20)
    for row in range(3):
        ends = batch["next", "done"][row].squeeze(-1).nonzero().squeeze(-1).tolist()
        starts = [0] + [e + 1 for e in ends if e + 1 < 20]
        ids = batch["collector", "traj_ids"][row]
        # each episode lasts at most 7 steps and starts from a fresh (small) observation
        for a, b in zip(starts, starts[1:] + [20]):
            assert b - a <= 7 and ids[a:b].unique().numel() == 1
            assert batch["observation"][row, a].abs().max() <= 0.05
        # the terminal observation is kept under "next", the root of the next step is the reset one
        for e in ends[:-1]:
            assert not torch.equal(batch["next", "observation"][row, e], batch["observation"][row, e + 1])
    collector.shutdown()


def test_gym_env_accepts_instances_and_rejects_kwargs_with_them():
    env = GymEnv(gym.make("CartPole-v1"))
    assert env.batch_size == ()
    with pytest.raises(TypeError, match="env id"):
        GymEnv(gym.make("CartPole-v1"), num_envs=2)


def test_random_policy_and_exploration_type():
    env = CountingEnv(batch_size=(4,))
    td = RandomPolicy(env.full_action_spec)(env.reset())
    assert td["action"].shape == (4, 1)
    assert ExplorationType.RANDOM.value == "random"
    assert Collector(env, frames_per_batch=8).next()["action"].shape == (4, 2, 1)


def test_is_env_rejects_non_envs():
    assert not is_env(object())
    assert is_env(TorchRLStyleCountingEnv())
    with pytest.raises(TypeError, match="not an env"):
        Collector(lambda: object(), frames_per_batch=4)
