"""What one evaluation is, whatever runs it: a collector yielding complete trajectories, and the
episode metrics read from them (docs/evaluation.md).

An evaluation is one batch of a collector built with ``trajs_per_batch=num_trajectories``: the
rollout loop (``rlharvest/rollout.py``) runs it, in this process (:class:`Collector`), in a worker
process (:class:`MultiSyncCollector`, one worker) or in a Ray actor (:class:`RayCollector`, one
actor). :class:`TrajectoryRun` drives any of them the same way: new weights go through the
collector's ``update_policy_weights_`` (its weight scheme when it has workers), then a reset drops
every trajectory begun with the previous weights, then one batch is collected.

That batch holds the first ``num_trajectories`` episodes to end, so short episodes are over-sampled
(``episode_sampling="first_done"``); ``_eval_episodes.py`` samples one episode per sub-env instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import sys
import time
from typing import Any, Callable, Iterator

import torch
from tensordict import TensorDictBase

from .._utils import as_tuple_key, unwrap
from ..envs.factory import env_keys, make_env
from .base import BaseCollector
from .single import Collector

__all__ = ["EvalConfig", "EvalCollector", "TrajectoryRun", "LocalRun", "WorkerRun", "episode_metrics", "eval_mode",
           "prefixed_result", "AfterInit", "build_policy", "frozen_normalization"]

#: where TorchRL's RewardSum transform writes the running return of each episode
EPISODE_REWARD_KEY = ("next", "episode_reward")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """The Evaluator's arguments, checked once (the names are TorchRL's)."""

    backend: str
    """``"thread"``, ``"process"`` or ``"ray"``."""
    num_trajectories: int
    """Complete episodes per evaluation (the collector's ``trajs_per_batch``)."""
    max_steps: int | None
    """Episodes are truncated after this many steps (``max_frames_per_traj``); None: never."""
    frames_per_batch: int
    """Env steps per poll of the collector: ``frames_per_batch``, else ``max_steps``, else 1000."""
    collector_kwargs: dict
    """More arguments of the collector."""
    log_prefix: str
    """Prefix of the result's keys (``"eval"``)."""
    reward_key: Any
    """The per-step reward, summed over an episode without a ``RewardSum`` transform."""
    done_key: Any
    """Accepted for TorchRL's signature; episodes end where the collector ends them."""
    device: torch.device | None
    """Where the evaluation policy runs (the collector's ``policy_device``); None: where it is."""
    exploration_type: Any
    """Ambient exploration mode of the evaluation rollouts (DETERMINISTIC)."""
    metrics_fn: Callable | None
    """``batch -> {name: value}``: more metrics, reported as ``<prefix>/<name>``."""
    dump_video: bool
    """After each evaluation, ``dump`` the video a TorchRL ``VideoRecorder`` of the env recorded."""
    on_result: Callable | None
    """Called with each result as a TensorDict."""
    busy_policy: str
    """``trigger_eval`` while one is pending: ``"skip"``, ``"error"`` or ``"queue"``."""
    episode_sampling: str
    """``"first_done"`` (the first ``num_trajectories`` episodes to end) or ``"per_env"`` (one episode
    per sub-env and rollout: :class:`EpisodeRun`)."""
    init_fn: Callable | None
    """Called first in the worker process or actor (process and ray backends)."""
    num_gpus: int
    """GPUs of the Ray actor."""
    ray_kwargs: dict
    """More ``ray.remote`` options of the Ray actor."""


def build_policy(policy_factory: Callable, env: Any) -> Any:
    """The evaluation policy: ``policy_factory(env)`` when the factory takes the env, else ``policy_factory()``.

    TorchRL's Evaluator documents factories of the env, ``(env) -> policy``, and is also given
    ``partial(RandomPolicy, env.action_spec)``, whose next parameter is ``action_key``: the env passed
    there would become the key the action is written at. So the env is passed when the factory's first
    positional parameter has no default, is named ``env``, or is ``*args``; a factory whose first one
    has another name and a default, or that takes no positional parameter, is called without it. A
    callable whose signature cannot be read is given the env.

    Example:
        >>> import functools
        >>> build_policy(lambda env: ("built for", env), "the env")
        ('built for', 'the env')
        >>> build_policy(functools.partial(lambda spec, key="action": (spec, key), "spec"), "the env")
        ('spec', 'action')
    """
    factory = unwrap(policy_factory)
    try:
        parameters = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):  # some builtins and C callables
        return factory(env)
    first = parameters[0] if parameters else None
    if first is None or first.kind in (first.KEYWORD_ONLY, first.VAR_KEYWORD):
        return factory()
    if first.kind is first.VAR_POSITIONAL or first.default is first.empty or first.name == "env":
        return factory(env)
    return factory()


