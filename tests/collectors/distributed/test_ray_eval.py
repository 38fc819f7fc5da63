"""RayEvalWorker and the Evaluator's "ray" backend on the session's local Ray (``ray_cluster``).

ActionRewardEnv(max_steps=3) with weight_policy(w): w = 1 ends episodes after 4 steps with a return
of 4; w = 0 never ends them, so they are truncated at ``max_steps`` with a return of 0.
"""

from __future__ import annotations

import functools
import time

import pytest
from mocks import ActionRewardEnv, FaultyEnv, wait_until, weight_policy, weight_policy_of
from ray_check import live_actors

from rlharvest import WorkerError
from rlharvest.collectors import Evaluator
from rlharvest.collectors.distributed import RayEvalWorker

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120), pytest.mark.usefixtures("ray_session")]

ENV = functools.partial(ActionRewardEnv, max_steps=3)


def test_ray_eval_worker_submit_poll_and_weights():
    worker = RayEvalWorker(None, ENV, weight_policy_of, num_gpus=0, num_trajectories=2)
    try:
        assert worker.poll() is None  # nothing submitted
        worker.submit(None, max_steps=8)
        result = worker.poll(timeout=60)
        assert (result["reward"], result["episode_length"], result["num_episodes"]) == (4.0, 4.0, 2)
        assert result["frames"] is None and worker.poll() is None
        worker.submit(Evaluator.extract_weights(weight_policy(0.0)), max_steps=6)  # another max_steps: a new actor
        result = worker.poll(timeout=60)
        assert (result["reward"], result["episode_length"]) == (0.0, 6.0)
    finally:
        worker.shutdown()
        worker.shutdown()  # idempotent


def test_ray_eval_worker_shutdown_leaves_no_actor(ray_cluster):
    worker = RayEvalWorker(lambda: None, ENV, weight_policy_of, num_gpus=0)
    worker.submit(None, max_steps=8)
    assert worker.poll(timeout=60)["reward"] == 4.0
    assert live_actors(ray_cluster)
    worker.shutdown()
    wait_until(lambda: not live_actors(ray_cluster), timeout=10, what="the actor's end")


def test_ray_eval_worker_refuses_names():
    with pytest.raises(NotImplementedError, match="name"):
        RayEvalWorker(None, ENV, weight_policy_of, num_gpus=0, name="eval")
    with pytest.raises(NotImplementedError, match="from_name"):
        RayEvalWorker.from_name("eval")


def test_evaluator_ray_backend_every_method():
    results = []
    evaluator = Evaluator(ENV, policy_factory=weight_policy_of, num_trajectories=3, max_steps=8, backend="ray",
                          num_gpus=0, busy_policy="queue", on_result=results.append)
    try:
        first = evaluator.evaluate(weight_policy(0.0), step=3)
        assert (first["eval/reward"], first["eval/episode_length"], first["eval/num_episodes"]) == (0.0, 8.0, 3)
        assert first["eval/step"] == 3
        assert evaluator.trigger_eval(weight_policy(1.0)) and evaluator.trigger_eval(weight_policy(0.0))
        assert evaluator.pending
        assert evaluator.wait(60)["eval/reward"] == 4.0
        assert evaluator.wait(60)["eval/reward"] == 0.0
        assert not evaluator.pending and evaluator.state_dict() == {"step_counter": 2}
        assert [float(r["eval/reward"]) for r in results] == [0.0, 4.0, 0.0]
    finally:
        evaluator.shutdown()


def test_evaluator_ray_backend_errors():
    with pytest.raises(ValueError, match="backend='ray'.*`env` must be a callable"):
        Evaluator(ENV(), policy_factory=weight_policy_of, backend="ray", num_gpus=0)
    with pytest.raises(ValueError, match="backend='ray'.*needs `policy_factory`"):
        Evaluator(ENV, weight_policy(), backend="ray", num_gpus=0)
    evaluator = Evaluator(functools.partial(FaultyEnv, bad=(None,), after_steps=2), policy_factory=weight_policy_of,
                          num_trajectories=2, max_steps=8, backend="ray", num_gpus=0)
    try:
        with pytest.raises(WorkerError, match="injected failure"):
            evaluator.evaluate()
    finally:
        evaluator.shutdown()


def test_shutdown_in_the_middle_of_an_evaluation_is_bounded(ray_cluster):
    slow = functools.partial(ActionRewardEnv, max_steps=3, delay=0.2)  # 2 episodes of 8 steps: 3.2 s
    evaluator = Evaluator(slow, policy_factory=weight_policy_of, num_trajectories=2, max_steps=8, backend="ray",
                          num_gpus=0)
    assert evaluator.trigger_eval(weight_policy(0.0))
    wait_until(lambda: live_actors(ray_cluster), timeout=30, what="the actor's start")
    start = time.monotonic()
    evaluator.shutdown(timeout=2.0)
    assert time.monotonic() - start < 10.0
    wait_until(lambda: not live_actors(ray_cluster), timeout=10, what="the actor's end")
