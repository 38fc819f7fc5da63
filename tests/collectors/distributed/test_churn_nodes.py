"""Churn on nodes and actors (docs/elastic.md, "Churn"): DistributedCollector (sync and async,
``launcher="mp"``), RPCCollector and RayCollector (``-m ray``) while weights are updated every few
batches and nodes are SIGKILLed, preempted (SIGTERM), added and removed at random, seeded. Nothing is
lost, doubled or torn, ``total_frames`` is exact, and nothing is held for a departed node.

The helpers are in ``tests/churn.py``; worker processes are in ``tests/collectors/test_churn.py``.
"""

from __future__ import annotations

import os

import pytest
from churn import Churn, FrameCheck, churn_frames, drive, leftovers, open_fds, resources, start_process_state
from mocks import counting_env_7, echo_weight_policy

from rlharvest.collectors.distributed import DistributedCollector, RayCollector, RPCCollector
from rlharvest.transport.ports import free_port_block

SHARE = 8  # frames of one node's rollout


def check_report(collector, report, check, total: int | None, generations: int = 1) -> None:
    """Frames exact, every signal met as what it was, and nothing growing: with as many nodes, as
    many descriptors and mappings after the last event as after the first few, but for up to
    ``generations`` more weight generations (a sender's pool holds the generations in use plus one,
    and grows to that as nodes lag behind; each is a named segment and its descriptor, mapped twice)
    and two descriptors of the transport's own (a connection of the weights' channel being replaced)."""
    if total is not None:
        assert check.frames == total  # exact, through every change of membership
    causes = [cause.kind for cause in collector.restart_causes]
    assert causes.count("preempted") == report.events.count("term"), (causes, report.events)
    assert len(causes) == report.events.count("kill") + report.events.count("term"), (causes, report.events)
    warm, end = report.warm, report.end
    assert end["fds"] <= warm["fds"] + 2 + 2 * generations, (warm, end, report.events, report.new_fds)
    assert end["shm_files"] <= warm["shm_files"] + generations, (warm, end, report.new_fds)
    assert end["shm_bytes"] <= warm["shm_bytes"] + 2 * generations * 4096, (warm, end, report.new_fds)


def make_nodes(collector_class, count: int = 2, **kwargs):
    return collector_class([counting_env_7] * count, kwargs.pop("policy", None), launcher="mp",
                           tcp_port=free_port_block(3), **kwargs)


@pytest.mark.timeout(240)
@pytest.mark.filterwarnings("ignore:.*frames remain to total_frames")  # exact at the end: drive() leaves one node
@pytest.mark.parametrize("collector_class,sync", [(DistributedCollector, True), (DistributedCollector, False),
                                                  (RPCCollector, True)])
def test_churn_on_nodes(collector_class, sync):
    events = 10
    start_process_state()
    policy = echo_weight_policy(1.0)
    total = churn_frames(SHARE, events, most=3) if sync else churn_frames(2 * SHARE, events, most=1)
    before = open_fds()
    collector = make_nodes(collector_class, policy=policy, frames_per_batch=2 * SHARE, total_frames=total, sync=sync,
                           max_worker_restarts=100, preemption_grace=2.0)
    try:
        churn = Churn(collector, counting_env_7, seed=1205 + sync)
        check = FrameCheck()
        report = drive(collector, churn, check, policy, events=events, single_at_end=sync)
        check_report(collector, report, check, total)
    finally:
        collector.shutdown()
    assert resources()["children"] == 0
    assert leftovers(before, report) == ([], {})  # a shut-down collector holds nothing, even referenced
    del collector, churn
    assert leftovers(before, report) == ([], {})


