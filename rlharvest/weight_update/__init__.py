"""Weight sync: schemes (sender/receiver pairs) and the legacy updaters, over the transports."""

from .torchdist import DistributedWeightSyncScheme
from .ray import RayWeightSyncScheme, RayWeightUpdater
from .rpc import RPCWeightSyncScheme
from .schemes import NoWeightSyncScheme, WeightSyncScheme
from .shared_memory import MultiProcessWeightSyncScheme, SharedMemWeightSyncScheme
from .strategy import WeightStrategy
from .updaters import MultiProcessedWeightUpdater, RemoteModuleWeightUpdater, VanillaWeightUpdater, WeightUpdaterBase

__all__ = [
    "WeightSyncScheme",
    "WeightStrategy",
    "NoWeightSyncScheme",
    "DistributedWeightSyncScheme",
    "RPCWeightSyncScheme",
    "RayWeightSyncScheme",
    "RayWeightUpdater",
    "SharedMemWeightSyncScheme",
    "MultiProcessWeightSyncScheme",
    "WeightUpdaterBase",
    "VanillaWeightUpdater",
    "MultiProcessedWeightUpdater",
    "RemoteModuleWeightUpdater",
]
