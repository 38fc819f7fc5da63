"""Replay buffers that are not rlharvest's (TorchRL's, or any object with ``extend``)."""

from __future__ import annotations

import time

import pytest
from mocks import CountingPolicy, ItemBuffer, wait_until

from rlharvest.collectors import MultiAsyncCollector, MultiSyncCollector
from rlharvest.envs import CountingEnv

pytestmark = pytest.mark.timeout(90)


def envs(count: int, batch_size=()):
    return [lambda: CountingEnv(max_steps=3, batch_size=batch_size)] * count


@pytest.mark.parametrize("batch_size, items_per_batch", [((), 8), ((2,), 4)])
def test_multisync_writes_each_workers_batch_like_its_own_collector(batch_size, items_per_batch):
    buffer = ItemBuffer()
    collector = MultiSyncCollector(envs(2, batch_size), CountingPolicy(), frames_per_batch=8, total_frames=16,
                                   replay_buffer=buffer, local_init_rb=True)
    assert list(collector) == [None, None]
    # unbatched env: one item per frame; batched (2,): one item per sub-env trajectory row
    assert len(buffer) == 2 * items_per_batch
    collector.shutdown()


@pytest.mark.parametrize("collector_class", [MultiSyncCollector, MultiAsyncCollector])
def test_start_pause_and_shutdown_with_a_foreign_buffer(collector_class):
    buffer = ItemBuffer()
    collector = collector_class(envs(2), CountingPolicy(), frames_per_batch=8, total_frames=-1,
                                replay_buffer=buffer, local_init_rb=True)
    collector.start()
    assert collector.is_running()
    wait_until(lambda: buffer.write_count >= 16, timeout=20, what="16 frames written")
    with collector.pause():
        frozen = buffer.write_count
        time.sleep(0.3)  # the behaviour under test: nothing is written during a pause
        assert buffer.write_count == frozen
    wait_until(lambda: buffer.write_count > frozen, timeout=20, what="writes after the pause")
    collector.async_shutdown(timeout=10)
    assert not collector.is_running()
    observations = [int(item["observation"]) for item in buffer.items[:8]]
    assert observations[:4] == [0, 1, 2, 3]


def test_pause_without_start_is_an_error():
    collector = MultiSyncCollector(envs(2), CountingPolicy(), frames_per_batch=8, replay_buffer=ItemBuffer(),
                                   local_init_rb=True)
    with pytest.raises(RuntimeError, match="cannot be paused"):
        with collector.pause():
            pass
    collector.shutdown()
