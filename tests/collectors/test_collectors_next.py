"""The collectors of TorchRL's next release (torchrl-nightly 2026.10.27), through the public API only:
``worker_policy_versions()`` and the acknowledged ``policy_version``, ``stats(workers=...)``'s progress
keys, ``replay_write_mode`` and ``traj_format``.

The file runs unchanged against TorchRL's nightly, to check that both behave alike
(docs/torchrl-compatibility.md, "TorchRL's next release"): ``RLHARVEST_TEST_LIBRARY=torchrl`` takes the
collectors, ``GymEnv`` and the weight schemes from ``torchrl`` instead of ``rlharvest``; the suite itself
never imports TorchRL.

The env is a gymnasium env both libraries wrap (``GymEnv``): ``StepEnv(length)`` ends its episodes after
``length`` steps and observes ``[0, t]`` (``t``: the step of the episode).
"""

from __future__ import annotations

import importlib
import os

import gymnasium
import numpy as np
import pytest
import torch
from mocks import wait_until
from tensordict.nn import TensorDictModule

LIBRARY = os.environ.get("RLHARVEST_TEST_LIBRARY", "rlharvest")
collectors = importlib.import_module(f"{LIBRARY}.collectors")
envs = importlib.import_module(f"{LIBRARY}.envs")
weight_update = importlib.import_module(f"{LIBRARY}.weight_update")

pytestmark = pytest.mark.timeout(120)


class StepEnv(gymnasium.Env):
    """Episodes of ``length`` steps; observes ``[0, t]``."""

    def __init__(self, length: int = 3):
        self.length = length
        self.observation_space = gymnasium.spaces.Box(-np.inf, np.inf, (2,), np.float32)
        self.action_space = gymnasium.spaces.Box(-10.0, 10.0, (1,), np.float32)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.array([0.0, 0.0], dtype=np.float32), {}

    def step(self, action):
        self.t += 1
        return np.array([0.0, self.t], dtype=np.float32), 1.0, self.t >= self.length, False, {}


gymnasium.register("RlhStepEnv-v0", entry_point=StepEnv)


def step_env():
    return envs.GymEnv("RlhStepEnv-v0", length=3)


class Weight(torch.nn.Module):
    def __init__(self, weight: float = 1.0) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor([weight]))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.weight.expand(*observation.shape[:-1], 1)


def weight_policy() -> TensorDictModule:
    return TensorDictModule(Weight(), in_keys=["observation"], out_keys=["action"])


@pytest.fixture
def shutdown_after():
    made = []
    yield made.append
    for collector in made:
        collector.shutdown()


def multi_sync(shutdown_after, **kwargs):
    kwargs.setdefault("frames_per_batch", 8)
    kwargs.setdefault("total_frames", -1)
    collector = collectors.MultiSyncCollector([step_env] * 2, weight_policy(), **kwargs)
    shutdown_after(collector)
    return collector


# ---------------------------------------------------------------------------------- policy versions
def test_policy_version_is_the_one_every_worker_acknowledged(shutdown_after):
    collector = multi_sync(shutdown_after, track_policy_version=True)
    assert collector.policy_version == 0 and collector.worker_policy_versions() == {0: 0, 1: 0}
    iterator = iter(collector)
    next(iterator)
    collector.update_policy_weights_()
    assert collector.policy_version == 1 and collector.worker_policy_versions() == {0: 1, 1: 1}
    assert collector.stats()["policy_version"] == 1
    collector.update_policy_weights_(worker_ids=[0])  # the workers are apart: no one version describes them
    assert collector.policy_version is None and collector.get_policy_version() is None
    assert collector.worker_policy_versions() == {0: 2, 1: 1}
    assert "policy_version" not in collector.stats()
    collector.update_policy_weights_()  # the workers moved together, still apart
    assert collector.policy_version is None and collector.worker_policy_versions() == {0: 3, 1: 2}
    collector.increment_version()  # the user says which version it is: the acknowledged ones, plus one
    assert collector.policy_version == 2
    next(iterator)  # collection goes on


def test_an_update_to_every_worker_by_index_is_acknowledged(shutdown_after):
    collector = multi_sync(shutdown_after, track_policy_version=True)
    collector.update_policy_weights_(worker_ids=[1, 0])
    assert collector.policy_version == 1 and collector.worker_policy_versions() == {0: 1, 1: 1}


def test_an_update_not_waited_for_is_not_acknowledged(shutdown_after):
    scheme = weight_update.SharedMemWeightSyncScheme(sync=False)
    collector = multi_sync(shutdown_after, track_policy_version=True, weight_sync_schemes={"policy": scheme})
    next(iter(collector))
    collector.update_policy_weights_()
    assert collector.policy_version is None


