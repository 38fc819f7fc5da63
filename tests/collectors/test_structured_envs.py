"""Envs whose steps hold more than dense tensors of the env's batch shape: sub-TensorDicts with dims
of their own (agents), heterogeneous lazy stacks, non-tensor data, shapes that change every step."""

from __future__ import annotations

import functools

import pytest
from mocks import StructuredEnv
from tensordict import LazyStackedTensorDict

from rlharvest.collectors import Collector, MultiAsyncCollector, MultiSyncCollector

pytestmark = pytest.mark.timeout(90)


def _check_agents_and_notes(batch) -> None:
    """A (time,) rollout of StructuredEnv(max_steps=3): agent dims and text survive, auto-reset holds."""
    assert batch["agents"].batch_size == (*batch.shape, 2)
    assert batch["next", "agents"].batch_size == (*batch.shape, 2)
    counts = batch["agents", "count"][..., 0, 0].tolist()
    assert counts == [t % 3 for t in range(len(counts))]
    notes = list(batch["note"].tolist()) if hasattr(batch["note"], "tolist") else list(batch["note"])
    assert notes[:4] == ["reset", "step 1", "step 2", "reset"]
    assert list(batch["next", "note"])[:3] == ["step 1", "step 2", "step 3"]


@pytest.mark.parametrize("use_buffers", [None, False])
def test_sub_tensordicts_with_dims_of_their_own_and_non_tensor_data(use_buffers):
    collector = Collector(StructuredEnv(), frames_per_batch=6, total_frames=12, use_buffers=use_buffers)
    for batch in collector:
        _check_agents_and_notes(batch)
    collector.shutdown()


@pytest.mark.parametrize("collector_class", [MultiSyncCollector, MultiAsyncCollector])
def test_structured_batches_cross_the_process_boundary(collector_class):
    collector = collector_class([StructuredEnv] * 2, frames_per_batch=12, total_frames=24)
    batches = list(collector)
    collector.shutdown()
    assert sum(b.numel() for b in batches) == 24
    for batch in batches:
        for rollout in (batch.unbind(0) if batch.batch_dims > 1 else [batch]):
            _check_agents_and_notes(rollout)


def test_heterogeneous_lazy_stacks_are_kept():
    collector = Collector(functools.partial(StructuredEnv, heterogeneous=True), frames_per_batch=4, total_frames=4)
    batch = next(iter(collector))
    collector.shutdown()
    parts = batch["parts"]
    assert isinstance(parts, LazyStackedTensorDict)
    assert [tuple(parts[..., i]["x"].shape) for i in range(2)] == [(4, 1), (4, 2)]
    assert parts[..., 1]["x"][:, 0].tolist() == [0.0, 1.0, 2.0, 0.0]


@pytest.mark.parametrize("collector_class", [Collector, MultiSyncCollector, MultiAsyncCollector])
def test_dynamic_shapes_give_lazy_batches(collector_class):
    env_fn = functools.partial(StructuredEnv, dynamic=True)
    if collector_class is Collector:
        collector = Collector(env_fn, frames_per_batch=4, total_frames=8)
    else:
        collector = collector_class([env_fn], frames_per_batch=4, total_frames=8)
    batches = list(collector)
    collector.shutdown()
    for batch in batches:
        assert isinstance(batch, LazyStackedTensorDict) and batch.names[-1] == "time"
        rollout = batch[0] if batch.batch_dims > 1 else batch
        lengths = [rollout[t]["grow"].shape[0] for t in range(4)]
        assert lengths in ([1, 2, 3, 1], [2, 3, 1, 2])  # grows with the step, back to 1 after a reset


@pytest.mark.parametrize("options", [{"set_truncated": True}, {"max_frames_per_traj": 2}])
def test_truncation_sets_the_flags_inside_a_sub_tensordict(options):
    env_fn = functools.partial(StructuredEnv, agent_flags=True, max_steps=10)
    collector = Collector(env_fn, frames_per_batch=4, total_frames=4, **options)
    batch = next(iter(collector))
    collector.shutdown()
    truncated = batch["next", "agents", "truncated"].squeeze(-1)      # (time, agents)
    expected = [False, False, False, True] if "set_truncated" in options else [False, True, False, True]
    assert truncated.all(-1).tolist() == expected
    assert batch["next", "agents", "done"].squeeze(-1).all(-1).tolist() == expected
    assert not batch["next", "agents", "terminated"].any()
