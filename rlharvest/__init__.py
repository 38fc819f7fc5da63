"""rlharvest: fast, fault-tolerant RL experience collectors with TorchRL's collector API.

Layers, bottom up: ``envs`` (env protocol and envs) -> ``rollout`` (the one rollout loop) ->
``transport`` (process boundaries) -> ``worker`` (the one worker loop) -> ``collectors`` ->
``weight_update`` (weight sync over the same transports) -> ``collectors.distributed`` (launchers).
"""

from .errors import WorkerError, WorkerTimeoutError
from .policies import ExplorationType

__version__ = "0.1.0"

__all__ = ["ExplorationType", "WorkerError", "WorkerTimeoutError", "__version__"]