def test_without_versions_each_worker_reports_none(shutdown_after):
    collector = multi_sync(shutdown_after)
    collector.update_policy_weights_(worker_ids=[0])
    assert collector.policy_version is None and collector.worker_policy_versions() == {0: None, 1: None}


# ---------------------------------------------------------------------------------- stats(workers=...)
PROGRESS_KEYS = ("stepped_frames", "trajectory_completed_frames", "trajectory_pending_frames", "replay_written_frames",
                 "completed_trajectories")


def replay_buffer(capacity: int = 1000):
    if LIBRARY == "torchrl":
        data = importlib.import_module("torchrl.data")
        return data.ReplayBuffer(storage=data.LazyTensorStorage(capacity))
    return importlib.import_module("rlharvest.data").ReplayBuffer(capacity)


def progress(stats: dict, prefix: str = "") -> tuple:
    return tuple(stats[prefix + key] for key in PROGRESS_KEYS)


def test_a_collector_counts_its_steps_and_writes(shutdown_after):
    collector = collectors.Collector(step_env(), weight_policy(), frames_per_batch=8, total_frames=-1)
    shutdown_after(collector)
    iterator = iter(collector)
    next(iterator), next(iterator)
    assert progress(collector.stats()) == (16, 0, 0, 0, 0)  # no trajectory is assembled: none counted
    buffered = collectors.Collector(step_env(), weight_policy(), frames_per_batch=8, total_frames=-1,
                                    replay_buffer=replay_buffer())
    shutdown_after(buffered)
    iterator = iter(buffered)
    next(iterator), next(iterator)
    assert progress(buffered.stats()) == (16, 0, 0, 16, 0)


def test_complete_trajectories_are_counted_where_they_are_assembled(shutdown_after):
    collector = multi_sync(shutdown_after, trajs_per_batch=2, traj_format="cat")
    iterator = iter(collector)
    next(iterator)  # each worker stepped 4 times: one episode of 3 ended, one step pending
    stats = collector.stats()
    assert progress(stats) == (8, 6, 2, 0, 2)
    assert stats["frames"] == 8 and stats["workers"] == 2


def test_per_worker_views_and_bad_values(shutdown_after):
    collector = multi_sync(shutdown_after)
    next(iter(collector))
    per_worker, both = collector.stats(workers="per_worker"), collector.stats(workers="both")
    for worker in range(2):
        assert per_worker[f"worker_{worker}/stepped_frames"] == 4 and both[f"worker_{worker}/frames"] == 4
    assert "stepped_frames" not in per_worker and both["stepped_frames"] == 8
    assert per_worker["workers"] == 2 and per_worker["workers_alive"] == 2
    for bad in ("all", "per-worker", None):
        with pytest.raises(ValueError, match=r"workers must be one of 'aggregate', 'per_worker' or 'both'"):
            collector.stats(workers=bad)


# ---------------------------------------------------------------------------------- replay_write_mode
def test_a_collector_writes_complete_trajectories_or_whole_rollouts(shutdown_after):
    for mode, written in (("trajectory", (16, 15, 1, 15, 5)), ("rollout", (16, 0, 0, 16, 0))):
        buffer = replay_buffer()
        collector = collectors.Collector(step_env(), weight_policy(), frames_per_batch=8, total_frames=-1,
                                         replay_buffer=buffer, replay_write_mode=mode)
        shutdown_after(collector)
        iterator = iter(collector)
        next(iterator), next(iterator)
        assert len(buffer) == written[3] and progress(collector.stats()) == written
        if mode == "trajectory":  # whole episodes only: each ends with done
            steps = buffer[:len(buffer)]  # in order (sampling draws with replacement)
            assert int(steps["next", "done"].sum()) == 5


def test_workers_write_complete_trajectories(shutdown_after):
    buffer = replay_buffer()
    collector = multi_sync(shutdown_after, replay_buffer=buffer, replay_write_mode="trajectory", trajs_per_write=1)
    iterator = iter(collector)
    next(iterator), next(iterator)  # each worker stepped 8 times: two episodes of 3 each, 2 steps pending
    assert len(buffer) == 12
    assert progress(collector.stats()) == (16, 12, 4, 12, 4)  # what the workers wrote, counted here


# ---------------------------------------------------------------------------------- progress across a checkpoint
CUMULATIVE = [key for key in PROGRESS_KEYS if key != "trajectory_pending_frames"]


def cumulative(stats: dict) -> dict:
    return {key: stats[key] for key in CUMULATIVE}


