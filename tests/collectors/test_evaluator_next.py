"""The Evaluator of TorchRL's next release (torchrl-nightly 2026.10.27): ``episode_sampling``,
``evaluate_episodes`` and the bootstrap statistics, through the public API only.

The file runs unchanged against TorchRL's nightly, to check that both behave alike
(docs/torchrl-compatibility.md, "TorchRL's next release"): ``RLHARVEST_TEST_LIBRARY=torchrl`` takes
``Evaluator``, ``GymEnv``, ``SerialEnv`` ... from ``torchrl`` instead of ``rlharvest``; the suite
itself never imports TorchRL.

The env is a gymnasium env both libraries wrap (``GymEnv``): ``LineEnv(length)`` ends its episodes
after ``length`` steps and rewards each step with ``start + action``, where ``start`` is drawn at
reset from the env's seeded generator (``noisy=True``) or 0. The policy acts its one weight ``w``,
so an episode of ``n`` steps returns exactly ``n * (start + w)``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import time

import gymnasium
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

LIBRARY = os.environ.get("RLHARVEST_TEST_LIBRARY", "rlharvest")
collectors = importlib.import_module(f"{LIBRARY}.collectors")
envs = importlib.import_module(f"{LIBRARY}.envs")
Evaluator, bootstrap_estimate, paired_comparison = (collectors.Evaluator, collectors.bootstrap_estimate,
                                                    collectors.paired_comparison)

pytestmark = pytest.mark.timeout(60)

LENGTHS = (2, 4, 8)  # the episode length of each sub-env of `line_envs()`


class LineEnv(gymnasium.Env):
    """Episodes of ``length`` steps; reward ``start + action`` (``start`` drawn at reset when ``noisy``);
    ``fail_at``: the step of each episode that raises (None: never); ``delay``: seconds per step."""

    def __init__(self, length: int = 3, noisy: bool = False, fail_at: int | None = None, delay: float = 0.0):
        self.length, self.noisy, self.fail_at, self.delay = length, noisy, fail_at, delay
        self.observation_space = gymnasium.spaces.Box(-np.inf, np.inf, (2,), np.float32)
        self.action_space = gymnasium.spaces.Box(-10.0, 10.0, (1,), np.float32)
        self.t, self.start = 0, 0.0

    def _observation(self) -> np.ndarray:
        return np.array([self.start, self.t], dtype=np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.start = float(self.np_random.uniform(0.0, 1.0)) if self.noisy else 0.0
        return self._observation(), {}

    def step(self, action):
        self.t += 1
        if self.t == self.fail_at:
            raise ValueError("LineEnv: the step that fails")
        if self.delay:
            time.sleep(self.delay)
        reward = self.start + float(np.asarray(action).reshape(-1)[0])
        return self._observation(), reward, self.t >= self.length, False, {}


gymnasium.register("RlhLineEnv-v0", entry_point=LineEnv)


def line_env(**kwargs):
    """A LineEnv wrapped by the library under test."""
    return envs.GymEnv("RlhLineEnv-v0", **kwargs)


def line_envs(**kwargs):
    """Three sub-envs whose episodes last 2, 4 and 8 steps."""
    return envs.SerialEnv(len(LENGTHS), line_env, create_env_kwargs=[dict(length=n, **kwargs) for n in LENGTHS])


class Weight(torch.nn.Module):
    def __init__(self, weight: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor([weight]))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.weight.expand(*observation.shape[:-1], 1)


def weight_policy(weight: float = 1.0) -> TensorDictModule:
    """Acts ``weight`` whatever it observes."""
    return TensorDictModule(Weight(weight), in_keys=["observation"], out_keys=["action"])


def weight_policy_of(env) -> TensorDictModule:
    """A policy factory, as both Evaluators call it: ``policy_factory(env)``."""
    return weight_policy(1.0)


@pytest.fixture
def shutdown_after():
    made = []
    yield made.append
    for evaluator in made:
        evaluator.shutdown()


def parameters(function) -> list:
    return [(name, parameter.kind.name, parameter.default) for name, parameter
            in inspect.signature(function).parameters.items()]


def test_the_signatures():
    init = [name for name, _, _ in parameters(Evaluator.__init__)]
    assert init[init.index("on_result"):init.index("busy_policy") + 1] == ["on_result", "episode_sampling",
                                                                           "busy_policy"]
    assert inspect.signature(Evaluator.__init__).parameters["episode_sampling"].default == "first_done"
    keyword, empty = "KEYWORD_ONLY", inspect.Parameter.empty
    assert parameters(Evaluator.evaluate_episodes) == [
        ("self", "POSITIONAL_OR_KEYWORD", empty), ("weights", "POSITIONAL_OR_KEYWORD", None),
        ("step", "POSITIONAL_OR_KEYWORD", None), ("weights_dict", keyword, None), ("seed", keyword, None)]
    options = [("statistic", keyword), ("confidence", keyword), ("num_resamples", keyword), ("generator", keyword)]
    for function, samples, statistic in [(bootstrap_estimate, ["values"], "iqm"),
                                         (paired_comparison, ["first", "second"], "mean")]:
        assert parameters(function) == [(name, "POSITIONAL_OR_KEYWORD", empty) for name in samples] + [
            ("dim", "POSITIONAL_OR_KEYWORD", -1)] + [(name, kind, default) for (name, kind), default
                                                     in zip(options, [statistic, 0.95, 1000, None])]


# ---------------------------------------------------------------------------------- episode_sampling
def test_first_done_over_samples_short_episodes_and_per_env_takes_one_per_sub_env(shutdown_after):
    first_done = Evaluator(line_envs(), weight_policy(1.0), num_trajectories=3, max_steps=12)
    per_env = Evaluator(line_envs(), weight_policy(1.0), num_trajectories=3, max_steps=12, episode_sampling="per_env")
    shutdown_after(first_done), shutdown_after(per_env)
    # first to end: sub-env 0 at steps 2 and 4, sub-env 1 at step 4
    assert first_done.evaluate()["eval/episode_length"] == pytest.approx(8 / 3)
    for step in range(2):  # each evaluation starts the sub-envs afresh
        result = per_env.evaluate()
        assert result["eval/episode_length"] == pytest.approx(14 / 3)
        assert result["eval/reward"] == pytest.approx(14 / 3)  # w = 1: the return is the length
        assert result["eval/num_episodes"] == 3 and result["eval/step"] == step


def test_per_env_stops_stepping_once_every_sub_env_ended_its_first_episode(shutdown_after):
    """Episodes of 2, 4 and 8 steps with max_steps=40: each rollout takes 8 steps, not 40."""
    calls = []

    class Counted(Weight):
        def forward(self, observation: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return super().forward(observation)

    evaluator = Evaluator(line_envs(), TensorDictModule(Counted(1.0), in_keys=["observation"], out_keys=["action"]),
                          num_trajectories=6, max_steps=40, episode_sampling="per_env")
    shutdown_after(evaluator)
    calls.clear()  # the policy's calls while the evaluator was built (the batch layout)
    result = evaluator.evaluate()
    assert result["eval/episode_length"] == pytest.approx(14 / 3) and result["eval/num_episodes"] == 6
    assert len(calls) == 2 * 8


def test_per_env_takes_more_rollouts_for_more_episodes_than_sub_envs(shutdown_after):
    evaluator = Evaluator(line_envs(), weight_policy(1.0), num_trajectories=5, max_steps=6, episode_sampling="per_env")
    shutdown_after(evaluator)
    result = evaluator.evaluate(weight_policy(2.0))
    # lengths 2, 4, 6 (cut), then 2, 4; returns twice the lengths
    assert result["eval/episode_length"] == pytest.approx(18 / 5)
    assert result["eval/reward"] == pytest.approx(36 / 5)


def test_per_env_trigger_eval_runs_in_the_background(shutdown_after):
    evaluator = Evaluator(line_envs(), weight_policy(1.0), num_trajectories=3, max_steps=12, episode_sampling="per_env")
    shutdown_after(evaluator)
    assert evaluator.trigger_eval(weight_policy(0.5), step=7)
    result = evaluator.wait(timeout=30)
    assert result["eval/step"] == 7 and result["eval/reward"] == pytest.approx(14 / 3 * 0.5)


@pytest.mark.parametrize("value", ["per_episode", None, "PER_ENV"])
def test_episode_sampling_rejects_unknown_values(value):
    with pytest.raises(ValueError, match="episode_sampling"):
        Evaluator(line_env(), weight_policy(), max_steps=5, episode_sampling=value)


def test_per_env_needs_an_int_max_steps():
    with pytest.raises(ValueError, match="max_steps"):
        Evaluator(line_env(), weight_policy(), episode_sampling="per_env")


@pytest.mark.parametrize("other", [dict(backend="process"), dict(backend="ray"),
                                   dict(weight_sync_schemes="multiprocess")])
def test_per_env_needs_the_thread_backend_without_weight_sync_schemes(other):
    if other.get("weight_sync_schemes"):
        weight_update = importlib.import_module(f"{LIBRARY}.weight_update")
        other = dict(weight_sync_schemes={"policy": weight_update.MultiProcessWeightSyncScheme()})
    with pytest.raises(ValueError, match="per_env"):
        Evaluator(line_env, policy_factory=weight_policy_of, max_steps=5, episode_sampling="per_env", **other)


# ---------------------------------------------------------------------------------- evaluate_episodes
def test_evaluate_episodes_returns_one_entry_per_episode(shutdown_after):
    evaluator = Evaluator(line_envs(), weight_policy(1.0), num_trajectories=5, max_steps=6)
    shutdown_after(evaluator)
    episodes = evaluator.evaluate_episodes()
    assert isinstance(episodes, TensorDict) and episodes.batch_size == torch.Size([5])
    assert sorted(episodes.keys()) == ["env_index", "episode_length", "episode_reward", "truncated"]
    assert episodes["episode_length"].dtype == torch.int64 and episodes["env_index"].dtype == torch.int64
    assert episodes["truncated"].dtype == torch.bool
    assert episodes["episode_length"].tolist() == [2, 4, 6, 2, 4]
    assert episodes["env_index"].tolist() == [0, 1, 2, 0, 1]
    assert episodes["truncated"].tolist() == [False, False, True, False, False]
    assert episodes["episode_reward"].tolist() == [2.0, 4.0, 6.0, 2.0, 4.0]


def test_evaluate_episodes_of_one_env(shutdown_after):
    evaluator = Evaluator(line_env(length=3), weight_policy(1.0), num_trajectories=2, max_steps=12)
    shutdown_after(evaluator)
    episodes = evaluator.evaluate_episodes(weight_policy(3.0))
    assert episodes["episode_length"].tolist() == [3, 3] and episodes["env_index"].tolist() == [0, 0]
    assert episodes["episode_reward"].tolist() == [9.0, 9.0] and not episodes["truncated"].any()


def test_evaluate_episodes_loads_weights_but_leaves_step_on_result_and_metrics_fn_alone(shutdown_after):
    results, batches = [], []
    evaluator = Evaluator(line_envs(), weight_policy(1.0), num_trajectories=3, max_steps=12, on_result=results.append,
                          metrics_fn=lambda batch: batches.append(batch) or {"seen": 1.0})
    shutdown_after(evaluator)
    episodes = evaluator.evaluate_episodes(weight_policy(2.0), step=50)
    assert episodes["episode_reward"].tolist() == [4.0, 8.0, 16.0]
    assert results == [] and batches == []
    result = evaluator.evaluate()  # the weights given stay, the counter did not move
    assert result["eval/step"] == 0 and result["eval/seen"] == 1.0 and len(results) == 1
    assert evaluator.evaluate_episodes(weights_dict={"policy": weight_policy(0.5)})["episode_reward"].tolist() \
        == [1.0, 2.0, 4.0]


def test_evaluate_episodes_with_a_policy_factory_and_an_env_constructor(shutdown_after):
    evaluator = Evaluator(line_envs, policy_factory=weight_policy_of, num_trajectories=3, max_steps=12)
    shutdown_after(evaluator)
    assert evaluator.evaluate_episodes()["episode_length"].tolist() == list(LENGTHS)
    assert evaluator.evaluate()["eval/episode_length"] == pytest.approx(8 / 3)


def test_evaluate_episodes_restores_the_policy_mode_also_on_errors(shutdown_after):
    policy = weight_policy(1.0)
    evaluator = Evaluator(line_env(length=5), policy, num_trajectories=2, max_steps=12)
    failing = Evaluator(line_env(length=5, fail_at=3), policy, num_trajectories=2, max_steps=12)
    shutdown_after(evaluator), shutdown_after(failing)
    modes = []
    policy.module.register_forward_pre_hook(lambda module, args: modes.append(module.training))
    policy.train()
    evaluator.evaluate_episodes()
    assert modes and not any(modes) and policy.training  # eval mode during, train mode after
    with pytest.raises(ValueError, match="the step that fails"):
        failing.evaluate_episodes()
    assert policy.training
    policy.eval()
    evaluator.evaluate_episodes()
    assert not policy.training


def test_evaluate_episodes_refuses_while_an_evaluation_is_pending(shutdown_after):
    evaluator = Evaluator(line_env(length=20, delay=0.02), weight_policy(), num_trajectories=1, max_steps=20)
    shutdown_after(evaluator)
    assert evaluator.trigger_eval()
    with pytest.raises(RuntimeError, match="pending"):
        evaluator.evaluate_episodes()
    assert evaluator.wait(timeout=30)["eval/episode_length"] == 20
    assert evaluator.evaluate_episodes()["episode_length"].tolist() == [20]


def test_evaluate_episodes_needs_an_int_max_steps(shutdown_after):
    evaluator = Evaluator(line_env(), weight_policy(), num_trajectories=1)
    shutdown_after(evaluator)
    with pytest.raises(ValueError, match="max_steps"):
        evaluator.evaluate_episodes()


def test_evaluate_episodes_is_not_for_the_process_backend(shutdown_after):
    evaluator = Evaluator(line_env, policy_factory=weight_policy_of, num_trajectories=1, max_steps=5, backend="process")
    shutdown_after(evaluator)
    with pytest.raises(ValueError, match="backend='thread'"):
        evaluator.evaluate_episodes()


# ---------------------------------------------------------------------------------- seeds
def noisy_evaluator(shutdown_after, weight: float = 0.0):
    evaluator = Evaluator(line_envs(noisy=True), weight_policy(weight), num_trajectories=5, max_steps=12)
    shutdown_after(evaluator)
    return evaluator


def test_one_seed_starts_every_episode_from_the_same_state_whatever_the_policy(shutdown_after):
    evaluator = noisy_evaluator(shutdown_after)
    base = evaluator.evaluate_episodes(seed=3)
    again = evaluator.evaluate_episodes(seed=3)
    better = evaluator.evaluate_episodes(weight_policy(1.0), seed=3)
    assert torch.equal(base["episode_reward"], again["episode_reward"])
    lengths = base["episode_length"].to(torch.float32)
    assert torch.allclose(better["episode_reward"] - base["episode_reward"], lengths)  # +1 per step, same starts
    assert paired_comparison(better["episode_reward"], base["episode_reward"])["probability_of_improvement"] == 1.0
    starts = base["episode_reward"] / lengths
    assert bool(((starts > 0) & (starts < 1)).all()) and len(set(starts.tolist())) == 5  # noisy: drawn starts
    other = evaluator.evaluate_episodes(weight_policy(0.0), seed=4)["episode_reward"]
    assert not torch.equal(other, base["episode_reward"])


def test_a_seed_leaves_the_callers_torch_rng_as_it_was(shutdown_after):
    evaluator = noisy_evaluator(shutdown_after)
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    evaluator.evaluate_episodes(seed=0)
    assert torch.equal(torch.rand(3), expected)


# ---------------------------------------------------------------------------------- bootstrap statistics
def test_bootstrap_estimate_reduces_the_sample_dim():
    returns = torch.tensor([[0.0, 0.0, 0.0, 100.0], [5.0, 5.0, 5.0, 5.0]])
    summary = bootstrap_estimate(returns)  # the interquartile mean by default
    assert isinstance(summary, TensorDict) and summary.batch_size == torch.Size([2])
    assert summary["estimate"].tolist() == [0.0, 5.0]
    assert (summary["ci_low"][1].item(), summary["ci_high"][1].item()) == (5.0, 5.0)
    assert bootstrap_estimate(returns, statistic="mean")["estimate"].tolist() == [25.0, 5.0]
    assert bootstrap_estimate(returns.T, dim=0, statistic="median")["estimate"].tolist() == [0.0, 5.0]
    summary = bootstrap_estimate(torch.arange(20), statistic="mean", generator=torch.Generator().manual_seed(0))
    assert summary["estimate"].item() == 9.5 and summary["estimate"].dtype == torch.get_default_dtype()
    assert 0 < summary["ci_low"].item() < 9.5 < summary["ci_high"].item() < 19


def test_bootstrap_estimate_draws_reproducibly_from_a_generator():
    values = torch.tensor([1.0, 7.0, 3.0, 9.0, 4.0])
    first = bootstrap_estimate(values, statistic="mean", num_resamples=200, generator=torch.Generator().manual_seed(5))
    second = bootstrap_estimate(values, statistic="mean", num_resamples=200, generator=torch.Generator().manual_seed(5))
    assert torch.equal(first["ci_low"], second["ci_low"]) and torch.equal(first["ci_high"], second["ci_high"])
    narrow = bootstrap_estimate(values, statistic="mean", confidence=0.5, generator=torch.Generator().manual_seed(5))
    wide = bootstrap_estimate(values, statistic="mean", confidence=0.99, generator=torch.Generator().manual_seed(5))
    assert wide["ci_low"] < narrow["ci_low"] < narrow["ci_high"] < wide["ci_high"]


@pytest.mark.parametrize("arguments", [dict(statistic="max"), dict(confidence=0.0), dict(confidence=1.0),
                                       dict(confidence=1.5)])
def test_bootstrap_estimate_rejects_bad_arguments(arguments):
    with pytest.raises(ValueError, match=next(iter(arguments))):
        bootstrap_estimate(torch.ones(4), **arguments)


def test_paired_comparison_bootstraps_the_differences():
    first, second = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 1.0, 4.0, 0.0])
    result = paired_comparison(first, second)  # differences 0, 1, -1, 4: the mean by default
    assert sorted(result.keys()) == ["ci_high", "ci_low", "estimate", "probability_of_improvement"]
    assert result["estimate"].item() == 1.0
    assert result["probability_of_improvement"].item() == 0.625  # a tie, two wins, a loss
    per_row = paired_comparison(torch.stack([first, second]), torch.stack([second, first]), statistic="median")
    assert per_row.batch_size == torch.Size([2]) and per_row["estimate"].tolist() == [0.5, -0.5]
    assert per_row["probability_of_improvement"].tolist() == [0.625, 0.375]
    with pytest.raises(ValueError, match="shape"):
        paired_comparison(first, second[:3])
