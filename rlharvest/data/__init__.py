"""Data containers: the replay buffer."""

from .replay_buffer import ReplayBuffer

__all__ = ["ReplayBuffer"]
