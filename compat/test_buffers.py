"""TorchRL's replay buffers with every collector: iteration writes them, start() fills them."""

from __future__ import annotations

import time

import pytest
from collector_kinds import KINDS, make_collector
from mocks import wait_until
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl_objects import gym_env, q_value_actor

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "distributed_sync"])  # it has no replay_buffer
def test_iteration_writes_every_frame(kind, free_port):
    buffer = ReplayBuffer(storage=LazyTensorStorage(10_000))
    collector = make_collector(kind, gym_env, q_value_actor(), port=free_port, frames_per_batch=40,
                               total_frames=120, replay_buffer=buffer)
    try:
        assert list(collector) == [None] * 3
    finally:
        collector.shutdown()
    assert len(buffer) == 120
    sample = buffer.sample(16)
    assert {"observation", "action", "action_value", ("next", "reward")} <= set(sample.keys(True, True))


@pytest.mark.parametrize("kind", ["collector", "multisync", "multiasync", "distributed", "distributed_async"])
def test_start_fills_the_buffer_and_pause_stops_writes(kind, free_port):
    buffer = ReplayBuffer(storage=LazyTensorStorage(100_000))
    collector = make_collector(kind, gym_env, q_value_actor(), port=free_port, frames_per_batch=40,
                               total_frames=-1, replay_buffer=buffer)
    try:
        collector.start()
        wait_until(lambda: buffer.write_count >= 200, timeout=30, what="200 frames written")
        if kind != "collector":  # the in-process Collector has no pause() (as in TorchRL)
            with collector.pause():
                frozen = buffer.write_count
                time.sleep(0.3)  # the behaviour under test: nothing is written during a pause
                assert buffer.write_count == frozen
            wait_until(lambda: buffer.write_count > frozen, timeout=30, what="writes after the pause")
    finally:
        collector.async_shutdown(timeout=20)
    assert buffer.write_count >= 200
