"""Nodes that fail are replaced (docs/restarts.md): DistributedCollector, DistributedSyncCollector and
RPCCollector with launcher="mp" and 2 nodes, a node killed mid-batch or raising."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from mocks import check_counting_batches, fail_once_envs, weight_policy

from rlharvest.collectors.distributed import DistributedCollector, DistributedSyncCollector, RPCCollector
from rlharvest.envs import CountingEnv
from rlharvest.transport.ports import free_port_block

pytestmark = pytest.mark.timeout(120)


def make(collector_class, envs, **kwargs):
    kwargs.setdefault("launcher", "mp")
    kwargs.setdefault("tcp_port", free_port_block(3))
    return collector_class(envs, kwargs.pop("policy", weight_policy(1.0)), **kwargs)


@pytest.mark.parametrize("sync", [True, False])
@pytest.mark.parametrize("collector_class", [DistributedCollector, RPCCollector])
def test_a_node_killed_mid_batch_is_replaced(tmp_path, collector_class, sync):
    marker = tmp_path / "fired"
    with make(collector_class, fail_once_envs(marker, at_step=9, mode="kill"), frames_per_batch=8,
              total_frames=-1, sync=sync, max_worker_restarts=1) as collector:
        batches = []
        # async: the other node may serve many batches before the dead one is noticed; go on until the
        # restart happened (bounded: the death is noticed within the liveness interval) and a bit more
        while collector.stats()["restarts"] == 0 and len(batches) < 2000:
            batches.append(collector.next().clone())
        batches += [collector.next().clone() for _ in range(4)]
        causes = collector._fleet.restarts.causes
        stats = collector.stats()
    assert marker.exists()
    check_counting_batches(batches, 8, 8 * len(batches))
    assert [(c.worker, c.kind) for c in causes] == [(1, "died")] and "node" in causes[0].message
    assert stats["restarts"] == 1 and stats["worker_1/restarts"] == 1


def test_a_raising_node_env_is_survived_by_the_sync_collector(tmp_path):
    with make(DistributedSyncCollector, fail_once_envs(tmp_path / "fired", at_step=9, mode="raise"),
              frames_per_batch=8, total_frames=64, max_worker_restarts=1) as collector:
        batches = [batch.clone() for batch in collector]
        causes = collector._fleet.restarts.causes
    check_counting_batches(batches, 8, 64)
    assert [(c.worker, c.kind) for c in causes] == [(1, "exception")] and "FailOnceEnv" in causes[0].traceback


def test_a_replaced_node_runs_the_current_weights_with_fresh_ids():
    policy = weight_policy(1.0)
    with make(DistributedCollector, [lambda: CountingEnv(max_steps=50)] * 2, policy=policy, frames_per_batch=8,
              total_frames=-1, sync=True, max_worker_restarts=1) as collector:
        before = collector.next()
        with torch.no_grad():
            policy.module.weight.fill_(0.0)
        collector.update_policy_weights_()
        os.kill(collector._launched[1].process.pid, signal.SIGKILL)
        after = [collector.next() for _ in range(3)]
        assert collector.stats()["restarts"] == 1
    assert all((batch["action"] == 0).all() for batch in after)
    old_ids = set(before[("collector", "traj_ids")].flatten().tolist())
    new_ids = set(after[-1][("collector", "traj_ids")][1].tolist())
    assert not old_ids & new_ids  # the replacement's trajectories have ids never handed out


@pytest.mark.parametrize("collector_class", [DistributedCollector, RPCCollector])
def test_a_replaced_node_stamps_its_frames_with_the_current_version(collector_class):
    with make(collector_class, [lambda: CountingEnv(max_steps=50)] * 2, frames_per_batch=8, total_frames=-1,
              sync=True, max_worker_restarts=1, track_policy_version=True) as collector:
        assert collector.next()["policy_version"].flatten().tolist() == [0] * 8
        collector.update_policy_weights_()
        collector.update_policy_weights_()
        os.kill(collector._launched[1].process.pid, signal.SIGKILL)
        batches = [collector.next() for _ in range(3)]
        stats = collector.stats()
    assert stats["restarts"] == 1 and stats["policy_version"] == 2 and stats["policy_lag"] == 0
    assert all(batch["policy_version"].flatten().tolist() == [2] * 8 for batch in batches)


def test_free_running_nodes_stamp_versions_the_main_process_counts():
    with make(DistributedSyncCollector, [lambda: CountingEnv(max_steps=50)] * 2, frames_per_batch=8,
              total_frames=-1, max_worker_restarts=1, track_policy_version=True) as collector:
        collector.next()
        os.kill(collector._launched[1].process.pid, signal.SIGKILL)
        batches = [collector.next() for _ in range(4)]
        stats = collector.stats()
    assert stats["restarts"] == 1
    last = batches[-1]["policy_version"]
    assert 0 < int(last.min()) <= int(last.max()) <= stats["policy_version"]
    assert stats["policy_lag"] == stats["policy_version"] - int(last.min())
