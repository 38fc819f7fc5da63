"""Batches of complete trajectories: trajs_per_batch, trajs_per_write, traj_format (docs/trajectories.md)."""

from __future__ import annotations

import warnings

import pytest
import torch
from mocks import EpisodeLengthEnv, wait_until
from tensordict import NonTensorStack, TensorDict

from rlharvest.collectors import Collector, MultiAsyncCollector, MultiSyncCollector
from rlharvest.collectors.distributed import RPCCollector
from rlharvest.collectors.trajectories import TrajectoryAssembler
from rlharvest.data import ReplayBuffer
from rlharvest.transport.ports import free_port_block
from rlharvest.collectors.engine import engine_of

pytestmark = pytest.mark.timeout(90)


class RecordingBuffer:
    """A buffer that is not rlharvest's: keeps every ``extend`` (the collector writes it itself)."""

    def __init__(self) -> None:
        self.writes: list = []

    def extend(self, data) -> None:
        self.writes.append(data.clone())

    def frames(self):
        return torch.cat(self.writes, 0) if self.writes else None


def trajectories_of(flat) -> dict[int, list[int]]:
    """Flat steps grouped by trajectory id: {id: observations in order}."""
    out: dict[int, list[int]] = {}
    for traj_id, obs in zip(flat["collector", "traj_ids"].tolist(), flat["observation"].reshape(-1).tolist()):
        out.setdefault(traj_id, []).append(obs)
    return out


def assert_whole(observations: list[int], lengths) -> None:
    """An EpisodeLengthEnv trajectory seen from its first step to its last."""
    assert observations == list(range(len(observations))) and len(observations) in lengths


def padded_rows(batch) -> list[list[int]]:
    mask = batch["collector", "mask"]
    return [batch["observation"][i][mask[i]].reshape(-1).tolist() for i in range(batch.shape[0])]


# ------------------------------------------------------------------------------- in process
def test_padded_batches_hold_exactly_the_complete_trajectories():
    collector = Collector(EpisodeLengthEnv(3), frames_per_batch=4, total_frames=24, trajs_per_batch=2,
                          traj_format="padded")
    batches = list(collector)
    # 24 frames of 3-step episodes: 8 complete trajectories, yielded two by two
    assert [tuple(b.shape) for b in batches] == [(2, 3)] * 4
    assert [b["collector", "traj_ids"][:, 0].tolist() for b in batches] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    for batch in batches:
        assert batch.names == [None, "time"]
        assert batch["collector", "mask"].all()
        assert batch["observation"].squeeze(-1).tolist() == [[0, 1, 2], [0, 1, 2]]
        assert batch["next", "done"].squeeze(-1).tolist() == [[False, False, True]] * 2
    assert collector.stats()["frames"] == 24 and len(collector) == 6  # frames collected, polls


def test_rows_of_different_episode_lengths_padded_and_cat():
    def collect(traj_format):
        # 6 polls of 3 steps per row: row 0 (2-step episodes) completes 9, row 1 (3-step) 6
        with Collector(EpisodeLengthEnv([2, 3]), frames_per_batch=6, total_frames=36, trajs_per_batch=4,
                       traj_format=traj_format) as collector:
            return list(collector)

    padded, cat = collect("padded"), collect("cat")
    assert len(padded) == len(cat) == 3  # 15 complete trajectories: 3 batches of 4, 3 held back
    for batch, flat in zip(padded, cat):
        assert batch.shape[0] == 4 and batch.shape[1] == 3
        rows = padded_rows(batch)
        for row in rows:
            assert_whole(row, (2, 3))
        short = ~batch["collector", "mask"][:, -1]
        assert (batch["observation"][short][:, -1] == 0).all() and not batch["next", "done"][short][:, -1].any()
        # "cat": the same trajectories, in the same order, one after the other and unpadded
        assert flat.batch_dims == 1 and flat.names == ["time"] and ("collector", "mask") not in flat.keys(True)
        assert list(trajectories_of(flat).values()) == rows
        assert int(flat["next", "done"].sum()) == 4 and bool(flat["next", "done"][-1])
        assert list(trajectories_of(flat)) == batch["collector", "traj_ids"][:, 0].tolist()


