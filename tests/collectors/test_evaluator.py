"""Evaluator with the "thread" and "process" backends (the "ray" one: distributed/test_ray_eval.py).

ActionRewardEnv(max_steps=3) rewards the action, and weight_policy(w) always acts w: with w = 1 an
episode lasts 4 steps and returns 4; with w = 0 it never ends by itself, so it is truncated at
``max_steps`` (8 here) and returns 0. Each result says exactly which weights collected it.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import torch
from tensordict.nn import TensorDictModule
from mocks import ActionRewardEnv, FaultyEnv, wait_until, weight_policy, weight_policy_of
from process_check import process_gone

from rlharvest import WorkerError
from rlharvest.collectors import Evaluator
from rlharvest.collectors.evaluator import EvaluationPendingError, EvaluatorClosedError
from rlharvest.weight_update import SharedMemWeightSyncScheme
from rlharvest.collectors.engine import engine_of

pytestmark = pytest.mark.timeout(60)

BACKENDS = ["thread", "process"]
TRUNCATED = 8  # max_steps of every evaluator below


def make(backend: str, delay: float = 0.0, **kwargs) -> Evaluator:
    """Three episodes per evaluation, the policy built by a factory from the env (both backends)."""
    kwargs.setdefault("num_trajectories", 3)
    return Evaluator(functools.partial(ActionRewardEnv, max_steps=3, delay=delay), policy_factory=weight_policy_of,
                     max_steps=TRUNCATED, backend=backend, **kwargs)


def assert_weights(result: dict, weight: float, prefix: str = "eval") -> None:
    """The result of an evaluation with weight_policy(weight) (1 or 0)."""
    expected = (4.0, 4.0) if weight == 1 else (0.0, float(TRUNCATED))
    assert (result[f"{prefix}/reward"], result[f"{prefix}/episode_length"]) == expected
    assert result[f"{prefix}/num_episodes"] == 3 and result[f"{prefix}/reward_std"] == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_evaluate_reports_torchrl_keys_and_the_weights_it_was_given(backend):
    evaluator = make(backend)
    try:
        first = evaluator.evaluate()
        assert sorted(first) == ["eval/episode_length", "eval/fps", "eval/num_episodes", "eval/reward",
                                 "eval/reward_std", "eval/step"]
        assert_weights(first, 1)
        assert first["eval/step"] == 0 and first["eval/fps"] > 0
        assert_weights(evaluator.evaluate(weight_policy(0.0)), 0)  # a module: its weights
        back = evaluator.evaluate(weights_dict={"policy": weight_policy(1.0)}, step=100)
        assert_weights(back, 1)
        assert back["eval/step"] == 100
        assert evaluator.evaluate(Evaluator.extract_weights(weight_policy(0.0)))["eval/step"] == 2  # a TensorDict
        assert_weights(evaluator.evaluate(), 0)  # no weights: the last ones given stay
    finally:
        evaluator.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_collector_kwargs_may_set_the_trajectory_format(backend):
    evaluator = make(backend, collector_kwargs={"traj_format": "cat"})  # flat batches: the same metrics
    try:
        assert_weights(evaluator.evaluate(), 1)
        assert_weights(evaluator.evaluate(weight_policy(0.0)), 0)
    finally:
        evaluator.shutdown()


def test_process_weights_travel_through_the_default_scheme():
    evaluator = make("process")
    try:
        scheme = engine_of(evaluator._run.collector).weights.sender_schemes["policy"]
        assert isinstance(scheme, SharedMemWeightSyncScheme)
        sent = []
        send = scheme.send
        scheme.send = lambda *args, **kwargs: sent.append(args) or send(*args, **kwargs)
        assert_weights(evaluator.evaluate(weight_policy(0.0)), 0)
        assert len(sent) == 1  # the update went through the scheme's sender
        assert_weights(evaluator.evaluate(), 0)
        assert len(sent) == 1  # no weights: nothing sent
    finally:
        evaluator.shutdown()


def test_thread_backend_uses_the_policy_given_in_eval_mode():
    seen = []

    class ModeProbe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(1))

        def forward(self, observation):
            seen.append(self.training)
            return torch.zeros(observation.shape) + self.weight

    from tensordict.nn import TensorDictModule

    policy = TensorDictModule(ModeProbe(), in_keys=["observation"], out_keys=["action"])
    evaluator = Evaluator(ActionRewardEnv(max_steps=3), policy, num_trajectories=2, max_steps=TRUNCATED)
    assert evaluator.evaluate()["eval/reward"] == 4.0
    evaluator.evaluate(weight_policy(0.0))
    assert policy.module.weight.item() == 0.0  # the weights were copied into the policy given
    assert seen and not any(seen) and policy.training  # eval mode during evaluations only
    evaluator.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_trigger_poll_wait_and_pending(backend):
    results = []
    evaluator = make(backend, delay=0.01, on_result=results.append)
    try:
        assert evaluator.poll() is None and evaluator.wait(0.1) is None and not evaluator.pending
        assert evaluator.trigger_eval(weight_policy(0.0), step=7)
        assert evaluator.pending and evaluator.poll() is None  # 3 x 8 steps of 10 ms: still running
        result = evaluator.wait(timeout=30)
        assert_weights(result, 0)
        assert result["eval/step"] == 7 and not evaluator.pending
        assert evaluator.poll() is None and evaluator.wait() is None  # nothing pending, nothing ready
        assert evaluator.trigger_eval(weight_policy(1.0))
        wait_until(lambda: not evaluator.pending, timeout=30, what="the evaluation")
        assert_weights(evaluator.poll(), 1)
        assert [float(r["eval/reward"]) for r in results] == [0.0, 4.0]  # on_result: TensorDicts
        assert results[0]["eval/step"].item() == 7
    finally:
        evaluator.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_busy_policies(backend):
    skip = make(backend, delay=0.01)
    error = make(backend, delay=0.01, busy_policy="error")
    queue = make(backend, delay=0.01, busy_policy="queue")
    try:
        assert skip.trigger_eval(weight_policy(0.0), step=1)
        assert not skip.trigger_eval(weight_policy(1.0), step=2)  # skipped
        assert skip.wait(30)["eval/step"] == 1 and skip.wait() is None

        assert error.trigger_eval(step=1)
        with pytest.raises(EvaluationPendingError, match="busy_policy='skip'"):
            error.trigger_eval(step=2)
        with pytest.raises(EvaluationPendingError):
            error.evaluate()  # the backend runs one evaluation at a time
        assert error.wait(30)["eval/step"] == 1

        for step, weight in enumerate([0.0, 1.0, 0.0]):
            assert queue.trigger_eval(weight_policy(weight), step=step)
        for step, weight in enumerate([0.0, 1.0, 0.0]):
            result = queue.wait(30)
            assert result["eval/step"] == step
            assert_weights(result, weight)
        assert not queue.pending
    finally:
        for evaluator in (skip, error, queue):
            evaluator.shutdown()


def test_weights_are_copied_when_triggered():
    policy = weight_policy(0.0)
    evaluator = make("thread", delay=0.01, busy_policy="queue")
    try:
        evaluator.trigger_eval(policy)
        evaluator.trigger_eval(policy)
        with torch.no_grad():
            policy.module.weight.fill_(1.0)  # training goes on: the queued evaluation keeps what it got
        assert_weights(evaluator.wait(30), 0)
        assert_weights(evaluator.wait(30), 0)
    finally:
        evaluator.shutdown()


def test_metrics_fn_prefix_and_state_dict():
    def max_observation(batch):
        return {"max_obs": batch["next", "observation"].max().item()}

    evaluator = make("thread", metrics_fn=max_observation, log_prefix="test", busy_policy="queue")
    try:
        result = evaluator.evaluate()
        assert result["test/max_obs"] == 4 and result["test/reward"] == 4.0 and result["test/step"] == 0
        assert evaluator.state_dict() == {"step_counter": 1}
        evaluator.trigger_eval()
        with pytest.raises(RuntimeError, match="no pending, queued, or unread"):
            evaluator.state_dict()
        wait_until(lambda: not evaluator.pending, timeout=30, what="the evaluation")
        with pytest.raises(RuntimeError, match="unread"):
            evaluator.load_state_dict({"step_counter": 5})
        evaluator.poll()
        evaluator.load_state_dict({"step_counter": 5})
        assert evaluator.evaluate()["test/step"] == 5
    finally:
        evaluator.shutdown()


def test_env_with_its_own_step_counter_and_a_batched_env():
    from mocks import StepCountEnv

    evaluator = Evaluator(StepCountEnv(max_steps=2), weight_policy(1.0), num_trajectories=2, max_steps=50)
    assert evaluator.evaluate()["eval/num_episodes"] == 2  # max_steps dropped: the env counts its steps
    evaluator.shutdown()
    batched = Evaluator(ActionRewardEnv(max_steps=3, batch_size=(2,)), weight_policy(1.0), num_trajectories=4,
                        max_steps=TRUNCATED)
    result = batched.evaluate()
    assert (result["eval/num_episodes"], result["eval/reward"], result["eval/episode_length"]) == (4, 4.0, 4.0)
    batched.shutdown()


@pytest.mark.parametrize("arguments, message", [
    (dict(backend="threads"), "Unknown backend 'threads': choose one of 'thread', 'process', 'ray'"),
    (dict(busy_policy="drop"), "Unknown busy_policy 'drop': choose one of 'skip', 'error', 'queue'"),
    (dict(policy=weight_policy()), "either `policy` or `policy_factory`, not both"),
    (dict(policy_factory=None), "Either `policy` or `policy_factory` must be provided"),
    (dict(policy_factory=None, policy=weight_policy(), backend="process"), "needs `policy_factory`"),
    (dict(env=ActionRewardEnv(), backend="process"), "`env` must be a callable returning an env"),
    (dict(env=ActionRewardEnv(), weight_sync_schemes={}), "with weight_sync_schemes builds the env"),
    (dict(num_trajectories=0), "num_trajectories must be a positive int"),
    (dict(collector_cls="Colector"), "collector_cls 'Colector' is not a class of rlharvest.collectors"),
    (dict(episode_sampling="shortest"), "Unknown episode_sampling 'shortest': choose one of 'first_done', 'per_env'"),
    (dict(episode_sampling="per_env", max_steps=None), "integer max_steps; got max_steps=None"),
    (dict(episode_sampling="per_env", backend="process"), "integer max_steps; got backend='process'"),
])
def test_bad_arguments_name_what_is_allowed(arguments, message):
    arguments = {"env": ActionRewardEnv, "policy_factory": weight_policy_of, "max_steps": TRUNCATED, **arguments}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Evaluator(arguments.pop("env"), **arguments)


class OverlapProbe(torch.nn.Module):
    """Acts 1, and counts the calls that began while another one was running (two evaluations at once)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.running, self.overlaps, self.lock = 0, 0, threading.Lock()

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.running += 1
            self.overlaps += self.running > 1
        time.sleep(0.005)
        with self.lock:
            self.running -= 1
        return torch.zeros(observation.shape) + self.weight


