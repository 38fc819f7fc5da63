"""Per-env evaluations: one episode per sub-env and rollout, and one entry per episode (docs/evaluation.md).

A batch of the first ``num_trajectories`` episodes to end over-samples short episodes: in a batched
env, a sub-env whose episodes are short ends several while another ends one. ``"per_env"`` sampling
(:class:`EpisodeRun`) starts every sub-env afresh and keeps the episode each one begins with, ended
by the env or cut at ``max_steps``, then starts them all again until ``num_trajectories`` episodes
are there. The rollout loop runs it as it runs every collector: a :class:`~.single.Collector` whose
batches are ``max_steps`` steps long and whose ``interruptor`` (:class:`FirstEpisodesEnd`) ends a
batch as soon as every sub-env has ended its first episode.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import torch
from tensordict import TensorDict, TensorDictBase, pad

from .._utils import MASK, TRAJ_IDS, as_tuple_key
from .base import BaseCollector
from ._evaluation import EPISODE_REWARD_KEY, episode_metrics, eval_mode

__all__ = ["EpisodeRun", "FirstEpisodesEnd", "ENV_INDEX", "episodes_of"]

#: the sub-env (flat index) that ran each step of a per-env evaluation
ENV_INDEX = ("collector", "env_index")


class FirstEpisodesEnd:
    """A collector's ``interruptor`` that ends each batch as soon as every sub-env has ended an episode
    in it: the batches of a rollout watched from a fresh start hold each sub-env's first episode whole,
    and nothing past the step in which the last of them ended (those steps' trajectory ids are -1).

    Example:
        >>> from rlharvest.collectors import Collector
        >>> from rlharvest.envs import CountingEnv
        >>> stop = FirstEpisodesEnd()
        >>> step_up = lambda td: td.set("action", torch.ones(1, dtype=torch.int8))
        >>> collector = Collector(CountingEnv(max_steps=2), step_up, frames_per_batch=10, interruptor=stop)
        >>> stop.watch(collector.rollout)
        >>> collector.rollout_batch()["collector", "traj_ids"].tolist()  # the first episode's 3 steps
        [0, 0, 0, -1, -1, -1, -1, -1, -1, -1]
        >>> collector.shutdown()
    """

    def __init__(self) -> None:
        self._rollout: Any = None

    def watch(self, rollout: Any) -> None:
        """Stop the next batches of ``rollout`` (a :class:`~rlharvest.rollout.Rollout`) once each
        sub-env has ended an episode."""
        self._rollout = rollout

    def collection_stopped(self) -> bool:
        """True once every watched sub-env has ended an episode in the batch being collected."""
        if self._rollout is None:
            return False
        ended = self._rollout.ended_rows()
        return bool(ended.all()) if isinstance(ended, torch.Tensor) else bool(ended)


@contextlib.contextmanager
def _rng_kept() -> Iterator[None]:
    """Seeding inside the block leaves the caller's torch RNGs (CPU, and each device of the current
    accelerator) as they were."""
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        with torch.random.fork_rng(devices=[]):
            yield
        return
    with torch.random.fork_rng(devices=range(torch.accelerator.device_count()), device_type=accelerator.type):
        yield


def episodes_of(batch: TensorDictBase, reward_key: Any, done_key: Any) -> TensorDict:
    """One entry per row of a masked ``[episodes, steps]`` batch (:meth:`EpisodeRun.collect`).

    Returns:
        ``episode_reward`` (the last ``("next", "episode_reward")`` of a ``RewardSum`` transform, else
        the sum of ``reward_key``), ``episode_length`` (int64 steps), ``truncated`` (bool: the episode
        did not end with a done, or the env flagged it truncated) and ``env_index`` (int64).
    """
    mask = batch.get(MASK)
    lengths = mask.sum(-1)
    last = batch[torch.arange(batch.shape[0], device=mask.device), lengths - 1]
    episode_reward = last.get(EPISODE_REWARD_KEY, None)
    if episode_reward is None:
        reward = batch.get(as_tuple_key(reward_key))
        inside = mask.reshape(*mask.shape, *(1,) * (reward.ndim - mask.ndim))
        episode_reward = torch.where(inside, reward, torch.zeros((), dtype=reward.dtype)).sum(1)
    done_key = as_tuple_key(done_key)
    truncated = ~last.get(done_key)
    if done_key[-1] == "done":
        flagged = last.get((*done_key[:-1], "truncated"), None)
        if flagged is not None:
            truncated = truncated | flagged
    return TensorDict(episode_reward=_per_episode(episode_reward), episode_length=lengths,
                      truncated=_per_episode(truncated), env_index=last.get(ENV_INDEX), batch_size=batch.shape[:1])


def _per_episode(values: torch.Tensor) -> torch.Tensor:
    """Drop the trailing singleton dimension of a per-episode value (``(n, 1)`` -> ``(n,)``)."""
    return values.squeeze(-1) if values.ndim > 1 and values.shape[-1] == 1 else values


class EpisodeRun:
    """Per-env evaluations with one :class:`~.single.Collector` (``episode_sampling="per_env"`` and
    :meth:`~rlharvest.collectors.Evaluator.evaluate_episodes`).

    Args:
        collector: a Collector of the evaluation's env and policy whose batches are ``max_steps`` steps
            long, with ``stop`` as its ``interruptor``.
        stop: ends each batch once every sub-env has ended its first episode.
        num_trajectories: episodes per evaluation.
        reward_key, done_key: where the env writes them.
        metrics_fn: ``batch -> {name: value}`` (:meth:`run` only).

    Example:
        >>> from rlharvest.collectors import Collector
        >>> from rlharvest.envs import CountingEnv
        >>> stop = FirstEpisodesEnd()
        >>> up = lambda td: td.set("action", torch.ones(2, 1, dtype=torch.int8))
        >>> collector = Collector(CountingEnv(max_steps=2, batch_size=(2,)), up, frames_per_batch=2 * 6,
        ...                       interruptor=stop)
        >>> run = EpisodeRun(collector, stop, 3, ("next", "reward"), ("next", "done"))
        >>> run.episodes(None, None)["episode_length"].tolist(), run.episodes(None, None)["env_index"].tolist()
        ([3, 3, 3], [0, 1, 0])
        >>> run.shutdown()
    """

    def __init__(self, collector: BaseCollector, stop: FirstEpisodesEnd, num_trajectories: int, reward_key: Any,
                 done_key: Any, metrics_fn: Callable | None = None) -> None:
        self.collector = collector
        self.stop = stop
        self.num_trajectories = num_trajectories
        self.reward_key, self.done_key = reward_key, done_key
        self.metrics_fn = metrics_fn

    def run(self, weights_dict: dict[str, TensorDictBase] | None) -> dict[str, Any]:
        """An evaluation's metrics (:func:`~._evaluation.episode_metrics`) over per-env episodes."""
        batch, elapsed = self.collect(weights_dict, seed=None)
        return episode_metrics(batch, self.reward_key, self.metrics_fn, elapsed)

    def episodes(self, weights_dict: dict[str, TensorDictBase] | None, seed: int | None) -> TensorDict:
        """One entry per episode (:func:`episodes_of`), ``num_trajectories`` of them."""
        batch, _ = self.collect(weights_dict, seed)
        return episodes_of(batch, self.reward_key, self.done_key)

    def collect(self, weights_dict: dict[str, TensorDictBase] | None,
                seed: int | None) -> tuple[TensorDictBase, float]:
        """``num_trajectories`` masked episodes ``[episodes, max_steps]`` and the seconds they took.

        With a ``seed``, each rollout first seeds torch's RNG and the env (``set_seed``) from it and the
        rollout's rank only, so that two calls with one seed start every episode from the same state;
        the caller's torch RNG is left as it was, the env keeps its seeds.
        """
        if weights_dict:
            self.collector.update_policy_weights_(weights_dict=weights_dict)
        rows, remaining = [], self.num_trajectories
        seeding = _rng_kept() if seed is not None else contextlib.nullcontext()
        start = time.perf_counter()
        with eval_mode(self.collector.policy), seeding, torch.no_grad():
            while remaining > 0:
                episodes, seed = self._rollout(seed)
                rows.append(episodes[:remaining])
                remaining -= rows[-1].shape[0]
        elapsed = time.perf_counter() - start
        steps = max(row.shape[1] for row in rows)
        return torch.cat([pad(row, [0, 0, 0, steps - row.shape[1]]) for row in rows]), elapsed

    def _rollout(self, seed: int | None) -> tuple[TensorDictBase, int | None]:
        """Every sub-env's first episode from a fresh start, masked, and the seed of the next rollout."""
        collector = self.collector
        if seed is not None:
            torch.manual_seed(seed)
            seed = collector.set_seed(seed)  # starts fresh episodes too
        else:
            collector.reset()
        self.stop.watch(collector.rollout)
        batch = collector.rollout_batch()
        rows = batch.reshape(-1, batch.shape[-1]).clone()  # the collector reuses its buffer
        ids = rows.get(TRAJ_IDS)
        rows.set(MASK, ids == ids[:, :1])
        rows.set(ENV_INDEX, torch.arange(rows.shape[0], device=ids.device).unsqueeze(-1).expand(rows.shape))
        return rows, seed

    def dump_video(self, step: int | None) -> None:
        """Write what a TorchRL ``VideoRecorder`` of the env recorded (``dump``)."""
        self.collector.dump_video(step)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the collector; idempotent."""
        self.collector.shutdown(timeout=timeout)