def test_default_format_warns_and_explicit_or_buffer_does_not():
    with pytest.warns(FutureWarning, match="will change to 'cat'") as record:
        collector = Collector(EpisodeLengthEnv(3), frames_per_batch=4, total_frames=8, trajs_per_batch=2)
    assert record[0].filename == __file__  # points at the caller
    assert collector.traj_format == "padded" and collector.trajs_per_batch == 2 and collector.trajs_per_write is None
    for kwargs in ({"traj_format": "cat"}, {"traj_format": "padded"}, {"replay_buffer": RecordingBuffer()}):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*traj_format")
            Collector(EpisodeLengthEnv(3), frames_per_batch=4, total_frames=8, trajs_per_batch=2, **kwargs)
    assert Collector(EpisodeLengthEnv(3), frames_per_batch=4).traj_format == "padded"


@pytest.mark.parametrize("kwargs, error", [
    ({"trajs_per_batch": 2, "traj_format": "flat"}, "must be 'padded' or 'cat'"),
    ({"traj_format": "cat"}, "needs trajs_per_batch"),
    ({"trajs_per_batch": 0, "traj_format": "cat"}, "trajs_per_batch must be a positive int"),
    ({"trajs_per_batch": True, "traj_format": "cat"}, "trajs_per_batch must be a positive int"),
    ({"trajs_per_batch": 2, "trajs_per_write": 2, "traj_format": "cat"}, "trajs_per_write=2 needs a replay_buffer"),
    ({"trajs_per_batch": 2, "trajs_per_write": 0, "replay_buffer": RecordingBuffer()}, "trajs_per_write must be"),
    ({"trajs_per_batch": 2, "traj_format": "cat", "track_traj_ids": False}, "track_traj_ids=True"),
])
def test_bad_values_are_refused_by_name(kwargs, error):
    with pytest.raises(ValueError, match=error):
        Collector(EpisodeLengthEnv(3), frames_per_batch=4, **kwargs)


def test_replay_buffer_gets_complete_trajectories_per_write():
    def fill(**kwargs):
        buffer = RecordingBuffer()
        collector = Collector(EpisodeLengthEnv([2, 3]), frames_per_batch=8, total_frames=24, trajs_per_batch=5,
                              replay_buffer=buffer, **kwargs)
        assert list(collector) == [None] * 3  # one None per poll, whatever was ready
        return buffer

    one_by_one, all_ready = fill(trajs_per_write=1), fill()
    # 12 steps per row: six 2-step and four 3-step trajectories, written flat
    assert sorted(w.shape[0] for w in one_by_one.writes) == [2] * 6 + [3] * 4
    assert [w.batch_dims for w in one_by_one.writes] == [1] * 10
    assert len(all_ready.writes) == 3 and all_ready.frames().shape[0] == 24
    for buffer in (one_by_one, all_ready):
        trajectories = trajectories_of(buffer.frames())
        assert len(trajectories) == 10
        for observations in trajectories.values():
            assert_whole(observations, (2, 3))


def test_rlharvest_replay_buffer_and_start():
    buffer = ReplayBuffer(1000)
    collector = Collector(EpisodeLengthEnv(3), frames_per_batch=4, total_frames=-1, trajs_per_batch=2,
                          replay_buffer=buffer)
    collector.start()
    try:
        wait_until(lambda: len(buffer) >= 30, timeout=30, what="30 frames in the buffer")
    finally:
        collector.async_shutdown()
    assert len(buffer) % 3 == 0
    for observations in trajectories_of(buffer[:]).values():
        assert_whole(observations, (3,))


def test_reset_drops_what_was_held_back():
    collector = Collector(EpisodeLengthEnv(3), frames_per_batch=10, total_frames=-1, trajs_per_batch=2,
                          traj_format="cat")
    batches = iter(collector)
    first = next(batches)
    # the first poll completed 3 trajectories (2 yielded, 1 ready) and started a 4th
    assert list(trajectories_of(first)) == [0, 1]
    assembler = engine_of(collector).output.trajectories
    assert assembler.ready == 1 and assembler.in_flight_ids() == [3]
    collector.reset()
    assert assembler.ready == 0 and assembler.in_flight_ids() == []
    after = trajectories_of(next(batches))
    assert min(after) > 3 and all(obs == [0, 1, 2] for obs in after.values())
    collector.shutdown()


