"""Worker-process collectors: MultiSyncCollector, MultiAsyncCollector, AsyncCollector (docs/collection.md).

Each worker is a process of the ``mp`` backend running the worker loop around its own Collector (so
THE rollout loop); batches come back through shared memory, weights go out through shared-memory
schemes, and every wait is bounded and checks that workers are alive.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch
from tensordict import TensorDictBase

from .._utils import MASK, TRAJ_IDS
from ..policies import ExplorationType
from ..protocol import Command
from ..weight_update.strategy import weights_of
from ._signatures import bind_arguments, constructor_arguments, derived_signature, method_signature
from ._specs import default_schemes, stateless_copy
from ._fleet import Fleet
from .gather import SyncStack, request_batch
from .options.mp import DEFAULT_WORKER_TIMEOUT, WorkerProcessOptions
from .remote import RemoteCollectorBase
from .single import Collector

__all__ = ["MultiSyncCollector", "MultiAsyncCollector", "AsyncCollector", "MultiCollector", "DEFAULT_WORKER_TIMEOUT"]

class _DispatchOnSync(type(RemoteCollectorBase)):
    """``MultiCollector(..., sync=...)`` builds a MultiSyncCollector (default) or a MultiAsyncCollector."""

    @property
    def __signature__(cls) -> inspect.Signature:
        """The constructor's parameters (not this ``__call__``'s): what ``inspect.signature`` shows."""
        for klass in cls.__mro__:
            own = klass.__dict__.get("__signature__")
            if isinstance(own, inspect.Signature):  # a derived signature (AsyncCollector)
                return own
        signature = inspect.signature(cls.__init__)
        return signature.replace(parameters=list(signature.parameters.values())[1:])

    def __call__(cls, *args, sync: bool | None = None, **kwargs):
        if cls is MultiCollector:
            cls = MultiAsyncCollector if sync is False else MultiSyncCollector
        elif sync is not None and bool(sync) != cls._sync:
            raise TypeError(f"{cls.__name__} is {'' if cls._sync else 'a'}synchronous: sync={sync!r} contradicts it "
                            "(use MultiCollector(..., sync=...) to choose).")
        return super().__call__(*args, **kwargs)


class MultiCollector(RemoteCollectorBase, metaclass=_DispatchOnSync):
    """Collectors whose rollouts run in worker processes on this machine.

    ``MultiCollector(create_env_fn, policy, sync=True, ...)`` returns a :class:`MultiSyncCollector`,
    ``sync=False`` a :class:`MultiAsyncCollector`; both are instances of this class.

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> collector = MultiCollector([CountingEnv] * 2, frames_per_batch=8, total_frames=8, sync=False)
        >>> isinstance(collector, (MultiCollector, MultiAsyncCollector))
        True
        >>> collector.shutdown()
    """

    _supports_run_free = True
    _sync = True
    _started = False
    _traj_counter = None
    #: legacy updaters' ``{device: weights}`` staging area (made on first use)
    _legacy_staging: dict | None = None
    #: whether the workers were given the replay buffer's storage to write into
    _buffer_attached = False

    def __init__(
        self,
        create_env_fn: Sequence[Callable] | Callable,
        policy: Callable | None = None,
        *,
        num_workers: int | None = None,
        policy_factory: Callable | Sequence[Callable] | None = None,
        frames_per_batch: int | Sequence[int],
        total_frames: int = -1,
        device=None,
        storing_device=None,
        env_device=None,
        policy_device=None,
        create_env_kwargs: dict | Sequence[dict] | None = None,
        collector_class: Any = None,
        max_frames_per_traj: int | None = None,
        init_random_frames: int | None = None,
        reset_at_each_iter: bool = False,
        postproc: Callable | None = None,
        split_trajs: bool | None = None,
        exploration_type=ExplorationType.RANDOM,
        reset_when_done: bool = True,
        update_at_each_batch: bool = False,
        preemptive_threshold: float | None = None,
        num_threads: int | None = None,
        num_sub_threads: int = 1,
        cat_results: str | int | None = None,
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
        worker_timeout: float = DEFAULT_WORKER_TIMEOUT,
        max_worker_restarts: int = 0,
        restart_delay: float = 0.0,
        preemption_grace: float = 5.0,
        mp_start_method: str | None = None,
        pre_collect_hook: Callable[[], None] | None = None,
        post_collect_hook: Callable[[TensorDictBase], None] | None = None,
        trajs_per_batch: int | None = None,
        trajs_per_write: int | None = None,
        traj_format: str | None = None,
        track_traj_ids: bool = True,
        compact_obs: bool = False,
        init_fn: Callable[[], None] | None = None,
        auto_register_policy_transforms: bool | None = None,
    ) -> None:
        arguments = constructor_arguments(locals())  # first thing: parsed at once into typed options
        super().__init__()
        self._closed = True
        self._build(WorkerProcessOptions.parse(type(self).__name__, sync=self._sync, **arguments))
        self._closed = False
        if weight_recv_schemes is not None:
            self.register_scheme_receiver(weight_recv_schemes)

    # ------------------------------------------------------------------ construction
    def _build(self, options: WorkerProcessOptions) -> None:
        self._options = options
        self.config = options.config
        self._worker_idx = options.config.worker_idx
        # Serving a parent (inside a node): collect on demand, like a Collector, so that weights the
        # parent pushes after taking a batch are in the next one (no batch prefetched with old ones).
        self._relaunch_after_yield = options.config.worker_idx is not None
        self._version_tracker = options.config.track_policy_version or None
        self._backend = options.backend()
        self.policy, self.policy_factory = options.policy, options.policy_factories
        self._fallback_policy = None
        self._setup_weights()
        if options.workers_write_buffer:
            options.config.replay_buffer.make_process_safe(self._backend.ctx)
        torch.set_num_threads(options.torch_threads())
        self._traj_counter = self._backend.trajectory_counter()  # shared: ids are fresh after a restart
        specs = options.worker_specs(default_collector=Collector, policy=self._worker_policy,
                                     schemes=self._sender_schemes, traj_counter=self._traj_counter)
        try:
            self._start_fleet(specs, options.worker_timeout)
            self._started = True
        except BaseException:
            for scheme in self._sender_schemes.values():
                scheme.shutdown()
            raise
        if self._legacy:
            self.weight_updater = options.weight_updater

    def _setup_weights(self) -> None:
        options = self._options
        policy, factories = options.policy, options.policy_factories
        default_name = self._backend.default_scheme()
        self._legacy = options.weight_updater is not None
        if self._legacy:  # the legacy updater's transport
            schemes = default_schemes(default_name, policy, factories)
            self._legacy_schemes = schemes
            self._weight_sync_schemes = None
        else:
            schemes = options.weight_sync_schemes
            if schemes is None:
                schemes = default_schemes(default_name, policy, factories)
            self._weight_sync_schemes = dict(schemes)
        self._sender_schemes = dict(schemes or {})
        for model_id, scheme in self._sender_schemes.items():
            scheme.init_on_sender(model_id=model_id, context=self, num_workers=options.num_workers)
        if factories is not None:
            self._worker_policy = None
        elif self._sender_schemes and "policy" in self._sender_schemes and policy is not None:
            self._worker_policy = stateless_copy(policy)  # its weights arrive through the scheme
        else:
            self._worker_policy = policy

    def _trajectory_counter(self):
        return self._traj_counter

    @property
    def update_at_each_batch(self) -> bool:
        return self._options.update_at_each_batch

    @property
    def preemptive_threshold(self) -> float | None:
        return self._options.preemptive_threshold

    # ------------------------------------------------------------------ properties
    @property
    def requested_frames_per_batch(self) -> int:
        resized = self._resized_frames_per_batch()
        return self.config.requested_frames if resized is None else resized

    def _frames_share(self, worker: int) -> int:
        shares = self._options.frames_per_worker
        return shares[worker] if worker < len(shares) else shares[0]  # an added worker: the first's share

    @property
    def frames_per_batch_worker(self) -> list[int]:
        return list(self._options.frames_per_worker)

    def get_model(self, model_id: str):
        if model_id != "policy":
            return super().get_model(model_id)
        if self.policy is not None:
            return self.policy
        if not self._started:
            # Starting: workers build their policies from the factory themselves; building one here
            # only for its initial weights would run the factory where the user did not ask for it.
            return None
        if self._fallback_policy is None and self.policy_factory and len({id(f) for f in self.policy_factory}) == 1:
            # update_policy_weights_() without weights: the factory's policy is the main-side copy
            self._fallback_policy = self.policy_factory[0]()
        return self._fallback_policy

    def fake_tensordict(self) -> TensorDictBase:
        """Not available for worker-process collectors (as in TorchRL): ask a Collector of the same env.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(f"{type(self).__name__}.fake_tensordict() is not implemented: build a Collector "
                                  "with one of the env constructors and call its fake_tensordict().")

    def get_cached_weights(self, model_id: str) -> TensorDictBase | None:
        """The shared-memory weights the workers of ``model_id`` run on (first worker's device), or
        None when that model's scheme keeps none (pipes, or no update yet)."""
        scheme = (self._sender_schemes or {}).get(model_id)
        buffers = getattr(scheme.sender_transports, "shared", None) if scheme is not None else None
        if not buffers:
            return None
        return buffers.get(self.config.policy_device_of(0), next(iter(buffers.values())))

    # ------------------------------------------------------------------ weights
    def _update_local_policy(self, value: Any) -> None:
        # No scheme (parameter-free policy): nothing to send; versions still move.
        self._policy_version += 1

    def legacy_weights_written(self, device: torch.device) -> None:
        """A legacy MultiProcessedWeightUpdater wrote ``device``'s weights: push them to those workers."""
        updater = self.weight_updater
        workers = [w for w in range(self.num_workers) if self.config.policy_device_of(w) == torch.device(device)]
        self._legacy_schemes["policy"].send(weights=updater.policy_weights[device], worker_ids=workers)

    @property
    def policy_weights(self) -> dict:
        """``{device: weights}`` staging area of legacy updaters (private copies; pushed on write)."""
        if self._legacy_staging is None:
            source = self.get_model("policy")
            if source is None:
                return {}
            weights = weights_of(source)
            devices = dict.fromkeys(self.config.policy_device_of(w) for w in range(self.num_workers))
            self._legacy_staging = {device: weights.detach().to(device).clone() for device in devices}
        return self._legacy_staging

    # ------------------------------------------------------------------ workers that join (docs/elastic.md)
    def add_collectors(self, create_env_fn: Callable | Sequence[Callable], num_envs: int | None = None,
                       policy: Any = None, collector_kwargs: dict | Sequence[dict] | None = None) -> None:
        """Add one worker process per entry of ``create_env_fn`` to the running collector.

        The same semantics as :meth:`RayCollector.add_collectors <rlharvest.collectors.distributed.
        RayCollector.add_collectors>`: the new workers take the indices after every slot (``W``,
        ``W + 1``, ..., removed workers' slots included), start on the weights of the last update and
        the current policy version, with seeds that continue the chain of the last :meth:`set_seed`,
        and draw trajectory ids from the collector's shared counter (never used before). From the next
        batch on they collect like the others: with ``sync=True`` each adds one rollout of the first
        worker's share of ``frames_per_batch`` to every batch (``requested_frames_per_batch`` and
        ``len()`` follow); asynchronously each yields batches of ``frames_per_batch`` frames.

        Args:
            create_env_fn: an env constructor, or a list of them (one per new worker).
            num_envs: envs per new worker: 1 (each worker process runs one env).
            policy: None or this collector's policy, or a list of those (one per new worker).
            collector_kwargs: a dict of extra arguments for every new worker's collector, or one per
                new worker (``frames_per_batch`` other than the worker's share is refused).

        Raises:
            ValueError: for an argument that does not fit (named in the message).
            RuntimeError: after shutdown, while running free (:meth:`start`), or from inside the
                collector's own iteration.
            WorkerError: naming a new worker that failed to start (the new workers are then stopped;
                the collector goes on with the others, as it was).

        Example:
            >>> from rlharvest.envs import CountingEnv
            >>> collector = MultiSyncCollector([CountingEnv], frames_per_batch=4, total_frames=-1)
            >>> collector.add_collectors([CountingEnv])
            >>> collector.active_workers, collector.requested_frames_per_batch
            ([0, 1], 8)
            >>> collector.shutdown()
        """
        env_fns, factory = self._check_added(create_env_fn, num_envs, policy)
        count, first = len(env_fns), self.num_workers
        extra = _new_collector_kwargs(collector_kwargs, count, self._options.frames_per_worker[0])
        config = self.config.grown(count)
        try:
            config.check_workers(first + count)
        except (RuntimeError, ValueError) as err:
            raise ValueError(f"add_collectors: {err} The collector was built with one value per worker: it cannot "
                             "tell the new workers' values.") from None
        options = self._options.grown(env_fns, factory, config)
        specs = options.worker_specs(default_collector=Collector, policy=self._worker_policy,
                                     schemes=self._sender_schemes, traj_counter=self._traj_counter)[first:]
        specs = [spec.replacement(collector_kwargs={**spec.collector_kwargs, **entry})
                 for spec, entry in zip(specs, extra)]
        previous = self._options, self.config
        self._options, self.config = options, config
        try:
            self._add_workers(specs, [config.policy_device_of(worker) for worker in range(first, first + count)])
        except BaseException:
            self._options, self.config = previous
            raise
        if self.policy_factory:
            self.policy_factory = list(options.policy_factories)
        self._resized()

    def _check_added(self, create_env_fn, num_envs, policy) -> tuple[list[Callable], Callable | None]:
        """The new workers' env constructors and policy factory, or the error naming what does not fit."""
        self._check_resizable("add")
        if self._legacy:
            raise ValueError("add_collectors needs weight sync schemes: this collector was built with a legacy "
                             "weight_updater, which serves the workers it started with only.")
        env_fns = list(create_env_fn) if isinstance(create_env_fn, (list, tuple)) else [create_env_fn]
        if not env_fns or any(not callable(env_fn) for env_fn in env_fns):
            raise ValueError(f"create_env_fn must be an env constructor or a non-empty list of them (one per new "
                             f"worker), got {create_env_fn!r}.")
        if num_envs is not None and num_envs != 1:
            raise ValueError(f"num_envs must be 1 (each worker process runs one env), got {num_envs!r}.")
        if any(entry is not None and entry is not self.policy for entry in
               (policy if isinstance(policy, (list, tuple)) else [policy])):
            raise ValueError("policy must be None or this collector's policy, or a list of those: every worker runs "
                             "the weights this collector sends.")
        factories = {id(factory): factory for factory in self.policy_factory or []}
        if len(factories) > 1:
            raise ValueError("add_collectors cannot choose the new workers' policy_factory: this collector was built "
                             "with a different one per worker.")
        return env_fns, next(iter(factories.values()), None)

    # ------------------------------------------------------------------ replay buffer
    def _assembles_trajectories(self) -> bool:
        return not self._options.workers_write_buffer

    def _write_to_buffer(self, batch: TensorDictBase) -> None:
        buffer = self.config.replay_buffer
        if self._options.workers_write_buffer and self.config.trajs_per_batch is not None:
            # The worker that sent this batch keeps its trajectories and writes them once the storage
            # is attached: here the batch only gives the storage its layout.
            if batch.numel():
                buffer.init_storage(self._postprocess(batch))
        else:
            super()._write_to_buffer(batch)
        if self._options.workers_write_buffer and buffer.storage is not None and not self._buffer_attached:
            self._buffer_attached = True
            self._drain_async()
            self._requests.broadcast(Command.ATTACH_BUFFER, buffer.storage)

    def _workers_can_write(self) -> bool:
        return self._options.workers_write_buffer

    def _prepare_run_free(self) -> None:
        if self.config.replay_buffer.storage is None:
            reply = self._requests.wait_for(0, request_batch(self._fleet, 0, self._random_phase()))
            self._write_to_buffer(self._handle_worker_batch(0, reply))


