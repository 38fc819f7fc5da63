"""Weight sync to RPC nodes: the RPCWeightSyncScheme (default of RPCCollector) and TorchRL's
legacy RPCWeightUpdater, both over ``transport.rpc``."""

from __future__ import annotations

from typing import Any

from tensordict import TensorDictBase

from ..transport.rpc_weights import RPCWeightLinks, RPCWeightReceiver, RPCWeightSender
from .schemes import WeightSyncScheme
from .strategy import weights_of
from .updaters import WeightUpdaterBase

__all__ = ["RPCWeightSyncScheme", "RPCWeightUpdater"]


class RPCWeightSyncScheme(WeightSyncScheme):
    """Weights travel inside an RPC to each node, which applies them (between two env steps of its
    rollout), cascades them to its own workers, and returns the version as acknowledgement.

    ``init_on_sender`` needs ``context``: an RPCCollector (its node handles are the transport).

    Example:
        >>> collector = RPCCollector([make_env] * 2, policy, frames_per_batch=100, launcher="mp",  # doctest: +SKIP
        ...                          weight_sync_schemes={"policy": RPCWeightSyncScheme()})
    """

    needs_workers = True

    def __init__(self, strategy: str = "tensordict", sync: bool = True, timeout: float = 120.0) -> None:
        super().__init__(strategy=strategy, sync=sync, timeout=timeout)

    def _make_sender(self, links: RPCWeightLinks | None, **kwargs) -> RPCWeightSender:
        if not isinstance(links, RPCWeightLinks):
            raise RuntimeError(f"RPCWeightSyncScheme needs an RPCCollector context, got {type(links).__name__}.")
        return RPCWeightSender(links.handles, self._model_id, links.apply_weights)

    def _make_receiver(self, links=None) -> RPCWeightReceiver:
        return RPCWeightReceiver()

    def apply_pushed(self, version: int, weights: TensorDictBase) -> None:
        """On a node, inside the sender's RPC: swap the (exclusively owned) tensors in, cascade."""
        self.apply_weights(weights, inplace=False)
        self._version = version
        self._cascade(weights)


class RPCWeightUpdater(WeightUpdaterBase):
    """Pushes weights to RPC nodes by calling their collectors' ``update_policy_weights_`` remotely.

    Args:
        collector_infos: RPC worker infos of the nodes.
        collector_class: the collector class run on the nodes.
        collector_rrefs: remote references to the node collectors.
        policy_weights: the weights pushed when none are given.
        num_workers: number of nodes.

    Attach it to a running collector to switch it to this updater:

    Example:
        >>> collector.weight_updater = RPCWeightUpdater(collector.collector_infos,       # doctest: +SKIP
        ...     collector.collector_class, collector.collector_rrefs, collector.policy_weights,
        ...     collector.num_workers)
        >>> collector.update_policy_weights_(worker_ids=[1])                            # doctest: +SKIP
    """

    def __init__(self, collector_infos, collector_class, collector_rrefs, policy_weights: TensorDictBase,
                 num_workers: int) -> None:
        self.collector_infos = collector_infos
        self.collector_class = collector_class
        self.collector_rrefs = collector_rrefs
        self.policy_weights = policy_weights
        self.num_workers = num_workers

    def push_weights(self, weights: Any = None, worker_ids=None, **kwargs) -> None:
        """Call ``update_policy_weights_(weights)`` on all, one, or the listed nodes.

        Args:
            weights: the weights (also accepted as ``policy_or_weights=``); default ``policy_weights``.
            worker_ids: None for all nodes, an int, or a list of ints.
            wait: (keyword) False to return without waiting for the remote calls.
        """
        wait = kwargs.pop("wait", True)
        given = kwargs.pop("policy_or_weights", None)
        if kwargs:
            raise TypeError(f"push_weights() got unexpected keyword argument(s) {sorted(kwargs)}")
        payload = weights if weights is not None else given if given is not None else self.policy_weights
        if isinstance(payload, (dict, TensorDictBase)) or hasattr(payload, "parameters"):
            payload = weights_of(payload)
        if worker_ids is None:
            targets = list(range(self.num_workers))
        elif isinstance(worker_ids, int):
            targets = [worker_ids]
        else:
            targets = list(worker_ids)
        futures = [self.collector_rrefs[i].rpc_async().update_policy_weights_(payload) for i in targets]
        if wait:
            for future in futures:
                future.wait()
        self._run_post_hooks()

    update_weights = push_weights

    def __call__(self, policy_or_weights: Any = None, worker_ids=None) -> None:
        return self.push_weights(policy_or_weights, worker_ids=worker_ids)

    def all_worker_ids(self) -> list[int]:
        return list(range(self.num_workers))

    def _sync_weights_with_worker(self, *, worker_id=None, server_weights) -> None:
        raise NotImplementedError("RPCWeightUpdater pushes through push_weights(); per-worker sync is not implemented.")

    def _get_server_weights(self):
        raise NotImplementedError("RPCWeightUpdater has no server weights source (pass weights to push_weights).")

    def _maybe_map_weights(self, server_weights):
        raise NotImplementedError("RPCWeightUpdater does not map weights.")
