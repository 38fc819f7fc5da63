"""CollectionEngine: what every collector with workers is, whatever the backend (docs/architecture.md).

The engine wires the parts and owns their lifetimes; each part is given, typed, only what it uses:

* the :class:`~.fleet.Fleet` (the workers' life cycle, with its :class:`~.restarts.RestartPolicy`), the
  :class:`~.broadcast.WorkerBroadcast` (calls asked of every worker);
* the loop its options' :class:`~.gather.Gathering` makes (how batches come back) and the
  :class:`~.output.BatchOutput` (post-processing, replay buffer, complete trajectories);
* the :class:`~.weights.WeightPublisher` (schemes, legacy updater, versions) and the
  :class:`~.updates.WeightUpdates` (updates that meet failed workers, automatic pushes);
* the :class:`~.membership.Membership` (workers that join and leave) and the :class:`~.state.BatchSizes`,
  the :class:`~.running.Background` (``start()``), the :class:`~.checkpoint.FleetCheckpoint` and the
  :class:`~.stats.FleetStats`; what its backend adds (``extras.py``, ``served.py``, ``scaling.py``).

What differs between backends is what the options hand over (``contract.py``); the public classes are
faces that build an engine and call its parts.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import multiprocessing  # noqa: F401  (imported before our exit hook so that hook runs first)
import time
import weakref
from typing import Any, Callable, Iterator, Sequence

from tensordict import TensorDictBase

from ..._utils import resolve_attr_path
from ...config import CollectorConfig
from ...config_views import BatchShares
from ...errors import WorkerError
from ...profiling import ProfileConfig
from ...protocol import Command, Written
from .broadcast import WorkerBroadcast
from .checkpoint import FleetCheckpoint
from .env_calls import EnvCalls
from .contract import EngineOptions, WorkerSetup
from .events import EventKind, FleetEvents
from .extras import EngineExtra, ExternalJoins
from .fleet import Fleet, Replacement
from .gather import Gathering
from .legacy import LegacyStaging
from .loops import LoopParts
from .membership import Membership
from .output import BatchOutput
from .progress import ProgressMeter
from .pushed import Receiving
from .restarts import RestartPolicy
from .running import Background
from .scaling import FleetScaler
from .state import BatchSizes, Lifecycle, Tally
from .stats import FleetStats
from .updates import WeightUpdates
from .weights import NO_LOCAL_POLICY, WeightPublisher
from .worker_figures import WorkerFigures

__all__ = ["CollectionEngine"]

_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_live_engines() -> None:
    """At interpreter exit, close what users forgot (before multiprocessing joins its children)."""
    for engine in list(_LIVE):
        with contextlib.suppress(Exception):
            engine.shutdown(timeout=5.0, raise_on_error=False)


def _weakly(method: Callable, default: Any = None) -> Callable:
    """``method`` (bound) called through a weak reference to its object: ``default`` once it is gone."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return bound(*args) if bound is not None else default

    return call


