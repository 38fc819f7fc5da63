"""Checkpoints that resume exactly (docs/checkpoints.md): a collector built again in a fresh process
with the same arguments, given the checkpoint, yields bit for bit the batches an uninterrupted run
yields; async collectors lose and repeat no frame; what cannot be continued says so."""

from __future__ import annotations

import os
import pathlib
import signal
import warnings

import pytest
import torch
from checkpoint_cases import (TRAJ_IDS, assert_identical, build, interrupted, relabel_new_ids,
                              resume_in_fresh_process)
from tensordict import TensorDict
from mocks import TorchRLStyleCountingEnv, wait_until

from rlharvest import WorkerError
from rlharvest.checkpoint import CHECKPOINT_KEY, FORMAT_VERSION, CheckpointMismatchError, EpisodeRestartWarning
from rlharvest.collectors import Collector, MultiSyncCollector
from rlharvest.data import ReplayBuffer
from rlharvest.envs import CountingEnv
from rlharvest.collectors.engine import engine_of

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("zygote")]


def new_weights(collector) -> None:
    with torch.no_grad():
        collector.policy.module[0].bias.add_(0.5)
    collector.update_policy_weights_()


# ---------------------------------------------------------------------------------- Collector
@pytest.mark.parametrize("case", ["counting", "continuous", "gym", "gym_vector"])
def test_collector_resumes_bit_for_bit_in_a_fresh_process(case, tmp_path):
    state, expected = interrupted(case, 3, 4, change=new_weights if case == "continuous" else None)
    section = state[CHECKPOINT_KEY]
    assert {"frames", "iter", "traj_pool", "env_state_dict"} <= set(state) and section["format_version"] == FORMAT_VERSION
    assert "env" in section and "episode" in section
    resumed = resume_in_fresh_process(case, state, tmp_path, 4)
    for want, got in zip(expected, resumed["batches"], strict=True):
        assert_identical(want, got)
    if case == "continuous":
        assert resumed["batches"][0]["policy_version"].eq(1).all()
    # an episode in flight at the checkpoint continues with its id
    assert resumed["batches"][0][TRAJ_IDS][..., 0].tolist() == expected[0][TRAJ_IDS][..., 0].tolist()


def test_checkpoint_is_plain_and_counts():
    collector = build("counting")
    next(iter(collector))
    state = collector.state_dict()
    collector.shutdown()
    path = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"rlharvest-plain-{os.getpid()}.pt"
    try:
        torch.save(state, path)
        loaded = torch.load(path, weights_only=True)  # no code runs to read it
    finally:
        path.unlink(missing_ok=True)
    section = loaded[CHECKPOINT_KEY]
    assert (loaded["frames"], loaded["iter"], section["total_frames_left"]) == (6, 0, 54)
    assert section["traj_counter"] == int(loaded["traj_pool"]["traj_id"]) and section["seed_chain"] == [5, False, 7]


def test_other_arguments_or_newer_format_are_refused():
    source = Collector(CountingEnv(batch_size=(2,)), frames_per_batch=12, total_frames=24)
    state = source.state_dict()
    source.shutdown()
    other = Collector(CountingEnv(batch_size=(2,)), frames_per_batch=6, total_frames=12)
    with pytest.raises(CheckpointMismatchError, match="frames_per_batch: checkpoint 12, this collector 6$"):
        other.load_state_dict(state)
    assert other.state_dict()["frames"] == 0  # refused before anything changed
    other.shutdown()
    other = Collector(CountingEnv(batch_size=(3,)), frames_per_batch=12, total_frames=24)
    with pytest.raises(CheckpointMismatchError, match=r"env_batch_size: checkpoint \[2\], this collector \[3\]$"):
        other.load_state_dict(state)
    other.shutdown()
    newer = {**state, CHECKPOINT_KEY: {**state[CHECKPOINT_KEY], "format_version": FORMAT_VERSION + 1}}
    same = Collector(CountingEnv(batch_size=(2,)), frames_per_batch=12, total_frames=24)
    with pytest.raises(CheckpointMismatchError, match="format version 2"):
        same.load_state_dict(newer)
    same.shutdown()


