"""``rlharvest demo``: a small PPO learning CartPole-v1 through rlharvest collectors.

Example:
    >>> from rlharvest.demo import DemoConfig, run_demo
    >>> summary = run_demo(DemoConfig(collector="multisync", workers=2, seed=0))  # doctest: +SKIP
"""

from .ppo import PPO, CategoricalSampler, PPOConfig, gae, make_policy, make_value
from .run import COLLECTORS, DEFAULT_FRAMES, DemoConfig, EpisodeTracker, make_env, run_demo

__all__ = [
    "COLLECTORS",
    "DEFAULT_FRAMES",
    "DemoConfig",
    "EpisodeTracker",
    "PPO",
    "PPOConfig",
    "CategoricalSampler",
    "gae",
    "make_env",
    "make_policy",
    "make_value",
    "run_demo",
]
