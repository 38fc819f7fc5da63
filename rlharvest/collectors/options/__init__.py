"""Typed options of the collectors with workers, one frozen dataclass per backend: each parses and
validates its collector's constructor arguments once, and builds the backend and the worker specs
(docs/architecture.md)."""

from .async_batched import AsyncBatchedConfig
from .mp import WorkerProcessOptions
from .nodes import NodeOptions, RayOptions, RPCOptions, TorchDistOptions

__all__ = ["AsyncBatchedConfig", "NodeOptions", "RayOptions", "RPCOptions", "TorchDistOptions", "WorkerProcessOptions"]
