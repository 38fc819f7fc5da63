"""AsyncBatchedCollector: envs step in workers, one batched policy serves whichever of them are ready.

Every worker (a process of the ``mp`` backend, or a thread of the ``inprocess`` backend with
``env_backend="threading"``) runs the worker loop around an ordinary ``Collector``, so THE rollout
loop steps its env(s): auto-reset, trajectory ids drawn from one shared counter,
``max_frames_per_traj``. Its policy is an inference client: the actual policy runs in this process, in
the thread of a server that gathers the requests of whichever workers are ready (no barrier) into one
call of up to ``max_batch_size`` frames (``engine/served.py``). Batches are flat, of exactly
``frames_per_batch`` frames, with an ``"env_index"`` entry, or complete trajectories one at a time.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from tensordict import TensorDictBase

from ..config_views import BatchShares, FramesPerBatch
from ..policies import ExplorationType
from . import _workers
from .base import BaseCollector
from .engine.engine import CollectionEngine
from .options.async_batched import AsyncBatchedConfig, AsyncBatchedOptions
from .options.mp import DEFAULT_WORKER_TIMEOUT
from .single import Collector

__all__ = ["AsyncBatchedCollector"]


class AsyncBatchedCollector(BaseCollector):
    """Envs in workers, one batched policy in this process: batches of whichever envs were ready.

    Args:
        create_env_fn: a list of env factories, one per env.

    Keyword Args:
        policy: the policy (a private copy is served; see :meth:`update_policy_weights_`).
        policy_factory: a zero-argument callable building the policy (exclusive with ``policy``).
        frames_per_batch: frames per yielded batch (flat, shape ``(frames_per_batch,)``).
        total_frames: stop after this many frames (-1 = endless); the last batch is cut to it.
        max_batch_size: most frames one policy call serves (TorchRL's default: 64).
        min_batch_size: frames to gather, for up to ``server_timeout`` seconds, before a call (1).
        server_timeout: see ``min_batch_size`` (0.01 s).
        device: where the policy runs.
        env_backend: ``"multiprocessing"`` (default: a process per worker) or ``"threading"``.
        envs_per_worker: envs stepped by one worker (as one batched env).
        transition_chunk_size: env steps per message from a worker (``"auto"``: small enough that one
            chunk per worker stays below a batch, at most 64).
        postproc: applied to every batch.
        exploration_type: interaction mode of the policy calls.
        replay_buffer: batches are written there and iteration yields None.
        post_collect_hook: called with every (post-processed) batch before it is written or yielded.
        yield_completed_trajectories: yield one complete trajectory (shape ``(T,)``) at a time.
        create_env_kwargs: keyword arguments of the env factories (one dict, or one per env).
        policy_version: version of the initial weights.
        policy_version_key: where each frame carries the version of the weights that chose its
            action (None: not recorded).
        max_frames_per_traj: truncate trajectories after this many steps.
        trust_policy: use the policy as it is (no wrapping checks).
        worker_timeout: seconds a worker may go without answering or making progress.
        mp_start_method: start method of worker processes.
        **torchrl_options: TorchRL 0.14's other arguments (``transport``, ``server_config``, ...),
            accepted with their default values and refused by name otherwise.

    Raises:
        ValueError, TypeError: for bad or unsupported arguments (the error names the argument).

    Example:
        >>> import torch
        >>> from rlharvest.collectors import AsyncBatchedCollector
        >>> from rlharvest.envs import CountingEnv
        >>> from tensordict.nn import TensorDictModule
        >>> policy = TensorDictModule(lambda obs: torch.ones_like(obs), in_keys=["observation"],
        ...                           out_keys=["action"])
        >>> collector = AsyncBatchedCollector([CountingEnv] * 4, policy=policy, frames_per_batch=64,
        ...                                   total_frames=128)
        >>> [tuple(batch.shape) for batch in collector]
        [(64,), (64,)]
        >>> collector.shutdown()
    """

    def __init__(
        self,
        create_env_fn: Sequence[Callable],
        *,
        policy: Callable | None = None,
        policy_factory: Callable[[], Callable] | None = None,
        frames_per_batch: int,
        total_frames: int = -1,
        max_batch_size: int | None = None,
        min_batch_size: int | None = None,
        server_timeout: float | None = None,
        device=None,
        env_backend: str | None = None,
        envs_per_worker: int = 1,
        transition_chunk_size: int | str = "auto",
        postproc: Callable | None = None,
        exploration_type=ExplorationType.RANDOM,
        replay_buffer=None,
        post_collect_hook: Callable[[TensorDictBase], None] | None = None,
        yield_completed_trajectories: bool = False,
        create_env_kwargs: dict | Sequence[dict] | None = None,
        policy_version: int = 0,
        policy_version_key: Any = "policy_version",
        max_frames_per_traj: int | None = None,
        trust_policy: bool | None = None,
        worker_timeout: float = DEFAULT_WORKER_TIMEOUT,
        mp_start_method: str | None = None,
        **torchrl_options,
    ) -> None:
        frames = FramesPerBatch.parse(frames_per_batch)  # apart from the options: only what sizes batches reads it
        options = AsyncBatchedOptions.parse(
            create_env_fn=create_env_fn, policy=policy, policy_factory=policy_factory, total_frames=total_frames,
            max_batch_size=max_batch_size,
            min_batch_size=min_batch_size, server_timeout=server_timeout, device=device, env_backend=env_backend,
            envs_per_worker=envs_per_worker, transition_chunk_size=transition_chunk_size, postproc=postproc,
            exploration_type=exploration_type, replay_buffer=replay_buffer, post_collect_hook=post_collect_hook,
            yield_completed_trajectories=yield_completed_trajectories, create_env_kwargs=create_env_kwargs,
            policy_version=policy_version, policy_version_key=policy_version_key,
            max_frames_per_traj=max_frames_per_traj, trust_policy=trust_policy, worker_timeout=worker_timeout,
            mp_start_method=mp_start_method, worker_collector=Collector, torchrl_options=torchrl_options)
        self._build(options, options.worker_shares(frames))

    def _build(self, options: AsyncBatchedOptions, shares: BatchShares) -> None:
        self._engine = CollectionEngine(options, shares, self)  # the face holds it while the workers start
        self._engine.start()


    @property
    def options(self) -> AsyncBatchedConfig:
        """This collector's own arguments, validated."""
        return self._engine.options.batched

    @property
    def policy(self) -> Any:
        """The policy (the server runs a private copy of it, see :meth:`update_policy_weights_`)."""
        return self._engine.options.policy

    @property
    def policy_factory(self) -> Any:
        return self._engine.options.policy_factory

    worker_pids = _workers.worker_pids
    num_workers = _workers.num_workers
    active_workers = _workers.active_workers
    restart_causes = _workers.restart_causes

    @property
    def yield_completed_trajectories(self) -> bool:
        return self._engine.options.batched.yield_completed_trajectories

    def server_stats(self) -> dict:
        """Counters of the policy server: ``requests``, ``batches``, ``frames``, ``max_batch_frames``."""
        return self._engine.server.stats()
