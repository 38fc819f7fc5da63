"""Nodes, like worker processes, run under SCHED_BATCH: they must not preempt the learner on wake-up."""

from __future__ import annotations

import os

import pytest
from mocks import SchedulingProbeEnv

from rlharvest.collectors.distributed import DistributedCollector, RPCCollector
from rlharvest.transport.ports import free_port_block

pytestmark = pytest.mark.timeout(120)

COLLECTORS = [DistributedCollector, RPCCollector]


def make(collector_class, **kwargs):
    return collector_class([SchedulingProbeEnv] * 2, None, launcher="mp", tcp_port=free_port_block(3),
                           frames_per_batch=20, total_frames=-1, **kwargs)


@pytest.mark.parametrize("collector_class", COLLECTORS)
def test_nodes_run_under_sched_batch(collector_class):
    with make(collector_class) as collector:
        assert next(iter(collector)).numel() == 20
        # asked from inside each node: the thread that serves the env (an RPC thread for RPC nodes)
        policies = [collector.cascade_execute(f"workers[{i}].env.scheduling_policy") for i in (0, 1)]
        assert policies == [os.SCHED_BATCH] * 2


@pytest.mark.parametrize("collector_class", COLLECTORS)
def test_bad_worker_scheduling_value_fails_before_any_node_starts(collector_class, monkeypatch):
    monkeypatch.setenv("RLHARVEST_WORKER_SCHED", "realtime")
    with pytest.raises(ValueError, match=r"RLHARVEST_WORKER_SCHED must be one of \('batch', 'normal'\)"):
        make(collector_class)
