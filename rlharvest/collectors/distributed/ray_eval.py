"""RayEvalWorker: evaluations in a Ray actor, with TorchRL 0.14's API (docs/evaluation.md).

The actor is the one worker of a :class:`RayCollector` (``num_collectors=1``) whose collector is an
``EvalCollector`` with ``trajs_per_batch``: the Ray backend (``rlharvest/transport/ray.py``) starts,
watches and stops it, the worker loop runs the rollout loop in it, and weights reach it through
``RayWeightSyncScheme``. This object only drives that collector from one thread of its own, so that
:meth:`RayEvalWorker.submit` returns at once and :meth:`RayEvalWorker.poll` collects the result.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable

from tensordict import TensorDictBase

from ...policies import ExplorationType
from ...transport.ray import DEFAULT_REMOTE_CONFIG, require_ray
from .._evaluation import AfterInit, EvalCollector, TrajectoryRun, episode_metrics
from .ray import RayCollector

__all__ = ["RayEvalWorker"]


class RayEvalWorker:
    """Evaluates a policy in a Ray actor, in the background.

    The actor calls ``init_fn``, builds the env with ``env_maker`` and the policy with
    ``policy_maker(env)``; each :meth:`submit` sends weights and starts an evaluation of complete
    episodes, whose result :meth:`poll` returns.

    Args:
        init_fn: called first in the actor (process set-up), or None.
        env_maker: returns the env (called in the actor).
        policy_maker: ``(env) -> policy`` (called in the actor).

    Keyword Args:
        num_gpus: GPUs of the actor (default 1, as TorchRL).
        reward_keys: the per-step reward (default ``("next", "reward")``).
        name: not supported (see Raises).
        num_trajectories: complete episodes per evaluation (default 1; rlharvest's addition, used
            by the Evaluator's ``"ray"`` backend).
        frames_per_batch: env steps per poll of the actor's collector (default ``max_steps``).
        collector_kwargs: more arguments of the actor's collector.
        **remote_kwargs: more ``ray.remote`` options of the actor (``num_cpus`` is 1 unless given).

    Raises:
        ImportError: without Ray.
        NotImplementedError: for ``name``: the actor is the worker of a collector of this process,
            which another process cannot drive (:meth:`from_name` raises too).

    Example:
        >>> worker = RayEvalWorker(None, make_env, lambda env: make_policy(env), num_gpus=0)  # doctest: +SKIP
        >>> worker.submit(weights, max_steps=500)                                              # doctest: +SKIP
        >>> worker.poll(timeout=60)["reward"]                                                  # doctest: +SKIP
        >>> worker.shutdown()                                                                  # doctest: +SKIP
    """

    def __init__(self, init_fn: Callable[[], None] | None, env_maker: Callable[[], Any],
                 policy_maker: Callable[[Any], Any], *, num_gpus: int = 1, reward_keys: Any = ("next", "reward"),
                 name: str | None = None, num_trajectories: int = 1, frames_per_batch: int | None = None,
                 collector_kwargs: dict | None = None, **remote_kwargs: Any) -> None:
        require_ray()
        if name is not None:
            raise NotImplementedError("RayEvalWorker(name=...) is not supported: the actor is the worker of a "
                                      "collector of this process, which another process cannot drive.")
        self._env_maker = AfterInit(init_fn, env_maker)
        self._policy_maker = policy_maker
        self._reward_keys = reward_keys
        self._num_trajectories = num_trajectories
        self._frames_per_batch = frames_per_batch
        self._collector_kwargs = dict(collector_kwargs or {})
        self._remote_config = {**DEFAULT_REMOTE_CONFIG, "num_gpus": num_gpus, **remote_kwargs}
        self._run: TrajectoryRun | None = None
        self._run_key: tuple | None = None
        # One thread drives the collector: submit() returns at once, and no two calls overlap.
        self._executor: concurrent.futures.ThreadPoolExecutor | None = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="rlharvest-ray-eval")
        self._pending: concurrent.futures.Future | None = None

    @classmethod
    def from_name(cls, name: str, *, reward_keys: Any = ("next", "reward")) -> RayEvalWorker:
        """Not supported (see the class's Raises).

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError("RayEvalWorker.from_name() is not supported: an rlharvest RayEvalWorker's "
                                  "actor is driven by the collector of the process that created it.")

    def submit(self, weights: Any, max_steps: int, *, deterministic: bool = True,
               break_when_any_done: bool = True) -> None:
        """Start an evaluation with ``weights`` (a TensorDict of the policy's weights, or None for the
        weights it has); a result not polled yet is dropped.

        Args:
            weights: the policy's weights, or None.
            max_steps: episodes are truncated after this many steps.
            deterministic: DETERMINISTIC exploration (else RANDOM).
            break_when_any_done: accepted for compatibility: an evaluation always ends once it has
                ``num_trajectories`` complete episodes (1 by default: the first to end).

        Example:
            >>> worker.submit(TensorDict.from_module(policy).data, max_steps=500)   # doctest: +SKIP
        """
        self._pending = self._submit(self._evaluate, weights, max_steps, deterministic)

    def poll(self, timeout: float | None = 0) -> dict | None:
        """The result of the last :meth:`submit` once ready, waiting up to ``timeout`` seconds (None:
        until it is); None while it runs or when nothing was submitted.

        The result holds ``"reward"`` (mean episode return), ``"frames"`` (None: no rendering),
        ``"reward_std"``, ``"num_episodes"``, ``"episode_length"``, ``"frame_count"``, ``"fps"``.

        Raises:
            WorkerError: when the actor failed (with its traceback).

        Example:
            >>> result = worker.poll()          # doctest: +SKIP
            >>> if result is not None:          # doctest: +SKIP
            ...     print(result["reward"])
        """
        pending = self._pending
        if pending is None:
            return None
        try:
            result = pending.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            return None
        finally:
            if pending.done() and self._pending is pending:
                self._pending = None
        return result

    def collect(self, weights_dict: dict[str, TensorDictBase] | None, max_steps: int | None, *,
                exploration_type: Any = ExplorationType.DETERMINISTIC,
                metrics_fn: Callable | None = None) -> dict[str, Any]:
        """One evaluation, blocking, with weights for several models (rlharvest's addition, for the
        Evaluator). Returns the raw metrics (``rlharvest.collectors._evaluation.episode_metrics``).

        Example:
            >>> worker.collect({"policy": weights}, max_steps=500)["reward"]   # doctest: +SKIP
        """
        return self._submit(self._run_metrics, weights_dict, max_steps, exploration_type, metrics_fn).result()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the actor, also in the middle of an evaluation (which then ends with an error nobody
        reads); idempotent. ``timeout`` (rlharvest's addition) bounds the wait for the actor to close
        before it is killed (None: the collector's default).

        Example:
            >>> worker.shutdown()                                        # doctest: +SKIP
        """
        executor, self._executor = self._executor, None
        if executor is None:
            return
        executor.shutdown(wait=False, cancel_futures=True)
        self._pending = None
        self._stop_run(timeout)  # from this thread: the driving thread may be waiting for the actor

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # interpreter shutdown: nothing left to report to
            pass

    # ------------------------------------------------------------------ the driving thread
    def _submit(self, function: Callable, *args: Any) -> concurrent.futures.Future:
        if self._executor is None:
            raise RuntimeError("RayEvalWorker used after shutdown().")
        return self._executor.submit(function, *args)

    def _evaluate(self, weights: Any, max_steps: int, deterministic: bool) -> dict:
        exploration = ExplorationType.DETERMINISTIC if deterministic else ExplorationType.RANDOM
        weights_dict = {"policy": weights} if weights is not None else None
        return {**self._run_metrics(weights_dict, max_steps, exploration, None), "frames": None}

    def _run_metrics(self, weights_dict, max_steps, exploration_type, metrics_fn) -> dict:
        run = self._ensure_run(max_steps, exploration_type)
        batch, elapsed = run.collect(weights_dict)
        return episode_metrics(batch, self._reward_keys, metrics_fn, elapsed)

    def _ensure_run(self, max_steps: int | None, exploration_type: Any) -> TrajectoryRun:
        """The actor's collector for these settings (built on first use; rebuilt when they change,
        as they are the collector's construction arguments)."""
        key = (max_steps, exploration_type)
        if self._run is not None and self._run_key == key:
            return self._run
        self._stop_run()
        kwargs = dict(self._collector_kwargs)
        collector = RayCollector(
            [self._env_maker], policy_factory=self._policy_maker, num_collectors=1, sync=False,
            frames_per_batch=self._frames_per_batch or max_steps or 1000, total_frames=-1,
            max_frames_per_traj=max_steps if max_steps is not None else -1, exploration_type=exploration_type,
            collector_class=EvalCollector, collector_kwargs=kwargs, trajs_per_batch=self._num_trajectories,
            traj_format=kwargs.pop("traj_format", "padded"),
            remote_configs=self._remote_config)
        if self._executor is None:  # shut down while the actor started: nobody else will stop it
            collector.shutdown()
            raise RuntimeError("RayEvalWorker was shut down.")
        self._run, self._run_key = TrajectoryRun(collector, self._reward_keys), key
        return self._run

    def _stop_run(self, timeout: float | None = None) -> None:
        run, self._run = self._run, None
        if run is not None:
            run.shutdown(timeout)


class RayEvalRun:
    """The Evaluator's ``"ray"`` run: one :class:`RayEvalWorker`, driven with blocking calls."""

    def __init__(self, worker: RayEvalWorker, config: Any) -> None:
        self.worker, self.config = worker, config

    def run(self, weights_dict: dict[str, TensorDictBase] | None) -> dict[str, Any]:
        return self.worker.collect(weights_dict, self.config.max_steps,
                                   exploration_type=self.config.exploration_type, metrics_fn=self.config.metrics_fn)

    def dump_video(self, step: int) -> None:
        run = self.worker._run
        if run is not None:
            self.worker._submit(run.collector.map_fn, "dump_video", None, [{"step": step}]).result()

    def shutdown(self, timeout: float | None = None) -> None:
        self.worker.shutdown(timeout)