@pytest.mark.parametrize("call", ["evaluate", "evaluate_episodes"])
def test_a_request_queued_from_another_thread_waits_for_the_callers_evaluation(call):
    probe = OverlapProbe()
    evaluator = Evaluator(ActionRewardEnv(max_steps=3), TensorDictModule(probe, ["observation"], ["action"]),
                          num_trajectories=20, max_steps=TRUNCATED, busy_policy="queue")
    def trigger_while_busy():
        wait_until(lambda: evaluator.pending, timeout=30, what="the caller's evaluation")
        evaluator.trigger_eval(step=7)

    helper = threading.Thread(target=trigger_while_busy)
    try:
        helper.start()
        getattr(evaluator, call)()
        helper.join(timeout=30)
        assert evaluator.wait(timeout=30)["eval/step"] == 7
        assert probe.overlaps == 0
    finally:
        evaluator.shutdown()


def test_per_env_sampling_names_the_collector_arguments_it_does_not_use():
    with pytest.warns(UserWarning, match="collector_cls, traj_format are not used"):
        evaluator = Evaluator(ActionRewardEnv(max_steps=3), weight_policy(1.0), num_trajectories=3,
                              max_steps=TRUNCATED, episode_sampling="per_env", collector_cls="Collector",
                              collector_kwargs={"traj_format": "cat", "auto_register_policy_transforms": False})
    assert_weights(evaluator.evaluate(), 1)
    evaluator.shutdown()


