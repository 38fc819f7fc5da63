"""Random warm-up (``init_random_frames``) with policies that write more than the action.

TorchRL's batches of random actions hold the same keys as its policy batches, the policy's other
outputs (Q-values, distribution parameters, log-probabilities) being zero; rlharvest matches that.
"""

from __future__ import annotations

import pytest
import torch
from tensordict.nn import (
    NormalParamExtractor,
    ProbabilisticTensorDictModule,
    ProbabilisticTensorDictSequential,
    TensorDictModule,
    TensorDictSequential,
)

from rlharvest.collectors import Collector, MultiSyncCollector
from rlharvest.envs import ContinuousMockEnv, CountingEnv

pytestmark = pytest.mark.timeout(90)


class GreedyFromValues(torch.nn.Module):
    """Q-value head: one-hot argmax action and the chosen value."""

    def forward(self, action_value: torch.Tensor):
        index = action_value.argmax(-1, keepdim=True)
        return index.to(torch.int8), action_value.gather(-1, index)


def q_value_policy() -> TensorDictSequential:
    torch.manual_seed(0)
    values = TensorDictModule(torch.nn.Linear(1, 2), in_keys=["observation_float"], out_keys=["action_value"])
    head = TensorDictModule(GreedyFromValues(), in_keys=["action_value"], out_keys=["action", "chosen_action_value"])
    to_float = TensorDictModule(lambda obs: obs.float(), in_keys=["observation"], out_keys=["observation_float"])
    return TensorDictSequential(to_float, values, head)


def probabilistic_actor() -> ProbabilisticTensorDictSequential:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(7, 14), NormalParamExtractor())
    params = TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"])
    sample = ProbabilisticTensorDictModule(in_keys=["loc", "scale"], out_keys=["action"],
                                           distribution_class=torch.distributions.Normal, return_log_prob=True)
    return ProbabilisticTensorDictSequential(params, sample)


def _leaf_keys(batch) -> set:
    return set(batch.keys(True, True))


@pytest.mark.parametrize("make", ["q_value", "probabilistic"])
def test_random_batches_have_the_policy_batches_keys(make):
    if make == "q_value":
        env, policy, extra = CountingEnv(max_steps=3), q_value_policy(), ["action_value", "chosen_action_value"]
    else:
        env, policy, extra = ContinuousMockEnv(), probabilistic_actor(), ["loc", "scale", "action_log_prob"]
    collector = Collector(env, policy, frames_per_batch=8, total_frames=24, init_random_frames=8)
    random_batch, first_policy_batch, second_policy_batch = list(collector)
    assert _leaf_keys(random_batch) == _leaf_keys(first_policy_batch) == _leaf_keys(second_policy_batch)
    extra = [k for k in extra if k in _leaf_keys(first_policy_batch)]
    assert len(extra) >= 2, _leaf_keys(first_policy_batch)
    for key in extra:
        assert random_batch[key].eq(0).all(), key
        assert first_policy_batch[key].shape == random_batch[key].shape
        assert first_policy_batch[key].dtype == random_batch[key].dtype
        assert not first_policy_batch[key].eq(0).all(), key
    collector.shutdown()


def test_random_warmup_in_worker_processes_with_a_q_value_policy():
    collector = MultiSyncCollector([lambda: CountingEnv(max_steps=3)] * 2, q_value_policy(), frames_per_batch=8,
                                   total_frames=24, init_random_frames=8)
    batches = list(collector)
    assert len(batches) == 3
    assert all(_leaf_keys(b) == _leaf_keys(batches[0]) for b in batches)
    assert batches[0]["chosen_action_value"].eq(0).all()
    assert not batches[2]["action_value"].eq(0).all()
    collector.shutdown()


def test_policy_batch_first_then_random_keeps_the_layout():
    """A replay buffer decides random-or-policy from its write count; a layout built from a policy
    batch must also hold a random one."""
    collector = Collector(CountingEnv(max_steps=3), q_value_policy(), frames_per_batch=6, total_frames=6)
    policy_batch = collector.rollout_batch(random=False).clone()
    random_batch = collector.rollout_batch(random=True).clone()
    assert _leaf_keys(policy_batch) == _leaf_keys(random_batch)
    assert random_batch["action_value"].eq(0).all()
    collector.shutdown()
