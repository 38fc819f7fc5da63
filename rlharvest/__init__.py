"""rlharvest: fast, fault-tolerant RL experience collectors with TorchRL's collector API.

Layers, bottom up: ``envs`` (env protocol and envs) -> ``rollout`` (the one rollout loop) ->
``protocol`` (the wire types) -> ``transport`` (the backends: where workers run, and how commands,
batches and weights cross to them) -> ``worker`` (the one worker loop and the node entry points) ->
``weight_update`` (weight sync over the transports) -> ``collectors`` (which pick a backend and
drive their workers through one Fleet). Each layer imports only the layers below it.
"""

from ._service_backend import service_backend
from .errors import WorkerError, WorkerTimeoutError
from .policies import ExplorationType

__version__ = "0.1.0"

__all__ = ["ExplorationType", "WorkerError", "WorkerTimeoutError", "__version__", "service_backend"]