@pytest.mark.ray
@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:.*frames remain to total_frames")
@pytest.mark.usefixtures("ray_session")
def test_churn_on_ray_actors(ray_cluster):
    """Asynchronous: actors running free while others leave and join (a synchronous Ray batch losing
    and gaining rows is tests/collectors/distributed/test_ray_elastic.py's and test_ray_grow.py's)."""
    events = 6

    pids: dict[str, int | None] = {}

    def pid_of(collector, worker: int) -> int | None:
        """The process of actor ``worker`` (asked once per actor: its repr names its id); None once dead."""
        actor = collector.remote_collectors[worker]
        if repr(actor) not in pids:
            try:
                pids[repr(actor)] = ray_cluster.get(actor.pid.remote(), timeout=60)
            except ray_cluster.exceptions.RayError:  # signalled, and its end not met yet
                pids[repr(actor)] = None
        return pids[repr(actor)]

    policy = echo_weight_policy(1.0)
    total = churn_frames(2 * SHARE, events, most=1)
    collector = RayCollector([counting_env_7] * 2, policy, frames_per_batch=2 * SHARE, total_frames=total,
                             sync=False, remote_configs={"num_cpus": 0.5}, max_worker_restarts=100, preemption_grace=2.0)
    try:
        churn = Churn(collector, counting_env_7, seed=7, pid_of=pid_of)
        check = FrameCheck()
        report = drive(collector, churn, check, policy, events=events)
        check_report(collector, report, check, total, generations=2)
    finally:
        collector.shutdown()
    # the segments of the weights' channel to actors on this node (the object store's are Ray's)
    assert [name for name in report.shm_seen if os.path.exists(name) and "plasma" not in name] == []


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("zygote")
def test_churn_with_nodes_that_join():
    """``launcher="external"``: every node is a process started here with ``join_command()`` (forked
    from the session's zygote, tests/fresh.py); after each departure (SIGKILL, SIGTERM,
    ``remove_collectors``) a new node joins and takes the empty slot. Endless (how many batches a
    node's joining takes varies: frames are not the budget)."""
    import subprocess
    import sys

    import fresh

    policy = echo_weight_policy(1.0)
    collector = DistributedCollector([counting_env_7] * 2, policy, launcher="external", tcp_port=0,
                                     bind_address="127.0.0.1", frames_per_batch=2 * SHARE, total_frames=-1,
                                     sync=False, max_worker_restarts=100, preemption_grace=2.0)
    argv = [sys.executable, *collector.join_command()[1:]]
    nodes: list[fresh.FreshProcess] = []

    def join(event: str = "") -> None:
        nodes.append(fresh.popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def pid_of(collector, worker: int) -> int | None:
        """A node that joined is not a process the collector can name (it may run anywhere: its pid is
        None), but each of them is one of the processes started here: while every one of those is in a
        slot (none joining), the live ones are the slots' nodes, in some order."""
        live, active = [node for node in nodes if node.poll() is None], collector.active_workers
        return live[active.index(worker)].pid if len(live) == len(active) and worker in active else None

    try:
        join(), join()
        churn = Churn(collector, counting_env_7, seed=22, events=("kill", "term", "remove"), workers=(1, 2),
                      after=join, pid_of=pid_of)
        check = FrameCheck()
        report = drive(collector, churn, check, policy, events=4, warm=1, to_total=False)
        check_report(collector, report, check, None)
        assert collector.stats()["frames"] == check.frames
        # which events are possible depends on when nodes joined (a node is signalled only once every
        # slot has its node): the draws vary, but the first, with both nodes in their slots and every
        # event possible, is a SIGKILL with this seed
        assert report.events[0] == "kill", report.events
    finally:
        collector.shutdown()
        exits = []
        for node in nodes:
            try:
                exits.append(node.wait(60))
            except subprocess.TimeoutExpired:
                node.kill()
                exits.append(node.wait(10))
    # a node exits 0 when the collector removes it, shuts down, or it left on SIGTERM; one that
    # found every slot taken is refused (3)
    assert [code for code in exits if code not in (0, 3)] == [-9] * report.events.count("kill"), exits
