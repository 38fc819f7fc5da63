"""Multi-node collectors: DistributedCollector (torch.distributed) and RPCCollector (torch RPC)."""

from ..._utils import deprecated_alias
from ...weight_update.distributed import DistributedWeightUpdater
from .generic import DistributedCollector
from .launchers import DEFAULT_SLURM_CONF, DEFAULT_SLURM_CONF_MAIN, submitit_delayed_launcher

DistributedDataCollector = deprecated_alias(DistributedCollector, "DistributedDataCollector")

__all__ = [
    "DistributedCollector",
    "DistributedDataCollector",
    "DistributedWeightUpdater",
    "DEFAULT_SLURM_CONF",
    "DEFAULT_SLURM_CONF_MAIN",
    "submitit_delayed_launcher",
]
