"""rlharvest's Evaluator with TorchRL's envs (StepCounter + RewardSum) and actors, beside TorchRL's own."""

from __future__ import annotations

import functools
import inspect

import pytest
import torchrl.collectors
from tensordict import TensorDict
from torchrl_objects import gym_env, q_value_actor, transformed_env

import rlharvest.collectors

pytestmark = pytest.mark.timeout(120)


def greedy_actor(env=None):
    """The DQN actor without exploration, as a policy factory ``(env) -> policy``."""
    return q_value_actor(epsilon=None)


def check_cartpole(result: dict, count: int) -> None:
    """CartPole rewards 1 per step: RewardSum's return of an episode is its length (StepCounter's)."""
    assert result["eval/num_episodes"] == count
    assert result["eval/reward"] == result["eval/episode_length"]
    assert 1 <= result["eval/episode_length"] <= 40  # StepCounter(max_steps=40) truncates


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_evaluator_with_torchrl_env_and_reward_sum(backend):
    env = transformed_env if backend == "process" else transformed_env()
    policy = dict(policy_factory=greedy_actor) if backend == "process" else dict(policy=greedy_actor())
    evaluator = rlharvest.collectors.Evaluator(env, num_trajectories=3, max_steps=100, backend=backend, **policy)
    try:
        check_cartpole(evaluator.evaluate(greedy_actor(), step=10), 3)
        assert evaluator.trigger_eval(TensorDict.from_module(greedy_actor()).data)
        check_cartpole(evaluator.wait(60), 3)
    finally:
        evaluator.shutdown()


def test_same_result_keys_as_torchrl():
    ours = rlharvest.collectors.Evaluator(transformed_env(), greedy_actor(), num_trajectories=2, max_steps=100)
    theirs = torchrl.collectors.Evaluator(transformed_env(), greedy_actor(), num_trajectories=2, max_steps=100)
    try:
        mine, reference = ours.evaluate(greedy_actor()), theirs.evaluate(greedy_actor())
        assert sorted(mine) == sorted(reference)
        assert mine["eval/step"] == reference["eval/step"] == 0
        assert ours.state_dict() == theirs.state_dict()
    finally:
        ours.shutdown()
        theirs.shutdown()


def vecnorm_env():
    from torchrl.envs import VecNormV2

    return transformed_env().append_transform(VecNormV2(in_keys=["observation"]))


def test_vecnorm_of_the_eval_env_is_frozen():
    evaluator = rlharvest.collectors.Evaluator(vecnorm_env(), greedy_actor(), num_trajectories=2, max_steps=100)
    try:
        check_cartpole(evaluator.evaluate(), 2)
        vecnorm = evaluator._run.collector.env.transform[-1]
        assert vecnorm.frozen
    finally:
        evaluator.shutdown()


def _parameters(function) -> dict:
    return {name: p.default for name, p in inspect.signature(function).parameters.items()}


#: the arguments TorchRL's next release adds (tests/collectors/test_evaluator_next.py checks them)
NEXT_RELEASE = {"__init__": ("episode_sampling",)}


@pytest.mark.parametrize("method", ["__init__", "evaluate", "trigger_eval", "poll", "wait", "shutdown", "state_dict",
                                    "load_state_dict"])
def test_evaluator_signature_is_torchrl_s(method):
    ours = _parameters(getattr(rlharvest.collectors.Evaluator, method))
    theirs = _parameters(getattr(torchrl.collectors.Evaluator, method))
    added = NEXT_RELEASE.get(method, ())
    ours = {name: default for name, default in ours.items() if name in theirs or name not in added}
    assert list(ours) == list(theirs)
    assert {k: str(v) for k, v in ours.items()} == {k: str(v) for k, v in theirs.items()}  # defaults too


@pytest.mark.parametrize("method", ["__init__", "submit", "poll", "from_name"])
def test_ray_eval_worker_takes_every_torchrl_argument(method):
    from torchrl.collectors.distributed import RayEvalWorker as TheirWorker

    from rlharvest.collectors.distributed import RayEvalWorker

    ours, theirs = _parameters(getattr(RayEvalWorker, method)), _parameters(getattr(TheirWorker, method))
    assert all(name in ours and str(ours[name]) == str(default) for name, default in theirs.items())


def test_every_public_name_of_torchrl_collectors_is_exported():
    """Evaluator and RayEvalWorker were the last names of TorchRL 0.14.1's __all__ missing here."""
    import torchrl.collectors.distributed

    import rlharvest.collectors.distributed

    assert set(torchrl.collectors.__all__) <= set(rlharvest.collectors.__all__)
    assert set(torchrl.collectors.distributed.__all__) <= set(rlharvest.collectors.distributed.__all__)


@pytest.mark.parametrize("backend", ["thread", "process"])  # "ray": this venv has no Ray (compat/requirements.txt)
def test_torchrl_random_policy_from_a_partial_of_its_spec(backend):
    """TorchRL's ``RandomPolicy(action_spec, action_key="action")`` built by ``partial(RandomPolicy, spec)``:
    the env must not be passed as its ``action_key`` (TorchRL's
    ``test_process_backend_stateless_policy_without_weights``); a stateless policy needs no weights."""
    from torchrl.modules import RandomPolicy

    spec = gym_env().action_spec
    evaluator = rlharvest.collectors.Evaluator(transformed_env, policy_factory=functools.partial(RandomPolicy, spec),
                                               num_trajectories=2, max_steps=100, backend=backend)
    try:
        check_cartpole(evaluator.evaluate(), 2)
    finally:
        evaluator.shutdown()
