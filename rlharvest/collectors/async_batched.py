"""AsyncBatchedCollector: envs step in workers, one batched policy serves whichever of them are ready.

Every worker (a process of the ``mp`` backend, or a thread of the ``inprocess`` backend with
``env_backend="threading"``), started and stopped through a :class:`~rlharvest.collectors._fleet.Fleet`,
runs the worker loop around an ordinary :class:`~rlharvest.collectors.Collector`, so THE rollout
loop steps its env(s): auto-reset,
trajectory ids drawn from one shared counter, ``max_frames_per_traj``. Its policy is an
:class:`~rlharvest.transport.inference.InferenceClient`: the actual policy runs in this process, in
the thread of an :class:`~rlharvest.transport.inference.InferenceServer` that gathers the requests
of whichever workers are ready (no barrier: a slow env never holds up the fast ones) into one call
of up to ``max_batch_size`` frames.

Workers send their frames in chunks of ``transition_chunk_size`` steps through shared memory (as
MultiAsyncCollector's do); this collector concatenates the chunks in order of arrival into flat
batches of exactly ``frames_per_batch`` frames, like TorchRL 0.14's, with an ``"env_index"`` entry, or
yields complete trajectories one at a time (``yield_completed_trajectories``).
"""

from __future__ import annotations

import collections
import copy
from typing import Any, Callable, Iterator, Sequence

import torch
from tensordict import TensorDictBase

from .._utils import TRAJ_IDS
from ..config import CollectorConfig, positive_seconds
from ..checkpoint import pack, unpack
from ..errors import WorkerError
from ..policies import ExplorationType
from ..protocol import WorkerSpec
from ..transport.base import Backend
from ..transport.inference import InferenceChannels, InferenceClient, InferenceServer
from ..transport.inprocess import InProcessBackend
from ..transport.mp import MPBackend, mp_context
from ..weight_update.strategy import copy_weights_, weights_of
from ..worker import run_worker
from ._specs import has_weights, wrap_callable
from .options.async_batched import AsyncBatchedConfig, async_batched_config, worker_env_factories
from .base import BaseCollector
from .multi import DEFAULT_WORKER_TIMEOUT
from .remote import RemoteCollectorBase
from .single import Collector

__all__ = ["AsyncBatchedCollector"]

_ENV_INDEX = "env_index"


class _ServedCollector(Collector):
    """A worker's Collector whose policy is an inference client: it introduces itself once built.

    The client comes as ``inference`` rather than as the spec's policy: a backend may copy a spec's
    policy for each worker (the ``inprocess`` one does), and the client's pipes must stay shared.
    """

    def __init__(self, create_env_fn, policy=None, *, inference: InferenceClient, **kwargs) -> None:
        super().__init__(create_env_fn, inference, **kwargs)
        inference.connect(self.env, self.rollout.root)


