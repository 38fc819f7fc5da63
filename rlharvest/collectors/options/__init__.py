"""Typed options of the collectors with workers, one frozen dataclass per backend: each parses and
validates its collector's constructor arguments once, and builds the backend and the worker specs
(docs/architecture.md)."""

from .mp import WorkerProcessOptions

__all__ = ["WorkerProcessOptions"]
