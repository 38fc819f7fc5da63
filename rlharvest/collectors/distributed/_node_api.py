"""What every public collector with one node (or actor) per env constructor shows besides TorchRL's
collector methods: its options as attributes, the join command, the legacy updater's push. Written once
here and named in each face's class body (``policy = _node_api.policy``), so that no base class stands
between the faces and TorchRL's tree (docs/architecture.md)."""

from __future__ import annotations

from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase

from ..base import BaseCollector
from ..engine.engine import CollectionEngine
from ..engine.extras import ExternalJoins
from ..multi import MultiAsyncCollector, MultiSyncCollector
from ..options.nodes import NodeOptions
from ..single import Collector

__all__ = ["NODE_CLASSES", "option"]

#: what ``collector_class="single"``, ``"sync"`` and ``"async"`` stand for
NODE_CLASSES = {"single": Collector, "sync": MultiSyncCollector, "async": MultiAsyncCollector}


def _options(collector: BaseCollector) -> NodeOptions:
    """The node collector's options now (they grow with ``add_collectors``)."""
    return cast(NodeOptions, cast(CollectionEngine, collector._engine).options)


def option(name: str, doc: str = "") -> property:
    """A read-only attribute showing the collector's option ``name``."""
    return property(lambda self: getattr(_options(self), name), doc=doc or f"The ``{name}`` given.")


def _policy_weights(self: BaseCollector) -> TensorDictBase | None:
    """The weights of the policy this collector holds (TorchRL's ``policy_weights``), or None."""
    policy = _options(self).policy
    return TensorDict.from_module(policy).data if isinstance(policy, torch.nn.Module) else None


def _collector_kwargs(self: BaseCollector) -> list[dict]:
    """Each node's collector arguments as the user gave them."""
    return [dict(entry) for entry in _options(self).collector_kwargs]


def _policy_factory(self: BaseCollector) -> list | None:
    factories = _options(self).policy_factories
    return list(factories) if factories is not None else None


def _tcp_port(self: BaseCollector) -> str | None:
    network = getattr(_options(self), "network", None)
    return str(network.tcp_port) if network is not None else None


def join_command(self: BaseCollector) -> list[str]:
    """The argv of a node that joins this collector from any host (``launcher="external"``).

    ``[sys.executable, "-m", "rlharvest", "node", "--join", "HOST:PORT", "--key-file", PATH]``: PATH is a
    file (mode 0600) holding this collector's key, written at construction and removed at shutdown; copy
    it to the node's host (same path, or change the argument), never onto a command line. A node that
    joins takes the first empty slot (docs/elastic.md).

    Raises:
        RuntimeError: when this collector's launcher is not ``"external"``, or after shutdown.
    """
    engine = cast(CollectionEngine, self._engine)
    joins = engine.extra(ExternalJoins)
    if joins is None:
        launcher = getattr(engine.options, "launcher", None)
        raise RuntimeError(f"join_command() needs launcher='external' (nodes that join from anywhere); this "
                           f"collector's launcher is {launcher!r}, which starts its nodes itself.")
    return joins.command()


def push_legacy_weights(self: BaseCollector, worker: int, weights: Any, wait: bool = True) -> None:
    """Send ``weights`` to node ``worker`` for the legacy ``DistributedWeightUpdater`` (waits for the
    acknowledgement when ``wait``; the scheme's own ``sync`` stays as it was for later sends)."""
    scheme = (cast(CollectionEngine, self._engine).weights.sender_schemes or {}).get("policy")
    if scheme is not None:
        scheme.send(weights=weights, worker_ids=[worker], wait=wait)


# the attributes every face with nodes (or actors) shows
policy = option("policy", "The policy run on every node (actor), and the main-side source of weights.")
policy_factory = property(_policy_factory)
policy_weights = property(_policy_weights)
collector_class = option("collector_class", "The collector each node (actor) runs.")
collector_kwargs = property(_collector_kwargs)
num_workers_per_collector = option("num_workers_per_collector")
update_after_each_batch = option("update_after_each_batch")
max_weight_update_interval = option("max_weight_update_interval")

# those some faces show besides
update_interval = option("update_interval")
launcher = option("launcher", "How nodes are started (``\"mp\"``, ``\"submitit\"``, ...).")
backend = option("backend", "The process groups' backend (``\"gloo\"``, ...).")
slurm_kwargs = option("slurm_kwargs")
tcp_port = property(_tcp_port)
visible_devices = option("visible_devices")
tensorpipe_options = option("tensorpipe_options")
