"""BaseCollector: the iteration protocol and TorchRL's collector methods, implemented once for every collector.

A concrete collector provides ``_iterate()`` (a generator of batches, or None per batch when writing
to a replay buffer), ``_shutdown_impl()``, and optionally ``_start_impl()`` / ``_pause_impl()``.
Everything users call (``__iter__``, ``next``, ``len``, ``shutdown``, ``async_shutdown``, ``start``,
``pause``, ``enable_profile``, ``cascade_execute``, the weight methods) is defined here.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Any, Callable, Iterator

from tensordict import TensorDictBase

from .._utils import is_private_key, resolve_attr_path
from ..config import CollectorConfig
from ..profiling import ProfileConfig
from ._progress import ProgressMeter
from ._weight_api import WeightAPI
from .trajectories import TrajectoryAssembler

__all__ = ["BaseCollector"]


class BaseCollector(WeightAPI):
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

    config: CollectorConfig
    _worker_idx: int | None = None
    _frames: int = 0
    _iter: int = -1
    _iteration_started: bool = False
    _profile_config: ProfileConfig | None = None
    _persistent_iterator: Iterator | None = None
    _closed: bool = False
    _run_thread: threading.Thread | None = None
    _stop_event: threading.Event | None = None
    _background_error: BaseException | None = None
    #: drop keys with a path part starting with ``_`` from yielded batches (TorchRL's switch of the
    #: same name)
    _exclude_private_keys: bool = True
    #: checks called between env steps (``add_step_check``)
    _extra_step_checks: tuple = ()
    #: the device the policy runs on, where known (receiver schemes materialise weights there)
    policy_device = None
    #: the user's policy, where this collector keeps one (the main-side source of weights)
    policy: Any = None
    #: the module weights are read from, when it is not ``policy`` itself (a wrapped callable's)
    _weight_source: Any = None
    _pre_collect_hook: Callable[[], None] | None = None
    _post_collect_hook: Callable[[TensorDictBase], None] | None = None
    _assembler: TrajectoryAssembler | None = None
    _meter: ProgressMeter | None = None

    # ------------------------------------------------------------------ identity
    @property
    def worker_idx(self) -> int | None:
        """Index of this collector inside a parent collector; None at the top level."""
        return self._worker_idx

    @worker_idx.setter
    def worker_idx(self, value: int | None) -> None:
        self._worker_idx = value

    @property
    def frames_per_batch(self) -> int:
        return self.requested_frames_per_batch

    @property
    def requested_frames_per_batch(self) -> int:
        raise NotImplementedError

    @property
    def total_frames(self) -> int:
        return self.config.total_frames

    @property
    def replay_buffer(self):
        return self.config.replay_buffer

    @property
    def trajs_per_batch(self) -> int | None:
        """Complete trajectories per yielded batch (None: batches of ``frames_per_batch`` frames)."""
        return self.config.trajs_per_batch

    @property
    def trajs_per_write(self) -> int | None:
        """Complete trajectories per replay-buffer ``extend`` (None: all that are ready)."""
        return self.config.trajs_per_write

    @property
    def traj_format(self) -> str:
        """Layout of trajectory batches: ``"padded"`` or ``"cat"`` (docs/trajectories.md)."""
        return self.config.traj_format

    @property
    def _trajectories(self) -> TrajectoryAssembler | None:
        """Where this collector assembles complete trajectories (``trajs_per_batch``), made on first use;
        None without ``trajs_per_batch`` or when its workers assemble their own."""
        if self._assembler is None and self.config.trajs_per_batch is not None and self._assembles_trajectories():
            self._assembler = TrajectoryAssembler.from_config(self.config)
        return self._assembler

    def _assembles_trajectories(self) -> bool:
        """Hook: False when the workers assemble the trajectories (and write them) themselves."""
        return True

    # ------------------------------------------------------------------ iteration
    def _iterate(self) -> Iterator[TensorDictBase | None]:
        raise NotImplementedError

    def iterator(self) -> Iterator[TensorDictBase | None]:
        """The generator behind ``__iter__``."""
        return self._measured(self._iterate())

    def _measured(self, batches: Iterator[TensorDictBase | None]) -> Iterator[TensorDictBase | None]:
        """``batches``, each recorded for :meth:`stats` (throughput, policy lag) as it is yielded."""
        meter = self._progress
        for batch in batches:
            meter.record(self._frames, batch, self.policy_version)
            yield batch

    @property
    def _progress(self) -> ProgressMeter:
        if self._meter is None:
            self._meter = ProgressMeter()
        return self._meter

    def __iter__(self) -> Iterator[TensorDictBase | None]:
        self._iteration_started = True
        try:
            yield from self.iterator()
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

    def _reached_total(self) -> bool:
        return not self.config.endless and self._frames >= self.config.total_frames

    def __len__(self) -> int:
        if self.config.endless:
            raise RuntimeError("Non-terminating collector (total_frames=-1): len() is undefined.")
        return math.ceil(self.config.total_frames / self.requested_frames_per_batch)

    def _drop_private_keys(self, batch: TensorDictBase) -> TensorDictBase:
        if not self._exclude_private_keys:
            return batch
        private = [k for k in batch.keys(True, True) if is_private_key(k)]
        if not private:
            return batch
        batch = batch.exclude(*private)
        empty = [k for k in batch.keys(True) if isinstance(batch.get(k), TensorDictBase) and is_private_key(k)]
        return batch.exclude(*empty) if empty else batch

    # ------------------------------------------------------------------ life cycle
    def shutdown(self, timeout: float | None = None, close_env: bool = True, raise_on_error: bool = True) -> None:
        """Stop everything this collector runs and release it (idempotent)."""
        if self._closed:
            return
        self._check_shutdown_args(close_env)
        self._closed = True
        try:
            self._stop_background(timeout)
            self._shutdown_impl(timeout=timeout, close_env=close_env)
        except BaseException:
            if raise_on_error:
                raise
        finally:
            self._shutdown_schemes()

    def _check_shutdown_args(self, close_env: bool) -> None:
        """Hook: refuse shutdown arguments a collector cannot honour (before anything is stopped)."""

    def _shutdown_impl(self, timeout: float | None, close_env: bool) -> None:
        raise NotImplementedError

    def async_shutdown(self, timeout: float | None = None, close_env: bool = True) -> None:
        """Shut down a collector started with :meth:`start` (or any collector).

        Args:
            timeout: bound on the wait for background collection to stop.
            close_env: whether to close the envs.
        """
        self.shutdown(timeout=timeout, close_env=close_env)

    def __del__(self):
        try:
            self.shutdown(raise_on_error=False)
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # ------------------------------------------------------------------ running free
    def start(self) -> None:
        """Collect in the background into the replay buffer until :meth:`async_shutdown`.

        Raises:
            NotImplementedError: on collectors that cannot run free.
            RuntimeError: without a replay buffer.
        """
        raise NotImplementedError(f"Collector start() is not implemented for {type(self).__name__}.")

    def _start_thread(self) -> None:
        """Run the iterator in a daemon thread (the ``start()`` of thread-based collectors).

        While it runs, the thread is the only user of the collector's workers: ``pause()``,
        ``update_policy_weights_`` and the shutdown are what the caller may do meanwhile.
        """
        if self.replay_buffer is None:
            raise RuntimeError("start() requires a replay_buffer to write the collected data into.")
        if self.is_running():
            raise RuntimeError("The collector is already running.")
        self._iteration_started = True
        self._stop_event = threading.Event()
        self._pause_request, self._paused = threading.Event(), threading.Event()
        self._background_error = None
        self._run_thread = threading.Thread(target=self._run_in_thread, name=f"{type(self).__name__}-run",
                                            daemon=True)
        self._run_thread.start()

    def _run_in_thread(self) -> None:
        try:
            for _ in self.iterator():
                if self._stop_event.is_set():
                    break
                if self._pause_request.is_set():
                    self._paused.set()  # the batch just written was the last one before the pause
                    while self._pause_request.is_set() and not self._stop_event.wait(0.01):
                        pass
                    self._paused.clear()
        except BaseException as err:  # surfaced by pause() / async_shutdown
            self._background_error = err
        finally:
            self._paused.set()

    def _pause_thread(self, timeout: float = 60.0):
        """``pause()`` of thread-based background collection: no buffer write inside the block."""
        if not self.is_running():
            raise RuntimeError("Collector cannot be paused: it is not collecting in the background (start()).")
        self._pause_request.set()
        try:
            if not self._paused.wait(timeout):
                raise TimeoutError(f"background collection did not pause within {timeout:g} s.")
            if self._background_error is not None:
                raise self._background_error
            yield
        finally:
            self._pause_request.clear()

    @contextlib.contextmanager
    def _at_batch_boundary(self):
        """A block in which no batch is being collected or written: a ``start()`` thread is paused at
        its next batch boundary for the block (checkpoints hold one consistent moment)."""
        if self._run_thread is None or not self._run_thread.is_alive():
            yield
            return
        with contextlib.contextmanager(self._pause_thread)():
            yield

    def is_running(self) -> bool:
        """Whether background collection (``start()``) is in progress."""
        return self._run_thread is not None and self._run_thread.is_alive()

    def _interrupt_background(self) -> None:
        """Hook: make a background batch in progress end soon (collectors with workers interrupt them)."""

    def _stop_background(self, timeout: float | None) -> None:
        if self._stop_event is not None:
            self._stop_event.set()
        thread = self._run_thread
        if thread is not None and thread is not threading.current_thread():
            if thread.is_alive():
                self._interrupt_background()
            thread.join(timeout if timeout is not None else 30.0)
            if thread.is_alive():
                raise TimeoutError(f"Background collection did not stop within {timeout} s.")
        self._run_thread = None

    def _should_stop(self) -> bool:
        return self._stop_event is not None and self._stop_event.is_set()

    @contextlib.contextmanager
    def pause(self):
        """Context manager pausing background collection (buffer writes stop inside the block).

        Raises:
            NotImplementedError: when entered on collectors that cannot pause.
            RuntimeError: when the collector is not running free.
        """
        yield from self._pause_impl()

    def _pause_impl(self):
        raise NotImplementedError(f"Collector pause() is not implemented for {type(self).__name__}.")
        yield  # pragma: no cover

    # ------------------------------------------------------------------ profiling
    def enable_profile(
        self,
        *,
        workers: list[int] | None = None,
        num_rollouts: int = 3,
        warmup_rollouts: int = 1,
        save_path=None,
        activities: list[str] | None = None,
        record_shapes: bool = True,
        profile_memory: bool = False,
        with_stack: bool = True,
        with_flops: bool = False,
        on_trace_ready=None,
    ) -> None:
        """Profile rollouts with torch.profiler and export a Chrome trace (docs/collection.md, "Profiling").

        Raises:
            RuntimeError: after iteration started.
            ValueError: when ``num_rollouts <= warmup_rollouts`` or ``warmup_rollouts < 0``.

        Example:
            >>> collector.enable_profile(num_rollouts=3, warmup_rollouts=1,   # doctest: +SKIP
            ...                          save_path="traces/trace_{worker_idx}.json")
        """
        if self._iteration_started:
            raise RuntimeError("Cannot enable profiling after iteration has started; call it before iterating.")
        self._profile_config = ProfileConfig(
            workers=list(workers) if workers is not None else [0],
            num_rollouts=num_rollouts,
            warmup_rollouts=warmup_rollouts,
            save_path=save_path,
            activities=list(activities) if activities is not None else ["cpu", "cuda"],
            record_shapes=record_shapes,
            profile_memory=profile_memory,
            with_stack=with_stack,
            with_flops=with_flops,
            on_trace_ready=on_trace_ready,
        )
        self._apply_profile_config(self._profile_config)

    def _apply_profile_config(self, config: ProfileConfig) -> None:
        """Hook: start profiling where rollouts run."""

    def disable_profile(self) -> None:
        """Stop profiling (a trace being recorded is written as it stands); no-op when not profiling.

        Example:
            >>> collector.disable_profile()                         # doctest: +SKIP
        """
        if self._profile_config is None:
            return
        try:
            self._stop_profiling()
        finally:
            self._profile_config = None

    def _stop_profiling(self) -> None:
        """Hook: stop the profiler where rollouts run."""

    @property
    def profile_config(self) -> ProfileConfig | None:
        """The stored profiling configuration, or None."""
        return self._profile_config

    # ------------------------------------------------------------------ remote calls
    def cascade_execute(self, attr_path: str, *args, **kwargs) -> Any:
        """Resolve ``attr_path`` on this collector and call it (or return it when not callable).

        Raises:
            AttributeError: naming a missing segment.
            ValueError: when arguments are given for a non-callable target.

        Example:
            >>> collector.cascade_execute("_receiver_schemes['policy'].connect")  # doctest: +SKIP
        """
        target = resolve_attr_path(self, attr_path)
        if callable(target):
            return target(*args, **kwargs)
        if args or kwargs:
            raise ValueError(f"{attr_path!r} resolves to a non-callable {type(target).__name__}; it takes no arguments.")
        return target

    def get_distant_attr(self, attr: str) -> Any:
        """The attribute at ``attr`` (the path syntax of :meth:`cascade_execute`), never called.

        Example:
            >>> collector.get_distant_attr("worker_idx")            # doctest: +SKIP
        """
        return resolve_attr_path(self, attr)

    def map_fn(self, method_name: str, list_of_args: list[tuple] | None = None,
               list_of_kwargs: list[dict] | None = None) -> list[Any]:
        """Call the method at ``method_name`` once per set of arguments; returns the results in order.

        Raises:
            ValueError: when ``list_of_args`` and ``list_of_kwargs`` have different lengths.

        Example:
            >>> collector.map_fn("get_distant_attr", [("worker_idx",), ("frames_per_batch",)])  # doctest: +SKIP
            [None, 16]
        """
        calls = _argument_sets(list_of_args, list_of_kwargs, None)
        method = resolve_attr_path(self, method_name)
        return [method(*args, **kwargs) for args, kwargs in calls]

    # ------------------------------------------------------------------ hooks and progress
    @property
    def pre_collect_hook(self) -> Callable[[], None] | None:
        """Called with no argument before each batch is collected (where the rollout runs)."""
        return self._pre_collect_hook

    @pre_collect_hook.setter
    def pre_collect_hook(self, hook: Callable[[], None] | None) -> None:
        self._set_hook("_pre_collect_hook", hook)

    @property
    def post_collect_hook(self) -> Callable[[TensorDictBase], None] | None:
        """Called with each batch once it is collected (where the rollout runs)."""
        return self._post_collect_hook

    @post_collect_hook.setter
    def post_collect_hook(self, hook: Callable[[TensorDictBase], None] | None) -> None:
        self._set_hook("_post_collect_hook", hook)

    def set_pre_collect_hook(self, hook: Callable[[], None] | None) -> None:
        """Method form of the ``pre_collect_hook`` setter (callable through ``cascade_execute``)."""
        self.pre_collect_hook = hook

    def set_post_collect_hook(self, hook: Callable[[TensorDictBase], None] | None) -> None:
        """Method form of the ``post_collect_hook`` setter (callable through ``cascade_execute``)."""
        self.post_collect_hook = hook

    def _set_hook(self, name: str, hook: Callable | None) -> None:
        if hook is not None and not callable(hook):
            raise TypeError(f"{name.strip('_')} must be callable or None, got {type(hook).__name__}")
        setattr(self, name, hook)

    def stats(self) -> dict[str, int | float | bool]:
        """A cheap snapshot of progress, plain scalars only (JSON-serialisable, safe while running).

        Keys: ``frames``, ``batches``, ``total_frames`` (absent when endless), ``completed``,
        ``requested_frames_per_batch``, and ``policy_version`` when versions are tracked; once a batch
        was yielded, ``frames_per_s`` (overall) and ``frames_per_s_recent`` (last 16 batches), and
        ``policy_lag`` (how many versions the last batch's oldest frame is behind) when tracked;
        ``time_env_s``, ``time_policy_s``, ``time_transport_s``, ``time_waiting_s`` (see
        :meth:`time_split`); after a weight update, ``weight_sync_s_last`` and
        ``weight_sync_s_median`` (seconds, over the last 64 updates).

        Example:
            >>> collector.stats()["frames"]                          # doctest: +SKIP
            0
        """
        stats: dict[str, int | float | bool] = {"frames": int(self._frames), "batches": int(self._iter + 1)}
        if not self.config.endless:
            stats["total_frames"] = int(self.config.total_frames)
        stats["completed"] = bool(self._reached_total())
        stats["requested_frames_per_batch"] = int(self.requested_frames_per_batch)
        version = self.policy_version
        if isinstance(version, int):
            stats["policy_version"] = version
        stats.update(self._progress.stats())
        stats.update({f"time_{part}_s": seconds for part, seconds in self.time_split().items()})
        return stats

    def time_split(self) -> dict[str, float]:
        """Seconds of collection so far per part: ``env`` (env steps and the rollout's bookkeeping),
        ``policy``, ``transport`` (batches crossing a process boundary) and ``waiting`` (for workers).

        Env and policy are estimated from one step per batch timed in full (docs/restarts.md,
        "Watching a run"); the others are measured.
        """
        return dict(self._progress.seconds)

    # ------------------------------------------------------------------ the worker-loop contract
    # What ``rlharvest.worker.WorkerCollector`` asks of the collector a worker runs.
    def collect_for_parent(self, random: bool) -> TensorDictBase:
        """One batch for a parent collector (the next batch of an endless iteration)."""
        return self.next()

    def write_to_replay_buffer(self, buffer, batch: TensorDictBase) -> None:
        """Write a batch collected for a parent into the replay buffer the parent shares."""
        buffer.extend(batch)

    def add_step_check(self, check) -> None:
        """Call ``check()`` between env steps of every rollout; a True result ends the rollout early."""
        self._extra_step_checks = [*self._extra_step_checks, check]

    def write_batches_into(self, buffer: TensorDictBase, batch: TensorDictBase) -> None:
        """Write future batches into ``buffer`` (same layout) when ``batch`` is this collector's own
        output buffer, so a transport publishes them without a copy. Default: keep writing as before."""

    def use_profile_config(self, config: ProfileConfig) -> None:
        """Profile the next rollouts as ``config`` says, also once iteration started (a parent asked)."""
        self._iteration_started = False
        self._profile_config = config
        self._apply_profile_config(config)

    def set_policy_version(self, version: int) -> None:
        """Count policy versions from ``version`` on (a worker replacing another joins at the current one)."""
        self._policy_version = int(version)
        self._on_version_bump(self._policy_version)

    def keep_for_replay_buffer(self, batch: TensorDictBase) -> None:
        """Hook: ``batch`` goes to the parent, which allocates the replay buffer's storage from it, before
        this collector can write the buffer itself (a collector assembling trajectories keeps them)."""

    # ------------------------------------------------------------------ subclass API
    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        raise NotImplementedError

    def state_dict(self, *, env_state: bool = True) -> dict:
        """A checkpoint from which a collector built with the same arguments continues (docs/checkpoints.md)."""
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict, **kwargs) -> None:
        raise NotImplementedError

    def get_model(self, model_id: str):
        """The main-side weight source for ``model_id`` (``"policy"`` = the user's policy)."""
        if model_id == "policy":
            return self._weight_source or self.policy
        return resolve_attr_path(self, model_id)

    def __repr__(self) -> str:
        total = "endless" if self.config.endless else self.config.total_frames
        return (f"{type(self).__name__}(frames_per_batch={self.requested_frames_per_batch}, "
                f"total_frames={total}, frames={self._frames})")


def _argument_sets(list_of_args, list_of_kwargs, count: int | None) -> list[tuple[tuple, dict]]:
    """``(args, kwargs)`` pairs for ``map_fn``; ``count`` = the number of calls required (None: any)."""
    if list_of_args is None and list_of_kwargs is None:
        list_of_args = [()] * (count if count is not None else 1)
    if list_of_args is None:
        list_of_args = [()] * len(list_of_kwargs)
    if list_of_kwargs is None:
        list_of_kwargs = [{}] * len(list_of_args)
    if len(list_of_args) != len(list_of_kwargs):
        raise ValueError(f"list_of_args and list_of_kwargs must have the same length, got {len(list_of_args)} "
                         f"and {len(list_of_kwargs)}.")
    if count is not None and len(list_of_args) != count:
        raise ValueError(f"Expected {count} argument entries (one per worker), got {len(list_of_args)}.")
    return [(tuple(args), dict(kwargs)) for args, kwargs in zip(list_of_args, list_of_kwargs)]
