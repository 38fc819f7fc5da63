"""TorchRL's policies in every collector: a Q-value actor with a random warm-up, a probabilistic
actor, and weight updates that reach every worker and node."""

from __future__ import annotations

import pytest
import torch
from collector_kinds import KINDS, check_transitions, make_collector
from tensordict import TensorDict
from torchrl_objects import gym_env, pendulum_env, probabilistic_actor, q_value_actor

pytestmark = pytest.mark.timeout(120)


def _keys(batch) -> set:
    return set(batch.keys(True, True))


@pytest.mark.parametrize("kind", KINDS)
def test_random_warmup_then_q_value_policy(kind, free_port):
    collector = make_collector(kind, gym_env, q_value_actor(), port=free_port, frames_per_batch=40,
                               total_frames=160, init_random_frames=80)
    try:
        batches = list(collector)
    finally:
        collector.shutdown()
    assert len(batches) == 4
    assert all(_keys(b) == _keys(batches[-1]) for b in batches)
    assert batches[0]["action_value"].eq(0).all()            # random batch: the policy's outputs are zero
    assert not batches[-1]["action_value"].eq(0).all()       # policy batch
    for batch in batches:
        check_transitions(batch, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_probabilistic_actor(kind, free_port):
    collector = make_collector(kind, pendulum_env, probabilistic_actor(), port=free_port, frames_per_batch=40,
                               total_frames=80)
    try:
        batches = list(collector)
    finally:
        collector.shutdown()
    for batch in batches:
        assert {"loc", "scale", "action"} <= _keys(batch)
        log_prob = "action_log_prob" if "action_log_prob" in _keys(batch) else "sample_log_prob"
        assert torch.isfinite(batch[log_prob]).all()
        assert batch["action"].abs().max() <= 2.0 + 1e-5      # TanhNormal within Pendulum's bounds
        check_transitions(batch, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_weight_update_reaches_every_worker(kind, free_port):
    """Biasing the greedy actor towards action 1 after the first batch: every later action is 1."""
    policy = q_value_actor(epsilon=None)
    collector = make_collector(kind, gym_env, policy, port=free_port, frames_per_batch=40, total_frames=-1)
    try:
        iterator = iter(collector)
        next(iterator)
        weights = TensorDict.from_module(policy)
        with torch.no_grad():
            for key, value in weights.items(True, True):
                value.zero_()
                if key[-1] == "bias" and value.shape == (2,):
                    value.copy_(torch.tensor([0.0, 1.0]))
        if kind != "distributed_sync":      # it pushes the weights itself, every update_interval batches
            collector.update_policy_weights_()
        batches = [next(iterator) for _ in range(3)]
    finally:
        collector.shutdown()
    last = batches[-1]
    assert (last["action"].argmax(-1) == 1).all()
