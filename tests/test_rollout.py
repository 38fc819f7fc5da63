"""THE rollout loop on its own (no collector): the batch layout, the auto-reset invariant and
trajectory ids, exactly (docs/collection.md)."""

from __future__ import annotations

import gc

import pytest
import torch

from rlharvest.envs import CountingEnv
from rlharvest.policies import RandomPolicy, wrap_policy
from rlharvest.rollout import CHUNK_STEPS, LocalTrajectoryCounter, Rollout, RolloutSettings
from mocks import CountingPolicy


def rollout(env, time_steps=5, counter=None, **settings) -> Rollout:
    policy = wrap_policy(CountingPolicy(1.0), env, None)
    return Rollout(env, policy, RolloutSettings(time_steps=time_steps, **settings), counter or LocalTrajectoryCounter())


def column(batch, key):
    return batch.get(key).reshape(-1).tolist()


def test_auto_reset_invariant_and_trajectory_ids():
    batch = rollout(CountingEnv(max_steps=2)).collect()
    assert batch.names[-1] == "time" and batch.batch_size == torch.Size([5])
    # the root of step t is the state before acting; ("next", *) is its outcome, terminal state included
    assert column(batch, "observation") == [0, 1, 2, 0, 1]
    assert column(batch, ("next", "observation")) == [1, 2, 3, 1, 2]
    assert column(batch, ("next", "done")) == [False, False, True, False, False]
    assert column(batch, "done") == [False] * 5  # a finished sub-env is reset before the next step
    assert column(batch, ("collector", "traj_ids")) == [0, 0, 0, 1, 1]


def test_trajectories_continue_across_batches_and_ids_come_from_the_counter():
    counter = LocalTrajectoryCounter(start=10)
    loop = rollout(CountingEnv(max_steps=2), time_steps=2, counter=counter)
    first, second = column(loop.collect(), ("collector", "traj_ids")), column(loop.collect(), ("collector", "traj_ids"))
    assert first == [10, 10] and second == [10, 11]
    assert counter.state() == 12


def test_batched_env_renumbers_finished_rows_only():
    env = CountingEnv(max_steps=1, batch_size=(2,))
    batch = rollout(env, time_steps=3).collect()
    assert batch.batch_size == torch.Size([2, 3])
    assert batch.get(("collector", "traj_ids")).tolist() == [[0, 0, 2], [1, 1, 3]]


def test_between_steps_ends_the_batch_early_and_marks_the_rest():
    steps = iter(range(100))
    batch = rollout(CountingEnv(max_steps=10), time_steps=6).collect(between_steps=lambda: next(steps) == 2)
    assert column(batch, ("collector", "traj_ids")) == [0, 0, 0, -1, -1, -1]
    assert column(batch, "observation")[:3] == [0, 1, 2]


def test_max_frames_per_traj_truncates_and_counts_steps():
    batch = rollout(CountingEnv(max_steps=100), max_frames_per_traj=2).collect()
    assert column(batch, ("next", "truncated")) == [False, True, False, True, False]
    assert column(batch, "step_count") == [0, 1, 0, 1, 0]
    assert column(batch, ("collector", "traj_ids")) == [0, 0, 1, 1, 2]


def test_random_actions_and_versions_are_stamped():
    env = CountingEnv(max_steps=100)
    loop = Rollout(env, wrap_policy(RandomPolicy(env.full_action_spec), env, None),
                   RolloutSettings(time_steps=4, track_policy_version=True), LocalTrajectoryCounter())
    loop.policy_version = 3
    batch = loop.collect(random=True)
    assert column(batch, "policy_version") == [3] * 4
    assert set(column(batch, "action")) <= {0, 1}


def _batches(time_steps, stop_at=None, **settings):
    """Two batches of a batched CountingEnv with max_frames_per_traj and policy versions (every kind of
    column), optionally cut after ``stop_at`` steps each."""
    loop = rollout(CountingEnv(max_steps=7, batch_size=(2,)), time_steps=time_steps, max_frames_per_traj=5,
                   track_policy_version=True, **settings)
    out = []
    for _ in range(2):
        steps = iter(range(10**6))
        hook = None if stop_at is None else (lambda: next(steps) == stop_at - 1)
        out.append(loop.collect(between_steps=hook).clone())
    return out


