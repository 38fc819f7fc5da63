"""``autoscale=`` on node collectors (docs/elastic.md, "Autoscaling"): DistributedCollector and
RPCCollector with ``launcher="mp"`` (a new node is a new process), and DistributedCollector with
``launcher="external"``, whose nodes are started by ``on_scale`` (here: the join command on
loopback, forked from the session's zygote). Growth while the learner starves, shrinking while it
is slow, sync batches keeping ``frames_per_batch`` (a node's batch layout changes with its share),
every frame collected once, nothing left after shutdown (the autouse fixture; joined nodes exit by
themselves)."""

from __future__ import annotations

import os
import subprocess
import time

import fresh
import pytest
from mocks import SlowCountingEnv, check_trajectories, counting_env_7, wait_until, weight_policy

from rlharvest.collectors import Autoscale
from rlharvest.collectors.distributed import DistributedCollector, RPCCollector
from rlharvest.transport.ports import free_port_block

pytestmark = pytest.mark.timeout(240)

LENIENT = {"window": 4, "cooldown": 4, "grow_above": 0.5, "shrink_below": 0.3}


def slow_env():
    return SlowCountingEnv(max_steps=7, delay=0.01)


def collect(collector, work_s: float = 0.0) -> list:
    out = []
    for batch in collector:
        out.append(batch.clone())
        time.sleep(work_s)  # the learner's training step
    return out


@pytest.mark.parametrize("collector_class, sync", [(DistributedCollector, True), (DistributedCollector, False),
                                                   (RPCCollector, True)])
def test_a_starving_learner_gets_a_new_node(collector_class, sync):
    collector = collector_class([slow_env], weight_policy(1.0), launcher="mp", tcp_port=free_port_block(3),
                                frames_per_batch=12, total_frames=12 * 12, sync=sync,
                                autoscale=Autoscale(1, 2, **LENIENT))
    batches = collect(collector)
    stats = collector.stats()
    collector.shutdown()
    assert [(d["action"], d["reason"], d["workers"]) for d in stats["autoscale/decisions"]] == \
        [("add", "learner_wait", (1,))]
    assert stats["autoscale/collectors"] == 2 and stats["frames"] == 12 * 12
    assert all(b.numel() == 12 for b in batches)
    if sync:  # the new node's rollouts and the first's shrink to half: (1, 12), then (2, 6)
        added = stats["autoscale/decisions"][0]["batch"]
        assert [tuple(b.shape) for b in batches] == [(1, 12)] * added + [(2, 6)] * (12 - added)
    check_trajectories(batches, 12 * 12)


@pytest.mark.parametrize("collector_class, sync", [(DistributedCollector, True), (RPCCollector, False)])
def test_a_slow_learner_lets_a_node_go(collector_class, sync):
    collector = collector_class([counting_env_7] * 2, weight_policy(1.0), launcher="mp", tcp_port=free_port_block(3),
                                frames_per_batch=12, total_frames=12 * 12, sync=sync,
                                autoscale=Autoscale(1, 2, **LENIENT))
    batches = collect(collector, work_s=0.1)
    stats = collector.stats()
    collector.shutdown()
    reason = "learner_wait" if sync else "worker_idle"
    assert [(d["action"], d["reason"], d["workers"]) for d in stats["autoscale/decisions"]] == \
        [("remove", reason, (1,))]
    assert collector.active_workers == [0] and all(b.numel() == 12 for b in batches)
    check_trajectories(batches, 12 * 12)


@pytest.mark.usefixtures("zygote")
def test_external_nodes_are_asked_of_on_scale_and_removed_by_the_collector():
    nodes: list[fresh.FreshProcess] = []  # the join command, forked from the session's zygote (tests/fresh.py)
    asked: list[int] = []

    def start_nodes(wanted: int, join_command: list[str]) -> None:
        asked.append(wanted)
        running = [node for node in nodes if node.poll() is None]
        nodes.extend(fresh.popen(join_command) for _ in range(wanted - len(running)))

    collector = DistributedCollector([slow_env], weight_policy(1.0), launcher="external", tcp_port=0,
                                     bind_address="127.0.0.1", frames_per_batch=12, total_frames=-1, sync=True,
                                     autoscale=Autoscale(1, 2, on_scale=start_nodes, **LENIENT))
    try:
        start_nodes(1, collector.join_command())
        batches, deadline = [], time.monotonic() + 120
        for batch in collector:  # the learner starves until the second node joined
            batches.append(batch.clone())
            if collector.active_workers == [0, 1] and batches[-1].shape[0] == 2 or time.monotonic() > deadline:
                break
        assert asked[:2] == [1, 2] and collector.active_workers == [0, 1]
        assert batches[0].shape == (1, 12) and batches[-1].shape == (2, 6)  # the joined node takes half
        deadline = time.monotonic() + 60
        for batch in collector:  # now a slow learner: the collector removes the newest node itself
            batches.append(batch.clone())
            if collector.active_workers == [0] or time.monotonic() > deadline:
                break
            time.sleep(0.5)  # one node's rollouts (0.12 s) would keep it waiting less than 0.3 of its time
        assert collector.active_workers == [0]
        wait_until(lambda: nodes[1].poll() is not None, 30, "the removed node's exit")
        assert nodes[1].returncode == 0
        decisions = collector.stats()["autoscale/decisions"]
        assert [(d["action"], d["wanted"], d["workers"]) for d in decisions] == [("add", 2, ()), ("remove", 1, (1,))]
        check_trajectories(batches, sum(b.numel() for b in batches))
    finally:
        collector.shutdown()
        for node in nodes:
            try:
                node.wait(60)
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait(30)
    assert [node.returncode for node in nodes] == [0, 0]


def test_a_launcher_that_cannot_start_nodes_is_refused_at_construction():
    with pytest.raises(ValueError, match="launcher='submitit_delayed'"):
        DistributedCollector([counting_env_7], launcher="submitit_delayed", authkey=os.urandom(16),
                             frames_per_batch=4, autoscale=Autoscale(1, 2))
    with pytest.raises(ValueError, match="on_scale"):
        DistributedCollector([counting_env_7], launcher="external", tcp_port=0, bind_address="127.0.0.1",
                             frames_per_batch=4, autoscale=Autoscale(1, 2))
    with pytest.raises(ValueError, match="launcher='external'"):
        RPCCollector([counting_env_7], launcher="external", frames_per_batch=4, autoscale=Autoscale(1, 2))
    with pytest.raises(ValueError, match="collector_class"):
        DistributedCollector([counting_env_7], launcher="mp", collector_class="sync", frames_per_batch=4, sync=True,
                             autoscale=Autoscale(1, 2))
