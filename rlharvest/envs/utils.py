"""Exploration-mode helpers, at the import path TorchRL users know (``envs.utils``).

``exploration_type()`` is tensordict's ``interaction_type()``: exported by ``tensordict.nn`` from
0.15 on, only by ``tensordict.nn.probabilistic`` in 0.14 (what TorchRL 0.14.1 requires). Both
releases are within the versions rlharvest declares, so it is looked up in either place here, once.
"""

from tensordict.nn import InteractionType as ExplorationType
from tensordict.nn import set_interaction_type as set_exploration_type

try:
    from tensordict.nn import interaction_type as exploration_type
except ImportError:  # tensordict 0.14
    from tensordict.nn.probabilistic import interaction_type as exploration_type

__all__ = ["ExplorationType", "set_exploration_type", "exploration_type"]
