"""Never refuse what TorchRL runs: a policy's action that the env's spec does not hold (float logits for a
one-hot spec, an index, extra values) reaches the gymnasium env exactly as under TorchRL's collector, whether
the env is TorchRL's GymEnv or rlharvest's; what TorchRL cannot run either is an ActionSpecError.

Each case runs three ways on a gymnasium env that records the actions it is given: TorchRL's collector
with TorchRL's GymWrapper (the reference), rlharvest's with TorchRL's GymWrapper, rlharvest's with
rlharvest's GymEnv."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict.nn import TensorDictModule
from torchrl.collectors import Collector as TorchRLCollector
from torchrl.envs import GymWrapper

from rlharvest.collectors import Collector
from rlharvest.envs import GymEnv
from rlharvest.errors import ActionReadWarning, ActionSpecError

pytestmark = pytest.mark.timeout(120)


class Recorded(gym.Wrapper):
    """Keeps every action the env is stepped with."""

    def __init__(self, env) -> None:
        super().__init__(env)
        self.actions: list = []

    def step(self, action):
        self.actions.append(np.asarray(action).tolist())
        return self.env.step(action)


class Constant(torch.nn.Module):
    """Writes the same action at every step."""

    def __init__(self, value) -> None:
        super().__init__()
        self.value = torch.as_tensor(value)

    def forward(self, observation):
        return self.value.expand(torch.Size([*observation.shape[:-1], *self.value.shape])).clone()


def linear(n_in: int, n_out: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(n_in, n_out)


CARTPOLE, PENDULUM = "CartPole-v1", "Pendulum-v1"
#: (env id, categorical actions, policy module, does the spec hold the action)
CASES = {
    "one-hot: logits of nn.Linear(4, 2)": (CARTPOLE, False, lambda: linear(4, 2), False),
    "one-hot: floats truncated before argmax": (CARTPOLE, False, lambda: Constant([1.2, 1.9]), False),
    "one-hot: a negative float": (CARTPOLE, False, lambda: Constant([-1.5, 0.2]), False),
    "one-hot: an index": (CARTPOLE, False, lambda: Constant(1), False),
    "one-hot: three values": (CARTPOLE, False, lambda: linear(4, 3), False),
    "one-hot: booleans": (CARTPOLE, False, lambda: Constant([False, True]), True),
    "categorical: 0.7": (CARTPOLE, True, lambda: Constant(0.7), False),
    "categorical: 1.7": (CARTPOLE, True, lambda: Constant(1.7), False),
    "box: two values for one": (PENDULUM, False, lambda: Constant([0.3, -0.2]), False),
}
#: what TorchRL cannot run either: CartPole refuses an array of two floats as its action
REFUSED = {"categorical: two logits": (CARTPOLE, True, lambda: linear(4, 2))}


def _run(collector_cls, wrap, env_id: str, categorical: bool, module) -> list:
    recorded = Recorded(gym.make(env_id))
    # seeded by gymnasium itself (TorchRL's set_seed resets the env, rlharvest's seeds its next reset):
    # each collector's first reset then draws the same state
    recorded.reset(seed=0)
    env = wrap(recorded, categorical_action_encoding=categorical)
    policy = TensorDictModule(module, in_keys=["observation"], out_keys=["action"])
    collector = collector_cls(env, policy, frames_per_batch=40, total_frames=40)
    try:
        next(iter(collector))
    finally:
        collector.shutdown()
    return recorded.actions


@pytest.mark.parametrize("case", list(CASES))
def test_the_env_gets_the_actions_it_gets_under_torchrl(case):
    env_id, categorical, make_module, fits = CASES[case]
    expected = _run(TorchRLCollector, GymWrapper, env_id, categorical, make_module())
    assert len(expected) == 40
    for wrap in (GymWrapper, GymEnv):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _run(Collector, wrap, env_id, categorical, make_module())
        assert got == expected, (wrap.__name__, got[:5], expected[:5])
        read = [str(w.message) for w in caught if issubclass(w.category, ActionReadWarning)]
        assert fits == (read == []), read
        if read:
            assert "Read as TorchRL reads it" in read[0] and "the env's spec" in read[0], read


@pytest.mark.parametrize("wrap", [GymWrapper, GymEnv])
def test_what_torchrl_cannot_run_either_is_an_action_spec_error(wrap):
    env_id, categorical, make_module = REFUSED["categorical: two logits"]
    with pytest.raises(AssertionError):  # TorchRL: CartPole's own check of its action
        _run(TorchRLCollector, GymWrapper, env_id, categorical, make_module())
    with pytest.raises(ActionSpecError, match=r"holds 2 values where the spec holds 1.*failed at its first step") as info:
        _run(Collector, wrap, env_id, categorical, make_module())
    assert isinstance(info.value.__cause__, AssertionError)