def test_partial_reset_drops_only_the_reset_rows_episodes():
    collector = Collector(EpisodeLengthEnv([3, 3]), frames_per_batch=4, total_frames=-1, trajs_per_batch=1,
                          traj_format="cat")
    batches = iter(collector)
    # two polls of 2 steps per row: trajectories 0 and 1 complete, 2 (row 0) and 3 (row 1) started
    assert trajectories_of(next(batches)) == {0: [0, 1, 2]}
    assembler = engine_of(collector).output.trajectories
    assert assembler.ready == 1 and assembler.in_flight_ids() == [2, 3]
    collector.reset(index=0)
    assert assembler.in_flight_ids() == [3]
    assert trajectories_of(next(batches)) == {1: [0, 1, 2]}
    assert trajectories_of(next(batches)) == {3: [0, 1, 2]}  # row 1 went on
    assert trajectories_of(next(batches)) == {4: [0, 1, 2]}  # row 0 restarted
    collector.shutdown()


def test_reset_at_each_iter_discards_interrupted_episodes():
    with Collector(EpisodeLengthEnv(3), frames_per_batch=4, total_frames=16, trajs_per_batch=1,
                   traj_format="cat", reset_at_each_iter=True) as collector:
        batches = list(collector)
        assert [list(trajectories_of(b).values()) for b in batches] == [[[0, 1, 2]]] * 4
        assert engine_of(collector).output.trajectories.in_flight_ids() == []


def test_truncation_ends_a_trajectory_and_split_trajs_changes_nothing():
    def collect(**kwargs):
        with Collector(EpisodeLengthEnv(100), frames_per_batch=6, total_frames=18, trajs_per_batch=2,
                       traj_format="padded", max_frames_per_traj=4, **kwargs) as collector:
            return list(collector)

    plain, split = collect(), collect(split_trajs=True)
    assert [tuple(b.shape) for b in plain] == [(2, 4), (2, 4)]
    assert plain[0]["next", "truncated"].squeeze(-1).tolist() == [[False, False, False, True]] * 2
    for a, b in zip(plain, split):
        assert (a.exclude("action") == b.exclude("action")).all()  # the random actions differ


def test_postproc_runs_on_collected_batches_before_assembly():
    seen = []

    def postproc(batch):
        seen.append(tuple(batch.shape))
        batch.set("double", batch["observation"] * 2)
        return batch

    with Collector(EpisodeLengthEnv(3), frames_per_batch=6, total_frames=12, trajs_per_batch=4,
                   traj_format="cat", postproc=postproc) as collector:
        (batch,) = list(collector)
    assert seen == [(6,), (6,)] and (batch["double"] == batch["observation"] * 2).all()


def test_assembler_pads_non_tensor_entries_and_skips_unfilled_steps():
    def steps(traj_ids, done, text):
        return TensorDict({("collector", "traj_ids"): torch.tensor(traj_ids), "x": torch.arange(len(traj_ids)),
                           ("next", "done"): torch.tensor(done), "text": NonTensorStack(*text)}, [len(traj_ids)])

    assembler = TrajectoryAssembler(2, "padded")
    assert list(assembler.batches(steps([0, 1, 0, -1], [False, False, True, False], "abcd"))) == []
    (out,) = assembler.batches(steps([1, 1, 1], [False, False, True], "efg"))
    assert out.shape == (2, 4) and out["collector", "mask"].sum(-1).tolist() == [2, 4]
    assert out.get("text").tolist() == [["a", "c", "c", "c"], ["b", "e", "f", "g"]]
    assert out["x"].tolist() == [[0, 2, 0, 0], [1, 0, 1, 2]]
    with pytest.raises(KeyError, match="traj_ids"):
        assembler.ingest(TensorDict({"x": torch.zeros(2)}, [2]))