def test_an_env_whose_state_cannot_be_captured_restarts_with_one_warning():
    def make():
        return Collector(TorchRLStyleCountingEnv(max_steps=50), frames_per_batch=4, total_frames=40)

    source = make()
    seen = next(iter(source))[TRAJ_IDS].tolist()
    state = source.state_dict()
    source.shutdown()
    assert "TorchRLStyleCountingEnv" in state[CHECKPOINT_KEY]["env_unavailable"]
    restored = make()
    with pytest.warns(EpisodeRestartWarning, match="TorchRLStyleCountingEnv.*not an rlharvest env") as caught:
        restored.load_state_dict(state)
    assert len([w for w in caught if issubclass(w.category, EpisodeRestartWarning)]) == 1
    ids = next(iter(restored))[TRAJ_IDS].tolist()
    restored.shutdown()
    assert min(ids) >= int(state["traj_pool"]["traj_id"]) and not set(ids) & set(seen)


def test_env_state_false_is_smaller_and_restarts_episodes_without_a_warning():
    source = build("gym")
    next(iter(source))
    full, lean = source.state_dict(), source.state_dict(env_state=False)
    source.shutdown()
    assert "env" not in lean[CHECKPOINT_KEY] and "env_skipped" in lean[CHECKPOINT_KEY]
    assert lean[CHECKPOINT_KEY]["rng"]["torch"].numel() and len(_saved(lean)) < len(_saved(full))
    restored = build("gym")
    with warnings.catch_warnings():
        warnings.simplefilter("error", EpisodeRestartWarning)
        restored.load_state_dict(lean)
    ids = next(iter(restored))[TRAJ_IDS]
    restored.shutdown()
    assert int(ids[0]) == int(lean["traj_pool"]["traj_id"])  # a new episode


def _saved(state: dict) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def test_a_checkpoint_during_start_waits_for_a_batch_boundary():
    buffer = ReplayBuffer(capacity=10_000)
    collector = Collector(CountingEnv(batch_size=(2,)), frames_per_batch=8, total_frames=-1, replay_buffer=buffer)
    collector.start()
    try:
        wait_until(lambda: buffer.write_count >= 16, timeout=30, what="two batches written")
        for _ in range(3):  # taken between two batches: as many frames as batches started, and written
            state = collector.state_dict()
            assert (state["iter"] + 1) * 8 == state["frames"] >= 16
            assert state[CHECKPOINT_KEY]["frames"] == state["frames"]
        assert collector.is_running()
    finally:
        collector.async_shutdown(timeout=10)


# ---------------------------------------------------------------------------------- replay buffers
def assert_same_buffer(expected: dict, got: dict, ordered: bool) -> None:
    assert expected["capacity"] == got["capacity"] and torch.equal(expected["counters"], got["counters"])
    length = [int(expected["counters"][1])]
    want, have = (TensorDict.from_dict(state["frames"], batch_size=length) for state in (expected, got))
    if ordered:
        assert_identical(want, have)
    else:  # the same frames; workers writing themselves interleave their blocks in any order
        assert sorted(map(_row, want.unbind(0))) == sorted(map(_row, have.unbind(0)))


def _row(frame: TensorDict) -> tuple:
    return tuple(value for key in sorted(frame.keys(True, True), key=str)
                 for value in frame.get(key).flatten().tolist())


