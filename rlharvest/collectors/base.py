"""BaseCollector: TorchRL's collector methods, once for every collector, each delegating to the
collector's engine (docs/architecture.md).

A public collector is a face: its constructor (TorchRL's signature) parses its arguments into typed
options and builds an engine (``engine/local.py`` for ``Collector``, ``engine/engine.py`` for every
collector with workers); what it does lives there. ``BaseCollector`` is a
``torch.utils.data.IterableDataset``, as TorchRL's.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from tensordict import TensorDictBase
from torch.utils.data import IterableDataset

from .._utils import resolve_attr_path
from ..errors import CollectorShutdownError
from ..profiling import ProfileConfig
from ..weight_update.torchrl_schemes import own_schemes
from ..worker import ParentDuties
from .engine.contract import EngineOptions
from .engine.engine import CollectionEngine
from .engine.events import FleetEvents
from .engine.local import LocalEngine
from .engine.weights import merge_weight_arguments
from .options.local import LocalOptions

__all__ = ["BaseCollector"]


class BaseCollector(IterableDataset):
    """Base class of every rlharvest collector.

    Iterating yields batches (TensorDicts whose last dim is named ``"time"``) until ``total_frames``
    frames were collected; with a replay buffer it yields None per batch and writes the buffer.

    Example:
        >>> from rlharvest.collectors import Collector
        >>> from rlharvest.envs import CountingEnv
        >>> collector = Collector(CountingEnv(), frames_per_batch=10, total_frames=30)
        >>> [batch.numel() for batch in collector]
        [10, 10, 10]
    """

    #: the engine behind this face: the rollout loop in this process (``Collector``), or workers
    _engine: LocalEngine | CollectionEngine | None = None
    _persistent_iterator: Iterator | None = None

    def __new__(cls, *args: Any, **kwargs: Any):
        return cls._construct(args, kwargs)

    @classmethod
    def _construct(cls, args: tuple, kwargs: dict) -> Any:
        """What ``cls(*args, **kwargs)`` makes: an instance of ``cls`` (or of a subclass) that Python then
        initialises, or a finished collector of another class (then no ``__init__`` follows). A hook, not
        ``__new__`` itself, so that ``inspect.signature`` shows each collector's ``__init__``."""
        return object.__new__(cls)

    @classmethod
    def from_options(cls, options: LocalOptions | EngineOptions) -> BaseCollector:
        """A collector built from typed options parsed elsewhere (a worker's, from its parent's spec:
        nothing is parsed again)."""
        collector = object.__new__(cls)
        collector._build(options)
        return collector

    def _build(self, options: LocalOptions | EngineOptions) -> None:  # pragma: no cover - every face builds its own
        raise NotImplementedError

    def _open(self, action: str) -> LocalEngine | CollectionEngine:
        """The engine, or the error saying this collector is shut down."""
        engine = self._engine
        if engine is None or engine.life.closed:
            name = type(self).__name__
            raise CollectorShutdownError(f"{name} is shut down: {action} is not possible any more (build a new "
                                         f"{name} to collect again).")
        return engine

    # ------------------------------------------------------------------ identity and arguments
    @property
    def worker_idx(self) -> int | None:
        """Index of this collector inside a parent collector; None at the top level."""
        return self._engine.config.worker_idx

    @property
    def config(self):
        """The collector's arguments, validated (``rlharvest.config.CollectorConfig``)."""
        return self._engine.config

    @property
    def requested_frames_per_batch(self) -> int:
        """Frames of the next batch (a sync batch follows the workers that join and leave)."""
        return self._engine.sizes.frames_per_batch()

    frames_per_batch = requested_frames_per_batch

    @property
    def total_frames(self) -> int:
        return self._engine.config.total_frames

    # TorchRL's counters of frames collected and batches yielded (-1 before the first), private there
    # too but read by scripts and by TorchRL's own tests (``test_collector_reloading``)
    @property
    def _frames(self) -> int:
        return self._engine.tally.frames

    @property
    def _iter(self) -> int:
        return self._engine.tally.iter

    @property
    def replay_buffer(self):
        return self._engine.config.replay_buffer

    @property
    def trajs_per_batch(self) -> int | None:
        """Complete trajectories per yielded batch (None: batches of ``frames_per_batch`` frames)."""
        return self._engine.config.trajs_per_batch

    @property
    def trajs_per_write(self) -> int | None:
        """Complete trajectories per replay-buffer ``extend`` (None: all that are ready)."""
        return self._engine.config.trajs_per_write

    @property
    def traj_format(self) -> str:
        """Layout of trajectory batches: ``"padded"`` or ``"cat"`` (docs/trajectories.md)."""
        return self._engine.config.traj_format

    @property
    def _exclude_private_keys(self) -> bool:
        """Whether keys with a part starting with ``_`` are dropped from batches (TorchRL's switch)."""
        return self._engine.output.exclude_private_keys

    @_exclude_private_keys.setter
    def _exclude_private_keys(self, value: bool) -> None:
        self._engine.output.exclude_private_keys = bool(value)

    # ------------------------------------------------------------------ iteration
    def iterator(self) -> Iterator[TensorDictBase | None]:
        """The generator behind ``__iter__``."""
        return self._open("iterating").iterate()

    def __iter__(self) -> Iterator[TensorDictBase | None]:
        batches = self.iterator()
        try:
            yield from batches
        except GeneratorExit:  # the caller stopped iterating (break, or a dropped iterator): not an error
            raise
        except BaseException:
            self.shutdown(raise_on_error=False)
            raise

    def next(self) -> TensorDictBase | None:
        """The next batch from one persistent internal iterator; None once exhausted."""
        if self._persistent_iterator is None:
            self._persistent_iterator = iter(self)
        try:
            batch = next(self._persistent_iterator)
        except StopIteration:
            return None
        if isinstance(batch, TensorDictBase) and batch.device is not None and batch.device.type != "cpu":
            batch = batch.clear_device_()
        return batch

    def __len__(self) -> int:
        return self._engine.sizes.num_batches()

    # ------------------------------------------------------------------ life cycle
    def shutdown(self, timeout: float | None = None, close_env: bool = True, raise_on_error: bool = True) -> None:
        """Stop everything this collector runs and release it, within one deadline (idempotent)."""
        if self._engine is not None:
            self._engine.shutdown(timeout, close_env, raise_on_error)

    def async_shutdown(self, timeout: float | None = None, close_env: bool = True) -> None:
        """Shut down a collector started with :meth:`start` (or any collector), waiting at most ``timeout``
        seconds for background collection to stop; ``close_env``: whether to close the envs."""
        self.shutdown(timeout=timeout, close_env=close_env)

    def __del__(self):
        with contextlib.suppress(Exception):
            self.shutdown(raise_on_error=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # ------------------------------------------------------------------ running free
    def start(self) -> None:
        """Collect in the background into the replay buffer until :meth:`async_shutdown`.

        Raises:
            NotImplementedError: on collectors that cannot run free.
            RuntimeError: without a replay buffer, or when already running.
        """
        self._open("start()").background.start()

    @contextlib.contextmanager
    def pause(self):
        """Context manager pausing background collection (buffer writes stop inside the block).

        Raises:
            NotImplementedError: when entered on collectors that cannot pause.
            RuntimeError: when the collector is not running free.
        """
        with self._open("pause()").background.pause():
            yield

    def is_running(self) -> bool:
        """Whether background collection (``start()``) is in progress."""
        return self._engine is not None and self._engine.background.is_running()

    # ------------------------------------------------------------------ profiling
    def enable_profile(self, *, workers: list[int] | None = None, num_rollouts: int = 3, warmup_rollouts: int = 1,
                       save_path=None, activities: list[str] | None = None, record_shapes: bool = True,
                       profile_memory: bool = False, with_stack: bool = True, with_flops: bool = False,
                       on_trace_ready=None) -> None:
        """Profile rollouts with torch.profiler and export a Chrome trace (docs/collection.md, "Profiling").

        Raises:
            RuntimeError: after iteration started.
            ValueError: when ``num_rollouts <= warmup_rollouts`` or ``warmup_rollouts < 0``.
        """
        engine = self._open("enable_profile()")
        if engine.life.started:
            raise RuntimeError("Cannot enable profiling after iteration has started; call it before iterating.")
        engine.enable_profile(ProfileConfig(
            workers=list(workers) if workers is not None else [0], num_rollouts=num_rollouts,
            warmup_rollouts=warmup_rollouts, save_path=save_path,
            activities=list(activities) if activities is not None else ["cpu", "cuda"], record_shapes=record_shapes,
            profile_memory=profile_memory, with_stack=with_stack, with_flops=with_flops,
            on_trace_ready=on_trace_ready))

    def disable_profile(self) -> None:
        """Stop profiling (a trace being recorded is written as it stands); no-op when not profiling."""
        if self._engine.profile_config is not None:
            self._engine.disable_profile()

    @property
    def profile_config(self) -> ProfileConfig | None:
        """The stored profiling configuration, or None."""
        return self._engine.profile_config

    # ------------------------------------------------------------------ remote calls
    def cascade_execute(self, attr_path: str, *args, **kwargs) -> Any:
        """Resolve ``attr_path`` on this collector and call it (or return it when not callable); on a
        collector with workers, ``workers[i].<path>`` runs inside worker i's collector and
        ``workers.<path>`` inside every worker.

        Raises:
            AttributeError: naming a missing segment.
            ValueError: when arguments are given for a non-callable target.
        """
        head = attr_path.partition(".")[0]
        if head == "workers" or head.startswith("workers["):
            return self._open("cascade_execute()").calls.cascade(attr_path, args, kwargs)
        target = resolve_attr_path(self, attr_path)
        if callable(target):
            return target(*args, **kwargs)
        if args or kwargs:
            raise ValueError(f"{attr_path!r} resolves to a non-callable {type(target).__name__}; it takes no arguments.")
        return target

    def get_distant_attr(self, attr: str) -> Any:
        """The attribute at ``attr`` (the path syntax of :meth:`cascade_execute`), never called; in every
        worker's collector (a list, in worker order) for a collector with workers."""
        return self._engine.calls.get_attr(attr)

    def map_fn(self, method_name: str, list_of_args: list[tuple] | None = None,
               list_of_kwargs: list[dict] | None = None) -> list[Any]:
        """Call the method at ``method_name`` once per set of arguments; returns the results in order.

        Raises:
            ValueError: when ``list_of_args`` and ``list_of_kwargs`` have different lengths.
        """
        return self._engine.calls.map_fn(method_name, list_of_args, list_of_kwargs)

    # ------------------------------------------------------------------ hooks and progress
    @property
    def pre_collect_hook(self) -> Callable[[], None] | None:
        """Called with no argument before each batch is collected (where the rollout runs)."""
        return self._engine.hooks["pre_collect_hook"]

    @pre_collect_hook.setter
    def pre_collect_hook(self, hook: Callable[[], None] | None) -> None:
        self._set_hook("pre_collect_hook", hook)

    @property
    def post_collect_hook(self) -> Callable[[TensorDictBase], None] | None:
        """Called with each batch once it is collected (where the rollout runs)."""
        return self._engine.hooks["post_collect_hook"]

    @post_collect_hook.setter
    def post_collect_hook(self, hook: Callable[[TensorDictBase], None] | None) -> None:
        self._set_hook("post_collect_hook", hook)

    def set_pre_collect_hook(self, hook: Callable[[], None] | None) -> None:
        """Method form of the ``pre_collect_hook`` setter (callable through ``cascade_execute``)."""
        self.pre_collect_hook = hook

    def set_post_collect_hook(self, hook: Callable[[TensorDictBase], None] | None) -> None:
        """Method form of the ``post_collect_hook`` setter (callable through ``cascade_execute``)."""
        self.post_collect_hook = hook

    def _set_hook(self, name: str, hook: Callable | None) -> None:
        if hook is not None and not callable(hook):
            raise TypeError(f"{name} must be callable or None, got {type(hook).__name__}")
        self._engine.set_hook(name, hook)

    def stats(self, workers: str = "aggregate", *, timeout: float | None = 10.0) -> dict[str, Any]:
        """A cheap snapshot of progress, plain scalars in flat keys (JSON-serialisable, safe while running;
        docs/restarts.md, "Watching a run").

        Keys: ``frames``, ``batches``, ``total_frames``, ``completed``, ``policy_version``, throughput,
        lag and where the time goes, the workers' restarts, and the progress keys of TorchRL's next
        release (``stepped_frames``, ``replay_written_frames``...; docs/trajectories.md).
        ``workers="per_worker"`` or ``"both"`` asks every worker for its own snapshot
        (``worker_<i>/<key>``), waiting at most ``timeout`` seconds (``RayCollector`` asks at every call).

        Raises:
            ValueError: for another ``workers`` value, or a negative ``timeout``.
        """
        return self._open("stats()").stats.snapshot(workers, timeout).as_dict(workers)

    @property
    def events(self) -> FleetEvents:
        """What happened to the workers, in order: restarts, preemptions, joins, adds, removes, autoscaling
        decisions (``events.since(seq)``, ``events.counts()``; docs/restarts.md, "Watching a run")."""
        return self._engine.events

    def time_split(self) -> dict[str, float]:
        """Seconds of collection so far per part: ``env`` (env steps and the rollout's bookkeeping),
        ``policy``, ``transport`` (batches crossing a process boundary) and ``waiting`` (for workers)."""
        return self._engine.stats.time_split()

    # ------------------------------------------------------------------ inside a worker
    @property
    def for_parent(self) -> ParentDuties:
        """What a worker loop asks of this collector beyond TorchRL's API when it runs inside a worker
        (one batch for the parent, the shared buffer, rollouts cut short, weights): its engine."""
        return self._open("serving a parent")

    # ------------------------------------------------------------------ seeds, state, attributes
    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """Seed the envs: the env (``Collector``), or worker 0 with ``seed`` and worker k with what worker
        k-1 returned; returns the seed for the next env. Asynchronous collectors drop the batches in flight."""
        return self._open("set_seed()").set_seed(seed, static_seed)

    def state_dict(self, *, env_state: bool = True) -> dict:
        """A checkpoint of one consistent moment from which a collector built with the same arguments
        continues exactly (docs/checkpoints.md).

        Args:
            env_state: False leaves the envs' states and the episodes in flight out.
        """
        return self._open("state_dict()").state_dict(env_state)

    def load_state_dict(self, state_dict: dict, strict: bool = True, **kwargs) -> None:
        """Continue from a checkpoint of :meth:`state_dict` (docs/checkpoints.md); a TorchRL checkpoint
        restarts the episodes.

        Raises:
            CheckpointMismatchError: for a checkpoint of a newer format or of other arguments.
        """
        self._open("load_state_dict()").load_state_dict(state_dict, strict)

    def reset(self, reset_idx: Any = None, **kwargs: Any) -> None:
        """Reset the envs (every one, or those ``reset_idx`` selects); with ``trajs_per_batch``, the
        trajectories held back are dropped."""
        self._open("reset()").reset(reset_idx if reset_idx is not None else kwargs.get("index"))

    def getattr_policy(self, name: str) -> Any:
        """An attribute of the policy (the first worker's, for collectors with workers)."""
        return self._engine.calls.getattr_policy(name)

    def getattr_env(self, name: str) -> Any:
        """An attribute of the env (the first worker's), at a dotted path (``"env.unwrapped.gravity"``);
        a batched env without it gives its sub-envs' (docs/collection.md, "Reconfiguring running envs")."""
        return self._engine.env_calls.getattr(name)

    def setattr_env(self, name: str, value: Any, *, worker_ids: int | list[int] | None = None) -> None:
        """Set the attribute at ``name`` (a dotted path; it must exist) to ``value`` in the env of each
        targeted worker (None: all), in every sub-env of a batched env. Every frame collected after it
        returns has it, and it lasts through replaced, added and joined workers and checkpoints
        (docs/collection.md, "Reconfiguring running envs").

        Raises:
            ValueError: for ``worker_ids`` naming no current worker, or an empty ``name``.
            WorkerError: naming the worker where it failed, its error's type kept (``AttributeError``).
        """
        self._open("setattr_env()").env_calls.setattr(name, value, worker_ids)

    def call_env(self, name: str, *args: Any, worker_ids: int | list[int] | None = None, **kwargs: Any) -> list[Any]:
        """Call the method at ``name`` once in each targeted worker's env; the results in worker order.
        Nothing of it lasts. Raises as :meth:`setattr_env` does."""
        return self._open("call_env()").env_calls.call(name, args, kwargs, worker_ids)

    def getattr_rb(self, name: str) -> Any:
        """An attribute of the replay buffer."""
        return getattr(self._engine.config.replay_buffer, name)

    # ------------------------------------------------------------------ weights (docs/weights.md)
    @property
    def weight_updater(self):
        return self._engine.weights.updater

    @weight_updater.setter
    def weight_updater(self, value) -> None:
        self._engine.weights.set_updater(value, self)

    def init_updater(self, *args, **kwargs) -> None:
        """Forward to ``weight_updater.init(*args, **kwargs)``; no-op without a legacy updater."""
        if self._engine.weights.updater is not None:
            self._engine.weights.updater.init(*args, **kwargs)

    @property
    def policy_version(self) -> int | str | None:
        """The version every worker acknowledged (None: untracked, or not every worker has it yet;
        docs/weights.md, "Versions")."""
        return self._engine.weights.acknowledged_version

    def get_policy_version(self) -> int | str | None:
        return self.policy_version

    def increment_version(self) -> None:
        """Bump the policy version (and the workers').

        Raises:
            RuntimeError: when a version tracker without ``increment_version`` was given.
        """
        self._engine.updates.increment_version()

    def update_policy_weights_(self, policy_or_weights: Any = None, *, weights: Any = None, policy: Any = None,
                               worker_ids: int | list[int] | torch.device | list[torch.device] | None = None,
                               model_id: str | None = None, weights_dict: dict[str, Any] | None = None,
                               **kwargs) -> None:
        """Bring the policy weights used for collection up to date (docs/weights.md); returns once every
        worker runs them.

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
        """
        engine = self._open("update_policy_weights_()")
        value = merge_weight_arguments(policy_or_weights, weights, policy, kwargs)
        engine.updates.update(value, policy_or_weights, worker_ids, model_id, weights_dict)

    def receive_weights(self, policy_or_weights: Any = None, *, weights: Any = None, policy: Any = None) -> None:
        """Apply weights to this collector's own policy (the receiver-side entry point, docs/weights.md).

        Raises:
            ValueError: for conflicting arguments, or arguments given while receiver schemes exist.
        """
        self._engine.weights.receive(merge_weight_arguments(policy_or_weights, weights, policy, {}))

    def register_scheme_receiver(self, weight_recv_schemes: dict, *, synchronize_weights: bool = True) -> None:
        """Register schemes through which this collector receives weights from a parent (docs/weights.md).

        Raises:
            RuntimeError: for a scheme already initialised as a sender.
        """
        schemes = own_schemes(weight_recv_schemes, "weight_recv_schemes", receiving=True)
        self._engine.updates.register_receivers(schemes, synchronize_weights)

    @property
    def _receiver_schemes(self) -> dict | None:
        """The receiver schemes (TorchRL's attribute, reached by ``cascade_execute`` paths)."""
        return self._engine.weights.receiver_schemes

    @property
    def _weight_sync_schemes(self) -> dict | None:
        """The sender schemes (TorchRL's attribute)."""
        return self._engine.weights.sync_schemes

    def get_model(self, model_id: str) -> Any:
        """The main-side weight source for ``model_id`` (``"policy"`` = the user's policy)."""
        return self._engine.updates.get_model(model_id)

    def weight_links(self):
        return self._engine.updates.weight_links()

    def __repr__(self) -> str:
        return self._engine.describe() if self._engine is not None else f"{type(self).__name__}(not built)"