# ------------------------------------------------------------------------------- workers
WORKER_ENVS = [lambda: EpisodeLengthEnv(3), lambda: EpisodeLengthEnv(2)]


@pytest.mark.parametrize("collector_class", [MultiSyncCollector, MultiAsyncCollector])
def test_workers_batches_of_complete_trajectories(collector_class):
    frames = 12 if collector_class is MultiSyncCollector else 6  # 6 steps per worker per poll
    with collector_class(WORKER_ENVS, frames_per_batch=frames, total_frames=24, trajs_per_batch=3,
                         traj_format="padded") as collector:
        batches = list(collector)
    # 24 frames: 12 per worker when sync (4 + 6 trajectories); async workers share them unevenly
    assert len(batches) >= 2 and all(b.shape[0] == 3 for b in batches)
    if collector_class is MultiSyncCollector:
        assert len(batches) == 3
    ids = [traj_id for b in batches for traj_id in b["collector", "traj_ids"][:, 0].tolist()]
    assert len(set(ids)) == len(ids)
    for batch in batches:
        for row in padded_rows(batch):
            assert_whole(row, (2, 3))


@pytest.mark.parametrize("buffer_kind", ["rlharvest", "other"])
def test_workers_write_complete_trajectories_to_a_buffer(buffer_kind):
    buffer = ReplayBuffer(1000) if buffer_kind == "rlharvest" else RecordingBuffer()
    with MultiSyncCollector(WORKER_ENVS, frames_per_batch=12, total_frames=36, trajs_per_batch=2,
                            trajs_per_write=1, replay_buffer=buffer) as collector:
        assert list(collector) == [None] * 3
    frames = buffer[:] if buffer_kind == "rlharvest" else buffer.frames()
    trajectories = trajectories_of(frames)
    # 18 steps per worker: 6 three-step and 9 two-step trajectories, the first poll's included
    assert sorted(len(obs) for obs in trajectories.values()) == [2] * 9 + [3] * 6
    for observations in trajectories.values():
        assert_whole(observations, (2, 3))
    if buffer_kind == "other":
        assert [w.shape[0] for w in buffer.writes].count(3) == 6  # one trajectory per extend


def test_workers_running_free_write_complete_trajectories():
    buffer = ReplayBuffer(2000)
    collector = MultiAsyncCollector(WORKER_ENVS, frames_per_batch=5, total_frames=-1, trajs_per_batch=2,
                                    replay_buffer=buffer)
    try:
        collector.start()
        wait_until(lambda: len(buffer) >= 60, timeout=30, what="60 frames in the buffer")
    finally:
        collector.async_shutdown()
    for observations in trajectories_of(buffer[:]).values():
        assert_whole(observations, (2, 3))


def test_workers_reset_drops_what_the_parent_held_back():
    collector = MultiSyncCollector(WORKER_ENVS, frames_per_batch=8, total_frames=-1, trajs_per_batch=3,
                                   traj_format="cat")
    try:
        batches = iter(collector)
        before = trajectories_of(next(batches))  # 4 steps per worker: 1 + 2 complete, worker 0's next in flight
        assembler = engine_of(collector).output.trajectories
        held = assembler.in_flight_ids()
        assert len(before) == 3 and held
        collector.reset()
        assert assembler.ready == 0 and assembler.in_flight_ids() == []
        after = trajectories_of(next(batches))
        assert min(after) > max([*before, *held])
        for observations in after.values():
            assert_whole(observations, (2, 3))
    finally:
        collector.shutdown()


def test_rpc_collector_takes_the_arguments():
    with pytest.warns(FutureWarning, match="traj_format"):
        collector = RPCCollector(WORKER_ENVS, frames_per_batch=12, total_frames=24, trajs_per_batch=3,
                                 sync=True, launcher="mp", tcp_port=free_port_block(3))
    try:
        batches = list(collector)
    finally:
        collector.shutdown()
    assert len(batches) == 3 and all(b.shape[0] == 3 for b in batches)
    for batch in batches:
        for row in padded_rows(batch):
            assert_whole(row, (2, 3))