class MultiSyncCollector(MultiCollector):
    """Workers collect in lockstep: every batch stacks one rollout of every worker, ordered by index.

    Nothing is stepped between a yield and the next request, so it is safe for on-policy training.

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> collector = MultiSyncCollector([CountingEnv] * 2, frames_per_batch=8, total_frames=16)
        >>> [tuple(batch.shape) for batch in collector]
        [(2, 4), (2, 4)]
        >>> collector.shutdown()
    """

    _sync = True

    def _before_sync_batch(self) -> None:
        if self.update_at_each_batch:
            self.update_policy_weights_()

    def _gather_strategy(self, fleet: Fleet) -> SyncStack:
        return SyncStack(fleet, self._meter, self._options.preemptive_threshold)

    def _assemble_sync(self, batches: list[TensorDictBase], replies: list) -> TensorDictBase:
        if self._options.cat_results == "stack":
            out = torch.stack(batches, 0)
            if self.preemptive_threshold is not None:
                out.set(MASK, out.get(TRAJ_IDS) != -1)
            out.names = [None] * (out.batch_dims - 1) + ["time"]
            return out
        dim = self._options.cat_results
        if self.preemptive_threshold is not None:
            batches = [_valid_steps(b) for b in batches]
        out = torch.cat(batches, dim)
        if dim in (-1, out.batch_dims - 1):
            out.names = [None] * (out.batch_dims - 1) + ["time"]
        return out


