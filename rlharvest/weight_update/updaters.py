"""The legacy weight-updater interface: ``WeightUpdaterBase`` and its classes (docs/weights.md).

A collector is in *legacy mode* when it has a weight updater: ``update_policy_weights_`` then calls
``updater(policy_or_weights=..., worker_ids=...)``, i.e. :meth:`WeightUpdaterBase.push_weights`:

1. resolve the weights (``None`` -> ``_get_server_weights()``),
2. ``_maybe_map_weights``,
3. deliver to every targeted worker with ``_sync_weights_with_worker``,
4. run the post-hooks.

Subclasses that talk to workers deliver through the same transports as the weight-sync schemes.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Protocol

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase

from .strategy import copy_weights_, weights_of

__all__ = [
    "WeightUpdaterBase",
    "VanillaWeightUpdater",
    "MultiProcessedWeightUpdater",
    "RemoteModuleWeightUpdater",
]


class UpdaterHost(Protocol):
    """What a legacy updater is registered with: a collector. Every updater bumps its version; the kinds
    that need more (a worker-process collector's staged weights, a node collector's push) look for it
    by name."""

    def increment_version(self) -> None: ...


class WeightUpdaterBase:
    """Base class of the legacy weight updaters.

    Life cycle: created by the user (instance or zero-argument constructor) -> attached to a collector,
    which calls :meth:`register_collector` -> optionally :meth:`init` through
    ``collector.init_updater`` -> called by ``update_policy_weights_`` (``__call__`` is
    :meth:`push_weights`) -> post-hooks.

    Example:
        >>> class Recorder(WeightUpdaterBase):
        ...     def _sync_weights_with_worker(self, *, worker_id=None, server_weights):
        ...         self.last = server_weights
        >>> updater = Recorder()
        >>> updater.push_weights({"w": torch.ones(1)})
        >>> updater.last["w"]
        tensor([1.])
    """

    _collector_ref: weakref.ref | None = None
    _post_hooks: list[Callable[[], None]] | None = None

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.__module__.startswith("rlharvest."):
            warnings.warn(
                "WeightUpdaterBase is the legacy weight-update API; prefer weight_sync_schemes "
                "(rlharvest.weight_update.WeightSyncScheme).",
                DeprecationWarning,
                stacklevel=2,
            )

    # ------------------------------------------------------------------ collector registration
    @classmethod
    def from_policy(cls, policy: TensorDictModuleBase) -> WeightUpdaterBase | None:
        """Build an updater from a policy; the base class cannot, and returns None."""
        return None

    def register_collector(self, collector: UpdaterHost) -> None:
        """Register ``collector``. Once registered, another live collector is refused.

        Raises:
            RuntimeError: when a different collector is already registered.
        """
        current = self.collector
        if current is collector:
            return
        if current is not None:
            raise RuntimeError(
                f"{type(self).__name__} is already registered with a collector "
                f"({type(current).__name__}); an updater serves one collector only."
            )
        self._collector_ref = weakref.ref(collector)

    @property
    def collector(self):
        """The registered collector, or None (never set, or garbage-collected)."""
        return self._collector_ref() if self._collector_ref is not None else None

    @property
    def collectors(self) -> list | None:
        collector = self.collector
        return [collector] if collector is not None else None

    def init(self, *args, **kwargs) -> None:
        """Initialisation hook (called through ``collector.init_updater``); no-op by default."""
        return None

    # ------------------------------------------------------------------ hooks
    @property
    def post_hooks(self) -> list[Callable[[], None]]:
        """The live list of post-hooks, run after every successful push in registration order."""
        if self._post_hooks is None:
            self._post_hooks = []
        return self._post_hooks

    def register_post_hook(self, hook: Callable[[], None]) -> None:
        """Run ``hook()`` after every successful :meth:`push_weights`."""
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        self.post_hooks.append(hook)

    def _run_post_hooks(self) -> None:
        for hook in self.post_hooks:
            hook()

    def increment_version(self) -> None:
        """Bump the policy version of the registered collector (no-op without one)."""
        collector = self.collector
        if collector is not None:
            collector.increment_version()

    # ------------------------------------------------------------------ pushing
    def _get_server_weights(self) -> Any:
        """The weights to push when none are given. Base: None."""
        return None

    def _maybe_map_weights(self, server_weights: Any) -> Any:
        """Map weights before delivery. Base: a TensorDict module becomes its detached parameters.

        Raises:
            TypeError: for None, a plain ``nn.Module`` or any other type.
        """
        if isinstance(server_weights, TensorDictModuleBase):
            return TensorDict.from_module(server_weights).detach()
        if isinstance(server_weights, (TensorDictBase, dict)):
            return server_weights
        raise TypeError(
            f"Cannot map weights of type {type(server_weights).__name__}; pass a TensorDict, a dict or a "
            "TensorDictModule, or override _get_server_weights/_maybe_map_weights."
        )

    def _sync_weights_with_worker(self, *, worker_id: int | torch.device | None = None, server_weights: Any) -> Any:
        """Deliver ``server_weights`` to one worker (or the only one when ``worker_id`` is None)."""
        raise NotImplementedError

    def all_worker_ids(self) -> list[int] | list[torch.device] | None:
        """Every worker id, or None for a single implicit worker."""
        return None

    def _skip_update(self, worker_id) -> bool:
        return False

    def push_weights(self, policy_or_weights: Any = None, worker_ids=None) -> None:
        """Push weights to all, one or a list of workers, then run the post-hooks.

        Args:
            policy_or_weights: a TensorDict module, a TensorDict or a dict of weights; None fetches
                them with ``_get_server_weights()``.
            worker_ids: a worker id, a list of them, or None for all.
        """
        weights = self._get_server_weights() if policy_or_weights is None else policy_or_weights
        weights = self._maybe_map_weights(weights)
        if isinstance(worker_ids, (int, torch.device)):
            worker_ids = [worker_ids]
        elif worker_ids is None:
            worker_ids = self.all_worker_ids()
        if worker_ids is None:
            self._sync_weights_with_worker(server_weights=weights)
        else:
            for worker_id in worker_ids:
                if not self._skip_update(worker_id):
                    self._sync_weights_with_worker(worker_id=worker_id, server_weights=weights)
        self._run_post_hooks()

    def __call__(self, policy_or_weights: Any = None, worker_ids=None) -> None:
        return self.push_weights(policy_or_weights=policy_or_weights, worker_ids=worker_ids)

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_collector_ref", None)
        return state


class VanillaWeightUpdater(WeightUpdaterBase):
    """In-place updates of a local policy's weights.

    Args:
        weight_getter: zero-argument callable returning the server weights (optional).
        policy_weights: the TensorDict of weights to update in place.

    Example:
        >>> policy = torch.nn.Linear(1, 1)
        >>> updater = VanillaWeightUpdater.from_policy(policy)
        >>> updater.push_weights({"weight": torch.zeros(1, 1), "bias": torch.zeros(1)})
        >>> float(policy.weight)
        0.0
    """

    def __init__(self, *, weight_getter: Callable[[], Any] | None = None, policy_weights: TensorDictBase) -> None:
        self.weight_getter = weight_getter
        self.policy_weights = policy_weights

    @classmethod
    def from_policy(cls, policy) -> VanillaWeightUpdater:
        return cls(policy_weights=TensorDict.from_module(policy))

    def _get_server_weights(self) -> Any:
        return self.weight_getter() if self.weight_getter is not None else None

    def _maybe_map_weights(self, server_weights: Any) -> Any:
        return server_weights

    def _sync_weights_with_worker(self, *, worker_id=None, server_weights: Any) -> None:
        if server_weights is None:
            return
        copy_weights_(self.policy_weights, weights_of(server_weights))

    def all_worker_ids(self) -> None:
        return None


class MultiProcessedWeightUpdater(WeightUpdaterBase):
    """Updates the shared-memory weights of each policy device of a multi-process collector.

    Worker ids are devices. After the copy, the registered collector tells the workers on that
    device to take the new weights, and waits for their acknowledgement.

    Args:
        get_server_weights: zero-argument callable returning the server weights (or None).
        policy_weights: ``{device: TensorDict}`` of the shared weights.
    """

    def __init__(self, *, get_server_weights: Callable[[], Any] | None = None, policy_weights: dict | None = None) -> None:
        self.get_server_weights = get_server_weights
        self.policy_weights = policy_weights

    def register_collector(self, collector: UpdaterHost) -> None:
        super().register_collector(collector)
        if self.policy_weights is None:
            self.policy_weights = dict(getattr(collector, "policy_weights", {}) or {})

    def _get_server_weights(self) -> Any:
        return self.get_server_weights() if self.get_server_weights is not None else None

    def _maybe_map_weights(self, server_weights: Any) -> Any:
        return server_weights

    def all_worker_ids(self) -> list[torch.device]:
        return list(self.policy_weights)

    def _sync_weights_with_worker(self, *, worker_id=None, server_weights: Any) -> None:
        if server_weights is None:
            return
        device = torch.device(worker_id) if worker_id is not None else next(iter(self.policy_weights))
        if device not in self.policy_weights:
            raise ValueError(f"Worker device {device} not registered; known: {list(self.policy_weights)}")
        copy_weights_(self.policy_weights[device], weights_of(server_weights))
        collector = self.collector
        if collector is not None and hasattr(collector, "legacy_weights_written"):
            collector.legacy_weights_written(device)


class RemoteModuleWeightUpdater(WeightUpdaterBase):
    """For policies that live behind a remote module: explicit weights are required; nothing is done."""

    def push_weights(self, policy_or_weights: Any = None, worker_ids=None) -> None:
        if policy_or_weights is None:
            raise RuntimeError("RemoteModuleWeightUpdater needs explicit weights.")
        self._run_post_hooks()

    def _sync_weights_with_worker(self, *, worker_id=None, server_weights: Any) -> None:
        return None


class RemoteWorkerWeightUpdater(WeightUpdaterBase):
    """Shared part of the legacy updaters whose collector pushes weights to remote workers (nodes,
    actors) by 0-based index: subclasses set ``num_workers``, :attr:`noun` and :attr:`wait`."""

    #: how errors name a worker
    noun = "worker"
    #: whether a push waits for the worker's acknowledgement
    wait = True

    def _get_server_weights(self):
        return self.policy_weights

    def _maybe_map_weights(self, server_weights):
        return weights_of(server_weights) if server_weights is not None else None

    def all_worker_ids(self) -> list[int]:
        return list(range(self.num_workers))

    def _sync_weights_with_worker(self, *, worker_id=None, server_weights) -> None:
        if server_weights is None:
            return
        collector = self.collector
        if collector is None:
            raise RuntimeError(f"{type(self).__name__} is not registered with a collector.")
        if isinstance(worker_id, bool) or not isinstance(worker_id, int) or not 0 <= worker_id < self.num_workers:
            raise ValueError(f"Worker {worker_id} not registered (0-based {self.noun} indices "
                             f"0..{self.num_workers - 1}).")
        collector.push_legacy_weights(worker_id, server_weights, wait=self.wait)

