"""Collector: the rollout loop in the calling process (docs/collection.md)."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterator

import torch
from tensordict import TensorDictBase

from .._utils import TRAJ_IDS, as_tuple_key, unwrap
from ..checkpoint import CHECKPOINT_KEY, check_compatible
from ..config import CollectorConfig, resolve_devices
from ..envs.adapters import env_attr
from ..envs.factory import close_env as _close_env  # shutdown() takes an argument named close_env
from ..envs.factory import env_keys, make_env
from ..policies import ExplorationType, WeakPolicyRef, policy_device_copy, wrap_policy
from ..profiling import ProfileConfig, RolloutProfiler
from ..rollout import LocalTrajectoryCounter, Rollout, RolloutSettings, TrajectoryCounter
from ..weight_update.strategy import copy_weights_, weights_of
from . import _checkpoint
from ._dispatch import BackendDispatch
from ._signatures import constructor_arguments
from ._model_paths import resolve_env_transform_path
from .base import BaseCollector
from .utils import split_trajectories

__all__ = ["Collector", "make_env"]


def _check_arguments(*, unknown: dict, reset_when_done: bool, policy: Any, policy_factory: Any, weight_updater: Any,
                     weight_sync_schemes: Any, local_init_rb: bool | None) -> None:
    """The checks of Collector's own arguments (CollectorConfig checks the shared ones)."""
    if unknown:
        raise TypeError(f"Collector got unexpected keyword argument(s) {sorted(unknown)}.")
    if not reset_when_done:
        raise ValueError("reset_when_done=False is not supported (collectors always reset finished envs).")
    if policy is not None and policy_factory is not None:
        raise TypeError("policy_factory cannot be used together with policy.")
    if weight_updater is not None and weight_sync_schemes:
        raise TypeError("Pass either weight_updater or weight_sync_schemes, not both.")
    if local_init_rb is False:  # the old per-collector initialisation; storage-level init is all there is
        warnings.warn("local_init_rb=False is deprecated and ignored (buffers are always initialised by their "
                      "storage).", FutureWarning, stacklevel=3)


def _snapshot(weights: dict) -> dict:
    """A copy of a state dict: later updates do not change the checkpoint, and a weight that is a view
    of a larger buffer (weights received into one flat buffer) is saved alone, not with the buffer."""
    copied = type(weights)((name, value.detach().clone()) for name, value in weights.items())
    if hasattr(weights, "_metadata"):
        copied._metadata = weights._metadata
    return copied


