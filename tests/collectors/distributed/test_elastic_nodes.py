"""Nodes that join and leave a running collection (docs/elastic.md): ``remove_collectors`` on
DistributedCollector, DistributedSyncCollector and RPCCollector, ``add_collectors`` on
DistributedCollector and RPCCollector, with launcher="mp"."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import torch
from mocks import SlowCountingEnv, check_trajectories, counting_env_7 as counting_env, wait_until, weight_policy
from process_check import process_gone

from rlharvest.collectors.distributed import DistributedCollector, DistributedSyncCollector, RPCCollector
from rlharvest.transport.mp import MPBackend, mp_context
from rlharvest.transport.ports import free_port_block
from rlharvest.transport.torchdist import TorchDistBackend
from rlharvest.worker import run_worker
from rlharvest.worker.nodes import node_main
from rlharvest.collectors.engine import engine_of

pytestmark = pytest.mark.timeout(150)

IDS = ("collector", "traj_ids")


def make(collector_class, count: int, **kwargs):
    return collector_class([counting_env] * count, weight_policy(1.0), launcher="mp", tcp_port=free_port_block(3),
                           **kwargs)


@pytest.mark.parametrize("sync", [True, False])
@pytest.mark.parametrize("collector_class", [DistributedCollector, RPCCollector])
def test_a_node_leaves_and_the_others_keep_their_indices(collector_class, sync):
    collector = make(collector_class, 3, frames_per_batch=12 if sync else 4, total_frames=96 if sync else 64, sync=sync)
    batches, timings = [], []
    for batch in collector:
        batches.append(batch.clone())
        if len(batches) == 2:
            node = collector.worker_pids()[1]
            start = time.perf_counter()
            collector.remove_collectors([1])
            timings.append(time.perf_counter() - start)
            assert process_gone(node)
            assert collector.active_workers == [0, 2]
            stats = collector.stats()
            assert (stats["workers"], stats["workers_alive"]) == (2, 2)
            collector.update_policy_weights_()  # the weights go to the nodes still there
    collector.shutdown()
    if sync:
        assert [tuple(b.shape) for b in batches] == [(3, 4)] * 2 + [(2, 4)] * 9
    check_trajectories(batches, 96 if sync else 64)
    print(f"{collector_class.__name__} sync={sync}: remove_collectors took {timings[0]:.3f} s")


def test_a_free_running_node_is_paused_before_it_leaves():
    collector = make(DistributedSyncCollector, 2, frames_per_batch=8, total_frames=64)
    batches = []
    for batch in collector:
        batches.append(batch.clone())
        if len(batches) == 2:
            collector.remove_collectors(0)
            assert collector.active_workers == [1] and collector.requested_frames_per_batch == 4
    collector.shutdown()
    assert [b.numel() for b in batches] == [8, 8] + [4] * 12
    check_trajectories(batches, 64)


def test_a_free_running_collector_grows_by_the_new_nodes_share():
    collector = make(DistributedSyncCollector, 2, frames_per_batch=8, total_frames=64)
    batches = []
    for batch in collector:
        batches.append(batch.clone())
        if len(batches) == 2:
            collector.add_collectors([counting_env])
            assert collector.active_workers == [0, 1, 2] and collector.requested_frames_per_batch == 12
    pids = [pid for pid in collector.worker_pids() if pid is not None]
    collector.shutdown()
    assert [b.numel() for b in batches] == [8, 8] + [12] * 4
    check_trajectories(batches, 64)  # the new node's ids were never used: a shared id would break the count
    assert len(pids) == 3 and not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                                      for pid in pids)


# ---------------------------------------------------------------------------------- nodes that join
def set_weight(policy, value: float) -> None:
    with torch.no_grad():
        policy.module.weight.fill_(value)


@pytest.mark.parametrize("sync", [True, False])
@pytest.mark.parametrize("collector_class", [DistributedCollector, RPCCollector])
def test_a_node_joins_on_the_current_weights_with_fresh_ids(collector_class, sync):
    policy = weight_policy(1.0)
    collector = collector_class([counting_env] * 2, policy, launcher="mp", tcp_port=free_port_block(3),
                                frames_per_batch=8 if sync else 4, total_frames=52 if sync else 40, sync=sync)
    batches, timings, ids_before = [], [], set()
    for batch in collector:
        batches.append(batch.clone())
        if len(batches) == 2:
            ids_before = set(torch.cat([b.get(IDS).flatten() for b in batches]).tolist())
            if sync:  # async: the other nodes' rollouts in flight run the former weights
                set_weight(policy, 2.0)
                collector.update_policy_weights_()
            start = time.perf_counter()
            collector.add_collectors([counting_env])
            timings.append(time.perf_counter() - start)
            assert collector.active_workers == [0, 1, 2]
            assert collector.requested_frames_per_batch == (12 if sync else 4)
            assert collector.stats()["workers"] == 3
    pids = [pid for pid in collector.worker_pids() if pid is not None]
    collector.shutdown()
    after = batches[2:]
    if sync:
        assert [tuple(b.shape) for b in batches] == [(2, 4)] * 2 + [(3, 4)] * 3
        check_trajectories(after, 36, step=2)  # every frame after the update ran the new weights
        assert not set(after[0][2].get(IDS).tolist()) & ids_before  # the new node's ids were never used
    else:
        check_trajectories(batches, 40)  # two nodes sharing an id would break the count
    assert len(pids) == 3 and not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                                      for pid in pids)
    print(f"{collector_class.__name__} sync={sync}: add_collectors took {timings[0]:.3f} s")


def test_torchdist_nodes_grow_where_a_node_can_be_replaced():
    def backend(launcher, kind="gloo"):
        return TorchDistBackend(1, node_main, None, launcher=launcher, backend=kind)

    assert backend("mp").growable and backend("submitit").growable
    assert not backend("submitit_delayed").growable and not backend("mp", "mpi").growable
    with pytest.raises(NotImplementedError, match="cannot add workers"):
        backend("submitit_delayed").grow(1)


def test_a_backend_says_whether_a_node_can_be_started_again():
    """The fleet asks the backend (``replaceable``), not its launcher's name, whether a preempted node is
    replaced: nodes started elsewhere (``submitit_delayed``) only leave."""
    def backend(launcher):
        return TorchDistBackend(1, node_main, None, launcher=launcher)

    assert backend("mp").replaceable and backend("submitit").replaceable and backend("external").replaceable
    assert not backend("submitit_delayed").replaceable
    assert MPBackend(1, run_worker, mp_context(None)).replaceable


# ---------------------------------------------------------------------------------- preemption (SIGTERM)
def test_a_preempted_node_is_replaced_through_its_launcher_without_spending_a_restart():
    collector = make(DistributedCollector, 2, frames_per_batch=8, total_frames=80, sync=True, max_worker_restarts=1,
                     preemption_grace=2.0)
    batches = []
    for batch in collector:
        batches.append(batch.clone())
        if len(batches) == 2:
            node = collector.worker_pids()[1]
            os.kill(node, signal.SIGTERM)
            wait_until(lambda: process_gone(node), 30.0, "the preempted node's exit")
    stats = collector.stats()
    collector.shutdown()
    assert (stats["preemptions"], stats["restarts"], stats["workers"]) == (1, 0, 2)
    assert stats["worker_1/restart_causes"].startswith("preempted: ")
    assert [tuple(b.shape) for b in batches] == [(2, 4)] * 10
    check_trajectories(batches, 80)


def test_a_preempted_node_without_restarts_leaves_the_others_collecting():
    collector = make(DistributedCollector, 2, frames_per_batch=8, total_frames=160, sync=False)
    batches = []
    for batch in collector:
        batches.append(batch.clone())
        if len(batches) == 2:
            # its batch in flight is delivered (the node waits until it is taken), then it leaves
            os.kill(engine_of(collector).backend.launched[0].process.pid, signal.SIGTERM)
    stats = collector.stats()
    collector.shutdown()
    assert (stats["preemptions"], stats["workers"]) == (1, 1)
    check_trajectories(batches, 160)



def test_a_preempted_free_running_node_is_replaced():
    collector = make(DistributedSyncCollector, 2, frames_per_batch=8, total_frames=80, max_worker_restarts=1,
                     preemption_grace=2.0)
    batches = []
    for batch in collector:
        batches.append(batch.clone())
        if len(batches) == 2:
            os.kill(engine_of(collector).backend.launched[1].process.pid, signal.SIGTERM)
    stats = collector.stats()
    collector.shutdown()
    assert (stats["preemptions"], stats["restarts"], stats["workers"]) == (1, 0, 2)
    assert all(b.numel() == 8 for b in batches)
    check_trajectories(batches, 80)


# ---------------------------------------------------------------------------------- preemption of RPC nodes
@pytest.mark.parametrize("sync", [True, False])
def test_a_preempted_rpc_node_is_replaced_without_spending_a_restart(sync):
    total = 80 if sync else 60
    collector = make(RPCCollector, 2, frames_per_batch=8 if sync else 4, total_frames=total, sync=sync,
                     max_worker_restarts=1, preemption_grace=2.0)
    batches = []
    for batch in collector:
        batches.append(batch.clone())
        if len(batches) == 2:
            pid = collector.worker_pids()[1]
            os.kill(pid, signal.SIGTERM)  # it leaves by itself, whether the collector listens or not
            wait_until(lambda: process_gone(pid), 30.0, "the preempted node's exit")
    stats = collector.stats()
    causes = collector.restart_causes
    collector.shutdown()
    assert (stats["preemptions"], stats["restarts"], stats["workers"]) == (1, 0, 2)
    assert [cause.kind for cause in causes] == ["preempted"]
    assert stats["worker_1/restart_causes"].startswith("preempted: ")
    if sync:
        assert [tuple(b.shape) for b in batches] == [(2, 4)] * 10
    check_trajectories(batches, total)


def test_a_preempted_rpc_node_without_restarts_leaves_the_others_collecting():
    collector = make(RPCCollector, 2, frames_per_batch=8, total_frames=160, sync=False, preemption_grace=2.0)
    batches = []
    for batch in collector:
        batches.append(batch.clone())
        if len(batches) == 2:
            os.kill(collector.worker_pids()[0], signal.SIGTERM)  # its rollout in flight finishes, then it leaves
    stats = collector.stats()
    collector.shutdown()
    assert (stats["preemptions"], stats["restarts"], stats["workers"], stats["workers_removed"]) == (1, 0, 1, 1)
    check_trajectories(batches, 160)


def slow_env():
    return SlowCountingEnv(max_steps=7, delay=0.05)


def test_an_rpc_node_preempted_mid_rollout_hands_it_back_and_its_replacement_collects_it():
    collector = RPCCollector([slow_env] * 2, weight_policy(1.0), launcher="mp", tcp_port=free_port_block(3),
                             frames_per_batch=40, total_frames=240, sync=False, max_worker_restarts=1,
                             preemption_grace=0.1)
    batches = []
    for batch in collector:
        batches.append(batch.clone())
        if len(batches) == 2:
            # the node of the first batch was asked for its next one when iteration resumed: 2 s of
            # rollout, far beyond its grace period, so it hands it back (no partial batch travels),
            # unless the request has not reached it yet (then it leaves with nothing in flight)
            first = int(batches[0].get(IDS).flatten()[0]) % 2  # node i's trajectory ids are i modulo 2
            os.kill(collector.worker_pids()[first], signal.SIGTERM)
    stats = collector.stats()
    collector.shutdown()
    assert (stats["preemptions"], stats["restarts"], stats["workers"]) == (1, 0, 2)
    print(stats[f"worker_{first}/restart_causes"])
    assert all(b.numel() == 40 for b in batches)
    check_trajectories(batches, 240)
