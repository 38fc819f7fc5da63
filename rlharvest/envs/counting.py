"""Deterministic toy envs whose trajectories are known exactly, for tests and benchmarks."""

from __future__ import annotations

import torch

from .base import EnvBase
from .specs import Binary, Bounded, Composite, Unbounded

__all__ = ["CountingEnv", "ContinuousMockEnv"]


class CountingEnv(EnvBase):
    """A counter that the action increments: the reference env of the tests (known trajectories).

    Observation ``"observation"``: int32 counter of shape ``(*batch_size, 1)``; action ``"action"``:
    0/1 of the same shape, added to the counter; reward 0; ``done = terminated = counter >
    max_steps``; no ``truncated`` key; reset sets the counter to ``start_val``.

    Args:
        max_steps: the episode ends once the counter exceeds this value.
        start_val: counter value after a reset.
        batch_size: env batch shape, ``()`` for a single env.

    Example:
        >>> env = CountingEnv(max_steps=2, batch_size=(3,))
        >>> env.reset()["observation"].shape
        torch.Size([3, 1])
    """

    has_truncated = False

    def __init__(self, max_steps: int = 5, start_val: int = 0, batch_size=()) -> None:
        super().__init__()
        self.max_steps = int(max_steps)
        self.start_val = int(start_val)
        self.batch_size = torch.Size(batch_size)
        shape = (*self.batch_size, 1)
        self.observation_spec = Composite(
            observation=Unbounded(shape, dtype=torch.int32), shape=self.batch_size
        )
        self.full_action_spec = Composite(action=Binary(shape=shape, dtype=torch.int8), shape=self.batch_size)
        self.count = torch.full(shape, self.start_val, dtype=torch.int32)
        self._zero_reward = torch.zeros(shape, dtype=torch.float32)

    def _reset_arrays(self, mask=None):
        if mask is None:
            self.count = torch.full_like(self.count, self.start_val)
        else:
            self.count = torch.where(
                torch.as_tensor(mask).reshape(*self.batch_size, 1), self.start_val, self.count
            ).to(torch.int32)
        return {"observation": self.count}

    def _step_arrays(self, actions):
        # A new tensor each step: returned values must stay valid after the next step.
        self.count = self.count + actions["action"].reshape(self.count.shape).to(torch.int32)
        terminated = self.count > self.max_steps
        return {"observation": self.count}, self._zero_reward, terminated, None

    def _set_seed(self, seed: int) -> None:
        torch.manual_seed(seed)


class ContinuousMockEnv(EnvBase):
    """A cheap continuous-control env: the observation drifts with the action.

    ``observation`` (float32, ``obs_dim``) starts at zero plus small noise, moves by ``0.1 * action``
    each step; reward is ``-|observation|^2``; episodes are truncated after ``episode_length`` steps.

    Args:
        obs_dim: observation size.
        action_dim: action size (actions live in ``[-1, 1]``).
        episode_length: steps before truncation.
        batch_size: env batch shape.

    Example:
        >>> env = ContinuousMockEnv(batch_size=(2,))
        >>> env.rand_action()["action"].shape
        torch.Size([2, 7])
    """

    def __init__(self, obs_dim: int = 7, action_dim: int = 7, episode_length: int = 20, batch_size=()) -> None:
        super().__init__()
        self.batch_size = torch.Size(batch_size)
        self.obs_dim, self.action_dim = obs_dim, action_dim
        self.episode_length = int(episode_length)
        self.observation_spec = Composite(
            observation=Unbounded((*self.batch_size, obs_dim)), shape=self.batch_size
        )
        self.full_action_spec = Composite(
            action=Bounded(-1.0, 1.0, (*self.batch_size, action_dim)), shape=self.batch_size
        )
        self._generator = torch.Generator().manual_seed(0)
        self.obs = torch.zeros(*self.batch_size, obs_dim)
        self.steps = torch.zeros(self.batch_size, dtype=torch.int64)
        self._projection = torch.eye(action_dim, obs_dim)

    def _fresh(self, shape) -> torch.Tensor:
        return 0.01 * torch.randn(shape, generator=self._generator)

    def _reset_arrays(self, mask=None):
        if mask is None:
            self.obs = self._fresh(self.obs.shape)
            self.steps = torch.zeros_like(self.steps)
        else:
            mask = torch.as_tensor(mask).reshape(self.batch_size)
            self.obs = torch.where(mask.unsqueeze(-1), self._fresh(self.obs.shape), self.obs)
            self.steps = torch.where(mask, 0, self.steps)
        return {"observation": self.obs}

    def _step_arrays(self, actions):
        action = actions["action"].reshape(*self.batch_size, self.action_dim).to(torch.float32)
        self.obs = self.obs + 0.1 * action @ self._projection
        self.steps = self.steps + 1
        reward = -(self.obs * self.obs).sum(-1, keepdim=True)
        truncated = (self.steps >= self.episode_length).unsqueeze(-1)
        return {"observation": self.obs}, reward, torch.zeros_like(truncated), truncated

    def _set_seed(self, seed: int) -> None:
        self._generator.manual_seed(seed)
