"""After ``shutdown()`` a collector with nodes holds nothing it opened: no descriptor, no listening port
(its command listener, the weights' listener, torch RPC's store), while the user still references it and
after it is dropped (tests/held.py); a second collector on the same ports starts. The collectors without
nodes are tests/collectors/test_nothing_left_open.py.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import netns
import pytest
from held import Held, held, held_since, start_process_state
from mocks import weight_policy

from rlharvest.collectors.distributed import DistributedCollector, DistributedSyncCollector, RPCCollector
from rlharvest.envs import CountingEnv
from rlharvest.transport.ports import free_port_block

pytestmark = pytest.mark.timeout(180)

HERE = os.path.dirname(os.path.abspath(__file__))
NOTHING = Held({}, set())
ENVS = [functools.partial(CountingEnv, max_steps=5)] * 2
NODES = {cls.__name__: cls for cls in (DistributedCollector, DistributedSyncCollector, RPCCollector)}


def collect_and_shut_down(collector, update: bool = True) -> None:
    assert sum(batch.numel() for batch in collector) == 8
    if update:
        collector.update_policy_weights_(weight_policy(2.0))
    collector.shutdown()


@pytest.mark.parametrize("name", list(NODES))
def test_nodes_started_here_leave_nothing_open_and_their_ports_free(name):
    start_process_state()
    before = held()
    port = free_port_block(3)
    for _ in range(2):  # the second on the same ports as the first
        collector = NODES[name](ENVS, weight_policy(), launcher="mp", tcp_port=port, frames_per_batch=4,
                                total_frames=8)
        try:
            if name == "RPCCollector":  # torch RPC's store (nodes started here pair without a listener)
                assert port in {opened for _, opened in held_since(before).ports}
            collect_and_shut_down(collector, update=name != "DistributedSyncCollector")  # it pushes by itself
        finally:
            collector.shutdown()
        assert held_since(before) == NOTHING  # still referenced
        del collector
        assert held_since(before) == NOTHING


@pytest.mark.usefixtures("zygote")
def test_nodes_that_joined_leave_nothing_open_and_the_port_free():
    import fresh

    start_process_state()
    before = held()
    port = free_port_block(3)
    for _ in range(2):
        collector = DistributedCollector(ENVS, weight_policy(), launcher="external", tcp_port=port,
                                         bind_address="127.0.0.1", frames_per_batch=4, total_frames=8)
        argv = [sys.executable, *collector.join_command()[1:]]
        nodes = [fresh.popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in ENVS]
        try:
            collect_and_shut_down(collector)
        finally:
            collector.shutdown()
            exits = [node.wait(60) for node in nodes]
        assert exits == [0, 0]
        assert held_since(before) == NOTHING
        del collector
        assert held_since(before) == NOTHING


def test_rpc_collectors_one_after_another_on_the_default_port(require_netns, tmp_path):
    """``RPCCollector`` without ``tcp_port`` listens on 10003: two in a row in one process, in a network
    namespace of their own (another process of the machine may hold 10003)."""
    with netns.TwoHosts() as net:
        script = os.path.join(HERE, "_default_port_main.py")
        tests = os.path.dirname(os.path.dirname(HERE))
        done = net.host_a.run([sys.executable, script], timeout=150, env={"PYTHONPATH": tests})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["listening", "released", "listening", "released"], done.stdout + done.stderr


@pytest.mark.ray
@pytest.mark.usefixtures("ray_session")
def test_ray_actors_leave_nothing_open():
    from rlharvest.collectors.distributed import RayCollector

    # Ray connects its raylet and workers to this process for its session's life, with the first actors
    RayCollector(ENVS, weight_policy(), frames_per_batch=4, total_frames=8).shutdown()
    start_process_state()
    before = held()
    collector = RayCollector(ENVS, weight_policy(), frames_per_batch=4, total_frames=8)
    collector.update_policy_weights_(weight_policy(2.0))
    assert sum(batch.numel() for batch in collector) == 8
    collector.shutdown()
    assert held_since(before) == NOTHING
    del collector
    assert held_since(before) == NOTHING
