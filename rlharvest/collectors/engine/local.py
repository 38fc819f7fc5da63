"""LocalEngine: the rollout loop in the calling process (``Collector``), with the parts every engine
shares (weights, output, stats, background run, checkpoints). A worker process, a node or a Ray actor
runs the same engine inside the worker loop (docs/architecture.md)."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch
from tensordict import TensorDictBase

from ..._utils import TRAJ_IDS, resolve_attr_path, unwrap
from ...config import resolve_devices
from ...envs.factory import close_env, make_env
from ...envs.policy_transforms import appended_by_collector, env_for_policy
from ...policies import WeakPolicyRef, policy_device_copy, wrap_policy
from ...profiling import ProfileConfig, RolloutProfiler
from ...rollout import LocalTrajectoryCounter, Rollout
from ...weight_update.strategy import copy_weights_, weights_of
from ..options.local import LocalOptions
from . import checkpoint
from .broadcast import argument_sets
from .events import FleetEvents
from ._model_paths import resolve_env_transform_path
from .local_setup import check_env_options, compile_policy, round_frames_per_batch, rollout_settings
from .output import BatchOutput
from .progress import ProgressMeter
from .running import ThreadRun
from .stats import StatsSnapshot, check_view
from .weights import WeightPublisher

__all__ = ["LocalEngine"]


class LocalEngine:
    """The engine of a ``Collector``: its env, its policy and THE rollout loop, in this process.

    Args:
        options: the collector's typed options (:class:`~rlharvest.collectors.options.local.LocalOptions`).
        face: the public collector (held weakly; attribute paths given as weights resolve on it).
    """

    def __init__(self, options: LocalOptions, face: Any) -> None:
        self.name = type(face).__name__
        self._face = weakref.ref(face)
        self.options = options
        self.config = config = options.config
        self.closed = True  # until construction succeeds
        self.frames, self.iter = 0, -1
        self.iteration_started = False
        self.profile_config: ProfileConfig | None = None
        #: ``(seed, static_seed, next seed)`` of the last ``set_seed`` (a checkpoint keeps the seed chain)
        self.seed_chain: tuple | None = None
        self.extra_checks: tuple = ()
        self.hooks: dict[str, Any] = {"pre_collect_hook": unwrap(config.pre_collect_hook),
                                      "post_collect_hook": unwrap(config.post_collect_hook)}
        self.progress = ProgressMeter()
        self.events = FleetEvents()  # one process, no fleet: nothing is published (the monitor reads it alike)
        self.weights = WeightPublisher(self, self.progress, config.track_policy_version)
        self.env = make_env(options.create_env_fn, config.create_env_kwargs)
        served = options.served_by  # the policy runs in the parent, which serves whichever envs are ready
        self._served = served is not None
        self._setup_policy(served if served is not None else options.policy, options.policy_factory)
        check_env_options(config, self.env)
        self.frames_per_batch = round_frames_per_batch(config, self.env_batch)
        counter = options.trajectory_counter or LocalTrajectoryCounter()
        self.rollout = Rollout(self.env, self.policy, rollout_settings(config, self.env, self.frames_per_batch, self.devices()), counter)
        if served is not None:
            served.connect(self.env, self.rollout.root)
        if self.rollout.settings.use_buffers and not config.return_same_td:
            self.rollout.hand_out_batches()  # each batch a buffer of its own: nothing to copy before handing it out
        self.output = BatchOutput(config)
        compile_policy(config, self.rollout)
        self.profiler: RolloutProfiler | None = None
        self.thread_run = ThreadRun(lambda: self.iterate(), name=f"{self.name}-run")
        self.closed = False
        if options.weight_updater is not None:
            self.weights.set_updater(options.weight_updater, face)
        self._init_sender_schemes(options.weight_sync_schemes)
        if options.weight_recv_schemes is not None:
            self.register_receivers(options.weight_recv_schemes)

    # ------------------------------------------------------------------ construction
    def _setup_policy(self, policy: Any, policy_factory: Any) -> None:
        if policy is None and policy_factory is not None:
            policy = unwrap(policy_factory)()
        config = self.config
        self.env = env_for_policy(config.auto_register_policy_transforms, self.env, policy, self.name)
        storing, policy_device, env_device = resolve_devices(config.device, config.storing_device,
                                                             config.policy_device, config.env_device, self.env)
        self.storing_device, self.policy_device, self.env_device = storing, policy_device, env_device
        wrapped = wrap_policy(policy, self.env, config.trust_policy)
        self.policy, source = policy_device_copy(wrapped, policy_device)
        self._weight_source_ref = WeakPolicyRef(policy if policy is not None else wrapped)
        self.policy_is_copy = self.policy is not source

    def devices(self) -> tuple:
        """``(storing, policy, env)`` devices."""
        return self.storing_device, self.policy_device, self.env_device

    @property
    def env_batch(self) -> int:
        """Envs stepped at once (the env's batch size)."""
        return int(self.env.batch_size.numel()) if len(self.env.batch_size) else 1

    def _init_sender_schemes(self, schemes: dict | None) -> None:
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

    # ------------------------------------------------------------------ what the face reads
    @property
    def requested_frames_per_batch(self) -> int:
        return self.frames_per_batch

    @property
    def worker_idx(self) -> int | None:
        return self.config.worker_idx

    @property
    def policy_lock(self):
        return self.rollout.policy_lock

    def check_open(self, action: str) -> None:
        """Raises: RuntimeError naming ``action`` once the collector is shut down."""
        if self.closed:
            raise RuntimeError(f"{self.name} is shut down: {action} is not possible any more (build a new collector).")

    def is_running(self) -> bool:
        return self.thread_run.is_running()

    def time_split(self) -> dict[str, float]:
        split = dict(self.progress.seconds)
        split["env"] += self.rollout.times.env
        split["policy"] += self.rollout.times.policy
        return split

    # ------------------------------------------------------------------ iteration
    def reached_total(self) -> bool:
        return not self.config.endless and self.frames >= self.config.total_frames

    def num_batches(self) -> int:
        """Raises: RuntimeError for an endless collector."""
        if self.config.endless:
            raise RuntimeError(f"Non-terminating collector (total_frames={self.config.total_frames}): len() is "
                               "undefined.")
        return self.config.num_batches(self.frames_per_batch)

    def iterate(self) -> Iterator[TensorDictBase | None]:
        for batch in self._batches():
            self.progress.record(self.frames, batch, self.weights.policy_version)
            yield batch

    def _batches(self) -> Iterator[TensorDictBase | None]:
        self.iteration_started = True
        buffer = self.config.replay_buffer
        output = self.output
        trajectories = output.trajectories
        while not self.reached_total():
            if self.thread_run.should_stop():
                return
            pre = self.hooks["pre_collect_hook"]
            if pre is not None:
                pre()
            batch = self.rollout_batch()
            self.frames += self._batch_frames(batch)
            post = self.hooks["post_collect_hook"]
            if buffer is not None and (not self.config.return_same_td or trajectories is not None):
                self._write_buffer(buffer, batch, hook=post)
                yield None
            else:  # return_same_td hands the batch itself over, replay buffer or not (as TorchRL)
                yield from output.deliver(batch, post)
        close_env(self.env)

    def rollout_batch(self, random: bool | None = None) -> TensorDictBase:
        """One raw batch (no postproc): the unit of work of a worker."""
        self.iteration_started = True
        self.iter += 1
        if random is None:
            random = self.config.in_random_phase(self.frames)
        if self.config.reset_at_each_iter and self.rollout.stepped_since_reset:
            self.rollout.reset()
        hook = self._between_steps()
        profiler = self.profiler
        if profiler is not None and profiler.active:
            with profiler.rollout():
                return self.rollout.collect(random=random, between_steps=hook)
        return self.rollout.collect(random=random, between_steps=hook)

    def collect_for_parent(self, random: bool) -> TensorDictBase:
        pre = self.hooks["pre_collect_hook"]
        if pre is not None:
            pre()
        batch = self.rollout_batch(random)
        self.frames += self._batch_frames(batch)
        post = self.hooks["post_collect_hook"]
        if post is not None:
            post(batch)
        return batch

    def _between_steps(self):
        checks = []
        interruptor = self.config.interruptor
        if interruptor is not None:
            checks.append(interruptor.collection_stopped)
        if self.thread_run.stop_event is not None:
            checks.append(self.thread_run.stop_event.is_set)
        checks.extend(self.extra_checks)
        poll = self.weights.poll_hook()
        if poll is not None:
            checks.append(poll)
        if not checks:
            return None
        if len(checks) == 1:
            return checks[0]
        return lambda: any([check() for check in checks])

    def _batch_frames(self, batch: TensorDictBase) -> int:
        if self.config.replay_buffer is not None:
            return self.frames_per_batch
        traj_ids = batch.get(TRAJ_IDS, None)
        if self.config.interruptor is None or traj_ids is None:
            return batch.numel()
        return int((traj_ids != -1).sum())

    def _write_buffer(self, buffer: Any, batch: TensorDictBase, hook: Any = None) -> None:
        if not self.config.extend_buffer and self.output.trajectories is None:
            self.output.write_steps(buffer, batch, self.rollout.time_dim)
            return
        self.output.write(buffer, batch, hook)

    def write_to_replay_buffer(self, buffer: Any, batch: TensorDictBase) -> None:
        """A worker writes the buffer its parent shares (the post-collect hook saw the batch already)."""
        self._write_buffer(buffer, batch)

    def keep_for_replay_buffer(self, batch: TensorDictBase) -> None:
        trajectories = self.output.trajectories
        if trajectories is not None:
            trajectories.ingest(self.output.postprocess(batch))

    def resize_batches(self, frames: int) -> int:
        """Rollouts of ``frames`` frames (rounded up to the env batch) from the next one on, for a parent
        that re-split its batch (docs/elastic.md, "Autoscaling"); returns the frames it will collect."""
        rounded = -(-int(frames) // self.env_batch) * self.env_batch
        if rounded != self.frames_per_batch:
            self.frames_per_batch = rounded
            self.rollout.resize(rounded // self.env_batch)
        return rounded

    def write_batches_into(self, buffer: TensorDictBase, batch: TensorDictBase) -> None:
        if self.rollout.buffer is batch:
            self.rollout.set_buffer(buffer)

    def add_step_check(self, check) -> None:
        self.extra_checks = (*self.extra_checks, check)

    def fake_batch(self) -> TensorDictBase:
        """A zero batch shaped like the ones yielded (keys, shapes, dtypes, names).

        Raises:
            NotImplementedError: before the first batch, for an env without ``fake_tensordict``.
        """
        rollout = self.rollout
        batch = rollout.fake_batch()
        if self.config.set_truncated:  # the last step of every batch is truncated
            steps = batch.shape[rollout.time_dim]
            for truncated_key, done_key in rollout.adapter.truncation_keys:
                for key in (truncated_key, done_key):
                    full = ("next", *((key,) if isinstance(key, str) else key))
                    if full in batch.keys(True, True):
                        batch.get(full).narrow(rollout.time_dim, steps - 1, 1).fill_(True)
        return self.output.postprocess(batch)

    # ------------------------------------------------------------------ weights (WeightOwner)
    @property
    def weight_source(self) -> Any:
        return self._weight_source_ref()

    def get_model(self, model_id: str) -> Any:
        if model_id == "policy":
            source = self.weight_source
            return source if source is not None else self.policy
        step_counter = bool(self.config.max_frames_per_traj)  # TorchRL's env would have one: ids index its transforms
        if step_counter or appended_by_collector(self.env):
            found, model = resolve_env_transform_path(self.env, model_id, step_counter)
            if found:
                return model
        return resolve_attr_path(self._face(), model_id)

    def update_local_policy(self, value: Any) -> None:
        if value is None:
            source = self.weight_source
            if source is None or source is self.policy or not isinstance(source, torch.nn.Module):
                self.weights.increment()
                return
            value = source
        self.copy_into_local_policy(self.weights.weights_from_value(value))
        self.weights.increment()

    def copy_into_local_policy(self, weights: TensorDictBase) -> None:
        if not isinstance(self.policy, torch.nn.Module):
            return
        with self.rollout.policy_lock:
            copy_weights_(weights_of(self.policy), weights)

    def after_weights_sent(self, model_ids: list[str]) -> None:
        if "policy" in model_ids:
            self.weights.increment()

    def on_version_bump(self, version: int) -> None:
        self.rollout.policy_version = version

    def resolve(self, path: str) -> Any:
        return resolve_attr_path(self._face(), path)

    def increment_version(self) -> None:
        self.weights.increment()

    def update_weights(self, value: Any, policy_or_weights: Any, worker_ids: Any, model_id: str | None,
                       weights_dict: dict | None) -> None:
        """``update_policy_weights_``: the policy runs here, its weights are copied in directly."""
        self.weights.update(value, policy_or_weights, worker_ids, model_id, weights_dict)

    def weights_received(self, model_id: str, weights: TensorDictBase, applied_to: Any) -> None:
        """A receiver scheme applied ``weights`` to ``applied_to``: bring our own policy copy up to date."""
        weights_api = self.weights
        if not weights_api.forwards(model_id):
            return
        if (model_id == "policy" and applied_to is self.get_model("policy") and not self.policy_is_copy
                and weights_api.updater is None and not weights_api.sync_schemes):
            weights_api.increment()  # the scheme wrote into the very modules this collector runs
            return
        weights_api.update(weights, weights, None, model_id, None)

    def swaps_between_steps(self, model_id: str, model: Any) -> bool:
        """Whether a receiver scheme may swap ``model``'s weights in from its own thread, under
        :attr:`policy_lock`: the policy runs here under that lock (an env step's action and the
        version it records at once), and :meth:`weights_received` then only moves the version."""
        weights_api = self.weights
        return (model_id == "policy" and model is self.get_model("policy") and not self.policy_is_copy
                and weights_api.updater is None and not weights_api.sync_schemes
                and weights_api.version_tracker in (None, False, True) and not self._served)

    def forward_initial_weights(self, model_id: str, weights: TensorDictBase) -> None:
        """No workers of our own: nothing to pass on."""

    def weight_links(self):
        raise RuntimeError(f"{self.name} has no workers to send weights to.")

    def register_receivers(self, schemes: dict, synchronize: bool = True) -> None:
        self.weights.register_receivers(schemes, self, self.worker_idx, synchronize)

    # ------------------------------------------------------------------ env, seeds, state
    def set_seed(self, seed: int, static_seed: bool) -> int:
        """Seed the env (then start fresh episodes); returns the seed for the next env."""
        out = self.env.set_seed(seed, static_seed=static_seed)
        self.seed_chain = (seed, bool(static_seed), out)
        self.rollout.reset()
        if self.output.trajectories is not None:
            self.output.trajectories.drop_in_flight()  # those episodes will never end
        return out

    def reset(self, index: Any = None) -> None:
        trajectories = self.output.trajectories
        if index is None:
            self.rollout.reset()
            if trajectories is not None:
                trajectories.flush()
            return
        if not len(self.env.batch_size):
            raise RuntimeError("reset(index=...) needs a batched env.")
        mask = torch.zeros(self.env.batch_size, dtype=torch.bool)
        mask[index] = True
        if trajectories is not None:
            trajectories.drop_in_flight(self.rollout.traj_ids[mask].tolist())
        self.rollout.reset(mask)

    def where(self) -> str:
        return "Collector" if self.worker_idx is None else f"worker {self.worker_idx}"

    def state_dict(self, env_state: bool) -> dict:
        # under the policy's lock too: a receiver may swap weights in (and move the version) from its
        # own thread (swaps_between_steps), and a checkpoint holds one version's weights with its number
        with self.thread_run.at_batch_boundary(), self.rollout.policy_lock:
            return checkpoint.local_state(self, env_state)

    def load_state_dict(self, state_dict: dict, strict: bool) -> None:
        with self.rollout.policy_lock:
            checkpoint.load_local_state(self, state_dict, strict)

    # ------------------------------------------------------------------ hooks, attributes, profiling
    def set_hook(self, name: str, hook: Any) -> None:
        self.hooks[name] = hook

    def cascade_execute(self, attr_path: str, args: tuple, kwargs: dict) -> Any:
        raise AttributeError(f"{attr_path!r}: a {self.name} has no workers to run it in.")

    def getattr_policy(self, name: str) -> Any:
        return getattr(self.policy, name)

    def getattr_env(self, name: str) -> Any:
        return getattr(self.env, name)

    def get_distant_attr(self, attr: str) -> Any:
        return resolve_attr_path(self._face(), attr)

    def map_fn(self, method_name: str, list_of_args, list_of_kwargs) -> list[Any]:
        method = resolve_attr_path(self._face(), method_name)
        return [method(*args, **kwargs) for args, kwargs in argument_sets(list_of_args, list_of_kwargs, None)]

    def enable_profile(self, config: ProfileConfig) -> None:
        self.profile_config = config
        label = "collector_rollout" if self.worker_idx is None else f"worker_{self.worker_idx}_rollout"
        if self.profiler is not None:
            self.profiler.stop()
        self.profiler = RolloutProfiler(config, worker_idx=self.worker_idx or 0, label=label)

    def disable_profile(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
        self.profile_config = None

    # ------------------------------------------------------------------ stats
    def stats(self, workers: str = "aggregate", timeout: float | None = None) -> StatsSnapshot:
        check_view(workers)
        return StatsSnapshot(
            frames=self.frames, batches=self.iter + 1,
            total_frames=None if self.config.endless else self.config.total_frames, completed=self.reached_total(),
            requested_frames_per_batch=self.frames_per_batch, policy_version=self.weights.policy_version,
            progress=self.progress.stats(), times=self.time_split(), weight_version=self.weights.version,
            weight_syncs=self.progress.weight_sync_histogram())

    # ------------------------------------------------------------------ running free, shutdown
    def start_free(self) -> None:
        """Raises: RuntimeError without a replay buffer or when already running."""
        if self.config.replay_buffer is None:
            raise RuntimeError("start() requires a replay_buffer to write the collected data into.")
        if self.is_running():
            raise RuntimeError("The collector is already running.")
        self.iteration_started = True
        self.thread_run.start()

    @contextlib.contextmanager
    def pause(self):
        """Raises: NotImplementedError, as TorchRL's ``Collector`` (its background thread stops with
        ``async_shutdown()``)."""
        raise NotImplementedError(f"Collector pause() is not implemented for {self.name}.")
        yield  # pragma: no cover

    def shutdown(self, timeout: float | None = None, close_env_too: bool = True, raise_on_error: bool = True) -> None:
        """Stop the background thread, the profiler, and close the env (idempotent)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.thread_run.stop(timeout)
            if self.profiler is not None:
                self.profiler.stop()
            if close_env_too:
                close_env(self.env)
        except BaseException:
            if raise_on_error:
                raise
        finally:
            self.weights.shutdown()

    def describe(self) -> str:
        total = "endless" if self.config.endless else self.config.total_frames
        return (f"{self.name}(frames_per_batch={self.frames_per_batch}, total_frames={total}, "
                f"frames={self.frames})")
