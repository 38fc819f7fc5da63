"""Multi-node collectors: DistributedCollector (torch.distributed), RPCCollector (torch RPC) and
RayCollector (Ray actors; Ray itself is the optional extra ``rlharvest[ray]``)."""

from ..._utils import deprecated_alias
from ...weight_update.torchdist import DistributedWeightUpdater
from ...weight_update.ray import RayWeightSyncScheme, RayWeightUpdater
from ...weight_update.rpc import RPCWeightUpdater
from .torchdist import DistributedCollector
from .ray import RayCollector
from .ray_eval import RayEvalWorker
from .rpc import RPCCollector
from .sync import DistributedSyncCollector
from .slurm import DEFAULT_SLURM_CONF, DEFAULT_SLURM_CONF_MAIN, submitit_delayed_launcher

DistributedDataCollector = deprecated_alias(DistributedCollector, "DistributedDataCollector")
RPCDataCollector = deprecated_alias(RPCCollector, "RPCDataCollector")
DistributedSyncDataCollector = deprecated_alias(DistributedSyncCollector, "DistributedSyncDataCollector")

__all__ = [
    "DistributedCollector",
    "DistributedDataCollector",
    "DistributedWeightUpdater",
    "DistributedSyncCollector",
    "DistributedSyncDataCollector",
    "RPCCollector",
    "RPCDataCollector",
    "RPCWeightUpdater",
    "RayCollector",
    "RayEvalWorker",
    "RayWeightSyncScheme",
    "RayWeightUpdater",
    "DEFAULT_SLURM_CONF",
    "DEFAULT_SLURM_CONF_MAIN",
    "submitit_delayed_launcher",
]
