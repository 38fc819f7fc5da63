"""LocalEngine: the rollout loop in the calling process (``Collector``), with the parts a face calls on
every engine, each the local kind: ``updates`` (``local_weights.py``), ``calls``, ``background``,
``stats``, ``sizes``, ``checkpoint``. A worker process, a node or a Ray actor runs the same engine
inside the worker loop (docs/architecture.md)."""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Iterator

import torch
from tensordict import TensorDictBase

from ..._utils import TRAJ_IDS, as_tuple_key, resolve_attr_path, unwrap, user_stacklevel
from ...config import CollectorConfig, resolve_devices
from ...envs.adapters import env_attr
from ...envs.factory import close_env, env_keys, make_env
from ...envs.policy_transforms import env_for_policy
from ...policies import WeakPolicyRef, policy_device_copy, wrap_policy
from ...profiling import ProfileConfig, RolloutProfiler
from ...protocol import Written
from ...rollout import LocalTrajectoryCounter, Rollout, RolloutSettings
from ..options.local import LocalOptions
from .broadcast import LocalCalls
from .checkpoint import LocalCheckpoint
from .env_calls import LocalEnvCalls
from .events import FleetEvents
from .local_weights import LocalWeights
from .output import BatchOutput
from .progress import ProgressMeter
from .running import LocalRun, ThreadRun
from .state import BatchSizes, Lifecycle, Tally
from .stats import LocalStats

__all__ = ["LocalEngine", "rollout_settings", "check_env_options", "compile_policy"]