@pytest.mark.parametrize("case", ["buffer", "multisync_buffer"])
def test_replay_buffer_resumes_exactly_in_a_fresh_process(case, tmp_path):
    """The buffer (frames, write cursor, counters) is in the checkpoint: after the load and more batches it
    equals the uninterrupted run's, and (Collector: the process's generator is restored) samples alike."""
    collector = build(case)
    try:
        iterator = iter(collector)
        for _ in range(2):
            next(iterator)
        state = collector.state_dict()
        for _ in range(3):
            next(iterator)
        expected = collector.replay_buffer.state_dict()
        sample = collector.replay_buffer.sample(6)
    finally:
        collector.shutdown()
    saved = state[CHECKPOINT_KEY]["replay_buffer"]["plain"]
    assert int(saved["counters"][2]) == (16 if case == "buffer" else 24)  # the writes before the checkpoint
    assert all(CHECKPOINT_KEY not in state[key] or state[key][CHECKPOINT_KEY]["replay_buffer"] is None
               for key in state if key.startswith("worker"))  # held once, by the parent
    resumed = resume_in_fresh_process(case, state, tmp_path, 3)
    assert int(expected["counters"][2]) == (40 if case == "buffer" else 60)  # it wrapped around
    assert_same_buffer(expected, resumed["buffer"], ordered=case == "buffer")
    if case == "buffer":
        assert_identical(sample, resumed["sample"])


def test_a_collector_without_the_checkpoints_buffer_refuses_it():
    source = Collector(CountingEnv(), frames_per_batch=4, total_frames=8, replay_buffer=ReplayBuffer(capacity=8))
    next(iter(source))
    state = source.state_dict()
    source.shutdown()
    other = Collector(CountingEnv(), frames_per_batch=4, total_frames=8)
    with pytest.raises(CheckpointMismatchError, match=r"replay_buffer: checkpoint 'rlharvest.data.replay_buffer."
                                                      r"ReplayBuffer', this collector None"):
        other.load_state_dict(state)
    other.shutdown()


# ---------------------------------------------------------------------------------- collectors with workers
def test_multisync_resumes_bit_for_bit_in_a_fresh_process(tmp_path):
    state, expected = interrupted("multisync", 2, 3)
    assert set(state) >= {"worker0", "worker1", CHECKPOINT_KEY}
    resumed = resume_in_fresh_process("multisync", state, tmp_path, 3)["batches"]
    for want, got in zip(expected, resumed, strict=True):
        assert_identical(want, got, skip=[TRAJ_IDS])
    first_new = int(state["traj_pool"]["traj_id"])
    for want, got in zip(relabel_new_ids(expected, first_new), relabel_new_ids(resumed, first_new)):
        assert torch.equal(want, got)


def test_a_checkpoint_after_a_worker_restart_and_weight_updates_resumes_with_the_budget_spent():
    """A worker killed and replaced (restart 1 of max_worker_restarts=2: its env takes another seed), new
    weights pushed, then the checkpoint: the resumed collector yields the uninterrupted run's batches and
    counts the restart spent (max_worker_restarts counts over the run, across loads)."""
    def kill_and_update(collector) -> None:
        iterator = iter(collector)
        os.kill(collector.worker_pids()[1], signal.SIGKILL)
        wait_until(lambda: next(iterator) is not None and collector.stats()["restarts"] == 1, timeout=60,
                   what="worker 1 replaced")
        new_weights(collector)

    state, expected = interrupted("multisync_restarts", 2, 3, change=kill_and_update)
    section = state[CHECKPOINT_KEY]
    assert [cause["worker"] for cause in section["restart_causes"]] == [1]
    assert section["worker_specs"][1]["restart"] == 1
    restored = build("multisync_restarts")
    try:
        restored.load_state_dict(state)
        stats = restored.stats()
        assert stats["restarts"] == 1 and "died" in stats["worker_1/restart_causes"]
        iterator = iter(restored)
        resumed = [next(iterator).clone() for _ in range(3)]
    finally:
        restored.shutdown()
    for want, got in zip(expected, resumed, strict=True):
        assert_identical(want, got, skip=[TRAJ_IDS])
    first_new = int(state["traj_pool"]["traj_id"])
    for want, got in zip(relabel_new_ids(expected, first_new), relabel_new_ids(resumed, first_new)):
        assert torch.equal(want, got)


def replace_node_and_update_weights(collector) -> None:
    """What happens while training: node 1 fails and is replaced (restart 1: another env seed, ids past
    its predecessor's), new weights are pushed."""
    engine_of(collector).fleet.recover(WorkerError("injected failure", worker_idx=1, noun="node"))
    next(iter(collector))
    new_weights(collector)


