"""Weight sync to Ray actors: RayWeightSyncScheme (RayCollector's default) and the legacy
RayWeightUpdater, both over ``transport.ray_weights`` (one copy per update: into shared memory for
actors on the driver's node, into the object store for the others)."""

from __future__ import annotations

from typing import Any

from ..transport.ray_weights import RayWeightLinks, RayWeightReceiver, RayWeightSender, WeightInboxes
from .schemes import WeightSyncScheme
from .updaters import RemoteWorkerWeightUpdater

__all__ = ["RayWeightSyncScheme", "RayWeightUpdater"]


class RayWeightSyncScheme(WeightSyncScheme):
    """An update is copied once, into a shared-memory buffer that actors on the driver's node swap
    in (told, and acknowledging, through a Unix socket rather than Ray calls), and (when some
    target runs elsewhere) into Ray's object store, from which the other actors fetch it; every
    targeted actor applies it between two env steps, passes it on to its own workers (cascading),
    and acknowledges the version (docs/ray.md, "Weights").

    Args:
        strategy: ``"tensordict"`` (default) or ``"state_dict"``.
        backend: accepted for TorchRL compatibility (the weights travel through Ray's object store,
            not a process group).
        sync: whether ``send`` waits for every targeted actor's acknowledgement.
        timeout: seconds to wait for acknowledgements (and for a new actor's initial weights).
        use_shared_memory: whether actors on the driver's Ray node get updates through shared
            memory and the direct channel (default); False sends every update through the object
            store, with an actor call per actor.

    ``init_on_sender`` needs ``context``: a RayCollector (its actors are the transport).

    Example:
        >>> collector = RayCollector([make_env] * 2, policy, frames_per_batch=200,            # doctest: +SKIP
        ...                          weight_sync_schemes={"policy": RayWeightSyncScheme()})
        >>> collector.update_policy_weights_(worker_ids=[1])                                  # doctest: +SKIP
    """

    needs_workers = True

    def __init__(self, strategy: str = "tensordict", backend: str | None = "gloo", sync: bool = True,
                 timeout: float = 120.0, use_shared_memory: bool = True) -> None:
        super().__init__(strategy=strategy, sync=sync, timeout=timeout)
        self.backend = backend
        self.use_shared_memory = bool(use_shared_memory)

    def _make_sender(self, links: RayWeightLinks | None, **kwargs) -> RayWeightSender:
        if not isinstance(links, RayWeightLinks):
            raise RuntimeError(f"RayWeightSyncScheme needs a RayCollector context, got {type(links).__name__}.")
        sender = RayWeightSender(links.handles, self._model_id, use_shared_memory=self.use_shared_memory)
        sender.timeout = self.timeout
        return sender

    def _make_receiver(self, links: WeightInboxes | None = None) -> RayWeightReceiver:
        if not isinstance(links, WeightInboxes):
            raise RuntimeError("A RayWeightSyncScheme receiver runs inside a Ray actor of a RayCollector.")
        return RayWeightReceiver(links.get(self._model_id))


class RayWeightUpdater(RemoteWorkerWeightUpdater):
    """Legacy updater of a RayCollector: puts the weights in the object store once and has every
    targeted actor apply them (0-based actor indices).

    Args:
        policy_weights: the weights pushed when none are given.
        remote_collectors: the collector's actors (``collector.remote_collectors``); their number
            is what this updater serves.
        max_interval: skip an actor updated fewer than this many pushes ago (0: never skip).

    Example:
        >>> collector = RayCollector([make_env] * 2, policy, frames_per_batch=200,            # doctest: +SKIP
        ...     weight_updater=RayWeightUpdater(policy_weights, remote_collectors=[None] * 2))
    """

    noun = "actor"

    def __init__(self, policy_weights: Any = None, remote_collectors: list | None = None, max_interval: int = 0) -> None:
        self.policy_weights = policy_weights
        self.remote_collectors = list(remote_collectors or [])
        self.max_interval = int(max_interval)
        self._since_update: dict[int, int] = {}

    @property
    def num_workers(self) -> int:
        collector = self.collector
        return collector.num_workers if collector is not None else len(self.remote_collectors)

    def _skip_update(self, worker_id: int) -> bool:
        if self.max_interval <= 0:
            return False
        count = self._since_update.get(worker_id, self.max_interval)
        if count < self.max_interval:
            self._since_update[worker_id] = count + 1
            return True
        self._since_update[worker_id] = 0
        return False

