"""TorchRL envs and policies as a TorchRL user builds them (module-level, so they pickle by reference)."""

from __future__ import annotations

import functools

import torch
from tensordict.nn import TensorDictModule, TensorDictSequential
from torchrl.envs import Compose, GymEnv, ParallelEnv, RewardSum, SerialEnv, StepCounter, TransformedEnv
from torchrl.modules import (EGreedyModule, GRUModule, MLP, NormalParamExtractor, ProbabilisticActor, QValueActor,
                             TanhNormal)

CARTPOLE = "CartPole-v1"
PENDULUM = "Pendulum-v1"


def gym_env(name: str = CARTPOLE) -> GymEnv:
    return GymEnv(name)


def pendulum_env() -> GymEnv:
    return GymEnv(PENDULUM)


def transformed_env(name: str = CARTPOLE) -> TransformedEnv:
    return TransformedEnv(GymEnv(name), Compose(StepCounter(max_steps=40), RewardSum()))


def serial_env(name: str = CARTPOLE) -> SerialEnv:
    return SerialEnv(2, functools.partial(GymEnv, name))


def parallel_env(name: str = CARTPOLE) -> ParallelEnv:
    return ParallelEnv(2, functools.partial(GymEnv, name))


#: every kind of TorchRL env the suite runs, by name
ENV_MAKERS = {"gym": gym_env, "transformed": transformed_env, "serial": serial_env, "parallel": parallel_env}


def q_value_actor(epsilon: float | None = 0.5) -> TensorDictModule:
    """A DQN actor: Q-values, greedy one-hot action, chosen value; optional epsilon-greedy exploration."""
    torch.manual_seed(0)
    spec = GymEnv(CARTPOLE).action_spec
    actor = QValueActor(MLP(in_features=4, out_features=2, num_cells=[16]), in_keys=["observation"], spec=spec)
    if epsilon is None:
        return actor
    return TensorDictSequential(actor, EGreedyModule(spec, eps_init=epsilon, eps_end=epsilon))


def probabilistic_actor() -> ProbabilisticActor:
    """A continuous-control actor (TanhNormal) for Pendulum, writing loc, scale and the log-probability."""
    torch.manual_seed(0)
    spec = GymEnv(PENDULUM).action_spec
    net = torch.nn.Sequential(MLP(in_features=3, out_features=2, num_cells=[16]), NormalParamExtractor())
    module = TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"])
    return ProbabilisticActor(module, in_keys=["loc", "scale"], spec=spec, distribution_class=TanhNormal,
                              return_log_prob=True)


def recurrent_actor(env=None) -> TensorDictSequential:
    """A GRU actor for Pendulum: it reads ``is_init`` (InitTracker) and a ``recurrent_state`` (its primer),
    which a bare env lacks. ``env``: as a policy factory of an Evaluator."""
    torch.manual_seed(0)
    gru = GRUModule(input_size=3, hidden_size=8, num_layers=1, in_keys=["observation", "recurrent_state", "is_init"],
                    out_keys=["features", ("next", "recurrent_state")])
    head = TensorDictModule(torch.nn.Sequential(torch.nn.Linear(8, 1), torch.nn.Tanh()), in_keys=["features"],
                            out_keys=["action"])
    return TensorDictSequential(gru, head)
