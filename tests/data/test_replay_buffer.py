"""rlharvest.data.ReplayBuffer."""

from __future__ import annotations

import threading

import pytest
import torch
from tensordict import TensorDict

from rlharvest.data import ReplayBuffer

pytestmark = pytest.mark.timeout(60)


def frames(start, count):
    return TensorDict({"x": torch.arange(start, start + count), ("nested", "y"): torch.ones(count, 2)}, [count])


def test_extend_len_write_count_and_wraparound():
    rb = ReplayBuffer(capacity=10)
    rb.extend(frames(0, 6))
    assert len(rb) == 6 and rb.write_count == 6
    rb.extend(frames(6, 6))
    assert len(rb) == 10 and rb.write_count == 12
    assert sorted(rb[:]["x"].tolist()) == list(range(2, 12))
    assert rb.latest(3)["x"].tolist() == [9, 10, 11]
    rb.extend(frames(100, 25))  # larger than the capacity: the newest frames win
    assert sorted(rb[:]["x"].tolist()) == list(range(115, 125)) and rb.write_count == 37


def test_extend_flattens_batch_dims_in_order():
    rb = ReplayBuffer(capacity=100)
    rb.extend(TensorDict({"x": torch.arange(6).reshape(2, 3)}, [2, 3]))
    assert rb[:]["x"].tolist() == [0, 1, 2, 3, 4, 5]


def test_sample_and_add():
    rb = ReplayBuffer(capacity=100, batch_size=5)
    with pytest.raises(RuntimeError, match="empty"):
        rb.sample()
    rb.add(frames(0, 1)[0])
    rb.extend(frames(1, 9))
    sample = rb.sample()
    assert sample.shape == (5,) and sample["nested", "y"].shape == (5, 2)
    assert ((sample["x"] >= 0) & (sample["x"] < 10)).all()
    with pytest.raises(ValueError, match="batch_size"):
        ReplayBuffer(10).sample()
    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer(0)


def test_thread_safe_writes():
    rb = ReplayBuffer(capacity=10_000)

    def writer(offset):
        for i in range(50):
            rb.extend(frames(offset * 1000 + i * 10, 10))

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert rb.write_count == 2000 and len(rb) == 2000
    data = rb[:]["x"].reshape(-1, 10)
    assert torch.equal(data - data[:, :1], torch.arange(10).expand(200, 10))  # each extend stays contiguous