class EvalCollector(Collector):
    """A :class:`Collector` for evaluations, built where it runs (in a worker, an actor, a thread).

    Three differences with a Collector, the Evaluator's contract (docs/evaluation.md):

    * ``policy_factory`` is called with the env, ``policy_factory(env)``, as TorchRL's Evaluator
      documents, so that a policy can be sized from the env's specs (unless it does not take the env:
      :func:`build_policy`);
    * ``max_frames_per_traj`` is dropped when the env already counts its steps (a ``StepCounter``
      transform): its own ``step_count`` then ends the episodes;
    * the ``VecNorm``/``VecNormV2`` transforms of a TorchRL env are frozen: evaluating must not move
      the running statistics the training env shares (they come with the weights).

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> collector = EvalCollector(CountingEnv(max_steps=2), policy_factory=lambda env: None,
        ...                           frames_per_batch=6, trajs_per_batch=2, traj_format="padded")
        >>> next(iter(collector))["collector", "mask"].shape[0]  # two complete episodes
        2
        >>> collector.shutdown()
    """

    def __init__(self, create_env_fn: Any, policy: Callable | None = None, *,
                 policy_factory: Callable[[Any], Callable] | None = None, **kwargs: Any) -> None:
        env = frozen_normalization(make_env(create_env_fn, kwargs.pop("create_env_kwargs", None)))
        if policy is None and policy_factory is not None:
            policy = build_policy(policy_factory, env)
        if kwargs.get("max_frames_per_traj") and ("step_count",) in env_keys(env):
            kwargs["max_frames_per_traj"] = None
        super().__init__(env, policy, **kwargs)

    def dump_video(self, step: int | None = None) -> None:
        """Write what a TorchRL ``VideoRecorder`` in the env's transforms recorded (``dump``).

        Only a TorchRL ``TransformedEnv`` has such transforms; it is recognised by its type, and
        only when TorchRL is already imported (the env came from it).
        """
        transforms = sys.modules.get("torchrl.envs.transforms")
        if transforms is not None and isinstance(self.env, transforms.TransformedEnv):
            self.env.transform.dump(step=step)


def frozen_normalization(env: Any) -> Any:
    """``env`` with the VecNorm transforms of a TorchRL ``TransformedEnv`` frozen, recognised by their
    types (only when TorchRL is already imported: the env came from it)."""
    transforms = sys.modules.get("torchrl.envs.transforms")
    if transforms is None or not isinstance(env, transforms.TransformedEnv):
        return env
    normalizers = tuple(getattr(transforms, name) for name in ("VecNorm", "VecNormV2") if hasattr(transforms, name))
    stack = [env.transform]
    while stack:
        transform = stack.pop()
        if isinstance(transform, transforms.Compose):
            stack.extend(transform)
        elif isinstance(transform, normalizers):
            transform.freeze()
    return env


class AfterInit:
    """An env constructor that first calls ``init_fn`` (once per process): how a Ray actor runs the
    Evaluator's ``init_fn`` before it builds anything (worker processes take ``init_fn`` directly).

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> AfterInit(lambda: None, CountingEnv)().batch_size
        torch.Size([])
    """

    def __init__(self, init_fn: Callable[[], None] | None, env_maker: Callable[[], Any]) -> None:
        self.init_fn, self.env_maker = init_fn, env_maker
        self._initialised = False

    def __call__(self, **kwargs: Any) -> Any:
        if self.init_fn is not None and not self._initialised:
            self.init_fn()
            self._initialised = True
        return self.env_maker(**kwargs)


