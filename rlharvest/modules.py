"""Policy modules (TorchRL's ``torchrl.modules`` import path)."""

from .policies import ObservationModule, RandomPolicy

__all__ = ["RandomPolicy", "ObservationModule"]
