"""Envs reconfigured while nodes run (docs/collection.md, "Reconfiguring running envs"): ``setattr_env``
and ``call_env`` on DistributedCollector (``launcher="mp"``) and RPCCollector, through a node killed and
replaced and a checkpoint. ``TaskEnv`` observes its ``value`` at every step."""

from __future__ import annotations

import os
import signal

import pytest
from mocks import TaskEnv, wait_until, weight_policy
from process_check import process_gone

from rlharvest import WorkerError
from rlharvest.collectors.distributed import DistributedCollector, RPCCollector
from rlharvest.transport.ports import free_port_block

pytestmark = pytest.mark.timeout(240)


def make(collector_class, **kwargs):
    return collector_class([TaskEnv] * 2, weight_policy(1.0), launcher="mp", tcp_port=free_port_block(3),
                           frames_per_batch=8, total_frames=-1, max_worker_restarts=1, **kwargs)


def values(batch) -> set[int]:
    return set(batch["next", "observation"].flatten().tolist())


@pytest.mark.parametrize("collector_class", [DistributedCollector, RPCCollector])
def test_a_node_setting_lasts_through_a_kill_and_a_checkpoint(collector_class):
    with make(collector_class, sync=True) as collector:
        collector.next()
        collector.setattr_env("value", 3)
        collector.setattr_env("value", 5, worker_ids=[1])
        assert values(collector.next()) == {3, 5}
        assert collector.call_env("task", 2) == [6, 10]
        with pytest.raises(WorkerError, match=r"(worker|node) 1: ") as raised:
            collector.call_env("fail", worker_ids=1)
        assert isinstance(raised.value, KeyError)
        pid = collector.worker_pids()[1]
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: process_gone(pid), timeout=10.0, what="node 1's exit")
        wait_until(lambda: collector.next() is not None and collector.stats()["restarts"] == 1, timeout=120.0,
                   what="the replacement")
        assert collector.call_env("task") == [3, 5]
        assert values(collector.next()) == {3, 5}
        state = collector.state_dict(env_state=False)
    with make(collector_class, sync=True) as resumed:
        resumed.load_state_dict(state)
        assert resumed.call_env("task") == [3, 5]
        assert values(resumed.next()) == {3, 5}


def test_free_running_nodes_take_a_setting_and_a_replacement_gets_it():
    with make(DistributedCollector, sync=False) as collector:
        collector.next()
        collector.setattr_env("value", 4)
        assert collector.call_env("task") == [4, 4]
        pid = collector.worker_pids()[0]
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: collector.next() is not None and collector.stats()["restarts"] == 1, timeout=120.0,
                   what="the replacement")
        assert collector.call_env("task") == [4, 4]
        assert collector.getattr_env("value") == 4
