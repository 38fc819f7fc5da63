"""Collector: the rollout loop in the calling process (docs/collection.md), a face over
:class:`~rlharvest.collectors.engine.local.LocalEngine`."""

from __future__ import annotations

from typing import Any, Callable

from tensordict import TensorDictBase

from ..envs.factory import make_env
from ..policies import ExplorationType
from ..rollout import Rollout
from ._dispatch import construct
from .base import BaseCollector
from .engine.local import LocalEngine
from .options.local import LocalOptions

__all__ = ["Collector", "make_env"]


class Collector(BaseCollector):
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
        replay_write_mode: ``"rollout"``, ``"trajectory"`` (complete trajectories only) or None, what
            goes to the replay buffer (docs/trajectories.md).
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

    @classmethod
    def _construct(cls, args: tuple, kwargs: dict) -> Any:
        return construct(__class__, cls, args, kwargs)  # Collector(backend=...) (``_dispatch.py``)

    def __init__(
        self,
        create_env_fn,
        policy: Callable | None = None,
        *,
        policy_factory: Callable[[], Callable] | None = None,
        backend: str | None = None,
        backend_options: dict | None = None,
        num_collectors: int | None = None,
        sync: bool | None = None,
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
        track_traj_ids: bool = True,
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
        trajs_per_batch: int | None = None,
        trajs_per_write: int | None = None,
        replay_write_mode: str | None = None,
        traj_format: str | None = None,
        auto_register_policy_transforms: bool | None = None,
        pre_collect_hook: Callable[[], None] | None = None,
        post_collect_hook: Callable[[TensorDictBase], None] | None = None,
        compact_obs: bool = False,
        **kwargs,
    ) -> None:
        # backend_options, num_collectors and sync were checked by the dispatch (``_dispatch.py``)
        self._build(LocalOptions.parse(
            type(self).__name__, create_env_fn=create_env_fn, policy=policy, policy_factory=policy_factory,
            backend=backend, reset_when_done=reset_when_done, weight_updater=weight_updater,
            weight_sync_schemes=weight_sync_schemes, weight_recv_schemes=weight_recv_schemes,
            local_init_rb=local_init_rb, unknown=kwargs, frames_per_batch=frames_per_batch,
            total_frames=total_frames, device=device, storing_device=storing_device, policy_device=policy_device,
            env_device=env_device, create_env_kwargs=create_env_kwargs, max_frames_per_traj=max_frames_per_traj,
            init_random_frames=init_random_frames, reset_at_each_iter=reset_at_each_iter, postproc=postproc,
            split_trajs=split_trajs, track_traj_ids=track_traj_ids, exploration_type=exploration_type,
            return_same_td=return_same_td, interruptor=interruptor, set_truncated=set_truncated,
            use_buffers=use_buffers, replay_buffer=replay_buffer, extend_buffer=extend_buffer,
            trust_policy=trust_policy, compile_policy=compile_policy, cudagraph_policy=cudagraph_policy,
            no_cuda_sync=no_cuda_sync, track_policy_version=track_policy_version, worker_idx=worker_idx,
            trajs_per_batch=trajs_per_batch, trajs_per_write=trajs_per_write, traj_format=traj_format,
            replay_write_mode=replay_write_mode,
            auto_register_policy_transforms=auto_register_policy_transforms, pre_collect_hook=pre_collect_hook,
            post_collect_hook=post_collect_hook, compact_obs=compact_obs))

    def _build(self, options: LocalOptions) -> None:
        self._engine = LocalEngine(options, self)

    # ------------------------------------------------------------------ what runs here
    @property
    def env(self) -> Any:
        """The env this collector steps."""
        return self._engine.env

    @property
    def policy(self) -> Any:
        """The policy this collector runs (a copy on ``policy_device`` when the user's lives elsewhere)."""
        return self._engine.policy

    @policy.setter
    def policy(self, value: Any) -> None:
        self._engine.policy = value

    @property
    def rollout(self) -> Rollout:
        """THE rollout loop, as this collector runs it."""
        return self._engine.rollout

    @property
    def policy_device(self):
        return self._engine.policy_device

    @property
    def storing_device(self):
        return self._engine.storing_device

    @property
    def env_device(self):
        return self._engine.env_device

    @property
    def policy_lock(self):
        """Held while the policy runs (weights are swapped under it)."""
        return self._engine.policy_lock

    def rollout_batch(self, random: bool | None = None) -> TensorDictBase:
        """Collect one raw batch (no postproc): the unit of work of a worker."""
        return self._engine.rollout_batch(random)

    def fake_tensordict(self) -> TensorDictBase:
        """A zero batch shaped like the ones this collector yields (keys, shapes, dtypes, names), e.g. to
        allocate storage or warm up a compiled model before collecting.

        Raises:
            NotImplementedError: before the first batch, for an env without ``fake_tensordict``.
        """
        return self._engine.fake_batch()

    def reset(self, index=None, **kwargs) -> None:
        """Reset every sub-env, or the sub-envs selected by ``index`` (batched envs only).

        With ``trajs_per_batch``, a full reset also drops the trajectories held back (running or complete
        but not yielded yet), so later batches hold only steps collected after it; a reset of some sub-envs
        drops only their running episodes.
        """
        self._open("reset()").reset(index)