class LocalEngine:
    """The engine of a ``Collector``: its env, its policy and THE rollout loop, in this process.

    Args:
        options: the collector's typed options (:class:`~rlharvest.collectors.options.local.LocalOptions`).
        face: the public collector (held weakly; attribute paths given as weights resolve on it).
    """

    def __init__(self, options: LocalOptions, face: object) -> None:
        self.life = Lifecycle(type(face).__name__)  # closed until construction succeeds
        self.name = self.life.name
        face_ref = weakref.ref(face)
        resolve: Callable[[str], Any] = lambda path: resolve_attr_path(face_ref(), path)  # noqa: E731
        self.options = options
        self.config = config = options.config
        self.tally = Tally(config.budget)
        self.profile_config: ProfileConfig | None = None
        self.extra_checks: tuple = ()
        self.hooks: dict[str, Any] = {"pre_collect_hook": unwrap(config.pre_collect_hook),
                                      "post_collect_hook": unwrap(config.post_collect_hook)}
        self.progress = ProgressMeter()
        self.events = FleetEvents()  # one process, no fleet: nothing is published (the monitor reads it alike)
        self.env = make_env(options.create_env_fn, config.create_env_kwargs)
        served = options.served_by  # the policy runs in the parent, which serves whichever envs are ready
        self._setup_policy(served if served is not None else options.policy, options.policy_factory)
        check_env_options(config, self.env)
        settings = rollout_settings(config, self.env, self.devices())
        counter = options.trajectory_counter or LocalTrajectoryCounter()
        self.rollout = Rollout(self.env, self.policy, settings, counter)
        if served is not None:
            served.connect(self.env, self.rollout.root)
        if self.rollout.settings.use_buffers and not config.return_same_td:
            self.rollout.hand_out_batches()  # each batch a buffer of its own: nothing to copy before handing it out
        self.output = BatchOutput(config.output_rules)
        compile_policy(config, self.rollout)
        self.profiler: RolloutProfiler | None = None
        policy = self._current_policy
        self.updates = LocalWeights(self.rollout, policy, self._weight_source_ref, self.policy_is_copy,
                                    served is not None, self.env, config.track_policy_version, config.worker_idx,
                                    bool(config.max_frames_per_traj), self.policy_device, resolve, self.progress,
                                    self.name)
        self.weights = self.updates.weights
        self.calls = LocalCalls(resolve, policy, self.name)
        self.env_calls = LocalEnvCalls(self.env, self.name)
        self.thread_run = ThreadRun(lambda: self.iterate(), name=f"{self.name}-run")
        self.background = LocalRun(self.thread_run, config.replay_buffer, self.life)
        self.sizes = BatchSizes(self.tally, lambda: self.frames_per_batch)
        self.stats = LocalStats(self.tally, self.progress, self.weights,
                                lambda: self.frames_per_batch, lambda: (self.rollout.times.env, self.rollout.times.policy),
                                self.output)
        self.checkpoint = LocalCheckpoint(self.env, self.rollout, policy, self.tally, self.weights,
                                          self.output, config.replay_buffer, config.worker_idx,
                                          lambda: self.frames_per_batch, self.where(),
                                          self.env_calls)
        self.life.closed = False
        if options.weight_updater is not None:
            self.weights.set_updater(options.weight_updater, face)
        self.updates.init_senders(options.weight_sync_schemes)
        if options.weight_recv_schemes is not None:
            self.updates.register_receivers(options.weight_recv_schemes)

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

    # ------------------------------------------------------------------ what the face reads
    @property
    def frames_per_batch(self) -> int:
        """Frames of each batch: the rollout's time steps times the envs stepped at once."""
        return self.rollout.settings.time_steps * self.env_batch

    @property
    def worker_idx(self) -> int | None:
        return self.config.worker_idx

    def _current_policy(self) -> Any:
        return self.policy

    # ------------------------------------------------------------------ iteration

    def iterate(self) -> Iterator[TensorDictBase | None]:
        for batch in self._batches():
            self.progress.record(self.tally.frames, batch, self.weights.policy_version)
            yield batch

    def _batches(self) -> Iterator[TensorDictBase | None]:
        self.life.started = True
        buffer = self.config.replay_buffer
        output = self.output
        trajectories = output.trajectories
        while not self.tally.reached_total():
            if self.thread_run.should_stop():
                return
            pre = self.hooks["pre_collect_hook"]
            if pre is not None:
                pre()
            batch = self.rollout_batch()
            self.tally.frames += self._batch_frames(batch)
            post = self.hooks["post_collect_hook"]
            if buffer is not None and (not self.config.return_same_td or trajectories is not None):
                self._write_buffer(buffer, batch, hook=post)
                yield None
            else:  # return_same_td hands the batch itself over, replay buffer or not (as TorchRL)
                yield from output.deliver(batch, post, public=self.rollout.public)
        close_env(self.env)

    def rollout_batch(self, random: bool | None = None) -> TensorDictBase:
        """One raw batch (no postproc): the unit of work of a worker."""
        self.life.started = True
        self.tally.iter += 1
        if random is None:
            random = self.tally.random_phase()
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
        self.tally.frames += self._batch_frames(batch)
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
        if self.config.interruptor is None:  # every step was collected
            return batch.numel()
        traj_ids = batch.get(TRAJ_IDS, None)
        return batch.numel() if traj_ids is None else int((traj_ids != -1).sum())

    def _write_buffer(self, buffer: Any, batch: TensorDictBase, hook: Any = None) -> None:
        if not self.config.extend_buffer and self.output.trajectories is None:
            self.output.write_steps(buffer, batch, self.rollout.time_dim)
            return
        self.output.write(buffer, batch, hook)

    def write_to_replay_buffer(self, buffer: Any, batch: TensorDictBase) -> Written:
        """A worker writes the buffer its parent shares (the post-collect hook saw the batch already);
        returns what it wrote (whole, or the trajectories that ended), with its steps pending now."""
        before = self.output.wrote()
        self._write_buffer(buffer, batch)
        return self.output.wrote() - before

    def keep_for_replay_buffer(self, batch: TensorDictBase) -> Written:
        before = self.output.wrote()
        trajectories = self.output.trajectories
        if trajectories is not None:
            trajectories.ingest(self.output.postprocess(batch))
        return self.output.wrote() - before

    def resize_batches(self, frames: int) -> int:
        """Rollouts of ``frames`` frames (rounded up to the env batch) from the next one on, for a parent
        that re-split its batch (docs/elastic.md, "Autoscaling"); returns the frames it will collect."""
        rounded = -(-int(frames) // self.env_batch) * self.env_batch
        if rounded != self.frames_per_batch:
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

    # ------------------------------------------------------------------ env, seeds, state
    def set_seed(self, seed: int, static_seed: bool) -> int:
        """Seed the env (then start fresh episodes); returns the seed for the next env."""
        out = self.env.set_seed(seed, static_seed=static_seed)
        self.checkpoint.seed_chain = (seed, bool(static_seed), out)
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
            return self.checkpoint.state(env_state)

    def load_state_dict(self, state_dict: dict, strict: bool) -> None:
        with self.rollout.policy_lock:
            self.checkpoint.load(state_dict, strict)

    # ------------------------------------------------------------------ hooks, profiling
    def set_hook(self, name: str, hook: Any) -> None:
        self.hooks[name] = hook

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

    def shutdown(self, timeout: float | None = None, close_env_too: bool = True, raise_on_error: bool = True) -> None:
        """Stop the background thread, the profiler, and close the env (idempotent)."""
        if self.life.closed:
            return
        self.life.closed = True
        try:
            self.background.stop(timeout)
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
                f"frames={self.tally.frames})")