def test_distributed_sync_resumes_bit_for_bit_after_a_restart_and_weight_updates(tmp_path):
    state, expected = interrupted("distributed", 2, 3, change=replace_node_and_update_weights)
    assert state[CHECKPOINT_KEY]["worker_specs"][1]["restart"] == 1
    assert state["worker1"][CHECKPOINT_KEY]["worker"]["traj_offset"] > 0
    resumed = resume_in_fresh_process("distributed", state, tmp_path, 3)["batches"]
    for want, got in zip(expected, resumed, strict=True):
        assert_identical(want, got)  # nodes count their own ids: those are exact too


def test_rpc_sync_resumes_bit_for_bit_in_a_fresh_process(tmp_path):
    state, expected = interrupted("rpc", 2, 3, change=new_weights)
    resumed = resume_in_fresh_process("rpc", state, tmp_path, 3)["batches"]
    for want, got in zip(expected, resumed, strict=True):
        assert_identical(want, got)


@pytest.mark.parametrize("case", ["multiasync", "async", "distributed_async", "rpc_async"])
def test_async_collectors_lose_and_repeat_no_frame(case, tmp_path):
    check_async_resume(case, tmp_path)


def check_async_resume(case: str, tmp_path, timeout: float = 100) -> None:
    collector = build(case)
    before = []
    iterator = iter(collector)
    for _ in range(5):
        before.append(next(iterator).clone())
    state = collector.state_dict()
    collector.shutdown()
    section = state[0]["rlharvest_collector"][CHECKPOINT_KEY] if isinstance(state, list) else state[CHECKPOINT_KEY]
    pending = section["pending"]
    assert pending  # a rollout was in flight: its batch is in the checkpoint, not lost
    resumed = resume_in_fresh_process(case, state, tmp_path, 0, timeout)
    assert resumed["frames"] == 48  # total_frames exactly
    batches = before + resumed["batches"]
    assert sum(batch.numel() for batch in batches) == 48
    per_worker: dict[int, list] = {0: [], 1: []} if case != "async" else {0: []}
    for batch in batches:
        obs = batch["observation"].flatten()
        worker = int(obs[0]) // 10
        per_worker[worker].append((obs.tolist(), batch[TRAJ_IDS].tolist()))
    for worker, parts in per_worker.items():
        steps = [value for obs, _ in parts for value in obs]
        # every worker's observations go 10w, ..., 10w + 4 and again: a lost or repeated batch breaks the cycle
        assert steps == [10 * worker + i % 5 for i in range(len(steps))], (worker, steps, len(pending))
        ids = [value for _, traj in parts for value in traj]
        for i in range(1, len(ids)):  # an episode keeps its id across the checkpoint
            assert (ids[i] == ids[i - 1]) == (i % 5 != 0), (worker, ids)


def test_async_batched_loses_and_repeats_no_frame_and_continues_episodes(tmp_path):
    """The frames assembled in the parent (the next batch's first ones), the chunks in flight and the
    served policy's version are in the checkpoint: per env, the frames of the two runs are one run's."""
    collector = build("async_batched")
    iterator = iter(collector)
    before = [next(iterator).clone() for _ in range(4)]
    collector.update_policy_weights_()  # the served policy's version goes on after the load
    state = collector.state_dict()
    collector.shutdown()
    section = state[CHECKPOINT_KEY]
    assert section["server_version"] == 1 and "served_policy" in section
    resumed = resume_in_fresh_process("async_batched", state, tmp_path, 0)
    batches = before + resumed["batches"]
    assert resumed["frames"] == 60 and [batch.numel() for batch in batches] == [6] * 10
    assert resumed["batches"][-1]["policy_version"].eq(1).all()
    per_env: dict[int, list] = {}
    for batch in batches:
        for env, obs, traj in zip(batch["env_index"].tolist(), batch["observation"].flatten().tolist(),
                                  batch[TRAJ_IDS].tolist()):
            per_env.setdefault(env, []).append((obs, traj))
    for env, frames in per_env.items():  # env w's observations cycle 10w, ..., 10w + 4: none lost or repeated
        assert [obs for obs, _ in frames] == [10 * env + i % 5 for i in range(len(frames))], (env, frames)
        ids = [traj for _, traj in frames]
        assert all((ids[i] == ids[i - 1]) == (i % 5 != 0) for i in range(1, len(ids))), (env, ids)
    all_ids = [traj for frames in per_env.values() for _, traj in frames]
    assert len(set(all_ids)) == sum(len(set(t for _, t in frames)) for frames in per_env.values())  # unique


