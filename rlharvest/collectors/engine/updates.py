"""How an engine with workers updates their weights: ``update_policy_weights_`` (a worker found failed
meanwhile is replaced, starting with the new weights), the automatic pushes of its
:class:`~.schedule.WeightSchedule` between batches (the loops' :class:`~.loops.Pacing`), and what its
weight schemes ask of the collector they serve (``weight_update/context.py``: the model, the links, where
updates are forwarded). docs/weights.md.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

from tensordict import TensorDictBase

from ...errors import WorkerError
from ...transport.base import WeightLinks
from .broadcast import WorkerBroadcast
from .fleet import Fleet
from .pushed import Receiving
from .schedule import WeightPushes, WeightSchedule
from .state import Lifecycle
from .weights import WeightPublisher

__all__ = ["WeightUpdates"]


class WeightUpdates:
    """The weight updates of one engine with workers, and its schemes' context.

    Args:
        weights: the publisher (schemes, legacy updater, versions).
        fleet: the workers (a failed one is replaced, starting with the new weights).
        broadcast: commands to every worker (a version bump asked by the user goes to them too).
        pushes: when weights are pushed without being asked (the :class:`WeightSchedule` made here).
        receiving: whether a receiver thread owns the workers (it then replaces a failed one), and the
            lock updates take meanwhile.
        life: whether the collector is open yet (a factory's policy is not built while starting).
        links: what the backend offers weight senders (``Backend.weight_links``).
        resolve: the object at an attribute path of the collector.
        policy: the user's policy (the main-side source of the workers' weights), or None.
        fallback_factories: the workers' policy factories when ``update_policy_weights_()`` without
            weights reads a factory's policy (None: it reads ``policy``).
        worker_idx: this collector's index inside a parent (it runs in a node), or None.
        refused: why ``update_policy_weights_`` is refused (the workers never stand still), or None.
        num_workers: worker slots at the start.
    """

    #: a receiver scheme in a node running this collector sees no policy lock or device here
    policy_device = None
    policy_lock = None
    #: held while the collector writes its replay buffer (set by the engine), or None
    writing_lock: Any = None

    def __init__(self, weights: WeightPublisher, fleet: Fleet, broadcast: WorkerBroadcast, pushes: WeightPushes,
                 receiving: Receiving, life: Lifecycle, links: Callable[[], WeightLinks],
                 resolve: Callable[[str], Any], *,
                 policy: Any = None, fallback_factories: Sequence[Callable | None] | None = None,
                 worker_idx: int | None = None, refused: str | None = None, num_workers: int = 0) -> None:
        self.weights = weights
        self.fleet = fleet
        self.broadcast = broadcast
        self.receiving = receiving
        self.life = life
        self.links = links
        self.resolve = resolve
        self.policy = policy
        self.fallback_factories = fallback_factories
        self.worker_idx = worker_idx
        self.refused = refused
        self.pushes = pushes
        #: when weights are pushed by themselves; ``push`` sends them as ``update_policy_weights_`` does
        self.schedule = WeightSchedule(pushes, self.push, num_workers)
        #: ``update_policy_weights_()`` without weights and without a policy: a factory's policy
        self.fallback_policy: Any = None

    # ------------------------------------------------------------------ update_policy_weights_
    def update(self, value: Any, policy_or_weights: Any, worker_ids: Any, model_id: str | None,
               weights_dict: dict | None) -> None:
        """``update_policy_weights_``: a worker found failed while the weights are delivered is replaced
        (restarts on) and starts with them (docs/restarts.md).

        Raises:
            NotImplementedError: where the workers never stand still (they push weights themselves).
        """
        if self.refused is not None:
            raise NotImplementedError(self.refused)
        weights = self.weights
        acknowledged, before = weights.acknowledged, weights.version
        weights.acknowledged = False  # until every worker has it
        try:
            self.updating(lambda: weights.update(value, policy_or_weights, worker_ids, model_id, weights_dict))
        except BaseException:  # some workers may have it: no version describes them all
            weights.unacknowledged += weights.version - before
            raise
        if acknowledged and self._everyone_waited_for(value, worker_ids, model_id, weights_dict):
            weights.acknowledged = True
        else:
            weights.unacknowledged += weights.version - before
        targets = self.fleet.active if worker_ids is None else ([worker_ids] if isinstance(worker_ids, int)
                                                                 else worker_ids)
        self.schedule.updated(list(targets))

    def _everyone_waited_for(self, value: Any, worker_ids: Any, model_id: str | None,
                             weights_dict: dict | None) -> bool:
        """Whether an update reached every current worker and was acknowledged by each (every model's
        scheme waits for acknowledgements): one version then describes them all."""
        everyone = set(self.fleet.active)

        def all_workers(ids: Any) -> bool:
            return ids is None or (isinstance(ids, int) and not isinstance(ids, bool) and {ids} == everyone) or (
                isinstance(ids, (list, tuple)) and all(type(i) is int for i in ids) and set(ids) == everyone)

        def per_worker(weights: Any) -> bool:
            return isinstance(weights, dict) and bool(weights) and all(type(k) is int for k in weights)

        entries = dict(weights_dict) if weights_dict is not None else {model_id or "policy": value}
        if not all_workers(worker_ids) or any(per_worker(w) and set(w) != everyone for w in entries.values()):
            return False
        if self.weights.updater is not None:  # a legacy updater says nothing of acknowledgements
            return False
        schemes = self.weights.sync_schemes
        if not schemes:  # the policy runs here (a policy server): nothing to acknowledge
            return True
        return all(mid in schemes and getattr(schemes[mid], "sync", True) for mid in entries)

    def updating(self, update: Callable[[], Any], counted: bool = True) -> None:
        """Run a weight update; a worker it finds failed is replaced.

        Updates are delivered to every worker before acknowledgements are awaited, so the survivors
        have the new weights; the replacement starts with them (and, when the update ``counted`` a
        version, with the version it makes) too. Running free, the receiver thread owns the workers:
        an update that meets a failed worker counts as done for the survivors, and the receiver replaces
        that worker (it meets the failure too), starting it with these weights and this version.
        """
        with self.receiving.lock:
            try:
                update()
            except WorkerError as err:
                if not self.fleet.restarts.enabled:
                    raise
                if not self.receiving.active:
                    step = 1 if counted else 0
                    self.fleet.recover(err, policy_version=self.weights.version + step)
                if counted:
                    self.weights.increment()

    def increment_version(self) -> None:
        """``increment_version()`` asked by the user: here and in every worker, which acknowledge it."""
        self.weights.increment()
        self.broadcast.increment_version()
        self.weights.acknowledge()

    def register_receivers(self, schemes: dict, synchronize: bool = True) -> None:
        """Schemes through which this collector (inside a node) receives weights from its parent."""
        self.weights.register_receivers(schemes, self, self.worker_idx, synchronize)

    def push(self, workers: list[int] | None) -> None:
        """An automatic weight update (``WeightSchedule``): only where something carries weights."""
        weights = self.weights
        if weights.sender_schemes or weights.updater is not None:
            if weights.updater is not None and not self.pushes.name_targets:
                workers = None
            self.update(None, None, workers, None, None)

    # ------------------------------------------------------------------ between batches (the loops' Pacing)
    def before_batch(self, workers: list[int]) -> None:
        self.updating(lambda: self.schedule.before_batch(workers))

    def before_relaunch(self, worker: int, started: bool) -> None:
        self.updating(lambda: self.schedule.before_relaunch(worker, started=started))

    def after_yield(self, served: list[int], active: list[int], done: bool) -> None:
        self.schedule.after_yield(served, active, done)

    def before_pushed_batch(self) -> None:
        """Workers running free pick the weights up between two env steps, without acknowledging; each
        counts one version as we do, so a replacement starts at the new one."""
        if not self.schedule.free_running_due():
            return
        scheme = (self.weights.sender_schemes or {}).get("policy")
        if scheme is not None:
            self.weights.increment()
            self.updating(scheme.send, counted=False)

    def pushed_batch_yielded(self) -> None:
        self.schedule.yielded += 1

    # ------------------------------------------------------------------ what sender schemes ask (``weight_update/context.py``)
    def get_model(self, model_id: str) -> Any:
        if model_id != "policy":
            return self.resolve(model_id)
        if self.policy is not None or self.fallback_factories is None:
            return self.policy
        if self.life.closed:
            # Starting: workers build their policies from the factory themselves; building one here
            # only for its initial weights would run the factory where the user did not ask for it.
            return None
        factories = self.fallback_factories
        if (self.fallback_policy is None and factories and len({id(f) for f in factories}) == 1
                and _takes_no_argument(factories[0])):
            # update_policy_weights_() without weights: the factory's policy is the main-side copy (a
            # factory of the env, as the Evaluator's, has none: its updates carry their weights)
            self.fallback_policy = factories[0]()
        return self.fallback_policy

    def weight_links(self) -> WeightLinks:
        return self.links()

    # ------------------------------------------------------------------ what receiver schemes ask (inside a node)
    def weights_received(self, model_id: str, weights: TensorDictBase, applied_to: Any) -> None:
        """A receiver scheme of this collector (inside a node) applied ``weights``: our workers get them."""
        if self.weights.forwards(model_id):
            self.update(weights, weights, None, model_id, None)

    def forward_initial_weights(self, model_id: str, weights: TensorDictBase) -> None:
        """Initial weights received from a parent continue down to our own workers (no version bump)."""
        scheme = (self.weights.sync_schemes or {}).get(model_id)
        if scheme is not None and self.fleet.requests is not None:
            scheme.send(weights=weights)


def _takes_no_argument(factory: Any) -> bool:
    """Whether ``factory()`` is a valid call (every parameter has a default, or the signature is unknown)."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return True
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters)
