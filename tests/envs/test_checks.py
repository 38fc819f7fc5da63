"""Envs that break their own specs give a ValueError naming the key, within the first batch
(rlharvest/envs/checks.py), in process and in a worker; envs that keep to them, or have none, collect."""

from __future__ import annotations

import pytest
import torch
from mocks import TorchRLStyleCountingEnv

from rlharvest import WorkerError
from rlharvest.collectors import Collector, MultiSyncCollector
from rlharvest.envs import CountingEnv
from rlharvest.envs.specs import Composite, Unbounded

pytestmark = pytest.mark.timeout(60)


class SpecBreakingEnv(CountingEnv):
    """CountingEnv whose step breaks a spec in one way (``fault``) from step ``at`` on."""

    def __init__(self, fault: str, at: int = 0, batch_size=()) -> None:
        super().__init__(max_steps=1000, batch_size=batch_size)
        self.fault, self.at, self.steps = fault, at, 0

    def _step_arrays(self, actions):
        observations, reward, terminated, truncated = super()._step_arrays(actions)
        self.steps += 1
        if self.steps > self.at:
            obs = observations["observation"]
            if self.fault == "reward-shape":
                reward = reward.reshape(self.batch_size)  # (*B,) instead of (*B, 1)
            elif self.fault == "obs-dtype":
                observations = {"observation": obs.to(torch.float64)}
            elif self.fault == "obs-shape":
                observations = {"observation": torch.cat([obs, obs], -1)}
        return observations, reward, terminated, truncated


def first_batch(env_fn, where: str, frames: int = 8):
    if where == "in process":
        collector = Collector(env_fn(), frames_per_batch=frames, total_frames=-1)
    else:
        collector = MultiSyncCollector([env_fn], frames_per_batch=frames, total_frames=-1)
    try:
        return collector.next()
    finally:
        collector.shutdown()


@pytest.mark.parametrize("where", ["in process", "in a worker"])
@pytest.mark.parametrize("fault, key, expected, actual", [
    ("reward-shape", "('next', 'reward')", "shape (1,) and dtype torch.float32", "shape () and dtype torch.float32"),
    ("obs-dtype", "('next', 'observation')", "dtype torch.int32", "dtype torch.float64"),
    ("obs-shape", "('next', 'observation')", "shape (1,)", "shape (2,)"),
])
def test_spec_mismatch_on_the_first_step(where, fault, key, expected, actual):
    with pytest.raises(ValueError) as info:
        first_batch(lambda: SpecBreakingEnv(fault), where)
    message = str(info.value)
    assert key in message and expected in message and actual in message, message
    if where == "in a worker":
        assert isinstance(info.value, WorkerError)


@pytest.mark.parametrize("batch_size", [(), (3,)])
@pytest.mark.parametrize("fault", ["obs-shape", "obs-dtype"])
def test_change_mid_episode_is_named_within_the_first_batch(batch_size, fault):
    # the env's 4th step (index 3) returns it: ("next", key) at step 3, the root (the state acted on) at step 4
    with pytest.raises(ValueError, match="changed at step [34] of this batch") as info:
        first_batch(lambda: SpecBreakingEnv(fault, at=3, batch_size=batch_size), "in process", 8 * max(batch_size, default=1))
    message = str(info.value)
    assert "'observation'" in message and f"shape {(*batch_size, 1)} and dtype torch.int32" in message, message
    changed = f"shape {(*batch_size, 2)}" if fault == "obs-shape" else "dtype torch.float64"
    assert f"now {changed}" in message or changed in message.split("now")[1], message


def test_shape_change_at_a_batch_boundary():
    env = SpecBreakingEnv("obs-shape", at=8)  # the second batch starts with the new shape
    collector = Collector(env, frames_per_batch=8, total_frames=-1)
    try:
        collector.next()
        with pytest.raises(ValueError, match="changed at step [01] of this batch"):
            collector.next()
    finally:
        collector.shutdown()


class RewardSpecTensorDictEnv(TorchRLStyleCountingEnv):
    """The TensorDict path with a TorchRL-style ``full_reward_spec``, and a reward of the wrong shape."""

    full_reward_spec = Composite(reward=Unbounded((1,)))

    def step(self, tensordict):
        out = super().step(tensordict)
        out.get("next").set("reward", torch.zeros(2))
        return out


class UnreadableSpecsEnv(TorchRLStyleCountingEnv):
    """Specs that raise when read: the env is not checked, and collects."""

    @property
    def full_reward_spec(self):
        raise RuntimeError("no specs here")


def test_tensordict_envs_are_checked_too_and_unreadable_specs_are_skipped():
    with pytest.raises(ValueError, match=r"reward \('next', 'reward'\).*shape \(2,\)"):
        first_batch(RewardSpecTensorDictEnv, "in process")
    assert first_batch(UnreadableSpecsEnv, "in process")["next", "observation"].shape == (8, 1)
    assert first_batch(TorchRLStyleCountingEnv, "in process")["next", "reward"].shape == (8, 1)