class CollectionEngine:
    """The collector behind every public class with workers.

    Args:
        options: the collector's typed options (``WorkerProcessOptions``, ``TorchDistOptions``,
            ``RPCOptions``, ``RayOptions``, ``AsyncBatchedOptions``): see :class:`~.contract.EngineOptions`.
        shares: the frames of a batch and each worker's share of them, which only the
            :class:`~.state.BatchSizes`, the autoscaler and the workers' specs read.
        face: the public collector (held weakly: dropping it stops the workers).
    """

    def __init__(self, options: EngineOptions, shares: BatchShares, face: object) -> None:
        face_ref = self._face = weakref.ref(face)
        #: the collector's options now (they grow with ``add_collectors``)
        self.options = options
        config = options.config
        noun = options.noun
        #: how the workers' batches come back (and whether they stand still between batches)
        self.gathering = gathering = options.gathering
        self.life = Lifecycle(type(face).__name__)
        self.tally = Tally(config.budget)
        self.hooks: dict[str, Any] = {"pre_collect_hook": config.pre_collect_hook,
                                      "post_collect_hook": config.post_collect_hook}
        self.profile_config: ProfileConfig | None = None
        self.progress = ProgressMeter()
        #: what happened to the fleet (restarts, joins, leaves, autoscaling): log, stats and monitor read it
        self.events = FleetEvents()
        self.backend = options.build_backend()
        #: the policy served in this process to env workers (``AsyncBatchedCollector``), or None
        self.server = options.served_policy(self.backend)
        self.weights = WeightPublisher(self.server if self.server is not None else NO_LOCAL_POLICY, self.progress,
                                       options.version_tracker, lambda path: resolve_attr_path(face_ref(), path),
                                       lambda model_id: self.updates.get_model(model_id))
        if self.server is not None:
            self.weights.version = self.server.version
        #: each worker's figures, kept from its replies (``stats()``)
        self.figures = WorkerFigures(_weakly(self._policy_version, 0))
        self.ids = options.trajectory_ids()
        self.output = BatchOutput(config.output_rules, assembles=options.assembles_trajectories)
        restarts = RestartPolicy(config.max_worker_restarts, config.restart_delay, noun, self.events)
        self.fleet = Fleet(self.backend, {}, options.worker_timeout, restarts,
                           Replacement(_weakly(self._before_replacement), _weakly(self._replacement_changes, {}),
                                       _weakly(self._after_replacement), _weakly(self._after_leave)),
                           on_collect=self.figures.sent, events=self.events)
        self.receiving = Receiving()
        #: the calls asked of every worker (their in-flight rollouts answered first: the loop drains them)
        self.calls = WorkerBroadcast(self.fleet, lambda: self.loop.drain(), noun,
                                     self.server.policy if self.server is not None else None)
        refused = None if gathering.stands_still else f"{self.life.name} pushes weights every update_interval batches by itself."
        self.updates = WeightUpdates(
            self.weights, self.fleet, self.calls, options.pushes, self.receiving, self.life, self.backend.weight_links,
            self.weights.resolve, policy=options.policy,
            fallback_factories=options.policy_factories if options.factory_fallback else None,
            worker_idx=config.worker_idx, refused=refused, num_workers=options.num_workers)
        self.updates.writing_lock = self.output.writing
        self.schedule = self.updates.schedule
        #: parts a backend adds (``launcher="external"``'s joins, RPC references): ``extras.py``
        self.extras: list[EngineExtra] = options.extras(self.backend, self.fleet, self.life, self.events)
        #: the frames of a batch and each worker's share (``BatchSizes`` follows the workers that join and leave)
        self.shares = shares
        #: the autoscaler's part (``autoscale=``, docs/elastic.md "Autoscaling"), or None
        self.scaler = self._scaler(options, shares, gathering.sync)
        self._compose_batches(options, shares, gathering)
        #: the legacy updaters' staging copies (``MultiProcessedWeightUpdater``)
        self.legacy = LegacyStaging(self.weights, self.updates.get_model,
                                    [config.policy_device_of(worker) for worker in range(options.num_workers)])
        #: what the workers' specs were built with (``add_collectors`` builds more)
        self.setup: WorkerSetup | None = None

    def _compose_batches(self, options: EngineOptions, shares: BatchShares, gathering: Gathering) -> None:
        """The parts around the batches: their sizes, the loop the options chose, running free, who
        collects, checkpoints and ``stats()``."""
        fleet, config, noun = self.fleet, options.config, options.noun
        self.sizes = BatchSizes(self.tally, lambda: shares.requested, sync=gathering.sync,
                                share=self.scaler.frames_of if self.scaler is not None else shares.share,
                                active=lambda: fleet.active)
        self.loop = gathering.loop(LoopParts(
            fleet=fleet, tally=self.tally, progress=self.progress, figures=self.figures, ids=self.ids,
            output=self.output, replay_buffer=config.replay_buffer, sizes=self.sizes, pacing=self.updates,
            between_batches=_weakly(self._between_batches), hooks=self.hooks,
            policy_error=self.server.policy_error if self.server is not None else lambda: None,
            workers_write_buffer=options.workers_write_buffer))
        self.background = Background(options.free_run, self.loop, fleet, self.receiving, config.replay_buffer,
                                     self.iterate, self.life, noun)
        self.membership = Membership(fleet, self.loop, self.calls, self.weights, self.schedule, self.ids,
                                     self.sizes, self.extras, self.hooks, self.life, self.background.is_running,
                                     self.scaler, noun, env_settings=lambda: self.env_calls.for_new_worker())
        #: ``setattr_env``, ``call_env``, ``getattr_env``: the workers' envs reconfigured while they run
        self.env_calls = EnvCalls(fleet, self.loop.drop, self.background.thread_run.at_batch_boundary, noun)
        self.checkpoint = FleetCheckpoint(self.life.name, self.tally, fleet, self.calls, self.loop, self.weights,
                                          config.replay_buffer, self.sizes.frames_per_batch, self.ids,
                                          [self.schedule, self.env_calls, self.output], self.server)
        self.stats = FleetStats(self.tally, self.progress, self.weights, self.sizes.frames_per_batch, fleet,
                                self.figures, self.calls, self.life, options.census,
                                [*self.extras, *([self.scaler] if self.scaler is not None else [])],
                                steps_only=self.server is not None, output=self.output)

    def _scaler(self, options: EngineOptions, shares: BatchShares, sync: bool) -> FleetScaler | None:
        if options.autoscale is None:
            return None
        joins = next((extra for extra in self.extras if isinstance(extra, ExternalJoins)), None)
        return FleetScaler(options.autoscale, self.fleet, self.figures, self.tally, self.life,
                           add=_weakly(self._scaled_add), grow=_weakly(self._joined_grow),
                           remove=_weakly(self._scaled_remove), requested=lambda: shares.requested,
                           share=shares.share, backend_options=options.scaled_backend_options,
                           env_fn=options.env_fns[0], joins=joins, events=self.events, sync=sync)

    # ------------------------------------------------------------------ construction
    def start(self) -> None:
        """Set the weights up, start the workers and wait for them (as the options say)."""
        options, fleet = self.options, self.fleet
        launched = False
        try:
            self.setup = setup = options.prepare(self.backend)
            self.weights.sender_schemes = setup.schemes
            self.weights.sync_schemes = None if setup.legacy else setup.schemes
            self.ids.counter = setup.trajectory_counter
            if self.server is not None:
                self.setup = setup = dataclasses.replace(setup, inference=self.server.channels)
            for model_id, scheme in setup.schemes.items():
                scheme.init_on_sender(model_id=model_id, context=self.updates, num_workers=options.num_workers)
            for extra in self.extras:
                extra.before_start()
            specs = options.worker_specs(setup, self.shares)
            fleet.schemes = setup.schemes
            _LIVE.add(self)
            launched = True
            startup = options.startup
            fleet.start(specs, started=self.server.start if self.server is not None else None,
                        wait=startup.wait_until_built, deferred=startup.deferred)
        except BaseException as err:  # the fleet stopped what it started
            self.weights.shutdown()
            for extra in self.extras:
                extra.after_stop()
            if not launched:
                self.backend.stop_all(time.monotonic())
            if self.server is not None:
                self.server.stop()
                if isinstance(err, WorkerError) and self.server.setup_error() is not None:
                    raise self.server.setup_error() from err  # the policy's or the env's own error
            raise
        self.life.closed = False
        self.events.publish(EventKind.START, f"{self.life.name} started {options.num_workers} {options.noun}s",
                            workers=tuple(range(options.num_workers)))
        for extra in self.extras:
            extra.after_start()
        if self.scaler is not None:
            self.scaler.start()
        if options.weight_updater is not None:
            self.weights.set_updater(options.weight_updater, self._face())
        if options.weight_recv_schemes is not None:
            self.updates.register_receivers(options.weight_recv_schemes)

    def _policy_version(self) -> int:
        return self.weights.version

    def extra(self, kind: type) -> Any:
        """The backend part of type ``kind``, or None."""
        return next((extra for extra in self.extras if isinstance(extra, kind)), None)

    # ------------------------------------------------------------------ what the faces read
    @property
    def config(self) -> CollectorConfig:
        """The collector's arguments now (they grow with ``add_collectors``), its ``frames_per_batch``
        as it was given."""
        config = self.options.config
        return config if config.frames_per_batch is not None else config.with_frames(self.shares.frames)

    # ------------------------------------------------------------------ iteration
    def iterate(self) -> Iterator[TensorDictBase | None]:
        """The collector's batches (``__iter__``), each recorded for ``stats()`` as it is yielded."""
        if self.background.workers_run_free():
            raise RuntimeError("The collector is running free (start()); iterate the replay buffer instead.")
        self.life.started = True
        scaler = self.scaler if not self.background.is_running() else None  # running free: nobody waits in here
        if scaler is not None:
            scaler.restarted()
        for batch in self.loop.batches():
            self.progress.record(self.tally.frames, batch, self.weights.policy_version)
            if scaler is not None:  # between two batches: workers may join and leave
                scaler.batch_ready()
            yield batch
            if scaler is not None:
                scaler.asked()
        if self.options.shutdown_after_total and self.tally.reached_total():  # TorchRL's Ray collector does so
            self.shutdown()

    def collect_for_parent(self, random: bool) -> TensorDictBase:
        """One batch for a parent collector (this engine's collector runs inside a node)."""
        if self._for_parent is None:
            self._for_parent = self.iterate()
        return next(self._for_parent)

    _for_parent: Iterator | None = None

    # the rest of ``ParentDuties`` (worker/contract.py; this engine's collector runs inside a node): its own workers
    # write a shared buffer themselves, and its rollouts are interrupted through its workers
    def write_to_replay_buffer(self, buffer: Any, batch: TensorDictBase) -> Written:
        buffer.extend(batch)
        return Written(batch.numel())

    def keep_for_replay_buffer(self, batch: TensorDictBase) -> Written:
        """Nothing is kept: trajectories are assembled where the batches are yielded."""
        return Written()

    def write_batches_into(self, buffer: TensorDictBase, batch: TensorDictBase) -> None:
        """Batches are assembled here from the workers': nothing to redirect."""

    def add_step_check(self, check: Callable[[], bool]) -> None:
        """Rollouts run in this engine's workers, which check their own parent link."""

    def resize_batches(self, frames: int) -> int:
        """Raises: NotImplementedError: a node running workers of its own is not re-split (autoscaling
        refuses such nodes with ``sync=True`` at construction)."""
        raise NotImplementedError(f"{self.life.name} inside a node cannot change the frames of its batches.")

    # ------------------------------------------------------------------ failed workers (docs/restarts.md)
    def _before_replacement(self, worker: int) -> None:
        """Drop what ``worker`` had in flight before it is replaced or leaves."""
        self.loop.forget(worker)
        self.figures.forget(worker)
        for extra in self.extras:
            extra.before_replacement(worker)

    def _replacement_changes(self, worker: int) -> dict:
        """What a worker replacing ``worker`` starts with besides its spec: the current policy version,
        and (workers counting their own trajectory ids) a fresh id range."""
        return {"policy_version": self.weights.version, **self.ids.replacement_changes(worker)}

    def _after_replacement(self, worker: int) -> None:
        if self.loop.pushing:  # the replacement runs free like the others
            self.fleet.requests.request(worker, Command.RUN_FREE)
        for extra in self.extras:
            extra.after_replacement(worker)

    def _after_leave(self, worker: int) -> None:
        """A worker left for good (preempted, not replaced): batches shrink as after remove_collectors."""
        self.membership.resized()

    def _between_batches(self) -> None:
        """Empty slots that a node joined meanwhile take it (``launcher="external"``)."""
        for extra in self.extras:
            if extra.admit():
                self.membership.resized()

    # ------------------------------------------------------------------ workers that join and leave
    def add_workers(self, create_env_fn: Any, num_envs: int | None, policy: Any, collector_kwargs: Any,
                    backend_options: Any = None) -> None:
        """``add_collectors``: the membership starts the new workers; this collector's options become
        the grown ones (docs/elastic.md)."""
        self.membership.check_add()
        self._grow(create_env_fn, num_envs, policy, collector_kwargs, backend_options)

    def _grow(self, create_env_fn: Any, num_envs: int | None, policy: Any, collector_kwargs: Any,
              backend_options: Any) -> None:
        self.membership.check_grow()
        grown, specs, extra = self.options.added(len(self.fleet), create_env_fn, num_envs, policy, collector_kwargs,
                                                 backend_options, self.setup, self.shares)
        self.fleet.check_growable()  # nothing started yet
        previous, self.options = self.options, grown
        try:
            self.membership.start_added(specs, extra)
        except BaseException:
            self.options = previous
            raise

    def _scaled_add(self, env_fns: list, backend_options: Any) -> None:
        self.add_workers(env_fns, None, None, None, backend_options)

    def _joined_grow(self, env_fns: list) -> None:
        self._grow(env_fns, None, None, None, None)

    def _scaled_remove(self, indices: list[int]) -> None:
        self.membership.remove(indices, None)

    # ------------------------------------------------------------------ asked of every worker
    def set_seed(self, seed: int, static_seed: bool) -> int:
        """Seed worker 0 with ``seed`` and worker k with what worker k-1 returned (workers that left are
        skipped); returns the last. Asynchronous collectors drop the batches in flight."""
        if not self.gathering.stands_still:
            raise NotImplementedError(f"{self.life.name} does not support set_seed (nodes run free).")
        self.loop.drop()
        seed = self.calls.seed(self.fleet.active, seed, static_seed)
        if self.output.trajectories is not None:
            self.output.trajectories.drop_in_flight()  # the workers started fresh episodes: those never end
        return seed

    def reset(self, reset_idx: Sequence[bool] | None) -> None:
        if self.output.trajectories is not None:
            self.output.trajectories.flush()
        self.calls.reset([w for w in self.fleet.active if reset_idx is None or reset_idx[w]])

    def set_hook(self, name: str, hook: Any) -> None:
        self.hooks[name] = hook
        if self.gathering.hooks_in_workers:
            self.calls.set_hook(name, hook)

    def enable_profile(self, config: ProfileConfig) -> None:
        self.profile_config = config
        self.calls.enable_profile(config)

    def disable_profile(self) -> None:
        self.calls.disable_profile()
        self.profile_config = None

    # ------------------------------------------------------------------ checkpoints (docs/checkpoints.md)
    def state_dict(self, env_state: bool) -> dict:
        name = self.life.name
        if not self.gathering.stands_still:
            raise NotImplementedError(f"{name} has no state_dict: its nodes run free, so there is no moment "
                                      "they all stand still at (docs/checkpoints.md).")
        if self.background.workers_run_free():
            raise NotImplementedError(f"{name}.state_dict() while its {self.options.noun}s run free (start()) "
                                      "and write the replay buffer themselves: checkpoint before start() or after "
                                      "async_shutdown() (docs/checkpoints.md).")
        with self.background.thread_run.at_batch_boundary():
            return self.checkpoint.state(env_state)

    def load_state_dict(self, state_dict: dict, strict: bool = True) -> None:
        if not self.gathering.stands_still:
            raise NotImplementedError(f"{self.life.name} has no load_state_dict: its nodes run free "
                                      "(docs/checkpoints.md).")
        self.checkpoint.load(state_dict)

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, timeout: float | None = None, close_env: bool = True, raise_on_error: bool = True) -> None:
        """Stop everything this collector runs, within one deadline (idempotent).

        Raises:
            RuntimeError: ``close_env=False`` where workers always close their envs.
        """
        if self.life.closed:
            return
        if not close_env and self.options.refuses_keep_env:
            raise RuntimeError(f"{self.life.name} always closes its workers' envs (close_env=False refused).")
        self.life.closed = True
        try:
            self.background.stop(timeout)
            self.loop.stop_pushing()
            for extra in self.extras:
                extra.before_stop()
            self.fleet.stop(self.options.shutdown_timeout if timeout is None else timeout)
        except BaseException:
            if raise_on_error:
                raise
        finally:
            for extra in self.extras:
                with contextlib.suppress(Exception):
                    extra.after_stop()
            if self.server is not None:
                self.server.stop()
            self.weights.shutdown()
            _LIVE.discard(self)
            self.events.publish(EventKind.SHUTDOWN, f"{self.life.name} shut down")

    def describe(self) -> str:
        return f"{self.life.name}(num_workers={len(self.fleet) or self.options.num_workers}, frames={self.tally.frames})"
