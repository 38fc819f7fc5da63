"""``rlharvest node``, the one command that starts a node by hand, in both its forms (docs/elastic.md,
"The node command"): ``--rank`` for a collector of ``launcher="submitit_delayed"``, and the exit
status of a node whose key the collector does not hold. (``--join`` nodes that collect:
test_join.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import mocks
import pytest
from mocks import check_trajectories, counting_env_7, wait_until, weight_policy

from rlharvest.collectors.distributed import DistributedCollector
from rlharvest.transport.channel import new_authkey

pytestmark = pytest.mark.timeout(240)

TESTS = os.path.dirname(os.path.abspath(mocks.__file__))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(TESTS), TESTS])}


def key_file(folder, key: bytes):
    path = folder / "key"
    path.write_text(key.hex())
    path.chmod(0o600)
    return str(path)


def node(*argv: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlharvest", "node", *argv], env=ENV, **popen)


def test_a_node_started_with_rank_serves_a_collector_of_submitit_delayed(tmp_path, free_port):
    key = new_authkey()
    # started first: the collector's constructor waits for its nodes, which wait for its store meanwhile
    started = node("--rank", "1", "--world-size", "2", "--host", "127.0.0.1", "--port", str(free_port),
                   "--key-file", key_file(tmp_path, key))
    collector = None
    try:
        collector = DistributedCollector([counting_env_7], weight_policy(1.0), launcher="submitit_delayed",
                                         tcp_port=free_port, bind_address="127.0.0.1", authkey=key, frames_per_batch=8,
                                         total_frames=24, sync=True, worker_timeout=120.0)
        batches = [batch.clone() for batch in collector]
    finally:
        if collector is not None:
            collector.shutdown()
        else:
            started.kill()
        wait_until(lambda: started.poll() is not None, 60.0, "the node's exit")
    check_trajectories(batches, 24)
    assert started.returncode == 0


def test_a_node_whose_key_the_collector_does_not_hold_exits_with_5(tmp_path):
    collector = DistributedCollector([counting_env_7], weight_policy(1.0), launcher="external", tcp_port=0,
                                     bind_address="127.0.0.1", frames_per_batch=8, total_frames=16)
    try:
        host_port = collector.join_command()[5]
        stranger = node("--join", host_port, "--key-file", key_file(tmp_path, new_authkey()), "--timeout", "30",
                        stderr=subprocess.PIPE, text=True)
        _, err = stranger.communicate(timeout=120)
    finally:
        collector.shutdown()
    assert stranger.returncode == 5, err
    # the line it said when it started, then the failure in one line
    assert err.strip().splitlines() == [f"rlharvest node: connecting to {host_port}", err.strip().splitlines()[-1]], err
    assert "does the key file hold this collector's key?" in err.lower(), err
