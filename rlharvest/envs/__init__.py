"""Environments: the duck-typed env protocol, minimal specs, rlharvest's own envs, and batched envs."""

from tensordict.nn import InteractionType as ExplorationType

from .adapters import is_env
from .base import EnvBase
from .batched import SerialEnv
from .counting import ContinuousMockEnv, CountingEnv
from .gym import GymEnv
from .parallel import ParallelEnv
from .specs import Binary, Bounded, Categorical, Composite, OneHot, TensorSpec, Unbounded

__all__ = [
    "EnvBase",
    "is_env",
    "CountingEnv",
    "ContinuousMockEnv",
    "GymEnv",
    "SerialEnv",
    "ParallelEnv",
    "ExplorationType",
    "TensorSpec",
    "Unbounded",
    "Bounded",
    "Categorical",
    "OneHot",
    "Binary",
    "Composite",
]
