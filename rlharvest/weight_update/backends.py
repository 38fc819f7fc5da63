"""The weight-sync scheme of each deployment backend, by name (``WeightSyncScheme.from_backend``).

Classes are written as import paths: a scheme's module (and its backend's library) is imported only
when that scheme is asked for.
"""

from __future__ import annotations

from .._utils import import_object

__all__ = ["BACKEND_SCHEMES", "BACKEND_ALIASES", "scheme_class"]

#: ``from_backend`` names: the scheme that moves weights over each deployment backend
BACKEND_SCHEMES = {
    "none": "rlharvest.weight_update.schemes:NoWeightSyncScheme",
    "shared": "rlharvest.weight_update.shared_memory:SharedMemWeightSyncScheme",
    "process": "rlharvest.weight_update.shared_memory:MultiProcessWeightSyncScheme",
    "distributed": "rlharvest.weight_update.torchdist:DistributedWeightSyncScheme",
    "rpc": "rlharvest.weight_update.rpc:RPCWeightSyncScheme",
    "ray": "rlharvest.weight_update.ray:RayWeightSyncScheme",
}
#: other names of the first three (TorchRL's service-backend names)
BACKEND_ALIASES = {"direct": "none", "thread": "shared", "multiprocessing": "process"}


def scheme_class(backend: str) -> type:
    """The scheme class of ``backend`` (a name of ``BACKEND_SCHEMES`` or ``BACKEND_ALIASES``).

    Raises:
        ValueError: for another backend name.
    """
    name = BACKEND_ALIASES.get(backend, backend) if isinstance(backend, str) else backend
    if not isinstance(name, str) or name not in BACKEND_SCHEMES:
        raise ValueError(f"backend must be one of {sorted(set(BACKEND_SCHEMES) | set(BACKEND_ALIASES))}, "
                         f"got {backend!r}")
    return import_object(BACKEND_SCHEMES[name])
