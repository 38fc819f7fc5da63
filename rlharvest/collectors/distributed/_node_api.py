"""What every public collector with one node (or actor) per env constructor shows besides TorchRL's
collector methods: its options as attributes, the join command, the legacy updater's push. Written once,
given to each face as class attributes (no base class between the faces and TorchRL's tree)."""

from __future__ import annotations

from typing import Any

from tensordict import TensorDict, TensorDictBase

from ..engine.extras import ExternalJoins
from ..multi import MultiAsyncCollector, MultiSyncCollector
from ..single import Collector

__all__ = ["NODE_CLASSES", "node_api"]

#: what ``collector_class="single"``, ``"sync"`` and ``"async"`` stand for
NODE_CLASSES = {"single": Collector, "sync": MultiSyncCollector, "async": MultiAsyncCollector}


def option(name: str, doc: str = "") -> property:
    """A read-only attribute showing the collector's option ``name``."""
    return property(lambda self: getattr(self._engine.options, name), doc=doc or f"The ``{name}`` given.")


def _policy_weights(self) -> TensorDictBase | None:
    """The weights of the policy this collector holds (TorchRL's ``policy_weights``), or None."""
    import torch

    policy = self._engine.options.policy
    return TensorDict.from_module(policy).data if isinstance(policy, torch.nn.Module) else None


policy_weights = property(_policy_weights)


def _collector_kwargs(self) -> list[dict]:
    """Each node's collector arguments as the user gave them."""
    return [dict(entry) for entry in self._engine.options.collector_kwargs]


collector_kwargs = property(_collector_kwargs)


def _policy_factory(self) -> list | None:
    factories = self._engine.options.policy_factories
    return list(factories) if factories is not None else None


policy_factory = property(_policy_factory)


def _tcp_port(self) -> str | None:
    network = getattr(self._engine.options, "network", None)
    return str(network.tcp_port) if network is not None else None


tcp_port = property(_tcp_port)


def join_command(self) -> list[str]:
    """The argv of a node that joins this collector from any host (``launcher="external"``).

    ``[sys.executable, "-m", "rlharvest", "node", "--join", "HOST:PORT", "--key-file", PATH]``: PATH is a
    file (mode 0600) holding this collector's key, written at construction and removed at shutdown; copy
    it to the node's host (same path, or change the argument), never onto a command line. A node that
    joins takes the first empty slot (docs/elastic.md).

    Raises:
        RuntimeError: when this collector's launcher is not ``"external"``, or after shutdown.
    """
    joins = self._engine.extra(ExternalJoins)
    if joins is None:
        launcher = getattr(self._engine.options, "launcher", None)
        raise RuntimeError(f"join_command() needs launcher='external' (nodes that join from anywhere); this "
                           f"collector's launcher is {launcher!r}, which starts its nodes itself.")
    return joins.command()


def push_legacy_weights(self, worker: int, weights: Any, wait: bool = True) -> None:
    """Send ``weights`` to node ``worker`` for the legacy ``DistributedWeightUpdater`` (waits for the
    acknowledgement when ``wait``; the scheme's own ``sync`` stays as it was for later sends)."""
    scheme = (self._engine.weights.sender_schemes or {}).get("policy")
    if scheme is not None:
        scheme.send(weights=weights, worker_ids=[worker], wait=wait)


#: the attributes every face with nodes (or actors) shows, by name
_COMMON = {
    "policy": option("policy", "The policy run on every node (actor), and the main-side source of weights."),
    "policy_factory": policy_factory,
    "policy_weights": policy_weights,
    "collector_class": option("collector_class", "The collector each node (actor) runs."),
    "collector_kwargs": collector_kwargs,
    "num_workers_per_collector": option("num_workers_per_collector"),
    "update_after_each_batch": option("update_after_each_batch"),
    "max_weight_update_interval": option("max_weight_update_interval"),
    "push_legacy_weights": push_legacy_weights,
}

#: those some faces show besides, as they name them
_MORE = {
    "update_interval": option("update_interval"),
    "launcher": option("launcher", "How nodes are started (``\"mp\"``, ``\"submitit\"``, ...)."),
    "backend": option("backend", "The process groups' backend (``\"gloo\"``, ...)."),
    "slurm_kwargs": option("slurm_kwargs"),
    "tcp_port": tcp_port,
    "join_command": join_command,
    "visible_devices": option("visible_devices"),
    "tensorpipe_options": option("tensorpipe_options"),
}


def node_api(*more: str):
    """Class decorator of a face with one node (or actor) per env constructor: it gets the attributes
    every such face shows (its options, ``policy_weights``, the legacy updater's push) and those of
    ``more`` it names (``"launcher"``, ``"join_command"``, ...).

    Raises:
        ValueError: for a name in ``more`` that is not one of them.
    """
    unknown = sorted(set(more) - set(_MORE))
    if unknown:
        raise ValueError(f"node_api: no attribute {unknown}; known: {sorted(_MORE)}.")

    def decorate(cls: type) -> type:
        for name in (*_COMMON, *more):
            if name not in vars(cls):
                setattr(cls, name, {**_COMMON, **_MORE}[name])
        return cls

    return decorate
