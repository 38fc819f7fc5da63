"""The worker side of every backend: THE worker loop (``loop.py``) and the entry points that run it
in a node (``nodes.py``: a torch.distributed node's main, the functions an RPC node serves).

Backends in ``rlharvest.transport`` get these passed in as their targets; they never import them.
"""

from ..protocol import FREE_BATCH, READY, Command, Message, Reply, UnknownCommandError, WorkerSpec
from .contract import ParentDuties, WorkerCollector, WorkerWeights
from .loop import Worker, run_worker

__all__ = [
    "Command",
    "Message",
    "Reply",
    "WorkerSpec",
    "FREE_BATCH",
    "READY",
    "UnknownCommandError",
    "ParentDuties",
    "Worker",
    "WorkerCollector",
    "WorkerWeights",
    "run_worker",
]
