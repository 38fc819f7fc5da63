"""How an :class:`~rlharvest.collectors.Evaluator` checks its arguments and builds the runs of its
backend: an ``EvalCollector`` in a thread of this process (or another collector class), a
``MultiSyncCollector`` with one worker process, or a Ray actor (``distributed/ray_eval.py``); the
collector's arguments are the same for every backend (docs/evaluation.md).

The ``"thread"`` backend builds its env and policy once (:class:`ThreadSources`) and may run two
collectors over them: one for ``"first_done"`` evaluations and one for per-env episodes
(``_eval_episodes.py``), so weights given to either reach the one policy.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

from .._utils import user_stacklevel
from ..envs.adapters import is_env
from ..envs.factory import make_env
from ._eval_episodes import EpisodeRun, FirstEpisodesEnd
from ._evaluation import EvalCollector, EvalConfig, LocalRun, WorkerRun, build_policy, frozen_normalization
from .async_batched import AsyncBatchedCollector
from .distributed.ray_eval import RayEvalRun, RayEvalWorker
from .multi import AsyncCollector, MultiAsyncCollector, MultiSyncCollector
from .single import Collector

__all__ = ["EvalConfig", "RunBuilders", "run_builders", "check_choice", "check_sources",
           "check_episode_sampling", "episodes_unsupported"]

#: the one collector argument per-env episodes take from ``collector_kwargs``
_KEPT_PER_ENV = "auto_register_policy_transforms"
#: the classes ``collector_cls`` may name
_BY_NAME = {cls.__name__: cls for cls in (Collector, MultiSyncCollector, MultiAsyncCollector, AsyncCollector,
                                          AsyncBatchedCollector, EvalCollector)}


# ---------------------------------------------------------------------------------- argument checks
def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    """Raises: ValueError naming ``name``, ``value`` and the ``allowed`` ones."""
    if value not in allowed:
        raise ValueError(f"Unknown {name} {value!r}: choose one of {', '.join(map(repr, allowed))}.")
    return value


def check_sources(backend: str, env: Any, policy: Any, policy_factory: Any, schemes: Any) -> None:
    """Both or neither of policy/policy_factory, and what a backend building them elsewhere needs.

    Raises:
        ValueError: naming what is missing or conflicting.
    """
    if policy is not None and policy_factory is not None:
        raise ValueError("Provide either `policy` or `policy_factory`, not both.")
    if policy is None and policy_factory is None:
        raise ValueError("Either `policy` or `policy_factory` must be provided.")
    if backend == "thread" and schemes is None:
        return
    where = f"backend={backend!r}" + (" with weight_sync_schemes" if backend == "thread" else "")
    if is_env(env) or not callable(env):
        raise ValueError(f"{where} builds the env in another process: `env` must be a callable returning an env "
                         f"(got {type(env).__name__}).")
    if policy_factory is None:
        raise ValueError(f"{where} builds the policy in another process: it needs `policy_factory` "
                         "(a callable `(env) -> policy`), not `policy`.")


def episodes_unsupported(backend: str, schemes: Any, max_steps: int | None) -> str | None:
    """Why per-env episodes cannot be sampled with these arguments (None: they can). They are rolled
    out on the env in this process, every episode cut at ``max_steps``."""
    if backend != "thread":
        return f"backend={backend!r} (per-env episodes run in this process: use backend='thread')"
    if schemes is not None:
        return "weight_sync_schemes (they run the evaluation in a worker process)"
    if max_steps is None:
        return "max_steps=None (each rollout is max_steps long: give an int)"
    return None


def check_episode_sampling(episode_sampling: Any, backend: str, schemes: Any, max_steps: int | None,
                           collector_cls: Any = None, collector_kwargs: dict | None = None) -> str:
    """Raises: ValueError for an unknown ``episode_sampling``, or ``"per_env"`` with arguments it cannot
    honour (another backend, weight_sync_schemes, no ``max_steps``). Warns when ``"per_env"`` leaves the
    collector arguments given unused."""
    check_choice("episode_sampling", episode_sampling, ("first_done", "per_env"))
    if episode_sampling != "per_env":
        return episode_sampling
    reason = episodes_unsupported(backend, schemes, max_steps)
    if reason is not None:
        raise ValueError(f"episode_sampling='per_env' requires backend='thread', no weight_sync_schemes and an "
                         f"integer max_steps; got {reason}.")
    unused = ["collector_cls"] * (collector_cls is not None) + sorted(set(collector_kwargs or {}) - {_KEPT_PER_ENV})
    if unused:
        warnings.warn(f"episode_sampling='per_env' steps the env with a collector of its own: {', '.join(unused)} "
                      f"{'is' if len(unused) == 1 else 'are'} not used (only {_KEPT_PER_ENV} of collector_kwargs is).",
                      UserWarning, stacklevel=user_stacklevel())
    return episode_sampling


# ---------------------------------------------------------------------------------- runs
def _collector_class(collector_cls: type | str | None) -> type:
    if collector_cls is None:
        return EvalCollector
    if isinstance(collector_cls, str):
        if collector_cls not in _BY_NAME:
            raise ValueError(f"collector_cls {collector_cls!r} is not a class of rlharvest.collectors (one of "
                             f"{sorted(_BY_NAME)}).")
        return _BY_NAME[collector_cls]
    return collector_cls


class ThreadSources:
    """The env and policy of the ``"thread"`` backend, built once, by whoever evaluates first: the env
    from its constructor (its VecNorm transforms frozen), the policy from ``policy_factory(env)``."""

    def __init__(self, env: Any, policy: Any, policy_factory: Any, env_kwargs: dict | None) -> None:
        self._env, self._policy, self._factory, self._env_kwargs = env, policy, policy_factory, env_kwargs
        self._built: tuple[Any, Any] | None = None

    def get(self) -> tuple[Any, Any]:
        """``(env, policy)``."""
        if self._built is None:
            env = frozen_normalization(make_env(self._env, self._env_kwargs))
            policy = self._policy if self._factory is None else build_policy(self._factory, env)
            self._built = (env, policy)
        return self._built


@dataclasses.dataclass(frozen=True)
class RunBuilders:
    """How the evaluator's runs are built."""

    main: Callable[[], Any]
    """The run of :meth:`~rlharvest.collectors.Evaluator.evaluate` and ``trigger_eval``."""
    episodes: Callable[[], EpisodeRun] | None
    """The run of ``evaluate_episodes`` (None: not with this backend)."""
    eager: bool
    """Whether ``main`` is built with the evaluator (else by the first evaluation)."""


