"""The weight part of an engine: ``update_policy_weights_``, ``receive_weights``, receiver schemes, the
legacy ``weight_updater`` and policy versions, once for every collector (docs/weights.md).

What differs between engines is where the weights go when no scheme carries them (a policy in this
process, a policy server, none): an engine hands the publisher a :class:`LocalPolicy` saying so.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Protocol

import torch
from tensordict import TensorDictBase

from ..._utils import user_stacklevel
from ...weight_update.context import ReceiverContext
from ...weight_update.payloads import check_fit
from ...weight_update.schemes import WeightSyncScheme
from ...weight_update.strategy import weights_of
from ...weight_update.updaters import UpdaterHost, WeightUpdaterBase
from .progress import ProgressMeter

__all__ = ["LocalPolicy", "NO_LOCAL_POLICY", "WeightPublisher", "merge_weight_arguments", "has_weights"]


def merge_weight_arguments(policy_or_weights: Any, weights: Any, policy: Any, kwargs: dict) -> Any:
    """Merge the three aliases of the weights argument (at most one may be given).

    Raises:
        ValueError: when two are given. TypeError: for an unknown keyword argument.
    """
    if "policy_weights" in kwargs:
        warnings.warn("policy_weights= is deprecated, pass the weights positionally.", DeprecationWarning, stacklevel=user_stacklevel())
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


class LocalPolicy(Protocol):
    """Where weights go when no scheme carries them: the policy an engine runs itself (``Collector``), a
    policy served to env workers (``AsyncBatchedCollector``), or none (:data:`NO_LOCAL_POLICY`)."""

    def update_local_policy(self, value: Any, weights: WeightPublisher) -> None:
        """No scheme and no updater: bring the policy up to date from ``value`` (None: its own source)
        and count the version in ``weights``."""

    def copy_into_local_policy(self, weights: TensorDictBase) -> None:
        """Copy ``weights`` into the policy (``receive_weights``)."""

    def on_version_bump(self, version: int) -> None:
        """Reflect a new version where rollouts stamp it."""


class _NoLocalPolicy:
    """A collector whose policy runs only in its workers: nothing to copy, versions still move."""

    def update_local_policy(self, value: Any, weights: WeightPublisher) -> None:
        weights.version += 1  # a parameter-free policy: nothing to send, versions still move

    def copy_into_local_policy(self, weights: TensorDictBase) -> None:
        """The workers' policies take weights through the schemes only."""

    def on_version_bump(self, version: int) -> None:
        """Workers count their own versions."""


NO_LOCAL_POLICY: LocalPolicy = _NoLocalPolicy()

