"""Exploration-mode helpers, at the import path TorchRL users know (``envs.utils``)."""

from tensordict.nn import InteractionType as ExplorationType
from tensordict.nn import interaction_type as exploration_type
from tensordict.nn import set_interaction_type as set_exploration_type

__all__ = ["ExplorationType", "set_exploration_type", "exploration_type"]
