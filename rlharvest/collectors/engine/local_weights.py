"""The weights of the policy a ``Collector`` runs in this process: where ``update_policy_weights_`` copies
them (the publisher's :class:`~.weights.LocalPolicy`), and what its weight schemes read of the collector
(``weight_update/context.py``: the model, its device and lock, where received weights go). docs/weights.md.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from tensordict import TensorDictBase

from ...envs.policy_transforms import appended_by_collector
from ...policies import WeakPolicyRef
from ...rollout import Rollout
from ...weight_update.strategy import copy_weights_, weights_of
from ._model_paths import resolve_env_transform_path
from .progress import ProgressMeter
from .weights import WeightPublisher

__all__ = ["LocalWeights"]


class LocalWeights:
    """The weight updates of a ``Collector`` and its schemes' context.

    Args:
        rollout: THE rollout loop (its policy lock, the version it stamps).
        policy: the policy it runs now (a face may set another).
        source: the user's policy, the main-side source of the weights (held weakly).
        policy_is_copy: whether the policy run is a copy of the source (on another device).
        served: whether the policy is served by a parent (an inference client here).
        env: the env (its transforms are models too, when ``max_frames_per_traj`` adds a step counter).
        version_tracker: ``track_policy_version`` (False, True, or the user's tracker).
        worker_idx: the collector's index in a parent, or None.
        step_counter: whether the env has a step counter (``max_frames_per_traj``): ids index its transforms.
        policy_device: where the policy runs.
        resolve: the object at an attribute path of the collector.
        progress: where update latencies are recorded.
        name: how messages name the collector.
    """

    #: no scheme of a Collector writes a model of its replay buffer (SenderContext.writing_lock)
    writing_lock = None

    def __init__(self, rollout: Rollout, policy: Callable[[], Any], source: WeakPolicyRef, policy_is_copy: bool,
                 served: bool, env: Any, version_tracker: Any, worker_idx: int | None, step_counter: bool,
                 policy_device: torch.device | None,
                 resolve: Callable[[str], Any], progress: ProgressMeter, name: str) -> None:
        self.rollout = rollout
        self.policy = policy
        self.source = source
        self.policy_is_copy = policy_is_copy
        self.served = served
        self.env = env
        self.worker_idx = worker_idx
        self.step_counter = step_counter
        self.policy_device = policy_device
        self.resolve = resolve
        self.name = name
        self.weights = WeightPublisher(self, progress, version_tracker, resolve, self.get_model)

    @property
    def policy_lock(self):
        """Held while the policy runs (weights are swapped under it)."""
        return self.rollout.policy_lock

    # ------------------------------------------------------------------ update_policy_weights_
    def update(self, value: Any, policy_or_weights: Any, worker_ids: Any, model_id: str | None,
               weights_dict: dict | None) -> None:
        """``update_policy_weights_``: the policy runs here, its weights are copied in directly."""
        self.weights.update(value, policy_or_weights, worker_ids, model_id, weights_dict)

    def increment_version(self) -> None:
        self.weights.increment()

    def register_receivers(self, schemes: dict, synchronize: bool = True) -> None:
        """Schemes through which this collector receives weights from a parent."""
        self.weights.register_receivers(schemes, self, self.worker_idx, synchronize)

    def init_senders(self, schemes: dict | None) -> None:
        """``weight_sync_schemes`` given to a ``Collector``: env-side models it updates itself.

        Raises:
            ValueError: for a scheme that sends weights to workers (a ``Collector`` has none).
        """
        if not schemes:
            return
        for model_id, scheme in schemes.items():
            if scheme.needs_workers:
                raise ValueError(
                    f"weight_sync_schemes[{model_id!r}] is a {type(scheme).__name__}, which sends weights to worker "
                    "processes or nodes: a Collector has none (its policy runs in this process and "
                    "update_policy_weights_ updates it directly). Use weight_recv_schemes to receive weights from a "
                    "parent collector, or a MultiSyncCollector/MultiAsyncCollector to run workers.")
        self.weights.sync_schemes = dict(schemes)
        for model_id, scheme in schemes.items():
            scheme.init_on_sender(model_id=model_id, context=self, num_workers=1)
            if not scheme.synchronized_on_sender:
                scheme.connect()

    # ------------------------------------------------------------------ the publisher's LocalPolicy
    def update_local_policy(self, value: Any, weights: WeightPublisher) -> None:
        if value is None:
            source = self.source()
            if source is None or source is self.policy() or not isinstance(source, torch.nn.Module):
                weights.increment()
                return
            value = source
        self.copy_into_local_policy(weights.weights_from_value(value))
        weights.increment()

    def copy_into_local_policy(self, weights: TensorDictBase) -> None:
        policy = self.policy()
        if not isinstance(policy, torch.nn.Module):
            return
        with self.rollout.policy_lock:
            copy_weights_(weights_of(policy), weights)

    def on_version_bump(self, version: int) -> None:
        self.rollout.policy_version = version

    # ------------------------------------------------------------------ what schemes ask (``weight_update/context.py``)
    def get_model(self, model_id: str) -> Any:
        if model_id == "policy":
            source = self.source()
            return source if source is not None else self.policy()
        step_counter = self.step_counter  # TorchRL's env would have one: ids index its transforms
        if step_counter or appended_by_collector(self.env):
            found, model = resolve_env_transform_path(self.env, model_id, step_counter)
            if found:
                return model
        return self.resolve(model_id)

    def weight_links(self):
        raise RuntimeError(f"{self.name} has no workers to send weights to.")

    def weights_received(self, model_id: str, weights: TensorDictBase, applied_to: Any) -> None:
        """A receiver scheme applied ``weights`` to ``applied_to``: bring our own policy copy up to date."""
        publisher = self.weights
        if not publisher.forwards(model_id):  # one of the env's models: it stops at the receiver
            return
        if (model_id == "policy" and applied_to is self.get_model("policy") and not self.policy_is_copy
                and publisher.updater is None and not publisher.sync_schemes):
            publisher.increment()  # the scheme wrote into the very modules this collector runs
            return
        publisher.update(weights, weights, None, model_id, None)

    def swaps_between_steps(self, model_id: str, model: Any) -> bool:
        """Whether a receiver scheme may swap ``model``'s weights in from its own thread, under
        :attr:`policy_lock`: the policy runs here under that lock (an env step's action and the
        version it records at once), and :meth:`weights_received` then only moves the version."""
        publisher = self.weights
        return (model_id == "policy" and model is self.get_model("policy") and not self.policy_is_copy
                and publisher.updater is None and not publisher.sync_schemes
                and publisher.version_tracker in (None, False, True) and not self.served)

    def forward_initial_weights(self, model_id: str, weights: TensorDictBase) -> None:
        """No workers of our own: nothing to pass on."""