def test_a_loaded_collector_counts_on_from_the_checkpoint(shutdown_after):
    def build():
        collector = collectors.Collector(step_env(), weight_policy(), frames_per_batch=8, total_frames=-1,
                                         replay_buffer=replay_buffer(), replay_write_mode="trajectory")
        shutdown_after(collector)
        return collector

    first = build()
    iterator = iter(first)
    next(iterator), next(iterator)
    state, saved = first.state_dict(), cumulative(first.stats())
    assert saved == dict(zip(CUMULATIVE, (16, 15, 15, 5)))
    loaded = build()
    loaded.load_state_dict(state)
    assert cumulative(loaded.stats()) == saved
    next(iter(loaded))
    stats = loaded.stats()
    assert stats["stepped_frames"] == 24 and stats["completed_trajectories"] > 5
    assert stats["replay_written_frames"] == stats["trajectory_completed_frames"] > 15


def test_a_loaded_multi_process_collector_counts_on_what_its_workers_wrote(shutdown_after):
    first = multi_sync(shutdown_after, replay_buffer=replay_buffer(), replay_write_mode="trajectory")
    iterator = iter(first)
    next(iterator), next(iterator)
    state, saved = first.state_dict(), cumulative(first.stats())
    assert saved == dict(zip(CUMULATIVE, (16, 12, 12, 4)))
    first.shutdown()
    loaded = multi_sync(shutdown_after, replay_buffer=replay_buffer(), replay_write_mode="trajectory")
    loaded.load_state_dict(state)
    assert cumulative(loaded.stats()) == saved
    next(iter(loaded))
    stats = loaded.stats()
    assert stats["stepped_frames"] == 24 and stats["completed_trajectories"] >= 6


# ---------------------------------------------------------------------------------- progress while workers run free
def counted_while_running(collector, buffer, at_least: int) -> tuple[dict, int]:
    """Once ``stats()`` counts ``at_least`` frames written, the counts and the buffer's length at one
    moment: paused, no write in flight."""
    wait_until(lambda: collector.stats()["replay_written_frames"] >= at_least, timeout=60.0,
               what=f"stats() counting {at_least} frames written while the workers run free")
    with collector.pause():
        return collector.stats(), len(buffer)


@pytest.mark.parametrize("name, mode", [("MultiSyncCollector", "trajectory"), ("MultiAsyncCollector", "rollout"),
                                        ("MultiAsyncCollector", None)])
def test_workers_writing_in_the_background_are_counted_as_they_write(shutdown_after, name, mode):
    buffer = replay_buffer(100_000)
    collector = getattr(collectors, name)([step_env] * 2, weight_policy(), frames_per_batch=8, total_frames=-1,
                                          replay_buffer=buffer, replay_write_mode=mode)
    shutdown_after(collector)
    collector.start()
    stats, length = counted_while_running(collector, buffer, 60)
    assert stats["replay_written_frames"] == length >= 60
    if mode == "trajectory":  # whole episodes of 3 steps; at most 2 steps of one pending per worker
        assert stats["trajectory_completed_frames"] == length == 3 * stats["completed_trajectories"]
        assert 0 <= stats["trajectory_pending_frames"] <= 4
        assert stats["stepped_frames"] == length + stats["trajectory_pending_frames"]
    else:
        assert stats["completed_trajectories"] == stats["trajectory_pending_frames"] == 0
        assert stats["stepped_frames"] >= length
    stats, length = counted_while_running(collector, buffer, length + 60)  # and on after the pause
    assert stats["replay_written_frames"] == length


def test_counting_in_the_background_goes_on_from_a_checkpoint(shutdown_after):
    first = multi_sync(shutdown_after, replay_buffer=replay_buffer(100_000), replay_write_mode="trajectory")
    iterator = iter(first)
    next(iterator), next(iterator)
    state, saved = first.state_dict(), cumulative(first.stats())
    first.shutdown()
    buffer = replay_buffer(100_000)
    loaded = multi_sync(shutdown_after, replay_buffer=buffer, replay_write_mode="trajectory")
    loaded.load_state_dict(state)
    before = len(buffer)  # the checkpoint's steps, where the buffer is part of it
    loaded.start()
    stats, length = counted_while_running(loaded, buffer, saved["replay_written_frames"] + 60)
    assert stats["replay_written_frames"] - saved["replay_written_frames"] == length - before >= 60
    assert stats["completed_trajectories"] - saved["completed_trajectories"] == (length - before) // 3


@pytest.mark.parametrize("arguments", [dict(replay_write_mode="episode"), dict(replay_write_mode="rollout"),
                                       dict(replay_write_mode="trajectory", trajs_per_batch=2),
                                       dict(replay_write_mode="rollout", trajs_per_write=2)])
def test_bad_replay_write_modes_are_refused(arguments):
    buffered = "trajs_per_batch" in arguments or "trajs_per_write" in arguments or arguments["replay_write_mode"] != "rollout"
    with pytest.raises(ValueError, match="replay_write_mode|trajs_per_write"):
        collectors.Collector(step_env(), weight_policy(), frames_per_batch=8, total_frames=-1,
                             replay_buffer=replay_buffer() if buffered else None, **arguments)
