"""TorchRL-side envs and policy wrappers for the benchmarks (needs torchrl).

The plain modules come from ``common.py``; this file only adds TorchRL /
tensordict plumbing around them:

* :func:`make_cartpole_env`: ``GymEnv("CartPole-v1")``.
* :class:`CountingEnv`: an equivalent of the counting env of TorchRL's test
  mocks (``torchrl.testing.mocking_classes.CountingEnv``, which cannot be
  imported without pytest), written from its documented behaviour.
* :class:`TimestampTransform` / :func:`make_timestamp_env`: CartPole whose
  observations also carry ``"timestamp"`` = ``time.monotonic()`` (float64).
* Policy builders wrapping the ``common`` modules in TensorDict modules.

Everything here is importable by name so that spawned workers can unpickle it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule, TensorDictModuleBase
from torch import nn
from torchrl.data import Binary, Categorical, Composite, Unbounded
from torchrl.envs import Compose, EnvBase, GymEnv, RewardSum, StepCounter, Transform, TransformedEnv

import common


def make_cartpole_env() -> GymEnv:
    """TorchRL's Gymnasium wrapper around ``CartPole-v1``."""
    return GymEnv("CartPole-v1")


class CountingEnv(EnvBase):
    """Counter env: the action (0/1) is added to an int32 counter.

    Observation ``"observation"``: the counter, int32, shape ``(*B, 1)``.
    Action ``"action"``: Binary(n=1), shape ``(*B, 1)``.  Reward: 0.0.
    ``done = terminated = counter > max_steps``; no ``truncated`` key; reset
    sets the counter to ``start_val`` (only for ``_reset`` rows if given).
    """

    def __init__(self, max_steps: int = common.COUNTING_MAX_STEPS, start_val: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.max_steps = max_steps
        self.start_val = start_val
        shape = (*self.batch_size, 1)
        self.observation_spec = Composite(
            observation=Unbounded(shape, dtype=torch.int32), shape=self.batch_size
        )
        self.reward_spec = Unbounded(shape)
        self.done_spec = Categorical(2, dtype=torch.bool, shape=shape)
        self.action_spec = Binary(n=1, shape=shape)
        self.count = torch.zeros(shape, dtype=torch.int32)

    def _set_seed(self, seed: int | None) -> None:
        torch.manual_seed(seed)

    def _reset(self, tensordict: TensorDictBase | None, **kwargs) -> TensorDictBase:
        mask = None if tensordict is None else tensordict.get("_reset", None)
        if mask is None:
            self.count.fill_(self.start_val)
        else:
            self.count[mask] = self.start_val
        return self._output(with_reward=False)

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        self.count += tensordict.get("action").to(torch.int32)
        return self._output(with_reward=True)

    def _output(self, with_reward: bool) -> TensorDictBase:
        done = self.count > self.max_steps
        source = {"observation": self.count.clone(), "done": done, "terminated": done.clone()}
        if with_reward:
            source["reward"] = torch.zeros(self.count.shape, dtype=torch.float32)
        return TensorDict(source, batch_size=self.batch_size)


def make_transformed_cartpole() -> TransformedEnv:
    """CartPole with two common transforms (``step_count``, ``episode_reward``): a TorchRL env factory."""
    return TransformedEnv(make_cartpole_env(), Compose(StepCounter(), RewardSum()))


def make_cartpole_categorical_env() -> GymEnv:
    """``CartPole-v1`` with integer actions."""
    return GymEnv("CartPole-v1", categorical_action_encoding=True)


def cartpole_categorical_policy(seed: int = 0) -> TensorDictModule:
    return TensorDictModule(common.make_cartpole_categorical_mlp(seed), in_keys=["observation"], out_keys=["action"])


def make_counting_env() -> CountingEnv:
    """Unbatched :class:`CountingEnv` with the shared ``max_steps``."""
    return CountingEnv()


class TimestampTransform(Transform):
    """Adds ``"timestamp"``: ``time.monotonic()`` when an observation is produced.

    Written on reset and after every step, shape ``(*B, 1)``, float64 (float32
    cannot resolve milliseconds at typical uptimes).
    """

    def __init__(self) -> None:
        super().__init__(in_keys=[], out_keys=["timestamp"])

    def _stamp(self, tensordict: TensorDictBase) -> TensorDictBase:
        stamp = torch.full((*tensordict.batch_size, 1), time.monotonic(), dtype=torch.float64)
        return tensordict.set("timestamp", stamp)

    def _call(self, next_tensordict: TensorDictBase) -> TensorDictBase:
        return self._stamp(next_tensordict)

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        return self._stamp(tensordict_reset)

    def transform_observation_spec(self, observation_spec: Composite) -> Composite:
        observation_spec["timestamp"] = Unbounded(
            (*observation_spec.shape, 1), dtype=torch.float64, device=observation_spec.device
        )
        return observation_spec


def make_timestamp_env() -> TransformedEnv:
    """CartPole with the ``"timestamp"`` observation of :class:`TimestampTransform`."""
    return TransformedEnv(make_cartpole_env(), TimestampTransform())


# --------------------------------------------------------------------------
# Policies
# --------------------------------------------------------------------------


def cartpole_policy(seed: int = 0) -> TensorDictModule:
    """``common.make_cartpole_mlp`` reading ``observation``, writing ``action``."""
    return TensorDictModule(
        common.make_cartpole_mlp(seed), in_keys=["observation"], out_keys=["action"]
    )


class CountingPolicyModule(TensorDictModuleBase):
    """Writes ``action = weight`` of a ``common.CountingPolicy``, shape ``(*B, 1)``."""

    def __init__(self) -> None:
        super().__init__()
        self.module = common.CountingPolicy()
        self.in_keys = []
        self.out_keys = ["action"]

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        action = self.module().expand(*tensordict.batch_size, 1).clone()
        return tensordict.set("action", action)


def big_policy(n_params: int) -> TensorDictModule:
    """``common.make_big_policy`` + ArgmaxOneHot as an observation -> action module."""
    net = nn.Sequential(common.make_big_policy(n_params), common.ArgmaxOneHot())
    return TensorDictModule(net, in_keys=["observation"], out_keys=["action"])


def batched_policy(size: str) -> TensorDictModule:
    """``common.make_sized_cartpole_mlp(size)`` reading ``observation``, writing ``action``."""
    return TensorDictModule(common.make_sized_cartpole_mlp(size), in_keys=["observation"], out_keys=["action"])


def marked_policy() -> tuple[common.MarkedCartpolePolicy, TensorDictModule]:
    """The marked CartPole policy and its wrapper writing ``action`` and ``marker``."""
    module = common.MarkedCartpolePolicy()
    wrapper = TensorDictModule(
        module, in_keys=["observation"], out_keys=["action", "marker"]
    )
    return module, wrapper


#: Env constructors by family (``measure.Side.env_fn``).
ENV_FNS: dict[str, Callable[[], EnvBase]] = {
    "cartpole": make_cartpole_env,
    "cartpole_categorical": make_cartpole_categorical_env,
    "counting": make_counting_env,
    "timestamp": make_timestamp_env,
}

#: Policy builders by env family (``measure.Side.policy``).
POLICY_FNS: dict[str, Callable[[], nn.Module]] = {
    "cartpole": cartpole_policy,
    "cartpole_categorical": cartpole_categorical_policy,
    "counting": CountingPolicyModule,
}