class AsyncBatchedCollector(RemoteCollectorBase):
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

    _sync = False
    _supports_run_free = False
    _traj_counter = None
    _hooks_run_in_workers = False  # batches are assembled here, so hooks run here

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
        super().__init__()
        self._closed = True
        self._server = self._channels = None
        if policy is not None and policy_factory is not None:
            raise TypeError("AsyncBatchedCollector: policy and policy_factory are mutually exclusive.")
        if policy is None and policy_factory is None:
            raise TypeError("AsyncBatchedCollector: one of policy or policy_factory must be given.")
        self.options: AsyncBatchedConfig = async_batched_config(
            create_env_fn=create_env_fn, frames_per_batch=frames_per_batch, max_batch_size=max_batch_size,
            min_batch_size=min_batch_size, server_timeout=server_timeout, env_backend=env_backend,
            envs_per_worker=envs_per_worker, transition_chunk_size=transition_chunk_size,
            yield_completed_trajectories=yield_completed_trajectories, policy_version_key=policy_version_key,
            policy_version=policy_version, device=device, options=torchrl_options)
        # The policy runs here, so ``device`` is the server's (options.device), never the workers'.
        self.config = CollectorConfig(
            frames_per_batch=frames_per_batch, total_frames=total_frames, postproc=postproc,
            exploration_type=exploration_type, replay_buffer=replay_buffer, max_frames_per_traj=max_frames_per_traj,
            trust_policy=trust_policy)
        self.post_collect_hook = post_collect_hook
        self.policy = policy if policy is not None else policy_factory()
        self.policy_factory = policy_factory
        self._worker_timeout = positive_seconds("worker_timeout", worker_timeout)
        self._carry: collections.deque = collections.deque()
        self._carried = 0
        self._partial: dict[int, list] = {}
        self._complete: collections.deque = collections.deque()
        self._start(create_env_fn, create_env_kwargs, mp_start_method)
        self._closed = False

    # ------------------------------------------------------------------ start
    def _start(self, create_env_fn, create_env_kwargs, mp_start_method) -> None:
        options, config = self.options, self.config
        backend = self._backend = _make_backend(options, mp_start_method)
        self._channels = InferenceChannels(backend.ctx, options.num_workers)
        self._server = InferenceServer(
            _private_copy(self.policy, options.device), self._channels, max_batch_size=options.max_batch_size,
            min_batch_size=options.min_batch_size, timeout=options.server_timeout, device=options.device,
            exploration_type=config.exploration_type, trust_policy=config.trust_policy, version=options.policy_version)
        specs = self._worker_specs(worker_env_factories(list(create_env_fn), create_env_kwargs, options.envs_per_worker))
        try:
            # The server answers the workers' first messages while they are built.
            self._start_fleet(specs, self._worker_timeout, schemes={}, started=self._server.start)
        except BaseException as err:
            self._stop(5.0)
            if isinstance(err, WorkerError) and self._server.setup_error is not None:
                raise self._server.setup_error from err  # the policy's or the env's own error
            raise

    def _trajectory_counter(self):
        return self._traj_counter

    def _worker_specs(self, env_fns: list) -> list[WorkerSpec]:
        options = self.options
        counter = self._traj_counter = self._backend.trajectory_counter()
        return [WorkerSpec(
            worker_idx=worker, collector_class=wrap_callable(_ServedCollector),
            create_env_fn=wrap_callable(env_fns[worker]),
            collector_kwargs=self.config.for_worker(
                worker, frames_per_batch=options.chunk_steps * options.envs_per_worker, total_frames=-1,
                traj_pool=counter,
                inference=self._channels.client(worker, options.policy_version_key, self._worker_timeout)),
        ) for worker in range(options.num_workers)]

    # ------------------------------------------------------------------ properties
    @property
    def requested_frames_per_batch(self) -> int:
        return self.config.frames_per_batch

    @property
    def policy_version(self) -> int:
        """The version of the weights the server uses now (bumped by every weight update)."""
        return self._server.version if self._server is not None else self.options.policy_version

    @property
    def yield_completed_trajectories(self) -> bool:
        return self.options.yield_completed_trajectories

    def getattr_policy(self, name: str) -> Any:
        """An attribute of the policy (it lives in this process)."""
        return getattr(self.policy, name)

    def server_stats(self) -> dict:
        """Counters of the policy server: ``requests``, ``batches``, ``frames``, ``max_batch_frames``."""
        return dict(self._server.stats)

    # ------------------------------------------------------------------ iteration
    def _iterate(self) -> Iterator[TensorDictBase | None]:
        if self.options.yield_completed_trajectories:
            yield from self._iterate_trajectories()
            return
        total = self.config.total_frames
        while not self._reached_total():
            if self.pre_collect_hook is not None:
                self.pre_collect_hook()
            wanted = self.config.frames_per_batch
            if total >= 0:
                wanted = min(wanted, total - self._frames)
            batch = self._take_frames(wanted)
            self._iter += 1
            self._frames += batch.numel()
            yield from self._deliver(batch)

    def _iterate_trajectories(self) -> Iterator[TensorDictBase | None]:
        while not self._reached_total():
            while not self._complete:
                self._split_trajectories(self._next_chunk())
            trajectory = self._complete.popleft()
            self._iter += 1
            self._frames += trajectory.numel()
            yield from self._deliver(trajectory)

    def _deliver(self, batch: TensorDictBase) -> Iterator[TensorDictBase | None]:
        if self.config.postproc is not None:
            batch = self.config.postproc(batch)
        batch = self._drop_private_keys(batch)
        if self.post_collect_hook is not None:
            self.post_collect_hook(batch)
        if self.config.replay_buffer is not None:
            self.config.replay_buffer.extend(batch)
            yield None
        else:
            yield batch

    def _take_frames(self, wanted: int) -> TensorDictBase:
        """Exactly ``wanted`` frames, in order of arrival; what is left over opens the next batch."""
        while self._carried < wanted:
            chunk = self._next_chunk()
            self._carry.append(chunk)
            self._carried += chunk.numel()
        chunks = list(self._carry)
        batch = torch.cat(chunks, 0) if len(chunks) > 1 else chunks[0]
        self._carry.clear()
        self._carried = batch.numel() - wanted
        if self._carried:
            self._carry.append(batch[wanted:])
            batch = batch[:wanted]
        return batch

    def _next_chunk(self) -> TensorDictBase:
        """The frames of the first worker ready (as a flat private copy); that worker goes on at once.
        Chunks a loaded checkpoint holds (collected before it, not delivered yet) come first."""
        if self._restored_batches:
            worker, _, batch = self._restored_batches.pop(0)
            return _flat_chunk(batch, worker)
        gather = self._gather
        for worker in gather.idle():
            gather.launch(worker, False)
        try:
            worker, reply = gather.next()  # restarts are off: a failure raises
        except WorkerError as err:
            self._raise_server_error(err)
            raise
        batch = self._fetched_early.pop((worker, reply.request_id), None)  # by a checkpoint
        if batch is None:
            batch = self._requests.handles[worker].fetch_batch(reply)
        chunk = _flat_chunk(batch, worker)
        gather.launch(worker, False)
        return chunk

    def _raise_server_error(self, err: WorkerError) -> None:
        """A worker failed because the policy raised in the server: raise the policy's own error."""
        error = self._server.error if self._server is not None else None
        if error is not None:
            raise error from err

    def _split_trajectories(self, chunk: TensorDictBase) -> None:
        """Queue the trajectories a chunk completes; keep the unfinished ends, per env."""
        done = chunk.get(("next", "done")).reshape(chunk.shape[0], -1).any(-1)
        envs = chunk.get(_ENV_INDEX)
        for env in envs.unique().tolist():
            rows = (envs == env).nonzero().squeeze(-1)
            pieces = self._partial.setdefault(env, [])
            start = 0
            ends = done[rows].nonzero().squeeze(-1).tolist()
            for end in ends:
                pieces.append(chunk[rows[start:end + 1]])
                self._complete.append(torch.cat(pieces, 0) if len(pieces) > 1 else pieces[0])
                pieces.clear()
                start = end + 1
            if start < rows.numel():
                pieces.append(chunk[rows[start:]])

    # ------------------------------------------------------------------ checkpoints (docs/checkpoints.md)
    def _checkpoint_extra(self) -> dict:
        """The frames assembled here and not delivered yet (the next batch's first frames, the pieces
        of trajectories), and the served policy's weights and version (the workers' policy is a client)."""
        extra = {"carry": pack(list(self._carry)), "partial": pack(self._partial),
                 "complete": pack(list(self._complete)), "server_version": int(self._server.version)}
        if isinstance(self._server.policy, torch.nn.Module):
            extra["served_policy"] = self._server.policy_state_dict()
        return extra

    def _restore_checkpoint_extra(self, section: dict) -> None:
        self._carry = collections.deque(unpack(section["carry"]))
        self._carried = sum(chunk.numel() for chunk in self._carry)
        self._partial = unpack(section["partial"])
        self._complete = collections.deque(unpack(section["complete"]))
        weights = section.get("served_policy")
        if weights is not None and isinstance(self._server.policy, torch.nn.Module):
            self._server.update_policy(lambda served: served.load_state_dict(weights))
        self._server.version = int(section["server_version"])
        self._policy_version = self._server.version

    # ------------------------------------------------------------------ running free
    def start(self) -> None:
        """Collect into the replay buffer from a background thread until :meth:`async_shutdown`.

        Raises:
            RuntimeError: without a replay buffer, or when already running.
        """
        self._start_thread()

    def is_running(self) -> bool:
        """Whether :meth:`start`'s background collection runs."""
        return BaseCollector.is_running(self)

    # ------------------------------------------------------------------ weights
    def _update_local_policy(self, value: Any) -> None:
        """Copy the weights (the policy's own, when ``value`` is None) into the served policy, in process."""
        if value is None:
            value = self.policy if isinstance(self.policy, torch.nn.Module) else None
        weights = self._weights_from_value(value) if value is not None else None
        self._policy_version = self._server.update_policy(_copy_in(weights))

    def _copy_into_local_policy(self, weights: TensorDictBase) -> None:
        self._server.update_policy(_copy_in(weights))

    # ------------------------------------------------------------------ shutdown
    def _shutdown_impl(self, timeout: float | None, close_env: bool) -> None:
        self._stop(self._shutdown_timeout if timeout is None else timeout)

    def _stop(self, timeout: float) -> None:
        # Workers first: their rollouts end (interrupted) while the server still answers them.
        self._close_workers(timeout)
        if self._server is not None:
            self._server.stop()
        if self._channels is not None:
            self._channels.close()

    def __repr__(self) -> str:
        return (f"AsyncBatchedCollector(num_envs={self.options.num_envs}, workers={self.num_workers}, "
                f"frames={self._frames})")