def test_evaluate_episodes_checks_its_seed_and_the_evaluator_state():
    evaluator = make("thread")
    try:
        with pytest.raises(TypeError, match="seed must be an int or None, got float 1.5"):
            evaluator.evaluate_episodes(seed=1.5)
        episodes = evaluator.evaluate_episodes(weight_policy(0.0), seed=2)
        assert episodes["truncated"].all() and episodes["episode_length"].tolist() == [TRUNCATED] * 3
        assert_weights(evaluator.evaluate(), 0)  # one policy for both runs: the weights given stay
    finally:
        evaluator.shutdown()
    with pytest.raises(EvaluatorClosedError, match=r"evaluate_episodes\(\) after shutdown\(\)"):
        evaluator.evaluate_episodes()


@pytest.mark.parametrize("backend", BACKENDS)
def test_after_shutdown_every_call_names_the_closed_evaluator(backend):
    evaluator = make(backend)
    evaluator.evaluate()
    evaluator.trigger_eval()
    evaluator.shutdown(timeout=10)
    evaluator.shutdown()  # idempotent
    for call in (evaluator.evaluate, evaluator.trigger_eval, evaluator.poll, evaluator.wait):
        with pytest.raises(EvaluatorClosedError, match=r"after shutdown\(\)"):
            call()