# ---------------------------------------------------------------------------------- Ray
@pytest.fixture
def ray_address(ray_session, monkeypatch):
    """The session's Ray, which the fresh process connects to (its actors need the session's CPUs)."""
    monkeypatch.setenv("RAY_ADDRESS", ray_session.get_runtime_context().gcs_address)
    yield ray_session


# a fresh driver connecting to Ray and starting actors takes a minute on a loaded 2-core machine
RAY_TIMEOUT = 240


@pytest.mark.ray
@pytest.mark.timeout(RAY_TIMEOUT + 60)
def test_ray_sync_resumes_bit_for_bit_in_a_fresh_process(ray_address, tmp_path):
    state, expected = interrupted("ray", 2, 3, change=new_weights)
    assert isinstance(state, list) and len(state) == 2  # TorchRL's form: one state dict per actor
    part = state[0]["rlharvest_collector"]
    assert part["frames"] == 48 and part[CHECKPOINT_KEY]["layout"]["collector"] == "RayCollector"
    resumed = resume_in_fresh_process("ray", state, tmp_path, 3, RAY_TIMEOUT)["batches"]
    for want, got in zip(expected, resumed, strict=True):
        assert_identical(want, got)  # actors count their own ids (k * W + i): exact too


@pytest.mark.ray
@pytest.mark.timeout(RAY_TIMEOUT + 60)
def test_ray_async_loses_and_repeats_no_frame(ray_address, tmp_path):
    check_async_resume("ray_async", tmp_path, RAY_TIMEOUT)


def test_worker_warnings_reach_the_parent_once_per_worker():
    def make():
        return MultiSyncCollector([TorchRLStyleCountingEnv] * 2, frames_per_batch=8, total_frames=32)

    source = make()
    next(iter(source))
    state = source.state_dict()
    source.shutdown()
    restored = make()
    try:
        with pytest.warns(EpisodeRestartWarning) as caught:
            restored.load_state_dict(state)
        messages = sorted(str(w.message) for w in caught if issubclass(w.category, EpisodeRestartWarning))
        assert len(messages) == 2 and messages[0].startswith("worker 0: env") and messages[1].startswith("worker 1")
        with pytest.raises(CheckpointMismatchError, match="num_workers: checkpoint 2, this collector 3"):
            with MultiSyncCollector([TorchRLStyleCountingEnv] * 3, frames_per_batch=12, total_frames=24) as other:
                other.load_state_dict(state)
    finally:
        restored.shutdown()



def test_trajectories_held_back_are_in_the_checkpoint():
    """With trajs_per_batch, steps of episodes still running (and complete ones not yielded) are held
    back: they are part of the checkpoint, so the resumed collector yields the same trajectories."""
    def make():
        collector = Collector(CountingEnv(max_steps=6, batch_size=(2,)), None, frames_per_batch=6, total_frames=-1,
                              trajs_per_batch=3, traj_format="cat")
        collector.set_seed(2)
        return collector

    source = make()
    iterator = iter(source)
    next(iterator)
    state = source.state_dict()
    expected = [next(iterator).clone() for _ in range(3)]
    source.shutdown()
    assert "trajectories" in state[CHECKPOINT_KEY]
    restored = make()
    restored.load_state_dict(state)
    resumed = iter(restored)
    got = [next(resumed).clone() for _ in range(3)]
    restored.shutdown()
    for want, batch in zip(expected, got, strict=True):
        assert_identical(want, batch)
