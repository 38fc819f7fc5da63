"""Every action after ``update_policy_weights_()`` returned uses the new weights, and records their
version; no action runs on half-swapped weights (docs/weights.md, "When a node takes an update").

Nodes running free (``sync=False``) and idle between batches (``sync=True``) take an update announced
as a shared-memory generation in their weight channel's reader thread, under the policy's lock; the
acknowledgement, which ``update_policy_weights_()`` waits for, leaves after the swap."""

from __future__ import annotations

import time

import pytest
import torch
from mocks import StampedPolicy

from rlharvest.collectors.distributed import DistributedCollector
from rlharvest.envs import CountingEnv
from rlharvest.transport.ports import free_port_block

pytestmark = pytest.mark.timeout(180)


def _counting():
    return CountingEnv(max_steps=100)


@pytest.mark.parametrize("sync", [False, True])
def test_every_action_after_the_update_uses_the_new_weights(sync):
    policy = StampedPolicy(0.0)
    with DistributedCollector([_counting] * 2, policy, frames_per_batch=40, total_frames=-1, sync=sync,
                              launcher="mp", tcp_port=free_port_block(3), track_policy_version=True) as collector:
        batches = iter(collector)
        next(batches)
        checked = 0
        for k in range(1, 16):
            with torch.no_grad():
                policy.a.fill_(float(k))
                policy.b.fill_(float(k))
            collector.update_policy_weights_()
            returned = time.monotonic()
            version = collector.policy_version
            for _ in range(2):
                batch = next(batches)
                a, b = batch["action"].reshape(-1), batch["b"].reshape(-1)
                stamps, versions = batch["stamp"].reshape(-1), batch["policy_version"].reshape(-1)
                assert (a == b).all(), "an action ran on half-swapped weights"
                after = stamps > returned
                assert (a[after] == k).all(), f"update {k}: an action after the update used old weights"
                assert (versions[after] == version).all(), f"update {k}: an action after it recorded an old version"
                # every action records the version of the weights it used
                assert (versions[a == k] == version).all() and (a[versions == version] == k).all()
                checked += int(after.sum())
        assert checked > 0
