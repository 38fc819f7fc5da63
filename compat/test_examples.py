"""Short scripts written the way TorchRL's examples are, run end to end with small budgets: DQN with a
random warm-up, PPO over a ParallelEnv, off-policy training with a DistributedCollector whose nodes run
TorchRL envs, the float actions of a linear policy that two of TorchRL's collector examples use, and
three models updated at once through TorchRL's own scheme objects."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).parent / "examples"
pytestmark = pytest.mark.timeout(240)


def run(script: str, *args: str) -> dict:
    return run_with_stderr(script, *args)[0]


def run_with_stderr(script: str, *args: str) -> tuple[dict, str]:
    result = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                            timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    line = [text for text in result.stdout.splitlines() if text.startswith("done:")][-1]
    return ast.literal_eval(line[len("done:"):].strip()), result.stderr


def test_dqn_with_random_warmup():
    summary = run("dqn_cartpole.py", "--total-frames", "3000", "--init-random-frames", "500")
    assert summary["frames"] == 3000 and summary["updates"] > 50 and summary["episodes"] > 10


def test_ppo_over_a_parallel_env():
    summary = run("ppo_parallel.py", "--total-frames", "2000", "--frames-per-batch", "500")
    assert summary["frames"] == 2000 and summary["optimizer_steps"] > 0 and summary["episodes"] > 10


def test_distributed_collector_with_torchrl_envs_on_the_nodes():
    summary = run("distributed_sac.py", "--total-frames", "1600", "--init-random-frames", "400")
    assert summary["frames"] == 1600 and summary["updates"] > 0 and summary["episodes"] >= 4


def test_float_actions_of_a_linear_policy_as_in_torchrl_examples():
    """TorchRL's examples/collectors/async_batched_collector.py and Example 2 of weight_sync_collectors.py:
    an nn.Linear(4, 2) writes floats as CartPole's one-hot action, which TorchRL reads by argmax."""
    summary, stderr = run_with_stderr("float_actions.py", "--total-frames", "400")
    assert summary["async_batched"] == {"frames": 400, "float_actions": True}
    assert summary["shared_memory_workers"]["frames"] >= 400 and summary["shared_memory_workers"]["updates"] >= 2
    assert "ActionReadWarning" in stderr and "OneHot(shape=(2,), dtype=torch.int64, n=2)" in stderr
    assert "value.long().argmax(-1)" in stderr


def test_three_models_updated_through_torchrl_scheme_objects():
    """TorchRL's examples/collectors/multi_weight_updates.py: TorchRL's MultiProcessWeightSyncScheme for
    the policy, the env's module and the replay buffer's module; each model's marker weights show in
    every frame written after the update, and in none before."""
    summary = run("multi_model_weights.py", "--batches", "4")
    assert summary["buffer_sizes"] == [100, 200, 300, 400]
    assert summary["before_update"] == dict.fromkeys(summary["before_update"], False)
    assert summary["after_update"] == {"policy": True, "env.transform[0].module": True,
                                       "replay_buffer.transform[0].module": True}
