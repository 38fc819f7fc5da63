"""Environments: the duck-typed env protocol, minimal specs, and rlharvest's own envs."""

from ..policies import ExplorationType
from .adapters import is_env
from .base import EnvBase
from .counting import ContinuousMockEnv, CountingEnv
from .gym import GymEnv
from .specs import Binary, Bounded, Categorical, Composite, OneHot, TensorSpec, Unbounded

__all__ = [
    "EnvBase",
    "is_env",
    "CountingEnv",
    "ContinuousMockEnv",
    "GymEnv",
    "ExplorationType",
    "TensorSpec",
    "Unbounded",
    "Bounded",
    "Categorical",
    "OneHot",
    "Binary",
    "Composite",
]
