"""Typed options, one frozen dataclass per collector: each parses and validates its collector's
constructor arguments once, says through its :class:`~.traits.Traits` how its engine behaves, and
builds the backend and the worker specs (docs/architecture.md). The engine reads nothing else of a
collector's arguments."""

from .async_batched import AsyncBatchedConfig, AsyncBatchedOptions
from .local import LocalOptions
from .mp import WorkerProcessOptions
from .nodes import NodeOptions
from .ray import RayOptions
from .rpc import RPCOptions
from .torchdist import TorchDistOptions
from .traits import Traits, WeightPushes

__all__ = ["AsyncBatchedConfig", "AsyncBatchedOptions", "LocalOptions", "NodeOptions", "RayOptions", "RPCOptions",
           "TorchDistOptions", "Traits", "WeightPushes", "WorkerProcessOptions"]
