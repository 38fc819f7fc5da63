"""A weight update that meets a dead worker, on every scheme kind (docs/restarts.md, "What the
replacement gets"): the update counts as done (the version moves once), the survivors run it, the
dead worker is replaced and its replacement starts with those weights and that version."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from mocks import check_counting_batches, echo_weight_policy, wait_until
from process_check import process_gone

from rlharvest.collectors import MultiAsyncCollector, MultiSyncCollector
from rlharvest.collectors.distributed import DistributedCollector, RPCCollector
from rlharvest.envs import CountingEnv
from rlharvest.transport.ports import free_port_block
from rlharvest.weight_update import (DistributedWeightSyncScheme, MultiProcessWeightSyncScheme, RPCWeightSyncScheme,
                                     SharedMemWeightSyncScheme)

pytestmark = pytest.mark.timeout(120)

_IDS = ("collector", "traj_ids")
CASES = {
    "shared_mem-sync": (MultiSyncCollector, SharedMemWeightSyncScheme),
    "shared_mem-async": (MultiAsyncCollector, SharedMemWeightSyncScheme),
    "multiprocess-sync": (MultiSyncCollector, MultiProcessWeightSyncScheme),
    "multiprocess-async": (MultiAsyncCollector, MultiProcessWeightSyncScheme),
    "distributed": (DistributedCollector, DistributedWeightSyncScheme),
    "rpc": (RPCCollector, RPCWeightSyncScheme),
}


def make(case: str, policy):
    collector_class, scheme_class = CASES[case]
    kwargs = dict(frames_per_batch=8, total_frames=-1, max_worker_restarts=1, track_policy_version=True,
                  weight_sync_schemes={"policy": scheme_class()})
    if collector_class in (DistributedCollector, RPCCollector):
        kwargs.update(launcher="mp", tcp_port=free_port_block(3), sync=True)
    # worker 1 counts from 1000: its frames (and its replacement's) are told apart by their observations
    envs = [lambda: CountingEnv(max_steps=50), lambda: CountingEnv(max_steps=1050, start_val=1000)]
    return collector_class(envs, policy, **kwargs)


@pytest.mark.parametrize("case", list(CASES))
def test_an_update_meeting_a_dead_worker_counts_and_reaches_the_replacement(case):
    policy = echo_weight_policy(1.0)
    collector = make(case, policy)
    try:
        batches = [collector.next().clone() for _ in range(2)]
        victim = collector.worker_pids()[1]
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: process_gone(victim), timeout=10.0, what="the killed worker's exit")
        with torch.no_grad():
            policy.module.weight.fill_(3.0)
        collector.update_policy_weights_()  # the dead worker never acknowledges: it is replaced
        stats = collector.stats()
        assert stats["restarts"] == 1 and collector.policy_version == 1
        assert [(c.worker, c.kind) for c in collector.restart_causes] == [(1, "died")]
        old_ids = {i for batch in batches for i in batch[_IDS].flatten().tolist()}
        after = []
        while not any(replacement_frames(batch, old_ids).any() for batch in after) and len(after) < 40:
            after.append(collector.next().clone())  # async: the survivor may serve the first ones
        after += [collector.next().clone() for _ in range(4)]
    finally:
        collector.shutdown()
    # the frames stay whole and unique, trajectories step by 1 (an async collector's batches come
    # from one worker each: 8 frames, like a sync batch of 2 x 4)
    check_counting_batches(batches + after, 8, 8 * len(batches + after))
    for batch in after:  # the replacement ran the new weights and version from its first frame on
        fresh = replacement_frames(batch, old_ids)
        weights, versions = batch["policy_weight"].reshape(fresh.shape), batch["policy_version"].reshape(fresh.shape)
        assert (weights[fresh] == 3.0).all() and (versions[fresh] == 1).all()
    assert any(replacement_frames(batch, old_ids).any() for batch in after), "no frame of the replacement"
    # the survivor too, once past the batch it had in flight during the update (async: served after
    # the replacement's first, docs/collection.md, "A batch")
    for batch in after[-3:]:
        assert (batch["policy_weight"] == 3.0).all() and (batch["policy_version"] == 1).all()


def replacement_frames(batch, old_ids: set):
    """Frames of worker 1 (observations from 1000 on) in trajectories that started after the restart."""
    ids = batch[_IDS]
    new = torch.tensor([i not in old_ids for i in ids.flatten().tolist()]).reshape(ids.shape)
    return (batch["observation"].reshape(ids.shape) >= 1000) & new