def test_a_failing_worker_is_a_worker_error_with_its_traceback_then_nothing_is_left():
    evaluator = Evaluator(functools.partial(FaultyEnv, bad=(None,), after_steps=2), policy_factory=weight_policy_of,
                          num_trajectories=2, max_steps=TRUNCATED, backend="process")
    pid = evaluator._run.collector.worker_pids()[0]
    try:
        with pytest.raises(WorkerError, match="injected failure") as info:
            evaluator.evaluate()
        assert "Traceback" in str(info.value) and "_step_arrays" in str(info.value)
    finally:
        evaluator.shutdown(timeout=5)
    assert process_gone(pid)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failed_background_evaluation_is_raised_by_wait(backend):
    evaluator = Evaluator(functools.partial(FaultyEnv, bad=(None,), after_steps=2), policy_factory=weight_policy_of,
                          num_trajectories=2, max_steps=TRUNCATED, backend=backend)
    try:
        assert evaluator.trigger_eval()
        with pytest.raises(ValueError, match="injected failure"):
            evaluator.wait(30)
        assert not evaluator.pending
    finally:
        evaluator.shutdown()


def test_a_worker_that_fails_to_start_is_reported_by_the_constructor():
    def broken_env():
        raise KeyError("no such env")

    with pytest.raises(WorkerError, match="no such env"):
        Evaluator(broken_env, policy_factory=weight_policy_of, backend="process")


def test_init_fn_runs_first_in_the_worker(tmp_path):
    marker = tmp_path / "init"
    evaluator = make("process", init_fn=lambda: marker.write_text(str(os.getpid())))
    try:
        assert_weights(evaluator.evaluate(), 1)
        assert int(marker.read_text()) == evaluator._run.collector.worker_pids()[0] != os.getpid()
    finally:
        evaluator.shutdown()


def test_the_worker_exits_when_the_trainer_dies(tmp_path):
    script = textwrap.dedent(f"""
        import functools, sys, time
        sys.path.insert(0, {os.path.dirname(os.path.dirname(__file__))!r})
        from mocks import ActionRewardEnv, weight_policy_of
        from rlharvest.collectors import Evaluator
        evaluator = Evaluator(functools.partial(ActionRewardEnv, max_steps=3), policy_factory=weight_policy_of,
                              max_steps=8, backend="process")
        print(evaluator._run.collector.worker_pids()[0], flush=True)
        time.sleep(60)
    """)
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        worker = int(trainer.stdout.readline())
        assert psutil.pid_exists(worker)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(10)
        wait_until(lambda: process_gone(worker),
                   timeout=20, what="the orphaned evaluation worker's exit")
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(10)
        trainer.stdout.close()


def test_collector_cls_by_name_builds_the_policy_from_the_env():
    evaluator = Evaluator(ActionRewardEnv(max_steps=3), policy_factory=weight_policy_of, collector_cls="Collector",
                          num_trajectories=2, max_steps=TRUNCATED)
    assert type(evaluator._run.collector).__name__ == "Collector"
    assert evaluator.evaluate()["eval/reward"] == 4.0
    evaluator.shutdown()


@pytest.mark.parametrize("backend", [*BACKENDS, pytest.param("ray", marks=pytest.mark.ray)])
def test_a_factory_whose_next_parameter_is_not_the_env_is_called_without_it(backend, request):
    """``partial(RandomPolicy, spec)``, as TorchRL's tests give it: its next parameter is ``action_key``,
    which the env must not become (an IndexError from the first ``td.set``; compat/ runs TorchRL's)."""
    from rlharvest.collectors import RandomPolicy

    if backend == "ray":
        request.getfixturevalue("ray_session")
    spec = ActionRewardEnv(max_steps=3).action_spec  # a leaf spec: RandomPolicy writes it at its action_key
    evaluator = Evaluator(functools.partial(ActionRewardEnv, max_steps=3), max_steps=TRUNCATED, num_trajectories=2,
                          policy_factory=functools.partial(RandomPolicy, spec), backend=backend, num_gpus=0)
    try:
        result = evaluator.evaluate()
    finally:
        evaluator.shutdown()
    assert result["eval/num_episodes"] == 2 and 1 <= result["eval/episode_length"] <= TRUNCATED