class Collector(BaseCollector, metaclass=BackendDispatch):
    """Collects batches by running the rollout loop in the calling process.

    ``Collector(..., backend=..., num_collectors=..., sync=..., backend_options=...)`` builds the
    collector of another backend instead (``"process"``: worker processes, ``"distributed"``, ``"rpc"``,
    ``"submitit"``), as TorchRL 0.14 does; ``backend="direct"`` (the default without
    ``num_collectors``) is this class.

    Args:
        create_env_fn: an env (docs/envs.md) or a callable returning one.
        policy: a callable TensorDict -> TensorDict (usually an ``nn.Module``); None = random actions.

    Keyword Args:
        policy_factory: zero-argument callable returning the policy (exclusive with ``policy``).
        frames_per_batch: frames per batch, rounded up to a multiple of the env batch size.
        total_frames: stop after this many frames (-1 = endless).
        device, storing_device, policy_device, env_device: where the policy runs, the env steps and
            batches are stored (docs/collection.md, "Devices").
        create_env_kwargs: kwargs for ``create_env_fn``.
        max_frames_per_traj: truncate trajectories after this many steps (adds ``step_count``).
        init_random_frames: random actions until this many frames were collected.
        reset_at_each_iter: reset every sub-env before each batch.
        postproc: callable applied to each batch (after ``split_trajs``).
        split_trajs: regroup each batch per trajectory (zero-padded, with a mask).
        exploration_type: ambient exploration mode during rollouts.
        return_same_td: yield the internal buffer itself instead of a copy.
        reset_when_done: only True is supported.
        interruptor: object whose ``collection_stopped()`` ends a rollout early.
        set_truncated: mark the last step of every batch as truncated.
        use_buffers: stack into a preallocated buffer (default True without a replay buffer).
        replay_buffer: object with ``extend``; batches go there and iteration yields None.
        extend_buffer: write whole batches (True) or step by step (deprecated False).
        local_init_rb: deprecated, ignored.
        trust_policy: use the policy as-is (no wrapping checks).
        compile_policy: ``torch.compile`` the policy (True or compile kwargs).
        cudagraph_policy, no_cuda_sync: accepted; CUDA-only knobs without effect on the CPU.
        weight_updater: legacy updater (instance or constructor).
        weight_sync_schemes: sender schemes for env-side models.
        weight_recv_schemes: receiver schemes (this collector is fed by a parent).
        track_policy_version: stamp every step with the policy version (``policy_version`` key).
        worker_idx: index inside a parent collector.
        trajs_per_batch: yield batches of exactly this many complete trajectories (episodes still
            running are held back; ``frames_per_batch`` is how often the env is polled). With a replay
            buffer, complete trajectories are written to it as flat steps instead (docs/trajectories.md).
        trajs_per_write: with ``trajs_per_batch`` and a replay buffer, trajectories per ``extend``.
        traj_format: ``"padded"`` (``(trajs_per_batch, max_len)``, ``("collector", "mask")``) or
            ``"cat"`` (concatenated along time); None = ``"padded"`` with a ``FutureWarning``.
        track_traj_ids: keep ``("collector", "traj_ids")`` (False: no id bookkeeping).
        compact_obs: drop from ``("next", ...)`` the observations the next step's root holds.

    Example:
        >>> import torch
        >>> from rlharvest.envs import CountingEnv
        >>> step_up = lambda td: td.set("action", torch.ones(1, dtype=torch.int8))  # episodes of 4 steps
        >>> collector = Collector(CountingEnv(max_steps=3), step_up, frames_per_batch=8, total_frames=16)
        >>> batch = next(iter(collector))
        >>> batch.names[-1], batch["collector", "traj_ids"].tolist()
        ('time', [0, 0, 0, 0, 1, 1, 1, 1])
        >>> collector.shutdown()
    """

    #: ``(seed, static_seed, next seed)`` of the last :meth:`set_seed` (a checkpoint keeps the seed chain)
    _seed_chain: tuple | None = None

    def __init__(
        self,
        create_env_fn,
        policy: Callable | None = None,
        *,
        policy_factory: Callable[[], Callable] | None = None,
        frames_per_batch: int,
        total_frames: int = -1,
        device=None,
        storing_device=None,
        policy_device=None,
        env_device=None,
        create_env_kwargs: dict | None = None,
        max_frames_per_traj: int | None = None,
        init_random_frames: int | None = None,
        reset_at_each_iter: bool = False,
        postproc: Callable | None = None,
        split_trajs: bool | None = None,
        exploration_type=ExplorationType.RANDOM,
        return_same_td: bool = False,
        reset_when_done: bool = True,
        interruptor=None,
        set_truncated: bool = False,
        use_buffers: bool | None = None,
        replay_buffer=None,
        extend_buffer: bool = True,
        local_init_rb: bool | None = None,
        trust_policy: bool | None = None,
        compile_policy=None,
        cudagraph_policy=None,
        no_cuda_sync: bool = False,
        weight_updater=None,
        weight_sync_schemes: dict | None = None,
        weight_recv_schemes: dict | None = None,
        track_policy_version: Any = False,
        worker_idx: int | None = None,
        pre_collect_hook: Callable[[], None] | None = None,
        post_collect_hook: Callable[[TensorDictBase], None] | None = None,
        trajs_per_batch: int | None = None,
        trajs_per_write: int | None = None,
        traj_format: str | None = None,
        track_traj_ids: bool = True,
        compact_obs: bool = False,
        auto_register_policy_transforms: bool | None = None,
        **kwargs,
    ) -> None:
        arguments = constructor_arguments(locals())  # first thing: CollectorConfig takes its fields from them
        self._closed = True  # until construction succeeds
        traj_counter: TrajectoryCounter | None = kwargs.pop("traj_pool", None)
        _check_arguments(unknown=kwargs, reset_when_done=reset_when_done, policy=policy, policy_factory=policy_factory,
                         weight_updater=weight_updater, weight_sync_schemes=weight_sync_schemes,
                         local_init_rb=local_init_rb)
        self.config = CollectorConfig.from_arguments(arguments)
        self._worker_idx = worker_idx
        self._pre_collect_hook, self._post_collect_hook = pre_collect_hook, post_collect_hook
        self.env = make_env(create_env_fn, self.config.create_env_kwargs)
        self._setup_policy(policy, policy_factory)
        self._check_env_options()
        self._frames_per_batch = self._round_frames_per_batch(self.config.frames_per_batch)
        self._version_tracker = track_policy_version or None
        self._rollout = Rollout(self.env, self.policy, self._rollout_settings(), traj_counter or LocalTrajectoryCounter())
        self._maybe_compile()
        self._profiler: RolloutProfiler | None = None
        self._frames, self._iter = 0, -1
        self._closed = False
        if weight_updater is not None:
            self.weight_updater = weight_updater
        self._init_sender_schemes(weight_sync_schemes)
        if weight_recv_schemes is not None:
            self.register_scheme_receiver(weight_recv_schemes)

    # ------------------------------------------------------------------ construction helpers
    def _setup_policy(self, policy, policy_factory) -> None:
        if policy is None and policy_factory is not None:
            policy = unwrap(policy_factory)()
        storing, policy_device, env_device = resolve_devices(
            self.config.device, self.config.storing_device, self.config.policy_device,
            self.config.env_device, self.env,
        )
        self.storing_device, self.policy_device, self.env_device = storing, policy_device, env_device
        wrapped = wrap_policy(policy, self.env, self.config.trust_policy)
        self.policy, source = policy_device_copy(wrapped, policy_device)
        self._weight_source_ref = WeakPolicyRef(policy if policy is not None else wrapped)
        self._policy_is_copy = self.policy is not source

    def _check_env_options(self) -> None:
        config = self.config
        if config.max_frames_per_traj and ("step_count",) in env_keys(self.env):
            raise ValueError(
                "max_frames_per_traj is set but the env already has a 'step_count' entry (a step counter); "
                "remove one of them."
            )
        done_keys = [as_tuple_key(k)[-1] for k in env_attr(self.env, "done_keys", [])]
        if config.set_truncated and "truncated" not in done_keys and not config.max_frames_per_traj:
            raise RuntimeError(
                "set_truncated=True requires the env to have a 'truncated' done key (or max_frames_per_traj)."
            )

    def _round_frames_per_batch(self, frames_per_batch: int) -> int:
        n_env = int(self.env.batch_size.numel()) if len(self.env.batch_size) else 1
        rounded = -(-frames_per_batch // n_env) * n_env
        if rounded != frames_per_batch:
            warnings.warn(
                f"frames_per_batch={frames_per_batch} is not a multiple of the env batch size ({n_env}); "
                f"collecting {rounded} frames per batch.", stacklevel=3,
            )
        total, random_frames = self.config.total_frames, self.config.init_random_frames
        if total > 0 and total % rounded:
            warnings.warn(f"total_frames={total} is not a multiple of frames_per_batch={rounded}: the last batch "
                          "will overshoot.", stacklevel=3)
        if random_frames and random_frames % rounded:
            warnings.warn(f"init_random_frames={random_frames} is not a multiple of frames_per_batch={rounded}: "
                          "random actions continue to the end of the batch that reaches it.", stacklevel=3)
        return rounded

    def _rollout_settings(self) -> RolloutSettings:
        config = self.config
        n_env = int(self.env.batch_size.numel()) if len(self.env.batch_size) else 1
        dynamic = bool(env_attr(self.env, "_has_dynamic_specs", False))
        use_buffers = config.use_buffers
        if use_buffers is None:
            use_buffers = config.replay_buffer is None and not dynamic
        return RolloutSettings(
            time_steps=self._frames_per_batch // n_env,
            max_frames_per_traj=config.max_frames_per_traj,
            set_truncated=config.set_truncated,
            track_policy_version=bool(config.track_policy_version),
            exploration_type=config.exploration_type,
            storing_device=self.storing_device,
            policy_device=self.policy_device,
            env_device=self.env_device,
            use_buffers=use_buffers,
            track_traj_ids=config.track_traj_ids,
            compact_obs=config.compact_obs,
            lazy_stack=dynamic,
        )

    def _maybe_compile(self) -> None:
        options = self.config.compile_policy
        if options:
            kwargs = options if isinstance(options, dict) else {}
            step = self._rollout.policy_step
            if hasattr(step, "stages"):
                step.stages = [(torch.compile(m, **kwargs), i, o) for m, i, o in step.stages]
            elif hasattr(step, "policy"):
                step.policy = torch.compile(step.policy, **kwargs)
        if self.config.cudagraph_policy and not torch.cuda.is_available():
            warnings.warn("cudagraph_policy needs CUDA; it is ignored on this machine.", stacklevel=3)

    def _init_sender_schemes(self, schemes: dict | None) -> None:
        if not schemes:
            return
        for model_id, scheme in schemes.items():
            if scheme.needs_workers:
                raise ValueError(
                    f"weight_sync_schemes[{model_id!r}] is a {type(scheme).__name__}, which sends weights to worker "
                    "processes or nodes: a Collector has none (its policy runs in this process and "
                    "update_policy_weights_ updates it directly). Use weight_recv_schemes to receive weights from a "
                    "parent collector, or a MultiSyncCollector/MultiAsyncCollector to run workers."
                )
        self._weight_sync_schemes = dict(schemes)
        for model_id, scheme in schemes.items():
            scheme.init_on_sender(model_id=model_id, context=self, num_workers=1)
            if not scheme.synchronized_on_sender:
                scheme.connect()

    # ------------------------------------------------------------------ properties
    @property
    def requested_frames_per_batch(self) -> int:
        return self._frames_per_batch

    @property
    def rollout(self) -> Rollout:
        return self._rollout

    def time_split(self) -> dict[str, float]:
        split = super().time_split()
        split["env"] += self._rollout.times.env
        split["policy"] += self._rollout.times.policy
        return split

    @property
    def _weight_source(self):
        return self._weight_source_ref()

    def get_model(self, model_id: str):
        if model_id == "policy":
            source = self._weight_source
            return source if source is not None else self.policy
        if self.config.max_frames_per_traj:  # TorchRL's env would have a StepCounter: ids index its transforms
            found, model = resolve_env_transform_path(self.env, model_id)
            if found:
                return model
        return super().get_model(model_id)

    # ------------------------------------------------------------------ iteration
    def _iterate(self) -> Iterator[TensorDictBase | None]:
        buffer = self.config.replay_buffer
        trajectories = self._trajectories
        while not self._reached_total():
            if self._should_stop():
                return
            if self._pre_collect_hook is not None:
                self._pre_collect_hook()
            batch = self.rollout_batch()
            self._frames += self._batch_frames(batch)
            if buffer is not None and (not self.config.return_same_td or trajectories is not None):
                self._write_buffer(buffer, batch, run_hook=True)
                yield None
            else:  # return_same_td hands the batch itself over, replay buffer or not (as TorchRL)
                batch = self._postprocess(batch)
                if self._post_collect_hook is not None:
                    self._post_collect_hook(batch)
                if trajectories is None:
                    yield batch
                else:  # zero or more batches of complete trajectories per batch collected
                    yield from trajectories.batches(batch)
        _close_env(self.env)

    def rollout_batch(self, random: bool | None = None) -> TensorDictBase:
        """Collect one raw batch (no postproc): the unit of work of a worker."""
        self._iteration_started = True
        self._iter += 1
        if random is None:
            random = self._random_phase()
        if self.config.reset_at_each_iter and self._rollout.stepped_since_reset:
            self._rollout.reset()
        hook = self._between_steps_hook()
        profiler = self._profiler
        if profiler is not None and profiler.active:
            with profiler.rollout():
                return self._rollout.collect(random=random, between_steps=hook)
        return self._rollout.collect(random=random, between_steps=hook)

    def collect_for_parent(self, random: bool) -> TensorDictBase:
        if self._pre_collect_hook is not None:
            self._pre_collect_hook()
        batch = self.rollout_batch(random)
        self._frames += self._batch_frames(batch)
        if self._post_collect_hook is not None:
            self._post_collect_hook(batch)
        return batch

    def write_to_replay_buffer(self, buffer, batch: TensorDictBase) -> None:
        self._write_buffer(buffer, batch)  # the post-collect hook already saw it, in collect_for_parent

    def write_batches_into(self, buffer: TensorDictBase, batch: TensorDictBase) -> None:
        if self._rollout.buffer is batch:
            self._rollout.set_buffer(buffer)

    @property
    def policy_lock(self):
        return self._rollout.policy_lock

    def _random_phase(self) -> bool:
        return self.config.in_random_phase(self._frames)

    def _between_steps_hook(self):
        checks = []
        interruptor = self.config.interruptor
        if interruptor is not None:
            checks.append(interruptor.collection_stopped)
        if self._stop_event is not None:
            checks.append(self._stop_event.is_set)
        checks.extend(self._extra_step_checks)
        receivers = self._receiver_schemes
        if receivers:
            def poll() -> bool:
                self.poll_weight_receivers()
                return False
            checks.append(poll)
        if not checks:
            return None
        if len(checks) == 1:
            return checks[0]
        return lambda: any([check() for check in checks])

    def _batch_frames(self, batch: TensorDictBase) -> int:
        if self.config.replay_buffer is not None:
            return self._frames_per_batch
        traj_ids = batch.get(TRAJ_IDS, None)
        if self.config.interruptor is None or traj_ids is None:
            return batch.numel()
        return int((traj_ids != -1).sum())

    def _postprocess(self, batch: TensorDictBase) -> TensorDictBase:
        config = self.config
        if config.split_trajs and config.trajs_per_batch is None:  # trajectory batches are split already
            batch = split_trajectories(batch)
        elif self._rollout.settings.use_buffers and not config.return_same_td:
            batch = batch.clone()
        if config.postproc is not None:
            batch = config.postproc(batch)
        return self._drop_private_keys(batch)

    def _write_buffer(self, buffer, batch: TensorDictBase, run_hook: bool = False) -> None:
        trajectories = self._trajectories
        if not self.config.extend_buffer and trajectories is None:
            dim = self._rollout.time_dim
            for t in range(batch.shape[dim]):
                buffer.add(self._drop_private_keys(batch[(slice(None),) * dim + (t,)].clone()))
            return
        batch = self._postprocess(batch)
        if run_hook and self._post_collect_hook is not None:
            self._post_collect_hook(batch)  # the batch as written (a worker's hook already saw it)
        if trajectories is None:
            buffer.extend(batch)
        else:  # complete trajectories only, as flat steps
            trajectories.write(buffer, batch)

    def keep_for_replay_buffer(self, batch: TensorDictBase) -> None:
        trajectories = self._trajectories
        if trajectories is not None:
            trajectories.ingest(self._postprocess(batch))

    # ------------------------------------------------------------------ running free
    def start(self) -> None:
        """Collect in a background thread into the replay buffer (stop with :meth:`async_shutdown`)."""
        self._start_thread()

    # ------------------------------------------------------------------ weights
    def _update_local_policy(self, value: Any) -> None:
        if value is None:
            source = self._weight_source
            if source is None or source is self.policy or not isinstance(source, torch.nn.Module):
                self.increment_version()
                return
            value = source
        self._copy_into_local_policy(self._weights_from_value(value))
        self.increment_version()

    def weights_received(self, model_id: str, weights: TensorDictBase, applied_to: Any) -> None:
        if (model_id == "policy" and applied_to is self.get_model("policy") and not self._policy_is_copy
                and self._weight_updater is None and not self._weight_sync_schemes):
            self.increment_version()  # the scheme wrote into the very modules this collector runs
            return
        super().weights_received(model_id, weights, applied_to)

    def _copy_into_local_policy(self, weights: TensorDictBase) -> None:
        if not isinstance(self.policy, torch.nn.Module):
            return
        with self._rollout.policy_lock:
            copy_weights_(weights_of(self.policy), weights)

    def _on_version_bump(self, version: int) -> None:
        self._rollout.policy_version = version

    # ------------------------------------------------------------------ other public methods
    def getattr_policy(self, name: str) -> Any:
        """An attribute of the policy this collector runs."""
        return getattr(self.policy, name)

    def getattr_env(self, name: str) -> Any:
        """An attribute of the env."""
        return getattr(self.env, name)

    def getattr_rb(self, name: str) -> Any:
        """An attribute of the replay buffer."""
        return getattr(self.config.replay_buffer, name)

    def fake_tensordict(self) -> TensorDictBase:
        """A zero batch shaped like the ones this collector yields (keys, shapes, dtypes, names),
        e.g. to allocate storage or warm up a compiled model before collecting.

        Raises:
            NotImplementedError: before the first batch, for an env without ``fake_tensordict``.
        """
        rollout = self._rollout
        batch = rollout.fake_batch()
        if self.config.set_truncated:  # the last step of every batch is truncated
            steps = batch.shape[rollout.time_dim]
            for truncated_key, done_key in rollout.adapter.truncation_keys:
                for key in (truncated_key, done_key):
                    full = ("next", *((key,) if isinstance(key, str) else key))
                    if full in batch.keys(True, True):
                        batch.get(full).narrow(rollout.time_dim, steps - 1, 1).fill_(True)
        return self._postprocess(batch)

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """Seed the env (then start fresh episodes); returns the seed for the next env."""
        out = self.env.set_seed(seed, static_seed=static_seed)
        self._seed_chain = (seed, bool(static_seed), out)
        self._rollout.reset()
        if self._trajectories is not None:
            self._trajectories.drop_in_flight()  # those episodes will never end
        return out

    def reset(self, index=None, **kwargs) -> None:
        """Reset every sub-env, or the sub-envs selected by ``index`` (batched envs only).

        With ``trajs_per_batch``, a full reset also drops the trajectories held back (running or
        complete but not yielded yet), so later batches hold only steps collected after it; a reset
        of some sub-envs drops only their running episodes.
        """
        trajectories = self._trajectories
        if index is None:
            self._rollout.reset()
            if trajectories is not None:
                trajectories.flush()
            return
        if not len(self.env.batch_size):
            raise RuntimeError("reset(index=...) needs a batched env.")
        mask = torch.zeros(self.env.batch_size, dtype=torch.bool)
        mask[index] = True
        if trajectories is not None:
            trajectories.drop_in_flight(self._rollout.traj_ids[mask].tolist())
        self._rollout.reset(mask)

    def state_dict(self, *, env_state: bool = True) -> dict:
        """A checkpoint of this moment (docs/checkpoints.md): TorchRL's keys, and under
        ``"rlharvest_resume"`` what continues the run exactly (the env's state, the episodes in
        flight, the process's generators, the seed chain). ``torch.save`` writes it.

        Args:
            env_state: False leaves the env's state and the episodes in flight out (a smaller
                checkpoint; after a load the episodes restart, with new trajectory ids).

        Example:
            >>> from rlharvest.envs import CountingEnv
            >>> collector = Collector(CountingEnv(), frames_per_batch=4, total_frames=8)
            >>> state = collector.state_dict()
            >>> state["rlharvest_resume"]["format_version"]
            1
        """
        with self._at_batch_boundary():
            return self._state_dict(env_state)

    def _state_dict(self, env_state: bool) -> dict:
        state = {}
        if isinstance(self.policy, torch.nn.Module):
            state["policy_state_dict"] = _snapshot(self.policy.state_dict())
        state["env_state_dict"] = self.env.state_dict() if hasattr(self.env, "state_dict") else {}
        state["frames"] = self._frames
        state["iter"] = self._iter
        state["traj_pool"] = {"traj_id": torch.tensor(self._rollout.traj_counter.peek())}
        if self._version_tracker:
            state["policy_version"] = self._policy_version
        state[CHECKPOINT_KEY] = _checkpoint.capture(self, env_state)
        return state

    def load_state_dict(self, state_dict: dict, strict: bool = True, **kwargs) -> None:
        """Continue from a checkpoint of :meth:`state_dict`, taken by a collector built with the same
        arguments: the next batches are those the saved collector would have collected
        (docs/checkpoints.md). A TorchRL checkpoint (no ``"rlharvest_resume"``) restarts the episodes.

        Raises:
            CheckpointMismatchError: for a checkpoint of a newer format, or of a collector built
                with another env batch size or ``frames_per_batch``.
            EpisodeRestartWarning: (a warning) when the env's state could not be captured or put
                back: its episodes restart with new trajectory ids.
        """
        section = _checkpoint.section_of(state_dict)
        if section is not None:  # checked before anything changes
            check_compatible(section, _checkpoint.layout(self), self._where())
        if "policy_state_dict" in state_dict and isinstance(self.policy, torch.nn.Module):
            self.policy.load_state_dict(state_dict["policy_state_dict"], strict=strict)
        if state_dict.get("env_state_dict") and hasattr(self.env, "load_state_dict"):
            self.env.load_state_dict(state_dict["env_state_dict"], strict=strict)
        self._frames = state_dict["frames"]
        self._iter = state_dict["iter"]
        if "policy_version" in state_dict or section is not None:
            version = state_dict["policy_version"] if section is None else section["policy_version"]
            self._policy_version = int(version)
            self._on_version_bump(self._policy_version)
        if section is not None:
            _checkpoint.restore(self, section, self._where())
        elif "traj_pool" in state_dict:
            # ids continue after the saved ones (a replay buffer may hold them); episodes restart
            self._rollout.traj_counter.advance_to(int(state_dict["traj_pool"]["traj_id"]))
            self._rollout.reset()

    def _where(self) -> str:
        return "Collector" if self.worker_idx is None else f"worker {self.worker_idx}"

    def _apply_profile_config(self, config: ProfileConfig) -> None:
        label = "collector_rollout" if self.worker_idx is None else f"worker_{self.worker_idx}_rollout"
        if self._profiler is not None:
            self._profiler.stop()
        self._profiler = RolloutProfiler(config, worker_idx=self.worker_idx or 0, label=label)

    def _stop_profiling(self) -> None:
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None

    def _shutdown_impl(self, timeout: float | None, close_env: bool) -> None:
        if self._profiler is not None:
            self._profiler.stop()
        if close_env:
            _close_env(self.env)
