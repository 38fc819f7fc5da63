"""What a weight-sync scheme needs from the collector it serves, written down as Protocols.

``BaseCollector`` implements both; a scheme reads nothing else of its collector (docs/weights.md).
"""

from __future__ import annotations

from typing import Any, Protocol

from tensordict import TensorDictBase

from ..transport.base import WeightLinks

__all__ = ["SenderContext", "ReceiverContext"]


class SenderContext(Protocol):
    """What a sender scheme needs from the collector that owns the workers."""

    writing_lock: Any
    """Held while the collector writes its replay buffer (a model of the buffer is updated under it), or None."""

    def get_model(self, model_id: str) -> Any:
        """The main-side source of ``model_id``'s weights."""

    def weight_links(self) -> WeightLinks:
        """What the collector's backend offers weight senders (channels, devices, liveness)."""

    def resolve(self, path: str) -> Any:
        """The object at an attribute path of the collector (weights given as a string)."""


class ReceiverContext(Protocol):
    """What a receiver scheme needs from the collector of the worker it runs in."""

    worker_idx: int | None
    policy_device: Any
    policy_lock: Any
    """Held while the policy runs (weights are swapped under it), or None."""

    def get_model(self, model_id: str) -> Any:
        """The model the received weights go into."""

    def weights_received(self, model_id: str, weights: TensorDictBase, applied_to: Any) -> None:
        """An update was applied to ``applied_to``: bring the rest of the collector up to date."""

    def forward_initial_weights(self, model_id: str, weights: TensorDictBase) -> None:
        """The initial weights arrived: pass them on to the collector's own workers, if any."""