def _new_collector_kwargs(collector_kwargs: Any, count: int, share: int) -> list[dict]:
    """The extra collector arguments of each of ``count`` new workers (``add_collectors``)."""
    entries = list(collector_kwargs) if isinstance(collector_kwargs, (list, tuple)) else [collector_kwargs] * count
    if len(entries) != count:
        raise ValueError(f"collector_kwargs must hold one entry per new worker ({count}), got {len(entries)}.")
    for index, entry in enumerate(entries):
        if entry is not None and not isinstance(entry, dict):
            raise ValueError(f"collector_kwargs must be a dict or a list of dicts (one per new worker), got "
                             f"{type(entry).__name__} at index {index}.")
        frames = (entry or {}).get("frames_per_batch", share)
        if frames != share:
            raise ValueError(f"collector_kwargs[{index}]['frames_per_batch']={frames!r}: every worker collects "
                             f"{share} frames per rollout (leave it out).")
    return [dict(entry or {}) for entry in entries]


def _valid_steps(batch: TensorDictBase) -> TensorDictBase:
    """Drop the trailing time steps a preempted worker did not collect."""
    valid = (batch.get(TRAJ_IDS) != -1).reshape(-1, batch.shape[-1]).any(0)
    return batch[..., : int(valid.sum())]


class MultiAsyncCollector(MultiCollector):
    """Workers collect continuously; each batch is the first one ready (off-policy training).

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> collector = MultiAsyncCollector([CountingEnv] * 2, frames_per_batch=8, total_frames=16)
        >>> [batch.numel() for batch in collector]
        [8, 8]
        >>> collector.shutdown()
    """

    _sync = False

    def _before_relaunch(self, worker: int) -> None:
        if self.update_at_each_batch and (self._sender_schemes or self.weight_updater is not None):
            self.update_policy_weights_(worker_ids=[worker] if not self._legacy else None)

    def reset(self, reset_idx: Sequence[bool] | None = None) -> None:
        """Reset workers' envs (in-flight rollouts are dropped); iteration restarts them."""
        super().reset(reset_idx)


class AsyncCollector(MultiAsyncCollector):
    """One Collector running in a background process (a MultiAsyncCollector with one worker).

    Takes MultiAsyncCollector's arguments, with one env constructor and one dict of
    ``create_env_kwargs`` instead of lists.

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> collector = AsyncCollector(CountingEnv, frames_per_batch=4, total_frames=8)
        >>> len(list(collector))
        2
        >>> collector.shutdown()
    """

    __signature__ = derived_signature(MultiCollector.__init__, defaults={"num_workers": 1})

    def __init__(self, *args, **kwargs) -> None:
        arguments = bind_arguments(type(self).__name__, self.__signature__, args, kwargs)
        create_env_fn = arguments.pop("create_env_fn")
        if isinstance(create_env_fn, (list, tuple)):
            raise TypeError("AsyncCollector takes one env constructor, not a list (use MultiAsyncCollector).")
        if arguments.pop("num_workers") != 1:
            raise ValueError("AsyncCollector runs exactly one worker.")
        create_env_kwargs = arguments.pop("create_env_kwargs")
        super().__init__([create_env_fn], create_env_kwargs=[create_env_kwargs or {}], **arguments)

    __init__.__signature__ = method_signature(__signature__)
