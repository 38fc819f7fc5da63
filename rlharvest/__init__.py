"""rlharvest: fast, fault-tolerant RL experience collectors with TorchRL's collector API.

Layers, bottom up: ``envs`` (env protocol and envs) -> ``rollout`` (the one rollout loop) ->
``protocol`` (the wire types) -> ``transport`` (the backends: where workers run, and how commands,
batches and weights cross to them) -> ``worker`` (the one worker loop and the node entry points) ->
``weight_update`` (weight sync over the transports) -> ``collectors`` (which pick a backend and
drive their workers through one Fleet) -> ``monitor`` (a live page and Prometheus metrics of a
running collector). Each layer imports only the layers below it.

``import rlharvest`` imports no torch: ``ExplorationType`` is imported on first use, so the
``rlharvest`` command answers ``--help`` and ``--version`` at once. ``__version__`` is the installed
package's (``pyproject.toml`` is its one source).
"""

from __future__ import annotations

from importlib import metadata as _metadata
from typing import Any

from ._service_backend import service_backend
from .errors import WorkerError, WorkerTimeoutError

try:
    __version__ = _metadata.version("rlharvest")
except _metadata.PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"

__all__ = ["ExplorationType", "WorkerError", "WorkerTimeoutError", "__version__", "service_backend"]


def __getattr__(name: str) -> Any:
    if name == "ExplorationType":
        from .policies import ExplorationType

        globals()[name] = ExplorationType
        return ExplorationType
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"ExplorationType"})
