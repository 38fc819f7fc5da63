"""Evaluator: complete episodes with given weights, blocking or in the background (docs/evaluation.md).

TorchRL 0.14's ``Evaluator`` API over rlharvest's collectors. An evaluation is one batch of a
collector with ``trajs_per_batch=num_trajectories`` (``_evaluation.py``), so the one rollout loop
runs it wherever the backend puts it:

* ``"thread"``: an ``EvalCollector`` in this process, run by the caller (:meth:`Evaluator.evaluate`)
  or by the evaluator's one background thread (:meth:`Evaluator.trigger_eval`);
* ``"process"``: a ``MultiSyncCollector`` with one worker process, started by its ``Fleet`` like any
  collector's workers; weights travel through its weight scheme (shared memory by default);
* ``"ray"``: a :class:`~rlharvest.collectors.distributed.RayEvalWorker`, a ``RayCollector`` with one
  actor; weights travel through ``RayWeightSyncScheme``.

TorchRL's next release adds per-env sampling (``episode_sampling="per_env"``, and
:meth:`Evaluator.evaluate_episodes`, one entry per episode): a ``"thread"`` collector of its own over
the same env and policy runs it (``_eval_episodes.py``).

Collectors rather than a loop and a process of the evaluator's own: the process and ray backends
then get what every worker has (bounded start, ``WorkerError`` with the remote traceback, bounded
shutdown, exit when the parent dies, weights through the schemes), and episodes are measured as
training collects them.

The background is a small state machine: requests queue (``busy_policy``), the background thread
runs them one at a time, results (or the error that ended one) queue until :meth:`poll` or
:meth:`wait` takes them; after :meth:`shutdown` every call raises ``EvaluatorClosedError``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from typing import Any, Callable, Iterator, Mapping

import torch
from tensordict import TensorDict, TensorDictBase

from .._utils import positive_int
from ..errors import EvaluationPendingError, EvaluatorClosedError
from ..policies import ExplorationType
from ..weight_update.strategy import weights_of
from ._evaluation import prefixed_result
from ._eval_runs import (EvalConfig, check_choice, check_episode_sampling, check_sources, episodes_unsupported,
                         run_builders)


__all__ = ["Evaluator", "EvaluationPendingError", "EvaluatorClosedError"]

logger = logging.getLogger(__name__)

BACKENDS = ("thread", "process", "ray")
BUSY_POLICIES = ("skip", "error", "queue")


def _weights_snapshot(source: Any) -> TensorDictBase:
    """A copy of ``source``'s weights on the CPU: training may go on changing the original."""
    return weights_of(source).detach().clone().cpu()


