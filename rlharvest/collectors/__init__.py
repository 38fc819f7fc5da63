"""Collectors: single-process, worker-process and (in ``distributed``) multi-node."""

from .._utils import deprecated_alias
from ..policies import RandomPolicy
from ..profiling import ProfileConfig
from ..weight_update.ray import RayWeightUpdater
from ..weight_update.updaters import (
    MultiProcessedWeightUpdater,
    RemoteModuleWeightUpdater,
    VanillaWeightUpdater,
    WeightUpdaterBase,
)
from . import distributed  # noqa: F401  (the multi-node collectors, as rlharvest.collectors.distributed)
from .async_batched import AsyncBatchedCollector
from .base import BaseCollector
from ._eval_stats import bootstrap_estimate, paired_comparison
from .evaluator import Evaluator
from .options.autoscale import Autoscale
from .multi import AsyncCollector, MultiAsyncCollector, MultiCollector, MultiSyncCollector
from .single import Collector

SyncDataCollector = deprecated_alias(Collector, "SyncDataCollector")
MultiSyncDataCollector = deprecated_alias(MultiSyncCollector, "MultiSyncDataCollector")
MultiaSyncDataCollector = deprecated_alias(MultiAsyncCollector, "MultiaSyncDataCollector")
aSyncDataCollector = deprecated_alias(AsyncCollector, "aSyncDataCollector")
DataCollectorBase = BaseCollector
_MultiDataCollector = MultiCollector  # TorchRL 0.12's name of the common base (listed in its __all__)

__all__ = [
    "BaseCollector",
    "Collector",
    "ProfileConfig",
    "RandomPolicy",
    "WeightUpdaterBase",
    "VanillaWeightUpdater",
    "MultiProcessedWeightUpdater",
    "RemoteModuleWeightUpdater",
    "RayWeightUpdater",
    "MultiSyncCollector",
    "MultiAsyncCollector",
    "AsyncCollector",
    "MultiCollector",
    "AsyncBatchedCollector",
    "SyncDataCollector",
    "MultiSyncDataCollector",
    "MultiaSyncDataCollector",
    "aSyncDataCollector",
    "DataCollectorBase",
    "Evaluator",
    "bootstrap_estimate",
    "paired_comparison",
    "Autoscale",
]