def _make_backend(options: AsyncBatchedConfig, mp_start_method: str | None) -> Backend:
    if options.env_backend == "threading":
        return InProcessBackend(options.num_workers, run_worker)
    return MPBackend(options.num_workers, run_worker, mp_context(mp_start_method))


def _private_copy(policy: Any, device: torch.device | None) -> Any:
    """The policy the server runs: a copy when it has weights (only updates change it), on ``device``."""
    if not isinstance(policy, torch.nn.Module) or not has_weights(policy):
        return policy
    served = copy.deepcopy(policy)
    return served.to(device) if device is not None else served


def _copy_in(weights: TensorDictBase | None) -> Callable[[Any], None] | None:
    """What the server runs on its policy to take ``weights`` (nothing for a policy without weights)."""
    if weights is None:
        return None

    def change(served: Any) -> None:
        if isinstance(served, torch.nn.Module):
            copy_weights_(weights_of(served), weights)

    return change


def _flat_chunk(batch: TensorDictBase, worker: int) -> TensorDictBase:
    """A worker's ``(*env_batch, T)`` batch as a flat private copy of its valid frames, with ``env_index``."""
    envs = batch.batch_size[:-1].numel()
    steps = batch.batch_size[-1]
    flat = batch.clone(recurse=True)
    flat.names = [None] * flat.batch_dims
    flat = flat.reshape(-1)
    first = worker * envs
    flat.set(_ENV_INDEX, torch.arange(first, first + envs, dtype=torch.int64).repeat_interleave(steps))
    ids = flat.get(TRAJ_IDS)
    if bool((ids == -1).any()):  # an interrupted rollout (shutdown): only the collected steps are frames
        flat = flat[ids != -1]
    return flat

