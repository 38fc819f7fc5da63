"""After ``shutdown()`` a collector holds nothing it opened: no descriptor (pipe, socket, shared-memory
segment) and no listening port, while the user still references it and after it is dropped
(tests/held.py; the collectors with nodes are tests/collectors/distributed/test_nothing_left_open.py).
"""

from __future__ import annotations

import functools

import pytest
from held import Held, held, held_since, start_process_state
from mocks import weight_policy

from rlharvest.collectors import AsyncBatchedCollector, Collector, MultiAsyncCollector, MultiSyncCollector
from rlharvest.envs import CountingEnv

pytestmark = pytest.mark.timeout(120)

NOTHING = Held({}, set())
ENVS = [functools.partial(CountingEnv, max_steps=5)] * 2
COLLECTORS = {
    "Collector": lambda: Collector(ENVS[0], weight_policy(), frames_per_batch=4, total_frames=8),
    "MultiSyncCollector": lambda: MultiSyncCollector(ENVS, weight_policy(), frames_per_batch=4, total_frames=8),
    "MultiAsyncCollector": lambda: MultiAsyncCollector(ENVS, weight_policy(), frames_per_batch=4, total_frames=8),
    "AsyncBatchedCollector": lambda: AsyncBatchedCollector(ENVS, policy=weight_policy(), frames_per_batch=4,
                                                           total_frames=8),
}


@pytest.mark.parametrize("name", list(COLLECTORS))
def test_a_collector_shut_down_holds_nothing(name):
    start_process_state()
    before = held()
    for _ in range(2):  # and a second one as the first
        collector = COLLECTORS[name]()
        assert sum(batch.numel() for batch in collector) == 8
        collector.update_policy_weights_(weight_policy(2.0))
        collector.shutdown()
        assert held_since(before) == NOTHING  # still referenced
        del collector
        assert held_since(before) == NOTHING
