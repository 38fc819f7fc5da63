"""``rlharvest demo``: a small PPO learning CartPole-v1 through rlharvest collectors.

The names below are imported on first use: ``rlharvest --help`` reads :mod:`.choices` only, and
must not pay for torch.

Example:
    >>> from rlharvest.demo import DemoConfig, run_demo
    >>> summary = run_demo(DemoConfig(collector="multisync", workers=2, seed=0))  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

from .choices import COLLECTORS, DEFAULT_FRAMES

#: where each lazily imported name lives
_LAZY = {
    "PPO": ".ppo", "PPOConfig": ".ppo", "CategoricalSampler": ".ppo", "gae": ".ppo", "make_policy": ".ppo",
    "make_value": ".ppo", "DemoConfig": ".run", "EpisodeTracker": ".run", "make_env": ".run", "run_demo": ".run",
}

__all__ = ["COLLECTORS", "DEFAULT_FRAMES", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