@pytest.mark.parametrize("time_steps, stop_at", [
    (2 * CHUNK_STEPS + 3, None),      # two chunks and a tail
    (2 * CHUNK_STEPS, None),          # chunks only: nothing left at the end
    (3 * CHUNK_STEPS, CHUNK_STEPS),   # cut right after a chunk was written
    (3 * CHUNK_STEPS, CHUNK_STEPS + 5),
])
def test_batches_written_chunk_by_chunk_equal_batches_stacked_whole(time_steps, stop_at):
    """A reused buffer is written every CHUNK_STEPS steps; batches built at their end (no buffer) are
    the reference: every key, the -1 ids of a cut batch and the zero root flags agree."""
    chunked, whole = _batches(time_steps, stop_at), _batches(time_steps, stop_at, use_buffers=False)
    for a, b in zip(chunked, whole):
        n = b.shape[-1]
        assert a.shape[-1] == time_steps and set(a.keys(True, True)) == set(b.keys(True, True))
        for key in b.keys(True, True):
            assert torch.equal(a[..., :n].get(key), b.get(key)), key
        assert (a[..., n:].get(("collector", "traj_ids")) == -1).all()


def _ids_step_by_step(done: torch.Tensor, start: list[int], first_new: int) -> list[list[int]]:
    """The rule, one step at a time: a sub-env that ended at step t is in a new trajectory from t + 1,
    new ids handed out in step order, row-major within a step. ``done``: ``(rows, steps)``."""
    current, fresh, out = list(start), first_new, []
    for t in range(done.shape[1]):
        out.append(list(current))
        for row in range(done.shape[0]):
            if done[row, t]:
                current[row], fresh = fresh, fresh + 1
    return [list(row) for row in zip(*out)]


@pytest.mark.parametrize("time_steps, stop_at", [(2 * CHUNK_STEPS + 7, None), (2 * CHUNK_STEPS + 7, CHUNK_STEPS + 3)])
def test_trajectory_ids_of_sub_envs_ending_at_random_follow_the_step_by_step_rule(time_steps, stop_at):
    """Ids are handed out a chunk at a time: they must be those handed out one step at a time, over
    chunks, batches, a 2-D env batch, truncation (max_frames_per_traj) and a batch cut short."""
    torch.manual_seed(0)
    env = CountingEnv(max_steps=4, batch_size=(2, 3))
    counter = LocalTrajectoryCounter()
    loop = Rollout(env, wrap_policy(RandomPolicy(env.full_action_spec), env, None),
                   RolloutSettings(time_steps=time_steps, max_frames_per_traj=9), counter)
    start, fresh = list(range(6)), 6
    for _ in range(3):
        steps = iter(range(10**6))
        hook = None if stop_at is None else (lambda: next(steps) == stop_at - 1)
        batch = loop.collect(between_steps=hook)
        n = stop_at or time_steps
        done = batch.get(("next", "done"))[..., :n, 0].reshape(6, n)
        ids = batch.get(("collector", "traj_ids"))
        assert 0 < int(done.sum()) and ids.shape == (2, 3, time_steps)
        expected = _ids_step_by_step(done, start, fresh)
        assert ids[..., :n].reshape(6, n).tolist() == expected
        assert (ids[..., n:] == -1).all()
        fresh += int(done.sum())
        assert counter.peek() == fresh  # one id for each episode that ended, none taken twice
        # the next batch starts where this one stopped: in the rule's trajectories after its last step
        start = loop.traj_ids.reshape(-1).tolist()
        assert start == [fresh - int(done[:, -1].sum()) + int(done[:row, -1].sum()) if done[row, -1] else ids_row[-1]
                         for row, ids_row in enumerate(expected)]


def test_a_batch_lets_its_steps_go_as_it_writes_them():
    """The loop holds at most CHUNK_STEPS steps: the objects the garbage collector tracks do not grow
    with the batch (held whole, ~6 per step made it scan the whole heap every few batches)."""
    loop = rollout(CountingEnv(max_steps=10**6), time_steps=20 * CHUNK_STEPS)
    loop.collect()  # the buffer exists
    alive = {}

    def count():
        step = len(alive)
        if step in (CHUNK_STEPS, 19 * CHUNK_STEPS):
            gc.collect()
            alive[step] = len(gc.get_objects())
        alive.setdefault(step, None)
        return False

    loop.collect(between_steps=count)
    assert alive[19 * CHUNK_STEPS] - alive[CHUNK_STEPS] < 2 * CHUNK_STEPS, alive


@pytest.mark.parametrize("between", ["share_memory", "replace_leaf"])
def test_the_buffer_may_move_between_batches(between):
    """Workers share their rollout's buffer in place (``share_memory_()`` moves its memory) and a batch
    handed out as is may get a leaf replaced: the next batch is written where the buffer now is."""
    time_steps = 2 * CHUNK_STEPS + 1
    reference = _batches(time_steps, use_buffers=False)[1]
    loop = rollout(CountingEnv(max_steps=7, batch_size=(2,)), time_steps=time_steps, max_frames_per_traj=5,
                   track_policy_version=True)
    first = loop.collect()
    if between == "share_memory":
        first.share_memory_()
    else:
        first.set("observation", torch.full_like(first.get("observation"), -5))
    second = loop.collect()
    assert second is first
    for key in reference.keys(True, True):
        assert torch.equal(second.get(key), reference.get(key)), key