def rollout_settings(config: CollectorConfig, env: Any, devices: tuple) -> RolloutSettings:
    """The settings of a collector's rollouts: its ``frames_per_batch`` as time steps of ``env`` (rounded up
    to a multiple of the env batch, with a warning at the user's line when it was not one, or when
    ``total_frames`` or ``init_random_frames`` are not multiples of it), its ``(storing, policy, env)``
    ``devices``, buffers (preallocated unless a replay buffer is the storage or the env's specs are
    dynamic)."""
    storing, policy_device, env_device = devices
    n_env = int(env.batch_size.numel()) if len(env.batch_size) else 1
    frames = -(-config.frames_per_batch // n_env) * n_env
    if frames != config.frames_per_batch:
        warnings.warn(f"frames_per_batch={config.frames_per_batch} is not a multiple of the env batch size "
                      f"({n_env}); collecting {frames} frames per batch.", stacklevel=user_stacklevel())
    total, random_frames = config.total_frames, config.init_random_frames
    if total > 0 and total % frames:
        warnings.warn(f"total_frames={total} is not a multiple of frames_per_batch={frames}: the last batch "
                      "will overshoot.", stacklevel=user_stacklevel())
    if random_frames and random_frames % frames:
        warnings.warn(f"init_random_frames={random_frames} is not a multiple of frames_per_batch={frames}: "
                      "random actions continue to the end of the batch that reaches it.",
                      stacklevel=user_stacklevel())
    dynamic = bool(env_attr(env, "_has_dynamic_specs", False))
    use_buffers = config.use_buffers
    if use_buffers is None:
        use_buffers = config.replay_buffer is None and not dynamic
    return RolloutSettings(
        time_steps=frames // n_env, max_frames_per_traj=config.max_frames_per_traj,
        set_truncated=config.set_truncated, track_policy_version=bool(config.track_policy_version),
        exploration_type=config.exploration_type, storing_device=storing, policy_device=policy_device,
        env_device=env_device, use_buffers=use_buffers, track_traj_ids=config.track_traj_ids,
        compact_obs=config.compact_obs, lazy_stack=dynamic)


def check_env_options(config: CollectorConfig, env: Any) -> None:
    """Raises: ValueError or RuntimeError for options the env cannot honour (``max_frames_per_traj`` with a
    step counter of its own, ``set_truncated`` without a truncated key)."""
    if config.max_frames_per_traj and ("step_count",) in env_keys(env):
        raise ValueError("max_frames_per_traj is set but the env already has a 'step_count' entry (a step "
                         "counter); remove one of them.")
    done_keys = [as_tuple_key(k)[-1] for k in env_attr(env, "done_keys", [])]
    if config.set_truncated and "truncated" not in done_keys and not config.max_frames_per_traj:
        raise RuntimeError("set_truncated=True requires the env to have a 'truncated' done key (or "
                           "max_frames_per_traj).")


def compile_policy(config: CollectorConfig, rollout: Rollout) -> None:
    """``compile_policy``: ``torch.compile`` the policy's stages (``cudagraph_policy`` warns without CUDA)."""
    options = config.compile_policy
    if options:
        kwargs = options if isinstance(options, dict) else {}
        step = rollout.policy_step
        if hasattr(step, "stages"):
            step.stages = [(torch.compile(m, **kwargs), i, o) for m, i, o in step.stages]
        elif hasattr(step, "policy"):
            step.policy = torch.compile(step.policy, **kwargs)
    if config.cudagraph_policy and not torch.cuda.is_available():
        warnings.warn("cudagraph_policy needs CUDA; it is ignored on this machine.", stacklevel=user_stacklevel())
