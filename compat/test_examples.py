"""Three short training scripts written the way TorchRL's examples are, run end to end with small
budgets: DQN with a random warm-up, PPO over a ParallelEnv, off-policy training with a
DistributedCollector whose nodes run TorchRL envs."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).parent / "examples"
pytestmark = pytest.mark.timeout(240)


def run(script: str, *args: str) -> dict:
    result = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                            timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    line = [text for text in result.stdout.splitlines() if text.startswith("done:")][-1]
    return ast.literal_eval(line[len("done:"):].strip())


def test_dqn_with_random_warmup():
    summary = run("dqn_cartpole.py", "--total-frames", "3000", "--init-random-frames", "500")
    assert summary["frames"] == 3000 and summary["updates"] > 50 and summary["episodes"] > 10


def test_ppo_over_a_parallel_env():
    summary = run("ppo_parallel.py", "--total-frames", "2000", "--frames-per-batch", "500")
    assert summary["frames"] == 2000 and summary["optimizer_steps"] > 0 and summary["episodes"] > 10


def test_distributed_collector_with_torchrl_envs_on_the_nodes():
    summary = run("distributed_sac.py", "--total-frames", "1600", "--init-random-frames", "400")
    assert summary["frames"] == 1600 and summary["updates"] > 0 and summary["episodes"] >= 4
