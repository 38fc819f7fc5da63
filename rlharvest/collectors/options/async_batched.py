"""The options of AsyncBatchedCollector, validated once into a frozen dataclass, and its worker env factories."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

import torch

from ..._utils import NestedKey, positive_int, wrap_callable
from ...config import CollectorConfig, positive_seconds
from ...config_views import BatchShares, FramesPerBatch
from ...envs import SerialEnv
from ...protocol import WorkerSpec
from ...transport.base import Backend
from ...transport.inprocess import InProcessBackend
from ...transport.mp import MPBackend, mp_context
from ...worker import run_worker
from ..engine.contract import Startup, WorkerSetup
from ..engine.extras import EngineExtra
from ..engine.fleet import Fleet
from ..engine.gather import Gathering
from ..engine.running import IN_A_THREAD, FreeRun
from ..engine.schedule import WeightPushes
from ..engine.served import PolicyServer, ServedChunks
from ..engine.events import FleetEvents
from ..engine.state import Lifecycle
from ..engine.stats import ASKED_WHEN_VIEWED, WorkerCensus
from ..engine.traj_ids import SharedIds, TrajectoryIds
from .common import check_env_constructors
from .local import LocalOptions

__all__ = ["AsyncBatchedConfig", "AsyncBatchedOptions", "async_batched_config", "worker_env_factories"]

#: TorchRL 0.14 defaults of the inference server
DEFAULT_MAX_BATCH_SIZE, DEFAULT_MIN_BATCH_SIZE, DEFAULT_SERVER_TIMEOUT = 64, 1, 0.01
#: most env steps per message from a worker with transition_chunk_size="auto"
AUTO_CHUNK_CAP = 64
ENV_BACKENDS = ("multiprocessing", "threading")


@dataclass(frozen=True)
class AsyncBatchedConfig:
    """What AsyncBatchedCollector adds to the common collector arguments."""

    num_envs: int
    """Envs in all (``len(create_env_fn)``)."""
    envs_per_worker: int
    """Envs stepped by one worker (a SerialEnv of them when more than one)."""
    env_backend: str
    """``"multiprocessing"`` (a process per worker) or ``"threading"`` (a thread per worker)."""
    transition_chunk_size: int | None
    """Env steps a worker collects per message to the collector (None: ``"auto"``, :meth:`chunk_steps`)."""
    max_batch_size: int
    """Most frames one policy call serves."""
    min_batch_size: int
    """Frames the server gathers, for up to ``server_timeout`` seconds, before a policy call."""
    server_timeout: float
    yield_completed_trajectories: bool
    """Yield one complete trajectory at a time instead of batches of ``frames_per_batch`` frames."""
    policy_version_key: NestedKey | None
    """Where each frame carries the version of the weights that chose its action (None: nowhere)."""
    policy_version: int
    """Version of the initial weights."""
    device: torch.device | None = None
    """Where the policy runs (in the server; workers' envs stay where they are)."""

    def chunk_steps(self, frames_per_batch: int) -> int:
        """Env steps a worker collects per message: ``transition_chunk_size``, or with ``"auto"`` small
        enough that one chunk per worker (what may already be collected when weights are updated) stays
        below a batch, large enough to keep the per-message cost off the per-frame path."""
        if self.transition_chunk_size is not None:
            return self.transition_chunk_size
        return max(1, min(AUTO_CHUNK_CAP, frames_per_batch // ((self.num_workers + 1) * self.envs_per_worker)))

    @property
    def num_workers(self) -> int:
        return self.num_envs // self.envs_per_worker


#: TorchRL arguments that have nothing to configure here, with the values that mean "the default"
_NEUTRAL = {
    "transport": (None, "driver", "auto"),  # the server is always a thread of the collector's process
    "backend": (None, "threading", "multiprocessing"),
    "env_exchange": ("auto", "shm", "queue"),  # data always travels through shared memory
    "policy_backend": (None, "threading"),
    "weight_sync": (None,),
    "weight_sync_model_id": ("policy",),
    "verbose": (False, True),
    "worker_affinity": (None,),
    "driver_affinity": (None,),
    "server_config": (None,),
    "device_config": (None,),
    "reset_at_each_iter": (False,),
}


#: the check of a count argument, naming this collector
_positive = functools.partial(positive_int, owner="AsyncBatchedCollector")


def reject_unsupported(options: dict) -> None:
    """Refuse, by name, the TorchRL arguments this collector cannot honour.

    Raises:
        TypeError: for an argument TorchRL does not have either.
        ValueError: for a TorchRL argument given a value other than its neutral ones.
    """
    unknown = sorted(k for k in options if k not in _NEUTRAL)
    if unknown:
        raise TypeError(f"AsyncBatchedCollector got unexpected keyword argument(s) {unknown}.")
    for name, value in options.items():
        allowed = _NEUTRAL[name]
        if not any(value is a or (isinstance(a, str) and value == a) for a in allowed):
            raise ValueError(f"AsyncBatchedCollector does not support {name}={value!r} (allowed: {list(allowed)}): "
                             "envs step in rlharvest workers and the policy is served from a thread of this process.")


def async_batched_config(*, create_env_fn: Sequence[Callable], max_batch_size, min_batch_size,
                         server_timeout, env_backend, envs_per_worker, transition_chunk_size,
                         yield_completed_trajectories: bool, policy_version_key, policy_version, device=None,
                         options: dict) -> AsyncBatchedConfig:
    """Validate the collector's own arguments (see :class:`AsyncBatchedConfig`)."""
    reject_unsupported(options)
    if not isinstance(create_env_fn, (list, tuple)) or not create_env_fn:
        raise TypeError("AsyncBatchedCollector: create_env_fn must be a non-empty list of env factories.")
    check_env_constructors(create_env_fn, "worker process")
    num_envs = len(create_env_fn)
    backend = env_backend if env_backend is not None else options.get("backend") or "multiprocessing"
    if backend not in ENV_BACKENDS:
        raise ValueError(f"AsyncBatchedCollector: env_backend must be one of {ENV_BACKENDS}, got {backend!r}")
    envs_per_worker = _positive("envs_per_worker", envs_per_worker)
    if num_envs % envs_per_worker:
        raise ValueError(f"AsyncBatchedCollector: envs_per_worker={envs_per_worker} does not divide the {num_envs} "
                         "envs (every worker must host as many envs, so that their requests stack).")
    chunk = None if transition_chunk_size == "auto" else _positive("transition_chunk_size", transition_chunk_size)
    max_batch = _positive("max_batch_size", DEFAULT_MAX_BATCH_SIZE if max_batch_size is None else max_batch_size)
    min_batch = _positive("min_batch_size", DEFAULT_MIN_BATCH_SIZE if min_batch_size is None else min_batch_size)
    timeout = DEFAULT_SERVER_TIMEOUT if server_timeout is None else server_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
        raise ValueError(f"AsyncBatchedCollector: server_timeout must be a non-negative number, got {timeout!r}")
    if isinstance(policy_version, bool) or not isinstance(policy_version, int):
        raise TypeError(f"AsyncBatchedCollector: policy_version must be an int, got {policy_version!r}")
    return AsyncBatchedConfig(
        num_envs=num_envs, envs_per_worker=envs_per_worker, env_backend=backend, transition_chunk_size=chunk,
        max_batch_size=max_batch, min_batch_size=min_batch, server_timeout=float(timeout),
        yield_completed_trajectories=bool(yield_completed_trajectories), policy_version_key=policy_version_key,
        policy_version=policy_version, device=torch.device(device) if device is not None else None,
    )


def worker_env_factories(create_env_fn: Sequence[Callable], create_env_kwargs, envs_per_worker: int) -> list:
    """One env factory per worker: the env itself, or a SerialEnv of ``envs_per_worker`` of them."""
    count = len(create_env_fn)
    if create_env_kwargs is None or isinstance(create_env_kwargs, dict):
        kwargs = [dict(create_env_kwargs or {}) for _ in range(count)]
    elif len(create_env_kwargs) != count or not all(isinstance(k, dict) for k in create_env_kwargs):
        raise ValueError(f"AsyncBatchedCollector: create_env_kwargs must be a dict or a list of {count} dicts.")
    else:
        kwargs = [dict(k) for k in create_env_kwargs]
    if envs_per_worker == 1:
        return [functools.partial(fn, **kw) if kw else fn for fn, kw in zip(create_env_fn, kwargs)]
    return [
        functools.partial(SerialEnv, envs_per_worker, list(create_env_fn[first:first + envs_per_worker]),
                          create_env_kwargs=kwargs[first:first + envs_per_worker])
        for first in range(0, count, envs_per_worker)
    ]


@dataclass(frozen=True)
class AsyncBatchedOptions:
    """What an ``AsyncBatchedCollector`` is built from, validated: the arguments every collector shares,
    its own (:class:`AsyncBatchedConfig`), its policy and one env factory per worker."""

    config: CollectorConfig
    batched: AsyncBatchedConfig
    policy: Any
    """The policy the server runs (a private copy of it, updated by ``update_policy_weights_``)."""
    policy_factory: Any
    env_fns: tuple
    """One env factory per worker (a ``SerialEnv`` of several envs when ``envs_per_worker > 1``)."""
    worker_timeout: float
    mp_start_method: str | None = None
    worker_collector: Any = None
    """rlharvest's ``Collector``, which every worker runs (the face gives it)."""

    shutdown_timeout = 10.0
    factory_fallback = False
    cat_results = "stack"
    preemptive_threshold = None
    workers_write_buffer = False
    assembles_trajectories = False
    weight_updater = None
    weight_recv_schemes = None
    version_tracker = True
    policy_factories = None
    noun = "worker"
    refuses_keep_env = True
    shutdown_after_total = False
    startup = Startup()
    census: ClassVar[WorkerCensus] = ASKED_WHEN_VIEWED
    #: no weight is pushed by itself: the policy runs here
    pushes = WeightPushes()
    #: ``start()``: a thread here iterates into the replay buffer
    free_run: ClassVar[FreeRun] = IN_A_THREAD
    autoscale = None

    @classmethod
    def parse(cls, *, create_env_fn: Sequence[Callable], policy: Any, policy_factory: Any,
              total_frames: int, max_batch_size: Any, min_batch_size: Any, server_timeout: Any, device: Any,
              env_backend: Any, envs_per_worker: int, transition_chunk_size: Any, postproc: Any,
              exploration_type: Any, replay_buffer: Any, post_collect_hook: Any, yield_completed_trajectories: bool,
              create_env_kwargs: Any, policy_version: int, policy_version_key: Any, max_frames_per_traj: Any,
              trust_policy: Any, worker_timeout: Any, mp_start_method: str | None, worker_collector: type,
              torchrl_options: dict) -> AsyncBatchedOptions:
        """Validate ``AsyncBatchedCollector``'s arguments, once.

        Raises:
            TypeError, ValueError: naming the argument that does not fit.
        """
        if policy is not None and policy_factory is not None:
            raise TypeError("AsyncBatchedCollector: policy and policy_factory are mutually exclusive.")
        if policy is None and policy_factory is None:
            raise TypeError("AsyncBatchedCollector: one of policy or policy_factory must be given.")
        batched = async_batched_config(
            create_env_fn=create_env_fn, max_batch_size=max_batch_size,
            min_batch_size=min_batch_size, server_timeout=server_timeout, env_backend=env_backend,
            envs_per_worker=envs_per_worker, transition_chunk_size=transition_chunk_size,
            yield_completed_trajectories=yield_completed_trajectories, policy_version_key=policy_version_key,
            policy_version=policy_version, device=device, options=torchrl_options)
        # The policy runs here, so ``device`` is the server's, never the workers'; hooks run here too.
        config = CollectorConfig(total_frames=total_frames, postproc=postproc,
                                 exploration_type=exploration_type, replay_buffer=replay_buffer,
                                 max_frames_per_traj=max_frames_per_traj, trust_policy=trust_policy,
                                 post_collect_hook=post_collect_hook)
        env_fns = worker_env_factories(list(create_env_fn), create_env_kwargs, batched.envs_per_worker)
        return cls(config=config, batched=batched, policy=policy if policy is not None else policy_factory(),
                   policy_factory=policy_factory, env_fns=tuple(env_fns),
                   worker_timeout=positive_seconds("worker_timeout", worker_timeout), mp_start_method=mp_start_method,
                   worker_collector=worker_collector)

    # ------------------------------------------------------------------ what the engine is handed
    @property
    def gathering(self) -> Gathering:
        """Batches are assembled here, from whichever env worker is ready: hooks run here too."""
        return ServedChunks(self.batched.yield_completed_trajectories)

    def trajectory_ids(self) -> TrajectoryIds:
        """One counter every worker shares."""
        return SharedIds()

    def extras(self, backend: Backend, fleet: Fleet, life: Lifecycle, events: FleetEvents) -> list[EngineExtra]:
        return []

    def served_policy(self, backend: Backend) -> PolicyServer:
        """The policy, served in this process to every env worker (a private copy of it)."""
        batched = self.batched
        return PolicyServer(self.policy, backend.ctx, num_workers=batched.num_workers,
                            max_batch_size=batched.max_batch_size, min_batch_size=batched.min_batch_size,
                            timeout=batched.server_timeout, device=batched.device,
                            exploration_type=self.config.exploration_type, trust_policy=self.config.trust_policy,
                            version=batched.policy_version)

    def scaled_backend_options(self, count: int) -> None:
        return None

    def added(self, *args: Any) -> Any:
        """Raises: NotImplementedError: an ``AsyncBatchedCollector`` cannot add env workers."""
        raise NotImplementedError("AsyncBatchedCollector cannot add env workers to a running collector.")

    @property
    def num_workers(self) -> int:
        return len(self.env_fns)

    def worker_shares(self, frames: FramesPerBatch) -> BatchShares:
        """``frames`` per batch, and what each worker collects per rollout: a chunk of each of its envs.

        Raises:
            TypeError: for a per-worker list (batches are cut from whichever worker is ready).
        """
        if frames.per_worker:
            raise TypeError(f"frames_per_batch must be an int for AsyncBatchedCollector, got {list(frames.value)}.")
        batched = self.batched
        return BatchShares(frames, (batched.chunk_steps(frames.value) * batched.envs_per_worker,))

    def build_backend(self) -> Backend:
        if self.batched.env_backend == "threading":
            return InProcessBackend(self.num_workers, run_worker)
        return MPBackend(self.num_workers, run_worker, mp_context(self.mp_start_method))

    def prepare(self, backend: Backend) -> WorkerSetup:
        """No weight scheme (the policy runs here); one trajectory counter for every worker."""
        return WorkerSetup(policy=None, schemes={}, trajectory_counter=backend.trajectory_counter())

    def worker_specs(self, setup: WorkerSetup, shares: BatchShares, first: int = 0) -> list[WorkerSpec]:
        """Each worker runs a ``Collector`` of its env(s) whose policy is a client of the served one,
        collecting chunks of ``transition_chunk_size`` steps (its share of ``shares``)."""
        batched = self.batched
        config = self.config.worker_config(0, frames_per_batch=shares.share(0),
                                           total_frames=-1, post_collect_hook=None)
        return [WorkerSpec(
            worker_idx=worker, collector_class=self.worker_collector, create_env_fn=wrap_callable(self.env_fns[worker]),
            options=LocalOptions(config=config, create_env_fn=None, trajectory_counter=setup.trajectory_counter,
                                 served_by=setup.inference.client(worker, batched.policy_version_key,
                                                                  self.worker_timeout)),
        ) for worker in range(first, self.num_workers)]
