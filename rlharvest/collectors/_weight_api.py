"""The weight-facing half of every collector: ``update_policy_weights_``, ``receive_weights``,
``register_scheme_receiver``, ``init_updater``, the legacy ``weight_updater`` and policy versions.

Resolution of ``update_policy_weights_`` (docs/weights.md) happens here once for every collector; what
differs per collector is only how the leaf case updates the local policy (``_update_local_policy``).
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
from tensordict import TensorDictBase

from .._utils import resolve_attr_path
from ..weight_update.schemes import WeightSyncScheme
from ..weight_update.strategy import weights_of
from ..weight_update.updaters import WeightUpdaterBase
from ._progress import ProgressMeter

__all__ = ["WeightAPI", "merge_weight_arguments"]


def merge_weight_arguments(policy_or_weights: Any, weights: Any, policy: Any, kwargs: dict) -> Any:
    """Merge the three aliases of the weights argument (at most one may be given)."""
    if "policy_weights" in kwargs:
        warnings.warn("policy_weights= is deprecated, pass the weights positionally.", DeprecationWarning, stacklevel=3)
        if policy_or_weights is not None:
            raise ValueError("Cannot specify both 'policy_weights' and 'policy_or_weights'.")
        policy_or_weights = kwargs.pop("policy_weights")
    if kwargs:
        raise TypeError(f"update_policy_weights_() got unexpected keyword argument(s) {sorted(kwargs)}")
    if weights is not None and policy_or_weights is not None:
        raise ValueError("Cannot specify both 'weights' and 'policy_or_weights'.")
    if policy is not None and policy_or_weights is not None:
        raise ValueError("Cannot specify both 'policy' and 'policy_or_weights'.")
    if weights is not None and policy is not None:
        raise ValueError("Cannot specify both 'weights' and 'policy'.")
    for value in (policy_or_weights, weights, policy):
        if value is not None:
            return value
    return None


class WeightAPI:
    """The weight-facing half of :class:`~rlharvest.collectors.base.BaseCollector` (its base class):
    what it reads of the collector is declared here."""

    #: the collector's index inside a parent collector (None at the top level)
    worker_idx: int | None
    #: where weight-sync seconds are recorded for ``stats()``
    _progress: ProgressMeter
    _weight_updater: WeightUpdaterBase | None = None
    _weight_sync_schemes: dict[str, WeightSyncScheme] | None = None
    _receiver_schemes: dict[str, WeightSyncScheme] | None = None
    _version_tracker: Any = None
    _policy_version: int = 0

    # ------------------------------------------------------------------ legacy updater
    @property
    def weight_updater(self) -> WeightUpdaterBase | None:
        return self._weight_updater

    @weight_updater.setter
    def weight_updater(self, value) -> None:
        if value is None:
            self._weight_updater = None
            return
        if not isinstance(value, WeightUpdaterBase) and callable(value):
            value = value()
        if not isinstance(value, WeightUpdaterBase):
            raise TypeError(f"weight_updater must be a WeightUpdaterBase (or a constructor of one), got {value!r}")
        warnings.warn(
            "weight_updater is the legacy weight-update API; prefer weight_sync_schemes.", DeprecationWarning,
            stacklevel=2,
        )
        value.register_collector(self)
        if value.collector is not self:
            raise RuntimeError("Failed to register collector.")
        self._weight_updater = value

    def init_updater(self, *args, **kwargs) -> None:
        """Forward to ``weight_updater.init(*args, **kwargs)``; no-op without a legacy updater."""
        if self._weight_updater is not None:
            self._weight_updater.init(*args, **kwargs)

    # ------------------------------------------------------------------ versions
    @property
    def policy_version(self) -> int | str | None:
        """The current policy version, or None when versions are not tracked."""
        if not self._version_tracker:
            return None
        tracker = self._version_tracker
        if tracker is True:
            return self._policy_version
        return getattr(tracker, "version", self._policy_version)

    def get_policy_version(self) -> int | str | None:
        return self.policy_version

    def increment_version(self) -> None:
        """Bump the policy version.

        Raises:
            RuntimeError: when a version tracker without ``increment_version`` was given.
        """
        tracker = self._version_tracker
        if tracker not in (None, False, True):
            if not hasattr(tracker, "increment_version"):
                raise RuntimeError(f"The policy-version tracker {tracker!r} has no increment_version().")
            tracker.increment_version()
        self._policy_version += 1
        self._on_version_bump(self._policy_version)

    def _on_version_bump(self, version: int) -> None:
        """Hook: where the new version must be reflected (e.g. the rollout's per-step stamp)."""

    # ------------------------------------------------------------------ sender side
    def update_policy_weights_(
        self,
        policy_or_weights: Any = None,
        *,
        weights: Any = None,
        policy: Any = None,
        worker_ids: int | list[int] | torch.device | list[torch.device] | None = None,
        model_id: str | None = None,
        weights_dict: dict[str, Any] | None = None,
        **kwargs,
    ) -> None:
        """Bring the policy weights used for collection up to date (docs/weights.md).

        Args:
            policy_or_weights: an ``nn.Module`` / TensorDict module (its weights are read), a
                TensorDict or dict of weights, an attribute path on the collector, per-worker weights
                ``{worker_idx: weights}``, or None to re-read the main-side policy.
            weights: keyword alias for weights (exclusive with the others).
            policy: keyword alias for a module (exclusive with the others).
            worker_ids: 0-based worker index or list of them (None = all).
            model_id: which model to update (default ``"policy"``).
            weights_dict: ``{model_id: weights}`` to update several models at once.

        Raises:
            ValueError: for conflicting arguments or an unknown worker.
            KeyError: for a model id without a registered scheme.

        Example:
            >>> collector.update_policy_weights_()                       # doctest: +SKIP
            >>> collector.update_policy_weights_(weights=td, worker_ids=[1])  # doctest: +SKIP
        """
        value = merge_weight_arguments(policy_or_weights, weights, policy, kwargs)
        start = time.perf_counter()
        self._deliver_weights(value, policy_or_weights, worker_ids, model_id, weights_dict)
        self._progress.record_weight_sync(time.perf_counter() - start)  # stats(): weight_sync_s_*

    def _deliver_weights(self, value: Any, policy_or_weights: Any, worker_ids, model_id: str | None,
                         weights_dict: dict | None) -> None:
        """:meth:`update_policy_weights_` once its weight arguments are merged into ``value``."""
        if self._weight_updater is not None:
            if weights_dict is not None or model_id is not None:
                raise ValueError("weights_dict and model_id are not supported with legacy weight updater.")
            self._weight_updater(policy_or_weights=value, worker_ids=worker_ids)
            return
        if weights_dict is not None:
            if model_id is not None:
                raise ValueError("Cannot specify both 'weights_dict' and 'model_id'.")
            if value is not None:
                raise ValueError("Cannot specify both 'weights_dict' and 'policy_or_weights'/'weights'/'policy'.")
        schemes = self._weight_sync_schemes
        if schemes:
            work = dict(weights_dict) if weights_dict is not None else {model_id or "policy": value}
            missing = [mid for mid in work if mid not in schemes]
            if missing:
                raise KeyError(
                    f"Model '{missing[0]}' not found in registered weight sync schemes. "
                    f"Available models: {sorted(schemes)}"
                )
            for mid, entry in work.items():
                schemes[mid].send(weights=entry, worker_ids=worker_ids)
            self._after_weights_sent(work)
            return
        if weights_dict is not None:
            value = weights_dict.get("policy")
        elif model_id not in (None, "policy"):
            return
        self._update_local_policy(value)

    def _after_weights_sent(self, work: dict) -> None:
        """Hook after scheme sends (multi collectors track versions here)."""
        if "policy" in work:
            self.increment_version()

    def _update_local_policy(self, value: Any) -> None:
        """Leaf case: no updater, no scheme. Subclasses with a local policy override this."""

    # ------------------------------------------------------------------ what schemes ask of their context
    # ``rlharvest.weight_update.context.SenderContext`` and ``ReceiverContext``.
    def weights_received(self, model_id: str, weights: TensorDictBase, applied_to: Any) -> None:
        """A receiver scheme of this collector applied ``weights`` to ``applied_to``: bring the rest of
        the collector (its own policy copy, its own workers) up to date."""
        self.update_policy_weights_(model_id=model_id, policy_or_weights=weights)

    def forward_initial_weights(self, model_id: str, weights: TensorDictBase) -> None:
        """A receiver scheme received the initial weights: pass them on to this collector's own
        workers, if it has any (no version bump). Default: nothing to pass on."""

    @property
    def policy_lock(self):
        """Held while the policy runs (weights are swapped under it), or None."""
        return None

    def weight_links(self):
        """What the weight senders of this collector's workers ride on (``transport.base.WeightLinks``).

        Raises:
            RuntimeError: for a collector without workers.
        """
        raise RuntimeError(f"{type(self).__name__} has no workers to send weights to.")

    def _weights_from_value(self, value: Any) -> TensorDictBase:
        if isinstance(value, str):
            value = resolve_attr_path(self, value)
        if isinstance(value, dict) and value and all(isinstance(k, int) for k in value):
            raise ValueError("Per-worker weights ({worker_idx: weights}) need a SharedMemWeightSyncScheme "
                             "with per_worker_weights=True.")
        return weights_of(value)

    # ------------------------------------------------------------------ receiver side
    def receive_weights(self, policy_or_weights: Any = None, *, weights: Any = None, policy: Any = None) -> None:
        """Apply weights to this collector's own policy (the receiver-side entry point, docs/weights.md).

        With registered receiver schemes, pulls what they received (no argument allowed); otherwise
        copies the given weights into the local policy (remote workers are not updated).

        Raises:
            ValueError: for conflicting arguments, or arguments given while receiver schemes exist.
            KeyError: when the weights' keys differ from the policy's.
        """
        value = merge_weight_arguments(policy_or_weights, weights, policy, {})
        if self._receiver_schemes is not None:
            if value is not None:
                raise ValueError(
                    "Cannot specify 'policy_or_weights' when using 'receiver_schemes': weights come from the "
                    "registered schemes."
                )
            for scheme in self._receiver_schemes.values():
                scheme.receive()
            return
        if value is not None:
            self._copy_into_local_policy(self._weights_from_value(value))

    def _copy_into_local_policy(self, weights: TensorDictBase) -> None:
        """Copy into the local policy module (subclasses that have one override)."""

    def register_scheme_receiver(self, weight_recv_schemes: dict[str, WeightSyncScheme], *,
                                 synchronize_weights: bool = True) -> None:
        """Register schemes through which this collector receives weights from a parent (docs/weights.md).

        Raises:
            RuntimeError: for a scheme already initialised as a sender.
        """
        if self._receiver_schemes is None:
            self._receiver_schemes = {}
        for model_id, scheme in weight_recv_schemes.items():
            if not scheme.initialized_on_receiver:
                if scheme.initialized_on_sender:
                    raise RuntimeError(
                        f"The scheme for {model_id!r} is initialised as a sender and cannot receive."
                    )
                scheme.init_on_receiver(model_id=model_id, context=self, worker_idx=self.worker_idx)
            elif scheme.context is None:  # connected before this collector existed (stateless policy)
                scheme.bind_context(self)
            self._receiver_schemes[model_id] = scheme
        if synchronize_weights:
            for scheme in self._receiver_schemes.values():
                if not scheme.synchronized_on_receiver:
                    scheme.connect(worker_idx=self.worker_idx)

    def poll_weight_receivers(self) -> None:
        """Apply any pending update of the receiver schemes (cheap when nothing is pending)."""
        schemes = self._receiver_schemes
        if schemes:
            for scheme in schemes.values():
                if scheme.synchronized_on_receiver and scheme.has_pending():
                    scheme.receive(timeout=0.0)

    def receiver_scheme(self, model_id: str) -> WeightSyncScheme:
        """The receiver scheme of ``model_id`` (a node's weights arrive through it).

        Raises:
            KeyError: when this collector receives no weights for ``model_id``.
        """
        scheme = (self._receiver_schemes or {}).get(model_id)
        if scheme is None:
            raise KeyError(f"this collector has no receiver scheme for model {model_id!r}")
        return scheme

    def weight_receiver_waitables(self) -> list:
        """What ``multiprocessing.connection.wait`` wakes on when a receiver scheme gets an update."""
        waitables = []
        for scheme in (self._receiver_schemes or {}).values():
            handle = scheme.receiver_wait_handle()
            if handle is not None:
                waitables.append(handle)
        return waitables

    def _shutdown_schemes(self) -> None:
        for group in (self._weight_sync_schemes, self._receiver_schemes):
            for scheme in (group or {}).values():
                scheme.shutdown()
