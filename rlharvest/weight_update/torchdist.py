"""Weight sync to torch.distributed nodes: thin layers over ``transport.torchdist_weights``."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDictBase

from ..transport.torchdist_weights import DistWeightReceiver, DistWeightSender, NodeGroupLinks, NodeWeightLinks
from .schemes import WeightSyncScheme
from .strategy import weights_of
from .updaters import RemoteWorkerWeightUpdater

__all__ = ["DistributedWeightSyncScheme", "DistributedWeightUpdater"]


class DistributedWeightSyncScheme(WeightSyncScheme):
    """Weights sent point-to-point over the collector's process group, acknowledged with versions.

    Args:
        backend: the process group's backend (informational: the collector's group is used).
        sync: ``send`` waits for every targeted node's acknowledgement.
        timeout: seconds to wait for acknowledgements (dead nodes are detected much sooner).
        relay: with two or more remote hosts, send each update to one host only and let the hosts
            forward it to each other (docs/weights.md, "A relay between hosts"): ~1x the weights out
            of the learner whatever the number of hosts, and behind network-speed uplinks about the
            latency of an update to one host, at the cost of CPU on the hosts (docs/performance-at-scale.md).
            On by default (it takes effect only with two or more remote hosts); ``False`` sends each
            remote host its own copy and opens no relay port on the nodes.

    ``init_on_sender`` takes ``model_id``, ``num_workers``, ``context`` (the collector: its
    ``tcp_port`` + 2 is the weight channel's port) and optionally ``model`` or ``weights``.

    Example:
        >>> collector = DistributedCollector([make_env] * 2, policy, frames_per_batch=100,   # doctest: +SKIP
        ...     launcher="mp", weight_sync_schemes={"policy": DistributedWeightSyncScheme()})
    """

    needs_workers = True

    def __init__(self, backend: str = "gloo", sync: bool = True, timeout: float = 3600.0, relay: bool = True) -> None:
        super().__init__(sync=sync, timeout=timeout)
        if not isinstance(relay, bool):
            raise ValueError(f"relay must be True or False, got {relay!r}.")
        self.backend = backend
        self.relay = relay
        self._explicit_weights: Any = None

    def init_on_sender(self, *, model_id: str = "policy", num_workers: int | None = None, context=None,
                       model=None, weights=None, **kwargs) -> None:
        """Raises:
            RuntimeError: for arguments this scheme does not take.
            ValueError: without a collector context.
        """
        if self.initialized_on_sender:
            return super().init_on_sender(model_id=model_id, context=context)  # learns its collector
        if kwargs:
            raise RuntimeError(f"DistributedWeightSyncScheme.init_on_sender got unexpected arguments {sorted(kwargs)}")
        if context is None:
            raise ValueError("DistributedWeightSyncScheme needs the collector as context (its process group and port).")
        self._explicit_weights = weights
        super().init_on_sender(model_id=model_id, context=context, model=model, num_workers=num_workers)

    def _make_sender(self, links: NodeWeightLinks | None, **kwargs) -> DistWeightSender:
        if not isinstance(links, NodeWeightLinks):
            raise ValueError("DistributedWeightSyncScheme needs a DistributedCollector as context (its nodes' "
                             f"process group and port), got {type(links).__name__}.")
        return DistWeightSender(self._num_workers, host=links.host, bind_host=links.bind_host, port=links.port,
                                peer=links.peer, liveness=links.liveness, user_timeout=links.user_timeout,
                                handshake_timeout=links.handshake_timeout, relay_silence=links.relay_silence,
                                relay=self.relay, authkey=links.authkey)

    def _initial_payload(self, weights: Any):
        if weights is not None:
            return self.prepare_weights(weights, self._model_id, self._strategy, self.context)
        if self._explicit_weights is not None:
            return weights_of(self._explicit_weights)
        model = self.model
        return weights_of(model) if model is not None and _has_tensors(model) else None

    def init_on_receiver(self, *, model_id: str, context=None, worker_idx: int | None = None, model=None,
                         **kwargs) -> None:
        """Raises:
            ValueError: without a context or a model.
            RuntimeError: without a worker index, or if the sender was never initialised.
        """
        if context is None and model is None:
            raise ValueError("DistributedWeightSyncScheme needs a context (the node's collector) or a model.")
        super().init_on_receiver(model_id=model_id, context=context, worker_idx=worker_idx, model=model, **kwargs)

    def _make_receiver(self, links: NodeGroupLinks | None = None) -> DistWeightReceiver:
        info = self._connection_info
        if info is None:
            raise RuntimeError("This scheme was never initialised as a sender: no weight channel to connect to.")
        if self._worker_idx is None:
            raise RuntimeError("A DistributedWeightSyncScheme receiver needs its worker index (rank - 1).")
        return DistWeightReceiver(info, self._worker_idx, links)


def _has_tensors(model) -> bool:
    if isinstance(model, torch.nn.Module):
        return any(True for _ in model.parameters()) or any(True for _ in model.buffers())
    return True


class DistributedWeightUpdater(RemoteWorkerWeightUpdater):
    """Legacy updater of a DistributedCollector: pushes weights to nodes (0-based node ids, unlike
    TorchRL's 1-based ranks: docs/torchrl-compatibility.md).

    Args:
        store: accepted for compatibility (rlharvest talks to nodes over its command channels).
        policy_weights: the weights pushed when none are given.
        num_workers: number of nodes.
        sync: wait for each node's acknowledgement.
    """

    noun = "node"

    def __init__(self, store=None, policy_weights: TensorDictBase | None = None, num_workers: int = 1,
                 sync: bool = True) -> None:
        self.store = store
        self.policy_weights = policy_weights
        self.num_workers = num_workers
        self.sync = sync

    @property
    def wait(self) -> bool:
        return self.sync