class TrajectoryRun:
    """Evaluations with one collector: weights in, one batch of complete trajectories out.

    Args:
        collector: yields batches of ``num_trajectories`` complete trajectories (``trajs_per_batch``).
        reward_key: the per-step reward, summed over an episode without a ``RewardSum`` transform.
        metrics_fn: ``batch -> {name: value}``, custom metrics (reported as ``custom/<name>``).

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> run = TrajectoryRun(EvalCollector(CountingEnv(max_steps=2), frames_per_batch=6, trajs_per_batch=2,
        ...                                   traj_format="padded"), ("next", "reward"))
        >>> run.run(None)["num_episodes"]
        2
        >>> run.shutdown()
    """

    def __init__(self, collector: BaseCollector, reward_key: Any, metrics_fn: Callable | None = None) -> None:
        self.collector = collector
        self.reward_key = reward_key
        self.metrics_fn = metrics_fn
        self._batches = None

    def run(self, weights_dict: dict[str, TensorDictBase] | None) -> dict[str, Any]:
        """Collect one batch with ``weights_dict`` (None: the weights the collector has) and measure it.

        Returns:
            the raw metrics (:func:`episode_metrics`).
        """
        batch, elapsed = self.collect(weights_dict)
        return episode_metrics(batch, self.reward_key, self.metrics_fn, elapsed)

    def collect(self, weights_dict: dict[str, TensorDictBase] | None) -> tuple[TensorDictBase, float]:
        """One batch of complete trajectories, all collected with ``weights_dict``, and its seconds."""
        if weights_dict:
            self.collector.update_policy_weights_(weights_dict=weights_dict)
        # Trajectories begun before (held back by trajs_per_batch, or running) used older weights.
        self.collector.reset()
        if self._batches is None:
            self._batches = iter(self.collector)
        start = time.perf_counter()
        with torch.no_grad():
            batch = next(self._batches)
        return batch, time.perf_counter() - start

    def dump_video(self, step: int) -> None:
        """Write what a video recorder of the env recorded during the last evaluation (if it has one)."""

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the collector (and its worker, if it has one); idempotent."""
        self._batches = None
        self.collector.shutdown(timeout=timeout)


def _trajectories(batch: TensorDictBase) -> list[TensorDictBase]:
    """The valid steps of each trajectory of a padded (``("collector", "mask")``) or flat batch."""
    mask = batch.get(("collector", "mask"), None)
    if mask is not None and batch.ndim == 2:
        return [batch[row][mask[row]] for row in range(batch.shape[0]) if bool(mask[row].any())]
    flat = batch.reshape(-1)
    ids = flat.get(("collector", "traj_ids"), None)
    if ids is None:
        return [flat]
    return [flat[ids == traj_id] for traj_id in ids.unique(sorted=True) if traj_id >= 0]


def _last_value(values: torch.Tensor) -> float:
    return float(values[-1].reshape(-1)[0])


def episode_metrics(batch: TensorDictBase, reward_key: Any, metrics_fn: Callable | None = None,
                    elapsed: float | None = None) -> dict[str, Any]:
    """Episode metrics of a batch of complete trajectories, under TorchRL's Evaluator's names.

    An episode's return is its last ``("next", "episode_reward")`` (a ``RewardSum`` transform), else
    the sum of ``reward_key`` over its steps; its length is its last ``("next", "step_count")``, else
    its number of steps.

    Returns:
        ``reward`` (mean return), ``reward_std`` (0 for one episode), ``num_episodes``,
        ``episode_length`` (mean), ``frame_count``, ``fps`` (with ``elapsed``), and
        ``custom/<name>`` for each metric of ``metrics_fn``. Without episodes, the means are NaN.

    Example:
        >>> from tensordict import TensorDict
        >>> batch = TensorDict({"next": {"reward": torch.ones(4, 1)},
        ...                     "collector": {"traj_ids": torch.tensor([0, 0, 1, 1])}}, batch_size=[4])
        >>> episode_metrics(batch, ("next", "reward"))["reward"]
        2.0
    """
    reward_key = as_tuple_key(reward_key)
    returns, lengths, frames = [], [], 0
    for trajectory in _trajectories(batch):
        frames += trajectory.numel()
        episode_reward = trajectory.get(EPISODE_REWARD_KEY, None)
        reward = trajectory.get(reward_key, None)
        if episode_reward is not None:
            returns.append(_last_value(episode_reward))
        elif reward is not None:
            returns.append(float(reward.sum()))
        step_count = trajectory.get(("next", "step_count"), None)
        lengths.append(_last_value(step_count) if step_count is not None else float(trajectory.numel()))
    count = len(returns)
    rewards = torch.tensor(returns, dtype=torch.float64)
    metrics: dict[str, Any] = {
        "reward": float(rewards.mean()) if count else float("nan"),
        "reward_std": float(rewards.std()) if count > 1 else (0.0 if count else float("nan")),
        "num_episodes": count,
        "episode_length": sum(lengths) / len(lengths) if count else float("nan"),
        "frame_count": frames,
    }
    if elapsed:
        metrics["fps"] = frames / elapsed
    if metrics_fn is not None:
        metrics.update({f"custom/{name}": value for name, value in metrics_fn(batch).items()})
    return metrics


@contextlib.contextmanager
def eval_mode(policy: Any) -> Iterator[None]:
    """``policy`` in eval mode inside the block, back in the mode it had after (also on an error)."""
    training = isinstance(policy, torch.nn.Module) and policy.training
    if training:
        policy.eval()
    try:
        yield
    finally:
        if training:
            policy.train()


def prefixed_result(raw: dict[str, Any], step: int, prefix: str) -> dict[str, Any]:
    """An evaluation's result: the metrics of :func:`episode_metrics` TorchRL reports, with ``step``,
    under ``<prefix>/<name>`` (custom metrics under their own name).

    Example:
        >>> prefixed_result({"reward": 2.0, "frame_count": 8, "custom/best": 3.0}, 5, "eval")
        {'eval/reward': 2.0, 'eval/step': 5, 'eval/best': 3.0}
    """
    result = {f"{prefix}/{key}": raw[key] for key in ("reward", "reward_std", "num_episodes", "episode_length",
                                                       "fps") if key in raw}
    result[f"{prefix}/step"] = step
    result.update({f"{prefix}/{key[len('custom/'):]}": value for key, value in raw.items()
                   if key.startswith("custom/")})
    return result


class LocalRun(TrajectoryRun):
    """The ``"thread"`` run: the policy in eval mode during evaluations, as TorchRL's."""

    def collect(self, weights_dict: dict[str, TensorDictBase] | None) -> tuple[TensorDictBase, float]:
        with eval_mode(self.collector.policy):
            return super().collect(weights_dict)

    def dump_video(self, step: int) -> None:
        if isinstance(self.collector, EvalCollector):
            self.collector.dump_video(step)


class WorkerRun(TrajectoryRun):
    """The ``"process"`` run: the worker's collector dumps its own recorder."""

    def dump_video(self, step: int) -> None:
        self.collector.map_fn("dump_video", list_of_kwargs=[{"step": step}])
