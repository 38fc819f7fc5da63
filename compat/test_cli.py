"""The ``rlharvest`` command beside TorchRL 0.14.1, that is with tensordict 0.14.3 (pyproject declares
``tensordict>=0.14,<0.16``): ``--help``, ``--version``, the demo, and a node that joins a collector of
TorchRL envs through ``join_command()`` (docs/elastic.md, "Nodes that join from anywhere")."""

from __future__ import annotations

import importlib.metadata
import os
import secrets
import subprocess
import sys

import pytest
import tensordict
from torchrl_objects import gym_env

import rlharvest
from rlharvest.collectors.distributed import DistributedCollector

pytestmark = pytest.mark.timeout(180)

HERE = os.path.dirname(os.path.abspath(__file__))
# the node imports the env constructor by reference (torchrl_objects.gym_env): its module must import there
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))}


def rlharvest_command(*argv: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlharvest", *argv], capture_output=True, text=True, env=ENV,
                          **kwargs)


def test_this_venv_has_the_oldest_tensordict_declared():
    assert tensordict.__version__.startswith("0.14."), tensordict.__version__


def test_help_and_version():
    done = rlharvest_command("--help", timeout=120)
    assert done.returncode == 0 and "node" in done.stdout, done.stderr
    done = rlharvest_command("--version", timeout=120)
    assert done.stdout.strip() == f"rlharvest {importlib.metadata.version('rlharvest')}" == f"rlharvest {rlharvest.__version__}"
    for command in ("demo", "node", "bench"):
        done = rlharvest_command(command, "--help", timeout=120)
        assert done.returncode == 0, done.stderr


def test_the_demo_imports_and_its_sampler_reads_the_exploration_mode():
    # what failed to import beside tensordict 0.14 (tensordict.nn.interaction_type came in 0.15)
    import torch
    from tensordict.nn import InteractionType, set_interaction_type

    from rlharvest.demo import CategoricalSampler, DemoConfig, run_demo  # noqa: F401

    logits = torch.tensor([[0.0, 3.0], [2.0, 0.0]])
    with set_interaction_type(InteractionType.DETERMINISTIC):
        action, _ = CategoricalSampler()(logits)
    assert action.tolist() == [1, 0]


def test_the_demo_without_its_extra_says_what_to_install(tmp_path):
    # this venv has gymnasium but not matplotlib nor tqdm (compat/requirements.txt)
    done = rlharvest_command("demo", "--frames", "2048", "--out", str(tmp_path), timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "rlharvest demo: error: the demo needs matplotlib, tqdm: pip install 'rlharvest[demo]' (or matplotlib tqdm)."]


def test_a_node_joins_through_join_command_and_collects_torchrl_envs():
    collector = DistributedCollector([gym_env] * 2, None, launcher="external", tcp_port=0, bind_address="127.0.0.1",
                                     frames_per_batch=20, total_frames=60, sync=True)
    argv = collector.join_command()
    assert argv[1:5] == ["-m", "rlharvest", "node", "--join"], argv
    # this venv's interpreter: join_command() names the collector's own (a bare "python" before it did)
    nodes = [subprocess.Popen([sys.executable, *argv[1:]], env=ENV, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        shapes = [tuple(batch.shape) for batch in collector]
    finally:
        collector.shutdown()
        errors = [node.communicate(timeout=60)[1] for node in nodes]
    assert shapes == [(2, 10)] * 3
    assert [node.returncode for node in nodes] == [0, 0], errors


def test_a_node_without_a_collector_says_so_without_a_traceback(tmp_path):
    from rlharvest.transport.ports import free_port

    key = tmp_path / "key"
    key.write_text(secrets.token_hex(32))  # a key of one repeated byte is refused before anything
    key.chmod(0o600)
    done = rlharvest_command("node", "--join", f"127.0.0.1:{free_port()}", "--key-file", str(key), "--timeout", "1",
                             timeout=120)
    lines = done.stderr.strip().splitlines()
    # A node narrates its progress one line at a time (docs/monitoring.md); the failure is its last line.
    assert done.returncode == 4 and "Traceback" not in done.stderr, done.stderr
    assert all(line.startswith("rlharvest node: ") for line in lines), done.stderr
    assert "no collector answered" in lines[-1], done.stderr