class Evaluator:
    """Evaluates a policy on complete episodes, blocking (:meth:`evaluate`) or in the background
    (:meth:`trigger_eval`, then :meth:`poll` / :meth:`wait`).

    Args:
        env: an env, or a callable returning one (required by the ``"process"`` and ``"ray"``
            backends, which build it in their worker).
        policy: the evaluation policy (exclusive with ``policy_factory``).

    Keyword Args:
        policy_factory: ``(env) -> policy``, called where the env is built.
        num_trajectories: complete episodes per evaluation (default 10).
        max_steps: truncate episodes after this many steps (None: run until done).
        frames_per_batch: env steps per poll of the collector (default ``max_steps``, else 1000).
        collector_cls: the collector of the ``"thread"`` backend, a class or a name in
            ``rlharvest.collectors`` (default: a Collector calling ``policy_factory(env)``).
        collector_kwargs: more arguments of the collector.
        weight_sync_schemes: ``{model_id: scheme}``; runs the evaluation in a worker process (as
            TorchRL does), the weights of each model going through its scheme.
        log_prefix: prefix of the result's keys (default ``"eval"``).
        reward_keys: the per-step reward (default ``("next", "reward")``); a ``RewardSum``
            transform's ``("next", "episode_reward")`` is preferred when present.
        done_keys: accepted for compatibility (episodes end where the collector ends them).
        device: where the evaluation policy runs (None: where its parameters are).
        exploration_type: exploration mode of the evaluation (default DETERMINISTIC).
        metrics_fn: ``batch -> {name: value}``, reported as ``<prefix>/<name>``.
        dump_video: after each evaluation, ``dump`` what a TorchRL ``VideoRecorder`` of the env recorded.
        on_result: called with each result as a TensorDict (from the background thread for
            :meth:`trigger_eval`); its exceptions are logged, not raised.
        episode_sampling: which episodes an evaluation measures: ``"first_done"`` (default), the first
            ``num_trajectories`` to end, which over-samples short episodes in a batched env; or
            ``"per_env"``, one episode per sub-env and rollout, each sub-env started afresh (needs the
            ``"thread"`` backend, no ``weight_sync_schemes`` and an int ``max_steps``;
            ``collector_cls`` and ``collector_kwargs`` are then not used, but for
            ``auto_register_policy_transforms``).
        busy_policy: what :meth:`trigger_eval` does while an evaluation is pending: ``"skip"``
            (return False), ``"error"`` (raise), ``"queue"`` (run it next).
        backend: ``"thread"`` (default), ``"process"`` or ``"ray"``.
        init_fn: called first in the worker process or actor.
        num_gpus: GPUs of the Ray actor (default 1, as TorchRL).
        ray_kwargs: more ``ray.remote`` options of the actor.

    Raises:
        ValueError: for an unknown ``backend``, ``busy_policy`` or ``episode_sampling``, both or neither
            of ``policy`` and ``policy_factory``, a ``"process"``/``"ray"`` backend without an env
            constructor and a ``policy_factory``, or ``"per_env"`` sampling where it cannot run.

    Example:
        >>> from rlharvest.envs import CountingEnv
        >>> from rlharvest.policies import RandomPolicy
        >>> env = CountingEnv(max_steps=3)
        >>> evaluator = Evaluator(env, RandomPolicy(env.full_action_spec), num_trajectories=2, max_steps=4)
        >>> sorted(evaluator.evaluate(step=0))[:3]
        ['eval/episode_length', 'eval/fps', 'eval/num_episodes']
        >>> evaluator.shutdown()
    """

    def __init__(self, env: Any, policy: Callable | None = None, *, policy_factory: Callable | None = None,
                 num_trajectories: int = 10, max_steps: int | None = None, frames_per_batch: int | None = None,
                 collector_cls: type | str | None = None, collector_kwargs: dict | None = None,
                 weight_sync_schemes: dict[str, Any] | None = None, log_prefix: str = "eval",
                 reward_keys: Any = ("next", "reward"), done_keys: Any = ("next", "done"),
                 device: torch.device | str | None = None,
                 exploration_type: ExplorationType = ExplorationType.DETERMINISTIC,
                 metrics_fn: Callable[[TensorDictBase], dict[str, float]] | None = None, dump_video: bool = True,
                 on_result: Callable[[TensorDictBase], None] | None = None, episode_sampling: str = "first_done",
                 busy_policy: str = "skip", backend: str = "thread", init_fn: Callable[[], None] | None = None,
                 num_gpus: int = 1, ray_kwargs: dict | None = None) -> None:
        self._closed = True  # until built
        check_choice("backend", backend, BACKENDS)
        check_choice("busy_policy", busy_policy, BUSY_POLICIES)
        check_sources(backend, env, policy, policy_factory, weight_sync_schemes)
        max_steps = positive_int("max_steps", max_steps, allow_none=True)
        self.config = EvalConfig(
            backend=backend, num_trajectories=positive_int("num_trajectories", num_trajectories),
            max_steps=max_steps,
            frames_per_batch=positive_int("frames_per_batch", frames_per_batch or max_steps or 1000),
            collector_kwargs=dict(collector_kwargs or {}), log_prefix=str(log_prefix), reward_key=reward_keys,
            done_key=done_keys, device=torch.device(device) if device is not None else None,
            exploration_type=exploration_type, metrics_fn=metrics_fn, dump_video=bool(dump_video),
            on_result=on_result, busy_policy=busy_policy,
            episode_sampling=check_episode_sampling(episode_sampling, backend, weight_sync_schemes, max_steps,
                                                    collector_cls, collector_kwargs),
            init_fn=init_fn, num_gpus=num_gpus, ray_kwargs=dict(ray_kwargs or {}))
        self._episodes_unsupported = episodes_unsupported(backend, weight_sync_schemes, max_steps)
        self._step_counter = 0
        self._lock = threading.Condition()
        self._requests: collections.deque = collections.deque()
        self._results: collections.deque = collections.deque()
        self._running = False
        self._thread: threading.Thread | None = None
        self._run = None  # built below, or lazily by the first evaluation (thread backend, factories)
        self._episode_run = None  # evaluate_episodes()'s, built by its first call (per_env: self._run)
        self._builders = run_builders(self.config, env, policy, policy_factory, collector_cls, weight_sync_schemes)
        if self._builders.eager:
            self._run = self._builders.main()
        self._closed = False

    # ------------------------------------------------------------------ synchronous
    def evaluate(self, weights: Any = None, step: int | None = None, *,
                 weights_dict: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run one evaluation now, in the calling thread, and return its result.

        Args:
            weights: the policy's weights (a module or a TensorDict); None: the weights it has.
            step: the result's ``<prefix>/step``; None: an internal counter (0, 1, ...).
            weights_dict: ``{model_id: weights}`` for several models; ``weights`` is its ``"policy"``.

        Returns:
            ``{"<prefix>/reward": mean return, "<prefix>/reward_std", "<prefix>/num_episodes",
            "<prefix>/episode_length", "<prefix>/fps", "<prefix>/step", ...}``.

        Raises:
            EvaluatorClosedError: after :meth:`shutdown`.
            WorkerError: when the worker process or actor failed (with its traceback).

        Example:
            >>> evaluator.evaluate(policy, step=100)["eval/step"]    # doctest: +SKIP
            100
        """
        with self._in_caller_thread("evaluate"):
            prepared, step = self._prepare(weights, weights_dict), self._next_step(step)
            result = self._evaluate_now(prepared, step)
        self._call_on_result(result)
        return result

    def evaluate_episodes(self, weights: Any = None, step: int | None = None, *,
                          weights_dict: dict[str, Any] | None = None, seed: int | None = None) -> TensorDictBase:
        """Run ``num_trajectories`` episodes now, sampled ``"per_env"``, and return one entry per episode.

        Each rollout starts every sub-env afresh and keeps the episode each one begins with, ended by
        the env or cut at ``max_steps``, until ``num_trajectories`` are there (whatever
        ``episode_sampling`` says). The step counter, ``on_result`` and ``metrics_fn`` are left alone;
        the policy is in eval mode meanwhile and back in its mode after (also on an error).

        Args:
            weights: the policy's weights, as :meth:`evaluate`.
            step: passed to the ``dump`` of a TorchRL ``VideoRecorder`` of the env (None: its own count).

        Keyword Args:
            weights_dict: ``{model_id: weights}``, as :meth:`evaluate`.
            seed: before each rollout, torch's RNG and the env (``set_seed``) are seeded from ``seed``
                and the rollout's rank only, so that two calls with one seed start each episode from the
                same state whatever the policy, and their episodes pair up one to one (see
                ``paired_comparison``); your torch RNG is left as it was, the env keeps its seeds. None:
                no seeding.

        Returns:
            a TensorDict of batch size ``[num_trajectories]``: ``"episode_reward"`` (the last
            ``("next", "episode_reward")`` of a ``RewardSum`` transform, else the sum of rewards),
            ``"episode_length"`` (int64), ``"truncated"`` (bool: cut at ``max_steps``, or flagged
            truncated by the env) and ``"env_index"`` (int64, the flat index of the sub-env).

        Raises:
            EvaluationPendingError: while a background evaluation is pending (a RuntimeError).
            ValueError: with the ``"process"`` backend, ``weight_sync_schemes`` or ``max_steps=None``.
            NotImplementedError: with the ``"ray"`` backend.
            TypeError: for a ``seed`` that is not an int.
            EvaluatorClosedError: after :meth:`shutdown`.

        Example:
            >>> episodes = evaluator.evaluate_episodes(policy, seed=0)                  # doctest: +SKIP
            >>> paired_comparison(episodes["episode_reward"], baseline["episode_reward"])  # doctest: +SKIP
        """
        self._check_open("evaluate_episodes")
        if self.config.backend == "ray":
            raise NotImplementedError("evaluate_episodes() runs in this process: backend='ray' does not support it "
                                      "(use backend='thread').")
        if self._episodes_unsupported is not None:
            raise ValueError(f"evaluate_episodes() requires backend='thread', no weight_sync_schemes and an integer "
                             f"max_steps; got {self._episodes_unsupported}.")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__} {seed!r}.")
        with self._in_caller_thread("evaluate_episodes"):
            run = self._episodes()
            episodes = run.episodes(self._prepare(weights, weights_dict), seed)
            if self.config.dump_video:
                run.dump_video(step)
        return episodes

    # ------------------------------------------------------------------ asynchronous
    def trigger_eval(self, weights: Any = None, step: int | None = None, *,
                     weights_dict: dict[str, Any] | None = None) -> bool:
        """Start an evaluation in the background (the weights are copied now).

        Args: as :meth:`evaluate`.

        Returns:
            True when the evaluation was scheduled, False when it was skipped (``busy_policy="skip"``
            and another one pending).

        Raises:
            EvaluationPendingError: with ``busy_policy="error"`` while another one is pending.
            EvaluatorClosedError: after :meth:`shutdown`.

        Example:
            >>> if evaluator.trigger_eval(policy, step=frames):       # doctest: +SKIP
            ...     pass  # the result comes back through poll() or wait()
        """
        self._check_open("trigger_eval")
        step = self._next_step(step)  # counted also when skipped, as TorchRL's
        with self._lock:
            busy = self._running or bool(self._requests)
            if busy and self.config.busy_policy == "error":
                raise EvaluationPendingError("Evaluation already pending: wait for it, or use busy_policy='skip' "
                                             "or busy_policy='queue'.")
            if busy and self.config.busy_policy == "skip":
                return False
        request = (self._prepare(weights, weights_dict), step)
        with self._lock:
            self._requests.append(request)
            self._lock.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="rlharvest-evaluator", daemon=True)
                self._thread.start()
        return True

    def poll(self, timeout: float = 0) -> dict[str, Any] | None:
        """The oldest result not taken yet, waiting up to ``timeout`` seconds for one; else None.

        Raises:
            EvaluatorClosedError: after :meth:`shutdown`.
            Exception: what ended the evaluation whose result this would have been.

        Example:
            >>> result = evaluator.poll()                                  # doctest: +SKIP
            >>> if result is not None:                                     # doctest: +SKIP
            ...     logger.log_metrics(result, step=result["eval/step"])
        """
        return self._take(timeout, "poll")

    def wait(self, timeout: float | None = None) -> dict[str, Any] | None:
        """Like :meth:`poll`, waiting until a result is there (at most ``timeout`` seconds; None: as
        long as an evaluation is pending). Returns None when nothing is pending nor ready.

        Raises:
            EvaluatorClosedError: after :meth:`shutdown`.
            Exception: what ended the evaluation whose result this would have been.

        Example:
            >>> final = evaluator.wait(timeout=600)                        # doctest: +SKIP
        """
        return self._take(timeout, "wait")

    @property
    def pending(self) -> bool:
        """True while an evaluation runs or is queued.

        Example:
            >>> if not evaluator.pending:                                  # doctest: +SKIP
            ...     evaluator.trigger_eval(policy, step=frames)
        """
        with self._lock:
            return self._running or bool(self._requests)

    # ------------------------------------------------------------------ life cycle
    def shutdown(self, timeout: float = 5.0) -> None:
        """Drop queued evaluations, let a running one end (``timeout`` seconds), stop the backend's
        worker (within the same ``timeout``); idempotent. Results not taken are dropped.

        Example:
            >>> evaluator.shutdown(timeout=10.0)                           # doctest: +SKIP
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._requests.clear()
            self._results.clear()
            self._lock.notify_all()
        deadline = time.monotonic() + timeout
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
            if self._thread.is_alive() and self.config.backend == "thread":
                # The thread owns the in-process collector: it shuts it down once its evaluation ends.
                logger.warning("Evaluator.shutdown(): the running evaluation did not end within %.1f s", timeout)
                return
        self._shutdown_run(max(0.1, deadline - time.monotonic()))

    def state_dict(self) -> dict[str, Any]:
        """The evaluator's progress (its step counter), when nothing is pending, queued or unread.

        Raises:
            RuntimeError: while an evaluation is pending, queued, or its result unread.

        Example:
            >>> evaluator.state_dict()                                     # doctest: +SKIP
            {'step_counter': 3}
        """
        with self._lock:
            self._check_quiet("checkpointing")
            return {"step_counter": self._step_counter}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            RuntimeError: while an evaluation is pending, queued, or its result unread.

        Example:
            >>> evaluator.load_state_dict({"step_counter": 3})             # doctest: +SKIP
        """
        with self._lock:
            self._check_quiet("restoring its state")
            self._step_counter = int(state_dict.get("step_counter", 0))

    @staticmethod
    def extract_weights(policy: torch.nn.Module) -> TensorDictBase:
        """A detached CPU copy of ``policy``'s weights, safe to hand to another thread.

        Example:
            >>> evaluator.evaluate(Evaluator.extract_weights(policy))      # doctest: +SKIP
        """
        return _weights_snapshot(policy)

    def __del__(self) -> None:
        try:
            self.shutdown(timeout=2.0)
        except Exception:  # interpreter shutdown: nothing left to report to
            pass

    # ------------------------------------------------------------------ internals
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise EvaluatorClosedError(f"Evaluator.{what}() after shutdown(): build a new Evaluator.")

    @contextlib.contextmanager
    def _in_caller_thread(self, what: str) -> Iterator[None]:
        """An evaluation in the calling thread: refused while one is pending, and the evaluator busy
        meanwhile (``trigger_eval`` then finds it pending)."""
        self._check_open(what)
        with self._lock:
            if self._running or self._requests:
                raise EvaluationPendingError(f"{what}() while a background evaluation is pending: wait() first.")
            self._running = True
        try:
            yield
        finally:
            with self._lock:
                self._running = False
                self._lock.notify_all()

    def _episodes(self) -> Any:
        """The run of :meth:`evaluate_episodes` (with ``"per_env"`` sampling, the evaluator's run)."""
        if self.config.episode_sampling == "per_env":
            if self._run is None:
                self._run = self._builders.main()
            return self._run
        if self._episode_run is None:
            self._episode_run = self._builders.episodes()
        return self._episode_run

    def _check_quiet(self, what: str) -> None:
        if self._running or self._requests or self._results:
            raise RuntimeError(f"Evaluator {what} requires no pending, queued, or unread evaluation results.")

    def _prepare(self, weights: Any, weights_dict: dict[str, Any] | None) -> dict[str, TensorDictBase] | None:
        prepared = {model_id: _weights_snapshot(source) for model_id, source in (weights_dict or {}).items()}
        if weights is not None and "policy" not in prepared:
            prepared["policy"] = _weights_snapshot(weights)
        return prepared or None

    def _next_step(self, step: int | None) -> int:
        if step is not None:
            return step
        with self._lock:
            step, self._step_counter = self._step_counter, self._step_counter + 1
        return step

    def _evaluate_now(self, weights_dict: dict[str, TensorDictBase] | None, step: int) -> dict[str, Any]:
        if self._run is None:
            self._run = self._builders.main()
        raw = self._run.run(weights_dict)
        if self.config.dump_video:
            self._run.dump_video(step)
        return prefixed_result(raw, step, self.config.log_prefix)

    def _call_on_result(self, result: dict[str, Any]) -> None:
        if self.config.on_result is None:
            return
        try:
            data = {key: torch.as_tensor(value) for key, value in result.items() if value is not None}
            self.config.on_result(TensorDict(data, batch_size=[]))
        except Exception:
            logger.warning("Evaluator on_result callback failed", exc_info=True)

    def _serve(self) -> None:
        """The background thread: run the queued requests one at a time until shutdown."""
        while True:
            with self._lock:
                # an evaluation of the calling thread (evaluate, evaluate_episodes) runs on the same collector
                while (not self._requests or self._running) and not self._closed:
                    self._lock.wait()
                if self._closed:
                    break
                weights_dict, step = self._requests.popleft()
                self._running = True
            try:
                outcome: Any = self._evaluate_now(weights_dict, step)
            except BaseException as error:  # carried to poll()/wait(), which raise it
                outcome = error
            if not isinstance(outcome, BaseException):
                self._call_on_result(outcome)
            with self._lock:
                self._running = False
                if not self._closed:
                    self._results.append(outcome)
                self._lock.notify_all()
        if self.config.backend == "thread":
            self._shutdown_run(5.0)

    def _take(self, timeout: float | None, what: str) -> dict[str, Any] | None:
        self._check_open(what)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not self._results and not self._closed and (self._running or self._requests):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._lock.wait(remaining)
            self._check_open(what)
            if not self._results:
                return None
            outcome = self._results.popleft()
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def _shutdown_run(self, timeout: float) -> None:
        runs = (self._episode_run, self._run)
        self._episode_run = self._run = None
        deadline = time.monotonic() + timeout
        for run in runs:
            if run is not None:
                run.shutdown(max(0.1, deadline - time.monotonic()))
