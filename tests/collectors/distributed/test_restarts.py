"""Nodes that fail are replaced (docs/restarts.md): DistributedCollector, DistributedSyncCollector and
RPCCollector with launcher="mp" and 2 nodes, a node killed mid-batch or raising."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from mocks import check_counting_batches, echo_weight_policy, fail_once_envs, wait_until, weight_policy
from process_check import process_gone

from rlharvest.collectors.distributed import DistributedCollector, DistributedSyncCollector, RPCCollector
from rlharvest.data import ReplayBuffer
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
        causes = collector.restart_causes
        stats = collector.stats()
    assert marker.exists()
    check_counting_batches(batches, 8, 8 * len(batches))
    assert [(c.worker, c.kind) for c in causes] == [(1, "died")] and "node" in causes[0].message
    assert stats["restarts"] == 1 and stats["worker_1/restarts"] == 1


def test_a_raising_node_env_is_survived_by_the_sync_collector(tmp_path):
    with make(DistributedSyncCollector, fail_once_envs(tmp_path / "fired", at_step=9, mode="raise"),
              frames_per_batch=8, total_frames=64, max_worker_restarts=1) as collector:
        batches = [batch.clone() for batch in collector]
        causes = collector.restart_causes
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
        os.kill(collector.worker_pids()[1], signal.SIGKILL)
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
        os.kill(collector.worker_pids()[1], signal.SIGKILL)
        batches = [collector.next() for _ in range(3)]
        stats = collector.stats()
    assert stats["restarts"] == 1 and stats["policy_version"] == 2 and stats["policy_lag"] == 0
    assert all(batch["policy_version"].flatten().tolist() == [2] * 8 for batch in batches)


def test_free_running_nodes_stamp_versions_the_main_process_counts():
    with make(DistributedSyncCollector, [lambda: CountingEnv(max_steps=50)] * 2, frames_per_batch=8,
              total_frames=-1, max_worker_restarts=1, track_policy_version=True) as collector:
        collector.next()
        os.kill(collector.worker_pids()[1], signal.SIGKILL)
        batches = [collector.next() for _ in range(4)]
        stats = collector.stats()
    assert stats["restarts"] == 1
    last = batches[-1]["policy_version"]
    assert 0 < int(last.min()) <= int(last.max()) <= stats["policy_version"]
    assert stats["policy_lag"] == stats["policy_version"] - int(last.min())


def check_buffer_frames(frames) -> dict:
    """Frames of a replay buffer written by free-running nodes: none twice, and within each trajectory
    CountingEnv observations step by exactly 1 (nothing lost in the middle). ``{traj_id: [obs]}``."""
    pairs = list(zip(frames[("collector", "traj_ids")].tolist(), frames["observation"].flatten().tolist()))
    assert len(set(pairs)) == len(pairs), "a frame was written twice"
    trajectories: dict[int, list[int]] = {}
    for traj, obs in pairs:
        trajectories.setdefault(traj, []).append(obs)
    for traj, values in trajectories.items():
        values.sort()
        assert all(b - a == 1 for a, b in zip(values, values[1:])), f"trajectory {traj} skips: {values}"
    return trajectories


def started_free_running():
    """Two nodes running free into a replay buffer (restarts allowed), once they wrote some frames."""
    policy = echo_weight_policy(1.0)
    buffer = ReplayBuffer(capacity=100_000)
    collector = make(DistributedCollector, [lambda: CountingEnv(max_steps=50)] * 2, policy=policy, frames_per_batch=8,
                     total_frames=-1, replay_buffer=buffer, max_worker_restarts=1, track_policy_version=True)
    try:
        collector.start()
        wait_until(lambda: buffer.write_count >= 64, what="frames in the buffer")
    except BaseException:
        collector.async_shutdown()
        raise
    return policy, buffer, collector


def test_an_update_meeting_a_dead_free_running_node_counts_and_reaches_its_replacement():
    policy, buffer, collector = started_free_running()
    try:
        victim = collector.worker_pids()[1]
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: process_gone(victim), timeout=10.0, what="the killed node's exit")
        with torch.no_grad():
            policy.module.weight.fill_(3.0)
        collector.update_policy_weights_()  # the dead node's acknowledgement never comes, or it was replaced
        assert collector.policy_version == 1
        wait_until(lambda: collector.stats()["restarts"] == 1, what="the restart")
        written = buffer.write_count
        wait_until(lambda: buffer.write_count >= written + 400, what="frames after the restart")
    finally:
        collector.async_shutdown()
    frames = buffer[:]
    check_buffer_frames(frames)
    last = frames[-100:]
    node1 = last[("collector", "traj_ids")] % 2 == 1
    assert node1.any() and (last["policy_weight"].flatten()[node1] == 3.0).all()
    assert (last["policy_version"].flatten() == 1).all()


def test_a_free_running_node_killed_is_replaced_with_the_current_weights():
    policy, buffer, collector = started_free_running()
    try:
        with torch.no_grad():
            policy.module.weight.fill_(3.0)
        collector.update_policy_weights_()
        victim = collector.worker_pids()[1]
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: collector.stats()["restarts"] == 1, what="the restart")
        written = buffer.write_count
        wait_until(lambda: buffer.write_count >= written + 200, what="frames after the restart")
        replacement = collector.worker_pids()[1]
        causes = collector.restart_causes
    finally:
        collector.async_shutdown()
    frames = buffer[:]
    trajectories = check_buffer_frames(frames)
    assert [(c.worker, c.kind) for c in causes] == [(1, "died")]
    assert replacement != victim and process_gone(replacement)
    # node 1's trajectories (id k * 2 + 1) after the restart: the replacement's, with the current
    # weights and version from its first frame on, under ids node 1 never used before
    ids, weights = frames[("collector", "traj_ids")], frames["policy_weight"].flatten()
    versions = frames["policy_version"].flatten()
    late = slice(written, None)
    node1 = ids[late] % 2 == 1
    new_ids = set(ids[late][node1].tolist()) - set(ids[:written].tolist())
    assert new_ids, "no frame of the replacement after the restart"
    fresh = torch.tensor([i in new_ids for i in ids.tolist()])
    assert (weights[fresh] == 3.0).all() and (versions[fresh] == 1).all()
    assert all(len(trajectories[i]) >= 1 for i in new_ids)
