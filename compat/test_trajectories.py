"""trajs_per_batch with TorchRL's envs and replay buffers: whole episodes, yielded or written."""

from __future__ import annotations

import pytest
import torch
from collector_kinds import make_collector
from torchrl.data import LazyTensorStorage, ReplayBuffer, SliceSampler
from torchrl_objects import q_value_actor, serial_env, transformed_env

pytestmark = pytest.mark.timeout(120)

KINDS = ("collector", "multisync", "multiasync", "rpc")  # the collectors that take trajs_per_batch


def _episodes(flat) -> dict[int, list[int]]:
    steps: dict[int, list[int]] = {}
    for traj_id, count in zip(flat["collector", "traj_ids"].tolist(), flat["step_count"].reshape(-1).tolist()):
        steps.setdefault(traj_id, []).append(count)
    return steps


def _assert_whole(step_counts: list[int]) -> None:
    assert step_counts == list(range(len(step_counts)))


@pytest.mark.parametrize("kind", KINDS)
def test_buffer_holds_only_whole_episodes(kind, free_port):
    buffer = ReplayBuffer(storage=LazyTensorStorage(5_000),
                          sampler=SliceSampler(slice_len=4, end_key=("next", "done"), strict_length=True))
    collector = make_collector(kind, transformed_env, q_value_actor(), port=free_port, frames_per_batch=80,
                               total_frames=320, trajs_per_batch=2, replay_buffer=buffer)
    try:
        assert list(collector) == [None] * 4
    finally:
        collector.shutdown()
    frames = buffer[:]
    assert frames.batch_dims == 1 and bool(frames["next", "done"][-1])
    for step_counts in _episodes(frames).values():
        _assert_whole(step_counts)
    sample = buffer.sample(16)
    assert (sample["collector", "traj_ids"].reshape(4, 4) == sample["collector", "traj_ids"][::4, None]).all()


@pytest.mark.parametrize("traj_format", ["padded", "cat"])
def test_serial_env_batches_of_whole_episodes(traj_format):
    collector = make_collector("collector", serial_env, q_value_actor(), frames_per_batch=100, total_frames=400,
                               trajs_per_batch=3, traj_format=traj_format)
    try:
        batches = list(collector)
    finally:
        collector.shutdown()
    assert batches
    for batch in batches:
        if traj_format == "padded":
            mask = batch["collector", "mask"]
            assert batch.shape[0] == 3 and mask[:, 0].all()
            ends = mask.sum(-1) - 1
            assert batch["next", "done"].squeeze(-1)[torch.arange(3), ends].all()
        else:
            assert batch.batch_dims == 1 and int(batch["next", "done"].sum()) == 3
