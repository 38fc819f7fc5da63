"""rlharvest-side envs and policy wrappers for the benchmarks (mirror of ``torchrl_envs.py``).

Everything is importable by name so that worker processes and nodes can unpickle it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch
from tensordict.nn import TensorDictModule
from torch import nn

import common
from rlharvest.envs import CountingEnv, GymEnv, Unbounded


def make_cartpole_env() -> GymEnv:
    """rlharvest's gymnasium wrapper around ``CartPole-v1`` (one-hot actions, as TorchRL's)."""
    return GymEnv("CartPole-v1")


def make_cartpole_categorical_env() -> GymEnv:
    """``CartPole-v1`` with integer actions (``categorical_action_encoding=True``)."""
    return GymEnv("CartPole-v1", categorical_action_encoding=True)


def make_counting_env() -> CountingEnv:
    return CountingEnv(max_steps=common.COUNTING_MAX_STEPS)


class TimestampCartPole(GymEnv):
    """CartPole whose observations also carry ``"timestamp"`` = ``time.monotonic()`` (float64, (1,))."""

    def __init__(self) -> None:
        super().__init__("CartPole-v1")
        self.observation_spec["timestamp"] = Unbounded((1,), dtype=torch.float64)

    @staticmethod
    def _stamp() -> torch.Tensor:
        return torch.full((1,), time.monotonic(), dtype=torch.float64)

    def _reset_arrays(self, mask=None):
        return {**super()._reset_arrays(mask), "timestamp": self._stamp()}

    def _step_arrays(self, actions):
        observations, reward, terminated, truncated = super()._step_arrays(actions)
        return {**observations, "timestamp": self._stamp()}, reward, terminated, truncated


def cartpole_policy(seed: int = 0) -> TensorDictModule:
    return TensorDictModule(common.make_cartpole_mlp(seed), in_keys=["observation"], out_keys=["action"])


def cartpole_categorical_policy(seed: int = 0) -> TensorDictModule:
    return TensorDictModule(common.make_cartpole_categorical_mlp(seed), in_keys=["observation"], out_keys=["action"])


class CountingAction(nn.Module):
    """``action = weight`` of a ``common.CountingPolicy``, shaped like the observation."""

    def __init__(self) -> None:
        super().__init__()
        self.module = common.CountingPolicy()

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.module().expand(observation.shape).clone()


def counting_policy() -> TensorDictModule:
    return TensorDictModule(CountingAction(), in_keys=["observation"], out_keys=["action"])


def big_policy(n_params: int) -> TensorDictModule:
    net = nn.Sequential(common.make_big_policy(n_params), common.ArgmaxOneHot())
    return TensorDictModule(net, in_keys=["observation"], out_keys=["action"])


def marked_policy() -> tuple[common.MarkedCartpolePolicy, TensorDictModule]:
    module = common.MarkedCartpolePolicy()
    return module, TensorDictModule(module, in_keys=["observation"], out_keys=["action", "marker"])


def batched_policy(size: str) -> TensorDictModule:
    """``common.make_sized_cartpole_mlp(size)`` reading ``observation``, writing ``action``."""
    return TensorDictModule(common.make_sized_cartpole_mlp(size), in_keys=["observation"], out_keys=["action"])


def make_vector_cartpole(num_envs: int) -> GymEnv:
    """rlharvest's GymEnv around ``AsyncVectorEnv(num_envs, shared_memory=True)`` (resets done by the rollout)."""
    import gymnasium as gym

    vector = gym.vector.AsyncVectorEnv([functools.partial(gym.make, "CartPole-v1")] * num_envs, shared_memory=True,
                                       autoreset_mode=gym.vector.AutoresetMode.DISABLED)
    return GymEnv(vector)


ENV_FNS: dict[str, Callable] = {
    "cartpole": make_cartpole_env,
    "cartpole_categorical": make_cartpole_categorical_env,
    "counting": make_counting_env,
    "timestamp": TimestampCartPole,
}
POLICY_FNS: dict[str, Callable[[], nn.Module]] = {
    "cartpole": cartpole_policy,
    "cartpole_categorical": cartpole_categorical_policy,
    "counting": counting_policy,
}
