"""How an engine with workers updates their weights: ``update_policy_weights_`` (a worker found failed
meanwhile is replaced, starting with the new weights), the automatic pushes of its
:class:`~.schedule.WeightSchedule`, and what its weight schemes ask of the collector they serve
(``weight_update/context.py``: the model, the links, where updates are forwarded). docs/weights.md.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

from tensordict import TensorDictBase

from ..._utils import resolve_attr_path
from ...errors import WorkerError
from .running import PushedRun


__all__ = ["WeightUpdates"]


class WeightUpdates:
    """The weight updates of one engine with workers: the publisher's owner, and its schemes' context.

    Args:
        engine: the engine (its publisher ``weights``, fleet, schedule and options).
    """

    policy_device = None
    policy_lock = None

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        #: ``update_policy_weights_()`` without weights and without a policy: a factory's policy
        self.fallback_policy: Any = None

    @property
    def worker_idx(self) -> int | None:
        return self.engine.worker_idx

    def weight_links(self):
        return self.engine.backend.weight_links()

    def push(self, workers: list[int] | None) -> None:
        """An automatic weight update (``WeightSchedule``): only where something carries weights."""
        if self.engine.weights.sender_schemes or self.engine.weights.updater is not None:
            if self.engine.weights.updater is not None and not self.engine.traits.pushes.name_targets:
                workers = None
            self.update(None, None, workers, None, None)

    def update(self, value: Any, policy_or_weights: Any, worker_ids: Any, model_id: str | None,
                       weights_dict: dict | None) -> None:
        """``update_policy_weights_``: a worker found failed while the weights are delivered is replaced
        (restarts on) and starts with them (docs/restarts.md)."""
        if self.engine.traits.states_only_while_idle:
            raise NotImplementedError(f"{self.engine.name} pushes weights every update_interval batches by itself.")
        self.updating(lambda: self.engine.weights.update(value, policy_or_weights, worker_ids, model_id,
                                                          weights_dict))
        targets = self.engine.active_workers if worker_ids is None else (
            [worker_ids] if isinstance(worker_ids, int) else worker_ids)
        self.engine.schedule.updated(list(targets))

    def updating(self, update, counted: bool = True) -> None:
        """Run a weight update; a worker it finds failed is replaced.

        Updates are delivered to every worker before acknowledgements are awaited, so the survivors
        have the new weights; the replacement starts with them (and, when the update ``counted`` a
        version, with the version it makes) too. Running free, the receiver thread owns the workers:
        an update that meets a failed worker counts as done for the survivors, and the receiver replaces
        that worker (it meets the failure too), starting it with these weights and this version.
        """
        pushed = self.engine.background.free_run if isinstance(self.engine.background.free_run, PushedRun) else None
        with pushed.lock if pushed is not None else contextlib.nullcontext():
            try:
                update()
            except WorkerError as err:
                if self.engine.fleet is None or not self.engine.fleet.restarts.enabled:
                    raise
                if pushed is None:
                    step = 1 if counted else 0
                    self.engine.fleet.recover(err, policy_version=self.engine.weights.version + step)
                if counted:
                    self.engine.weights.increment()

    # what the publisher asks (WeightOwner)
    def update_local_policy(self, value: Any) -> None:
        if self.engine.server is not None:  # the policy is served here: it takes the weights in this process
            self.engine.weights.version = self.engine.server.update(self.engine.weights, value)
            return
        self.engine.weights.version += 1  # a parameter-free policy: nothing to send, versions still move

    def copy_into_local_policy(self, weights: TensorDictBase) -> None:
        if self.engine.server is not None:
            self.engine.server.copy_in(weights)

    def after_weights_sent(self, model_ids: list[str]) -> None:
        # Workers bumped their own versions when they applied the update: only ours moves here.
        if "policy" in model_ids:
            self.engine.weights.increment()

    def on_version_bump(self, version: int) -> None:
        """Workers count their own versions."""

    def resolve(self, path: str) -> Any:
        return resolve_attr_path(self.engine.face(), path)

    def increment_version(self) -> None:
        """``increment_version()`` asked by the user: here and in every worker."""
        self.engine.weights.increment()
        if self.engine.broadcast is not None:
            self.engine.broadcast.increment_version()

    # what sender schemes ask of their context (``weight_update/context.py``)
    def get_model(self, model_id: str) -> Any:
        if model_id != "policy":
            return resolve_attr_path(self.engine.face(), model_id)
        options = self.engine.options
        if options.policy is not None or not options.factory_fallback:
            return options.policy
        if self.engine.closed:
            # Starting: workers build their policies from the factory themselves; building one here
            # only for its initial weights would run the factory where the user did not ask for it.
            return None
        factories = options.policy_factories or ()
        if (self.fallback_policy is None and factories and len({id(f) for f in factories}) == 1
                and _takes_no_argument(factories[0])):
            # update_policy_weights_() without weights: the factory's policy is the main-side copy (a
            # factory of the env, as the Evaluator's, has none: its updates carry their weights)
            self.fallback_policy = factories[0]()
        return self.fallback_policy
    def weights_received(self, model_id: str, weights: TensorDictBase, applied_to: Any) -> None:
        """A receiver scheme of this collector (inside a node) applied ``weights``: our workers get them."""
        if self.engine.weights.forwards(model_id):
            self.update(weights, weights, None, model_id, None)

    def forward_initial_weights(self, model_id: str, weights: TensorDictBase) -> None:
        """Initial weights received from a parent continue down to our own workers (no version bump)."""
        scheme = (self.engine.weights.sync_schemes or {}).get(model_id)
        if scheme is not None and self.engine.requests is not None:
            scheme.send(weights=weights)


def _takes_no_argument(factory: Any) -> bool:
    """Whether ``factory()`` is a valid call (every parameter has a default, or the signature is unknown)."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return True
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters)