def run_builders(config: EvalConfig, env: Any, policy: Any, policy_factory: Any, collector_cls: Any,
                 schemes: dict | None) -> RunBuilders:
    """The builders of the backend's runs. The collector's arguments are the same for every backend."""
    # collector_kwargs may set what has a default here (traj_format="cat": metrics read flat batches too)
    collect = {**dict(frames_per_batch=config.frames_per_batch, total_frames=-1, max_frames_per_traj=config.max_steps,
                      trajs_per_batch=config.num_trajectories, traj_format="padded",
                      exploration_type=config.exploration_type), **config.collector_kwargs}
    if config.backend == "ray":
        return RunBuilders(lambda: RayEvalRun(RayEvalWorker(
            config.init_fn, env, policy_factory, num_gpus=config.num_gpus, reward_keys=config.reward_key,
            num_trajectories=config.num_trajectories, frames_per_batch=config.frames_per_batch,
            collector_kwargs=config.collector_kwargs, **config.ray_kwargs), config), None, True)
    if config.backend == "process" or schemes is not None:
        def build_worker() -> WorkerRun:
            collector = MultiSyncCollector(
                [env], policy_factory=policy_factory, collector_class=EvalCollector, weight_sync_schemes=schemes,
                init_fn=config.init_fn, policy_device=config.device, **collect)
            return WorkerRun(collector, config.reward_key, config.metrics_fn)
        return RunBuilders(build_worker, None, True)

    cls = _collector_class(collector_cls)
    sources = ThreadSources(env, policy, policy_factory, collect.pop("create_env_kwargs", None))

    def build_local() -> LocalRun:
        built_env, built_policy = sources.get()
        return LocalRun(cls(built_env, built_policy, policy_device=config.device, **collect), config.reward_key,
                        config.metrics_fn)

    def build_episodes() -> EpisodeRun:
        built_env, built_policy = sources.get()
        envs = int(built_env.batch_size.numel()) if len(built_env.batch_size) else 1
        stop = FirstEpisodesEnd()
        collector = EvalCollector(built_env, built_policy, frames_per_batch=envs * config.max_steps, total_frames=-1,
                                  exploration_type=config.exploration_type, policy_device=config.device,
                                  interruptor=stop, **{key: value for key, value in config.collector_kwargs.items()
                                                       if key == _KEPT_PER_ENV})
        return EpisodeRun(collector, stop, config.num_trajectories, config.reward_key, config.done_key,
                          config.metrics_fn)

    main = build_episodes if config.episode_sampling == "per_env" else build_local
    # A constructor and a factory: both are built by whoever evaluates first (the background thread
    # for trigger_eval), as TorchRL does, so that the env can live on a device of its own.
    return RunBuilders(main, build_episodes, not (policy_factory is not None and not is_env(env) and callable(env)))
