"""CollectionEngine: what every collector with workers is, whatever the backend (docs/architecture.md).

The engine is built from a collector's typed options (``collectors/options/``) and owns the parts:

* the :class:`~.fleet.Fleet` (workers' life cycle, with its :class:`~.restarts.RestartPolicy` and
  :class:`~.requests.WorkerRequests`), the :class:`~.broadcast.WorkerBroadcast` (calls asked of every
  worker);
* the :class:`~.loops.Iteration` (how batches come back: ``gather.py``) and the
  :class:`~.output.BatchOutput` (post-processing, replay buffer, complete trajectories);
* the :class:`~.weights.WeightPublisher` (schemes, legacy updater, versions) and the
  :class:`~.schedule.WeightSchedule` (automatic pushes);
* the :class:`~.membership.Membership` (workers that join and leave), the trajectory ids
  (``traj_ids.py``), the background runs (``running.py``), checkpoints (``checkpoint.py``) and the
  :class:`~.stats.StatsSnapshot`.

What differs between backends is data in the options' :class:`~rlharvest.collectors.options.traits.Traits`;
the public classes are faces that build an engine and delegate to it.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import multiprocessing  # noqa: F401  (imported before our exit hook so that hook runs first)
import time
import weakref
from typing import Any, Iterator, Sequence

from tensordict import TensorDictBase

from ...errors import WorkerError
from ...profiling import ProfileConfig
from ...protocol import Command
from ..options.common import WorkerSetup
from . import checkpoint
from .broadcast import WorkerBroadcast, argument_sets
from .events import EventKind, FleetEvents
from .extras import EngineExtra, ExternalJoins, RPCReferences
from .fleet import Fleet, Replacement
from .loops import Iteration
from .membership import Membership
from .output import BatchOutput
from .progress import ProgressMeter
from .restarts import RestartCause, RestartPolicy
from .running import Background
from .scaling import FleetScaler
from .schedule import WeightSchedule
from .served import PolicyServer
from .stats import StatsSnapshot, fleet_stats
from .updates import WeightUpdates
from .traj_ids import PerWorkerIds, SharedIds
from .weights import WeightPublisher
from .worker_figures import WorkerFigures

__all__ = ["CollectionEngine"]

_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_live_engines() -> None:
    """At interpreter exit, close what users forgot (before multiprocessing joins its children)."""
    for engine in list(_LIVE):
        with contextlib.suppress(Exception):
            engine.shutdown(timeout=5.0, raise_on_error=False)


def _weakly(method, default: Any = None):
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
            ``RPCOptions``, ``RayOptions``, ``AsyncBatchedOptions``).
        face: the public collector (held weakly: dropping it stops the workers).
    """

    def __init__(self, options: Any, face: Any) -> None:
        self.name = type(face).__name__
        #: the public collector, held weakly (dropping it stops the workers)
        self.face = weakref.ref(face)
        self.options = options
        self.traits = options.traits
        self.config = options.config
        self.closed = True  # until the workers are up
        self.frames, self.iter = 0, -1
        self.iteration_started = False
        self.profile_config: ProfileConfig | None = None
        self.hooks: dict[str, Any] = {"pre_collect_hook": self.config.pre_collect_hook,
                                      "post_collect_hook": self.config.post_collect_hook}
        self.progress = ProgressMeter()
        #: what happened to the fleet (restarts, joins, leaves, autoscaling): log, stats and monitor read it
        self.events = FleetEvents()
        #: each worker's figures, kept from its replies (``stats()``)
        self.figures = WorkerFigures(_weakly(self._policy_version, 0))
        self.updates = WeightUpdates(self)
        self.weights = WeightPublisher(self.updates, self.progress, options.version_tracker)
        self.output = BatchOutput(self.config, assembles=options.assembles_trajectories)
        self.membership = Membership(self, options.frames_share)
        self.schedule = WeightSchedule(self.traits.pushes, self.updates.push, options.num_workers)
        self.ids = PerWorkerIds(options.num_workers) if self.traits.per_worker_ids else SharedIds()
        self.loop = Iteration(self)
        self.background = Background(self)
        self.backend = options.build_backend()
        self.fleet: Fleet | None = None
        self.broadcast: WorkerBroadcast | None = None
        self.setup: WorkerSetup | None = None
        #: parts a backend adds (``launcher="external"``'s joins, RPC references): ``extras.py``
        self.extras: list[EngineExtra] = []
        if self.traits.external_joins:
            self.extras.append(ExternalJoins(self))
        if self.traits.remote_references:
            self.extras.append(RPCReferences(self))
        #: the policy served in this process to env workers (``AsyncBatchedCollector``), or None
        self.server = PolicyServer(options, self) if self.traits.gather == "chunks" else None
        #: the autoscaler's part (``autoscale=``, docs/elastic.md "Autoscaling"), or None
        self.scaler: FleetScaler | None = None
        if getattr(options, "autoscale", None) is not None:
            self.scaler = FleetScaler(self, options.autoscale)
            self.membership.share = self.scaler.frames_of

    # ------------------------------------------------------------------ construction
    def start(self) -> None:
        """Set the weights up, start the workers and wait for them (as the traits say)."""
        options = self.options
        try:
            self.setup = setup = options.prepare(self.backend)
            self.weights.sender_schemes = setup.schemes
            self.weights.sync_schemes = None if setup.legacy else setup.schemes
            if isinstance(self.ids, SharedIds):
                self.ids.counter = setup.trajectory_counter
            if self.server is not None:
                self.setup = setup = dataclasses.replace(setup, inference=self.server.channels)
            for model_id, scheme in (self.weights.sender_schemes or {}).items():
                scheme.init_on_sender(model_id=model_id, context=self.updates, num_workers=options.num_workers)
            for extra in self.extras:
                extra.before_start()
            specs = options.worker_specs(self.setup)
            hooks = Replacement(_weakly(self._before_replacement), _weakly(self._replacement_changes, {}),
                                _weakly(self._after_replacement), _weakly(self._after_leave))
            self.fleet = Fleet(self.backend, self.weights.sender_schemes or {}, options.worker_timeout,
                               RestartPolicy.of(self.config, self.traits.noun, self.events), hooks,
                               on_collect=self.figures.sent, events=self.events)
            self.loop.choose_gather(self.fleet)
            self.broadcast = WorkerBroadcast(self.fleet, _weakly(self.loop.drain), self.traits.noun)
            _LIVE.add(self)
            self.fleet.start(specs, started=self._started_hook(), wait=self.traits.wait_until_built,
                             deferred=self.traits.deferred_start)
        except BaseException as err:  # the fleet stopped what it started
            self.weights.shutdown()
            for extra in self.extras:
                extra.after_stop()
            if self.fleet is None:
                self.backend.stop_all(time.monotonic())
            if self.server is not None:
                self.server.stop()
                if isinstance(err, WorkerError) and self.server.setup_error() is not None:
                    raise self.server.setup_error() from err  # the policy's or the env's own error
            raise
        self.closed = False
        self.events.publish(EventKind.START, f"{self.name} started {options.num_workers} {self.traits.noun}s",
                            workers=tuple(range(options.num_workers)))
        for extra in self.extras:
            extra.after_start()
        if self.scaler is not None:
            self.scaler.start()
        if options.weight_updater is not None:
            self.weights.set_updater(options.weight_updater, self.face())
        if options.weight_recv_schemes is not None:
            self.register_receivers(options.weight_recv_schemes)

    def _policy_version(self) -> int:
        return self.weights.version

    def _started_hook(self):
        """What runs once the workers are started, before they are awaited (a policy server)."""
        if self.server is None:
            return None
        return self.server.start

    def extra(self, kind: type) -> Any:
        """The backend part of type ``kind``, or None."""
        return next((extra for extra in self.extras if isinstance(extra, kind)), None)

    # ------------------------------------------------------------------ what the faces read
    @property
    def requests(self):
        return self.fleet.requests if self.fleet is not None else None

    @property
    def num_workers(self) -> int:
        """Worker slots: every index given so far, those of workers that left included."""
        return len(self.fleet) if self.fleet is not None else self.options.num_workers

    @property
    def active_workers(self) -> list[int]:
        return self.fleet.active if self.fleet is not None else []

    @property
    def requested_frames_per_batch(self) -> int:
        resized = self.membership.resized_frames_per_batch()
        return self.options.requested_frames if resized is None else resized

    @property
    def worker_idx(self) -> int | None:
        return self.config.worker_idx

    def worker_pids(self) -> list[int | None]:
        requests = self.fleet.current_requests if self.fleet is not None else None
        return [handle.pid for handle in requests.handles] if requests is not None else []

    def handles(self) -> list:
        """The workers' handles, in index order (empty once shut down)."""
        requests = self.fleet.current_requests if self.fleet is not None and not self.closed else None
        return list(requests.handles) if requests is not None else []

    @property
    def restart_causes(self) -> tuple[RestartCause, ...]:
        if self.fleet is None:
            return ()
        restarts = self.fleet.restarts
        return tuple(sorted([*restarts.causes, *restarts.leaves], key=lambda cause: cause.time))

    def is_running(self) -> bool:
        return self.background.is_running()

    def workers_pushing(self) -> bool:
        """Whether the workers push batches unasked now (they are paused before they leave)."""
        return self.loop.pushing

    def weight_links(self):
        return self.backend.weight_links()

    def check_open(self, action: str) -> None:
        """Raises: RuntimeError naming ``action`` once the collector is shut down."""
        if self.closed:
            raise RuntimeError(f"{self.name} is shut down: {action} is not possible any more (build a new collector).")

    # ------------------------------------------------------------------ iteration
    def iterate(self) -> Iterator[TensorDictBase | None]:
        """The collector's batches (``__iter__``), each recorded for ``stats()`` as it is yielded."""
        if self.background.workers_run_free():
            raise RuntimeError("The collector is running free (start()); iterate the replay buffer instead.")
        self.iteration_started = True
        scaler = self.scaler if not self.is_running() else None  # running free (start()): nobody waits in here
        if scaler is not None:
            scaler.restarted()
        for batch in self.loop.batches():
            self.progress.record(self.frames, batch, self.weights.policy_version)
            if scaler is not None:  # between two batches: workers may join and leave
                scaler.batch_ready()
            yield batch
            if scaler is not None:
                scaler.asked()
        if self.traits.shutdown_after_total and self.reached_total():  # TorchRL's Ray collector does so
            self.shutdown()

    def reached_total(self) -> bool:
        return not self.config.endless and self.frames >= self.config.total_frames

    def random_phase(self) -> bool:
        return self.config.in_random_phase(self.frames)

    def num_batches(self) -> int:
        """``len()``.

        Raises:
            RuntimeError: for an endless collector.
        """
        if self.config.endless:
            raise RuntimeError(f"Non-terminating collector (total_frames={self.config.total_frames}): len() is "
                               "undefined.")
        return self.membership.num_batches(lambda: self.config.num_batches(self.options.requested_frames))

    def collect_for_parent(self, random: bool) -> TensorDictBase:
        """One batch for a parent collector (this engine's collector runs inside a node)."""
        if self._for_parent is None:
            self._for_parent = self.iterate()
        return next(self._for_parent)

    _for_parent: Iterator | None = None

    # the rest of ``ParentDuties`` (worker/contract.py; this engine's collector runs inside a node): its own workers
    # write a shared buffer themselves, and its rollouts are interrupted through its workers
    def write_to_replay_buffer(self, buffer: Any, batch: TensorDictBase) -> None:
        buffer.extend(batch)

    def keep_for_replay_buffer(self, batch: TensorDictBase) -> None:
        """Nothing is kept: trajectories are assembled where the batches are yielded."""

    def write_batches_into(self, buffer: TensorDictBase, batch: TensorDictBase) -> None:
        """Batches are assembled here from the workers': nothing to redirect."""

    def add_step_check(self, check) -> None:
        """Rollouts run in this engine's workers, which check their own parent link."""

    def resize_batches(self, frames: int) -> int:
        """Raises: NotImplementedError: a node running workers of its own is not re-split (autoscaling
        refuses such nodes with ``sync=True`` at construction)."""
        raise NotImplementedError(f"{self.name} inside a node cannot change the frames of its batches.")
    #: legacy updaters' ``{device: weights}`` staging area (``legacy.py``), made on first use
    legacy_staging: dict | None = None

    def interrupt_workers(self) -> None:
        """Make the workers' rollouts in progress end soon."""
        requests = self.fleet.current_requests if self.fleet is not None else None
        if requests is not None:
            for worker in requests.active():
                requests.handles[worker].interrupt()

    # ------------------------------------------------------------------ weights (``updates.py``)
    def update_weights(self, value: Any, policy_or_weights: Any, worker_ids: Any, model_id: str | None,
                       weights_dict: dict | None) -> None:
        self.updates.update(value, policy_or_weights, worker_ids, model_id, weights_dict)

    def updating_weights(self, update, counted: bool = True) -> None:
        self.updates.updating(update, counted)

    def increment_version(self) -> None:
        self.updates.increment_version()

    def get_model(self, model_id: str) -> Any:
        return self.updates.get_model(model_id)

    def register_receivers(self, schemes: dict, synchronize: bool = True) -> None:
        self.weights.register_receivers(schemes, self.updates, self.worker_idx, synchronize)

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
            self.requests.request(worker, Command.RUN_FREE)
        for extra in self.extras:
            extra.after_replacement(worker)

    def _after_leave(self, worker: int) -> None:
        """A worker left for good (preempted, not replaced): batches shrink as after remove_collectors."""
        self.membership.resized()

    # ------------------------------------------------------------------ workers that join and leave
    def admit_rejoined(self) -> None:
        """Empty slots that a node joined meanwhile take it (``launcher="external"``)."""
        for extra in self.extras:
            if extra.admit(self.fleet):
                self.membership.resized()

    # ------------------------------------------------------------------ asked of every worker
    def set_seed(self, seed: int, static_seed: bool) -> int:
        """Seed worker 0 with ``seed`` and worker k with what worker k-1 returned (workers that left are
        skipped); returns the last. Asynchronous collectors drop the batches in flight."""
        if self.traits.states_only_while_idle:
            raise NotImplementedError(f"{self.name} does not support set_seed (nodes run free).")
        self.loop.drop()
        seed = self.broadcast.seed(self.active_workers, seed, static_seed)
        if self.output.trajectories is not None:
            self.output.trajectories.drop_in_flight()  # the workers started fresh episodes: those never end
        return seed

    def reset(self, reset_idx: Sequence[bool] | None) -> None:
        if self.output.trajectories is not None:
            self.output.trajectories.flush()
        self.broadcast.reset([w for w in self.active_workers if reset_idx is None or reset_idx[w]])

    def get_distant_attr(self, attr: str) -> list[Any]:
        return self.broadcast.get_attr(attr)

    def map_fn(self, method_name: str, list_of_args, list_of_kwargs) -> list[Any]:
        return self.broadcast.call_each(method_name, argument_sets(list_of_args, list_of_kwargs,
                                                                   len(self.active_workers)))

    def cascade_execute(self, attr_path: str, args: tuple, kwargs: dict) -> Any:
        """``workers[i].<path>`` runs inside worker i's collector, ``workers.<path>`` inside every worker;
        any other path resolves on the collector itself."""
        head, _, rest = attr_path.partition(".")
        if head == "workers" or head.startswith("workers["):
            if not rest:
                raise ValueError(f"{attr_path!r}: give the path to run inside the worker after 'workers[i].'")
            workers = self.active_workers if head == "workers" else [int(head[len("workers["):-1])]
            results = self.broadcast.call(rest, args, kwargs, workers)
            return results if head == "workers" else results[0]
        return None

    def set_hook(self, name: str, hook: Any) -> None:
        self.hooks[name] = hook
        if self.traits.hooks_in_workers and self.broadcast is not None:
            self.broadcast.set_hook(name, hook)

    def getattr_policy(self, name: str) -> Any:
        if self.server is not None:  # the policy lives here (AsyncBatchedCollector)
            return getattr(self.server.policy, name)
        return self.broadcast.getattr_policy(name)

    def getattr_env(self, name: str) -> Any:
        return self.broadcast.getattr_env(name)

    def enable_profile(self, config: ProfileConfig) -> None:
        self.profile_config = config
        self.broadcast.enable_profile(config)

    def disable_profile(self) -> None:
        if self.broadcast is not None:
            self.broadcast.disable_profile()
        self.profile_config = None

    # ------------------------------------------------------------------ checkpoints (docs/checkpoints.md)
    def state_dict(self, env_state: bool) -> dict:
        if self.traits.states_only_while_idle:
            raise NotImplementedError(f"{self.name} has no state_dict: its nodes run free, so there is no moment "
                                      "they all stand still at (docs/checkpoints.md).")
        if self.background.workers_run_free():
            raise NotImplementedError(f"{self.name}.state_dict() while its {self.traits.noun}s run free (start()) "
                                      "and write the replay buffer themselves: checkpoint before start() or after "
                                      "async_shutdown() (docs/checkpoints.md).")
        with self.background.thread_run.at_batch_boundary():
            return checkpoint.engine_state(self, env_state)

    def load_state_dict(self, state_dict: dict, strict: bool = True) -> None:
        if self.traits.states_only_while_idle:
            raise NotImplementedError(f"{self.name} has no load_state_dict: its nodes run free "
                                      "(docs/checkpoints.md).")
        checkpoint.load_engine_state(self, state_dict)

    def stats(self, workers: str = "aggregate", timeout: float | None = 10.0) -> StatsSnapshot:
        return fleet_stats(self, workers, timeout)

    def start_free(self) -> None:
        self.background.start()

    def pause(self):
        return self.background.pause()

    def remove_workers(self, indices: int | Sequence[int], timeout: float | None) -> None:
        self.membership.remove(indices, timeout)

    def add_workers(self, create_env_fn: Any, num_envs: int | None, policy: Any, collector_kwargs: Any,
                    backend_options: Any = None) -> None:
        self.membership.add_collectors(create_env_fn, num_envs, policy, collector_kwargs, backend_options)

    def time_split(self) -> dict[str, float]:
        return dict(self.progress.seconds)

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, timeout: float | None = None, close_env: bool = True, raise_on_error: bool = True) -> None:
        """Stop everything this collector runs, within one deadline (idempotent).

        Raises:
            RuntimeError: ``close_env=False`` where workers always close their envs.
        """
        if self.closed:
            return
        if not close_env and self.traits.refuses_keep_env:
            raise RuntimeError(f"{self.name} always closes its workers' envs (close_env=False refused).")
        self.closed = True
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
            self.events.publish(EventKind.SHUTDOWN, f"{self.name} shut down")

    def describe(self) -> str:
        return f"{self.name}(num_workers={self.num_workers}, frames={self.frames})"

