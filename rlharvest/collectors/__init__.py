"""Collectors: single-process, worker-process and (in ``distributed``) multi-node."""

from .._utils import deprecated_alias
from ..profiling import ProfileConfig
from ..weight_update.updaters import (
    MultiProcessedWeightUpdater,
    RemoteModuleWeightUpdater,
    VanillaWeightUpdater,
    WeightUpdaterBase,
)
from .base import BaseCollector
from .single import Collector

SyncDataCollector = deprecated_alias(Collector, "SyncDataCollector")
DataCollectorBase = BaseCollector

__all__ = [
    "BaseCollector",
    "Collector",
    "ProfileConfig",
    "WeightUpdaterBase",
    "VanillaWeightUpdater",
    "MultiProcessedWeightUpdater",
    "RemoteModuleWeightUpdater",
    "SyncDataCollector",
    "DataCollectorBase",
]