class WeightPublisher:
    """Versions, schemes and the legacy updater of one collector.

    Args:
        local: where weights go when no scheme carries them (:class:`LocalPolicy`).
        progress: where update latencies are recorded (``stats()``: ``weight_sync_s_*``).
        version_tracker: ``track_policy_version``: False/None (untracked), True, or an object with
            ``version`` and ``increment_version()``.
        resolve: the object at an attribute path of the collector (weights given as a string).
        get_model: the model ``model_id`` in this process (the policy: the one workers run), or None;
            explicit weights are checked against it before anything is sent.
    """

    def __init__(self, local: LocalPolicy, progress: ProgressMeter, version_tracker: Any = None,
                 resolve: Callable[[str], Any] | None = None,
                 get_model: Callable[[str], Any] | None = None) -> None:
        self.get_model = get_model if get_model is not None else (lambda model_id: None)
        self.local = local
        self.resolve = resolve
        self.progress = progress
        self.version_tracker = version_tracker or None
        self.version = 0
        self.updater: WeightUpdaterBase | None = None
        #: ``{model_id: scheme}`` sending weights (None: the collector sends none itself)
        self.sender_schemes: dict[str, WeightSyncScheme] | None = None
        #: the schemes the user gave or the defaults, as ``update_policy_weights_`` sees them (None
        #: with a legacy updater, whose transport is ``sender_schemes``)
        self.sync_schemes: dict[str, WeightSyncScheme] | None = None
        self.receiver_schemes: dict[str, WeightSyncScheme] | None = None
        #: whether every worker acknowledged the current version: an update to some workers, or one
        #: not waited for, leaves them apart until ``increment_version()`` or a checkpoint's load
        self.acknowledged = True
        #: the versions counted by updates that not every worker acknowledged: the aggregate version
        #: leaves them out (TorchRL's next release counts only acknowledged updates there)
        self.unacknowledged = 0

    # ------------------------------------------------------------------ versions
    @property
    def acknowledged_version(self) -> int | str | None:
        """``policy_version`` as every worker acknowledged it: None after a partial or asynchronous
        update, until ``increment_version()`` or a checkpoint's load, and then without the versions
        such updates counted (TorchRL's next release; docs/weights.md, "Versions")."""
        if not self.acknowledged:
            return None
        version = self.policy_version
        return version - self.unacknowledged if self.version_tracker is True else version

    def acknowledge(self, version: int | None = None) -> None:
        """Every worker has the current version (``increment_version()``), or ``version`` (a load)."""
        if version is not None:
            self.version, self.unacknowledged = int(version), 0
        self.acknowledged = True

    @property
    def policy_version(self) -> int | str | None:
        """The current policy version, or None when versions are not tracked."""
        tracker = self.version_tracker
        if not tracker:
            return None
        if tracker is True:
            return self.version
        return getattr(tracker, "version", self.version)

    def increment(self) -> None:
        """Bump the version (and a user tracker's).

        Raises:
            RuntimeError: when a version tracker without ``increment_version`` was given.
        """
        tracker = self.version_tracker
        if tracker not in (None, False, True):
            if not hasattr(tracker, "increment_version"):
                raise RuntimeError(f"The policy-version tracker {tracker!r} has no increment_version().")
            tracker.increment_version()
        self.version += 1
        self.local.on_version_bump(self.version)

    def set_version(self, version: int) -> None:
        self.version = int(version)
        self.local.on_version_bump(self.version)

    # ------------------------------------------------------------------ legacy updater
    def set_updater(self, value: Any, collector: UpdaterHost) -> None:
        """Install a legacy updater (an instance or a constructor of one), registered with ``collector``.

        Raises:
            TypeError: for anything else.
        """
        if value is None:
            self.updater = None
            return
        if not isinstance(value, WeightUpdaterBase) and callable(value):
            value = value()
        if not isinstance(value, WeightUpdaterBase):
            raise TypeError(f"weight_updater must be a WeightUpdaterBase (or a constructor of one), got {value!r}")
        warnings.warn("weight_updater is the legacy weight-update API; prefer weight_sync_schemes.",
                      DeprecationWarning, stacklevel=user_stacklevel())
        value.register_collector(collector)
        if value.collector is not collector:
            raise RuntimeError("Failed to register collector.")
        self.updater = value

    # ------------------------------------------------------------------ sender side
    def update(self, value: Any, policy_or_weights: Any, worker_ids: Any, model_id: str | None,
               weights_dict: dict | None) -> None:
        """``update_policy_weights_`` once its weight arguments are merged into ``value``; its time is
        recorded for ``stats()``."""
        start = time.perf_counter()
        self._deliver(value, policy_or_weights, worker_ids, model_id, weights_dict)
        self.progress.record_weight_sync(time.perf_counter() - start)

    def _deliver(self, value: Any, policy_or_weights: Any, worker_ids: Any, model_id: str | None,
                 weights_dict: dict | None) -> None:
        if self.updater is not None:
            if weights_dict is not None or model_id is not None:
                raise ValueError("weights_dict and model_id are not supported with legacy weight updater.")
            model = self.get_model("policy") if value is not None else None
            if model is not None and type(self.updater).__module__.startswith("rlharvest."):
                # ours push to the workers' policy; a user's class may take weights of its own shape
                self._check_fit("policy", value, model)
            self.updater(policy_or_weights=value, worker_ids=worker_ids)
            return
        if weights_dict is not None:
            if model_id is not None:
                raise ValueError("Cannot specify both 'weights_dict' and 'model_id'.")
            if value is not None:
                raise ValueError("Cannot specify both 'weights_dict' and 'policy_or_weights'/'weights'/'policy'.")
        schemes = self.sync_schemes or {}
        work = dict(weights_dict) if weights_dict is not None else {model_id or "policy": value}
        missing = [mid for mid in work if mid not in schemes and (schemes or mid != "policy")]
        if missing:
            raise KeyError(f"Model '{missing[0]}' not found in registered weight sync schemes. "
                           f"Available models: {sorted(schemes)}")
        for mid, entry in work.items():  # every model's weights, before anything is sent
            if entry is not None:
                model = schemes[mid].model if schemes else self.get_model(mid)
                if model is not None or not schemes:  # a scheme without a model here: its receivers check
                    self._check_fit(mid, entry, model)
        if schemes:
            for mid, entry in work.items():
                schemes[mid].send(weights=entry, worker_ids=worker_ids)
            if "policy" in work:  # workers bumped their own versions when they applied it: ours moves here
                self.increment()
            return
        self.local.update_local_policy(work.get("policy"), self)

    def _check_fit(self, model_id: str, value: Any, model: Any) -> None:
        """Raise unless ``model`` can take the explicit weights ``value`` (``check_fit``)."""
        if isinstance(value, str):
            value = self._path(value)
        check_fit(value, model, model_id)

    def _path(self, path: str) -> Any:
        """The object at an attribute path of the collector (weights given as a string).

        Raises:
            ValueError: without a collector to resolve it on.
        """
        if self.resolve is None:
            raise ValueError(f"Cannot resolve weights path {path!r} without a collector.")
        return self.resolve(path)

    def forwards(self, model_id: str) -> bool:
        """Whether weights of ``model_id`` a receiver scheme applied go on from here (to this collector's
        own policy or workers); a model it sends nowhere (one of its env's) stops at the receiver."""
        return model_id == "policy" or model_id in (self.sync_schemes or {})

    def weights_from_value(self, value: Any) -> TensorDictBase:
        """The weights ``value`` stands for (a module, weights, or an attribute path on the collector).

        Raises:
            ValueError: for per-worker weights, which only a per-worker scheme takes.
        """
        if isinstance(value, str):
            value = self._path(value)
        if isinstance(value, dict) and value and all(isinstance(k, int) for k in value):
            raise ValueError("Per-worker weights ({worker_idx: weights}) need a SharedMemWeightSyncScheme "
                             "with per_worker_weights=True.")
        return weights_of(value)

    # ------------------------------------------------------------------ receiver side
    def receive(self, value: Any) -> None:
        """``receive_weights``: pull what the receiver schemes got, or copy ``value`` into the local policy.

        Raises:
            ValueError: for weights given while receiver schemes exist.
        """
        if self.receiver_schemes is not None:
            if value is not None:
                raise ValueError("Cannot specify 'policy_or_weights' when using 'receiver_schemes': weights come from "
                                 "the registered schemes.")
            for scheme in self.receiver_schemes.values():
                scheme.receive()
            return
        if value is not None:
            self.local.copy_into_local_policy(self.weights_from_value(value))

    def register_receivers(self, schemes: dict[str, WeightSyncScheme], context: ReceiverContext, worker_idx: int | None,
                           synchronize: bool) -> None:
        """Register schemes through which the collector receives weights from a parent.

        Raises:
            RuntimeError: for a scheme already initialised as a sender.
        """
        if self.receiver_schemes is None:
            self.receiver_schemes = {}
        for model_id, scheme in schemes.items():
            if not scheme.initialized_on_receiver:
                if scheme.initialized_on_sender:
                    raise RuntimeError(f"The scheme for {model_id!r} is initialised as a sender and cannot receive.")
                scheme.init_on_receiver(model_id=model_id, context=context, worker_idx=worker_idx)
            elif scheme.context is None:  # connected before this collector existed (stateless policy)
                scheme.bind_context(context)
            self.receiver_schemes[model_id] = scheme
        if synchronize:
            for scheme in self.receiver_schemes.values():
                if not scheme.synchronized_on_receiver:
                    scheme.connect(worker_idx=worker_idx)

    def poll_receivers(self) -> None:
        """Apply any pending update of the receiver schemes (cheap when nothing is pending)."""
        schemes = self.receiver_schemes
        if schemes:
            for scheme in schemes.values():
                if scheme.synchronized_on_receiver and scheme.has_pending():
                    scheme.receive(timeout=0.0)

    def receiver_scheme(self, model_id: str) -> WeightSyncScheme:
        """Raises: KeyError when the collector receives no weights for ``model_id``."""
        scheme = (self.receiver_schemes or {}).get(model_id)
        if scheme is None:
            raise KeyError(f"this collector has no receiver scheme for model {model_id!r}")
        return scheme

    def receiver_waitables(self) -> list:
        """What ``multiprocessing.connection.wait`` wakes on when a receiver scheme gets an update."""
        handles = [scheme.receiver_wait_handle() for scheme in (self.receiver_schemes or {}).values()]
        return [handle for handle in handles if handle is not None]

    def poll_hook(self) -> Callable[[], bool] | None:
        """A between-steps check applying pending updates (None without receivers)."""
        if not self.receiver_schemes:
            return None

        def poll() -> bool:
            self.poll_receivers()
            return False

        return poll

    def shutdown(self) -> None:
        """Release every scheme (idempotent)."""
        for group in (self.sync_schemes, self.sender_schemes, self.receiver_schemes):
            for scheme in (group or {}).values():
                scheme.shutdown()


def has_weights(policy: Any) -> bool:
    """Whether ``policy`` is a module with parameters or buffers (something a weight update changes)."""
    return isinstance(policy, torch.nn.Module) and (
        any(True for _ in policy.parameters()) or any(True for _ in policy.buffers()))
