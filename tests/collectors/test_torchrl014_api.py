"""TorchRL 0.14's additions to the collector API: hooks, stats(), map_fn, get_distant_attr,
fake_tensordict, getattr_*, get_cached_weights, track_traj_ids, compact_obs, init_fn,
auto_register_policy_transforms."""

from __future__ import annotations

import json
import os

import pytest
import torch
from mocks import CountingPolicy, weight_policy
from tensordict.nn import TensorDictModule

from rlharvest.collectors import Collector, MultiAsyncCollector, MultiSyncCollector
from rlharvest.envs import CountingEnv, GymEnv

pytestmark = pytest.mark.timeout(90)


def envs(count: int):
    return [lambda: CountingEnv(max_steps=3)] * count


def test_hooks_run_around_each_batch_in_process():
    events = []
    collector = Collector(CountingEnv(), CountingPolicy(), frames_per_batch=4, total_frames=12,
                          pre_collect_hook=lambda: events.append("pre"),
                          post_collect_hook=lambda batch: events.append(("post", batch.numel())))
    batches = list(collector)
    assert events == ["pre", ("post", 4)] * 3 and len(batches) == 3
    collector.pre_collect_hook = None
    assert collector.pre_collect_hook is None and callable(collector.post_collect_hook)
    with pytest.raises(TypeError, match="post_collect_hook must be callable"):
        collector.post_collect_hook = 3
    collector.shutdown()


def test_a_failing_hook_propagates():
    def broken(batch):
        raise RuntimeError("hook failed")

    collector = Collector(CountingEnv(), CountingPolicy(), frames_per_batch=4, total_frames=8, post_collect_hook=broken)
    with pytest.raises(RuntimeError, match="hook failed"):
        list(collector)
    collector.shutdown()


@pytest.mark.parametrize("collector_class", [MultiSyncCollector, MultiAsyncCollector])
def test_hooks_run_in_the_workers_and_setters_reach_them(collector_class, tmp_path):
    log = tmp_path / "hooks.log"

    def pre_hook():
        with open(log, "a") as file:
            file.write(f"pre {os.getpid()}\n")

    collector = collector_class(envs(2), CountingPolicy(), frames_per_batch=8, total_frames=32, pre_collect_hook=pre_hook)
    next(iter(collector))
    collector.set_post_collect_hook(lambda batch: open(log, "a").write(f"post {os.getpid()} {batch.numel()}\n"))
    list(collector)
    collector.shutdown()
    lines = [line.split() for line in log.read_text().splitlines()]
    pids = {int(line[1]) for line in lines}
    assert len(pids) == 2 and os.getpid() not in pids
    assert {line[0] for line in lines} == {"pre", "post"}


def test_stats_of_a_collector_are_plain_scalars():
    collector = Collector(CountingEnv(), CountingPolicy(), frames_per_batch=4, total_frames=8, track_policy_version=True)
    assert collector.stats() == {"frames": 0, "batches": 0, "total_frames": 8, "completed": False,
                                 "requested_frames_per_batch": 4, "policy_version": 0, "time_env_s": 0.0,
                                 "time_policy_s": 0.0, "time_transport_s": 0.0, "time_waiting_s": 0.0,
                                 # TorchRL's next release's progress keys (docs/torchrl-compatibility.md)
                                 "stepped_frames": 0, "trajectory_completed_frames": 0, "trajectory_pending_frames": 0,
                                 "replay_written_frames": 0, "completed_trajectories": 0}
    seen = [collector.stats()["frames"] for _ in collector]
    assert seen == [4, 8] and collector.stats()["completed"] and collector.stats()["batches"] == 2
    assert json.loads(json.dumps(collector.stats())) == collector.stats()
    collector.shutdown()
    endless = Collector(CountingEnv(), frames_per_batch=4, total_frames=-1)
    assert "total_frames" not in endless.stats() and "policy_version" not in endless.stats()
    endless.shutdown()


def test_stats_of_workers():
    collector = MultiSyncCollector(envs(2), CountingPolicy(), frames_per_batch=8, total_frames=16)
    with pytest.raises(ValueError, match="workers must be one of"):
        collector.stats(workers="all")
    next(iter(collector))
    stats = collector.stats()
    assert stats["workers"] == stats["workers_alive"] == 2 and stats["frames"] == 8
    both = collector.stats(workers="both")
    assert both["worker_0/frames"] == both["worker_1/frames"] == 4 and both["frames"] == 8
    per_worker = collector.stats(workers="per_worker")
    assert "frames" not in per_worker and "worker_1/batches" in per_worker
    collector.shutdown()


def test_map_fn_and_get_distant_attr():
    collector = Collector(CountingEnv(), frames_per_batch=4, total_frames=4, worker_idx=5)
    assert collector.get_distant_attr("worker_idx") == 5
    assert collector.map_fn("get_distant_attr", [("worker_idx",), ("frames_per_batch",)]) == [5, 4]
    with pytest.raises(ValueError, match="same length"):
        collector.map_fn("get_distant_attr", [("worker_idx",)], [{}, {}])
    collector.shutdown()
    multi = MultiAsyncCollector(envs(2), frames_per_batch=4, total_frames=4)
    assert multi.get_distant_attr("worker_idx") == [0, 1]
    assert multi.map_fn("get_distant_attr", [("worker_idx",), ("worker_idx",)]) == [0, 1]
    with pytest.raises(ValueError, match="Expected 2 argument entries"):
        multi.map_fn("get_distant_attr", [("worker_idx",)])
    multi.shutdown()


class FirstAction(torch.nn.Module):
    """CartPole's first action, one-hot (an action of 4 values, one per observation entry, is refused)."""

    def forward(self, observation):
        return torch.nn.functional.one_hot(torch.zeros(observation.shape[:-1], dtype=torch.long), 2)


@pytest.mark.parametrize("use_buffers", [None, False])
def test_fake_tensordict_matches_a_batch(use_buffers):
    policy = TensorDictModule(FirstAction(), in_keys=["observation"], out_keys=["action"])
    collector = Collector(GymEnv("CartPole-v1"), policy, frames_per_batch=10, total_frames=10,
                          use_buffers=use_buffers, set_truncated=True)
    fake = collector.fake_tensordict()
    real = next(iter(collector))
    assert fake.batch_size == real.batch_size and fake.names == real.names
    assert set(fake.keys(True, True)) == set(real.keys(True, True))
    assert all(fake[k].dtype == real[k].dtype for k in real.keys(True, True))
    assert not fake["observation"].any() and fake["next", "truncated"][-1].all()
    collector.shutdown()
    with pytest.raises(NotImplementedError, match="fake_tensordict"):
        MultiSyncCollector(envs(1), frames_per_batch=4).fake_tensordict()


def test_getattr_helpers_and_cached_weights():
    collector = Collector(CountingEnv(max_steps=7), CountingPolicy(), frames_per_batch=4)
    assert collector.getattr_env("max_steps") == 7 and collector.getattr_policy("weight").item() == 1.0
    collector.shutdown()
    multi = MultiSyncCollector(envs(2), weight_policy(3.0), frames_per_batch=4)
    cached = multi.get_cached_weights("policy")
    assert cached is not None and cached["module", "weight"].item() == 3.0
    assert multi.get_cached_weights("critic") is None
    multi.shutdown()


@pytest.mark.parametrize("collector_class", [Collector, MultiSyncCollector])
def test_track_traj_ids_false_and_compact_obs(collector_class):
    env_fn = envs(1)[0] if collector_class is Collector else envs(2)
    collector = collector_class(env_fn, CountingPolicy(), frames_per_batch=8, total_frames=8, track_traj_ids=False,
                                compact_obs=True)
    batch = next(iter(collector))
    collector.shutdown()
    keys = set(batch.keys(True, True))
    assert ("collector", "traj_ids") not in keys and ("next", "observation") not in keys
    assert {("next", "reward"), ("next", "done"), "observation"} <= keys


def test_init_fn_runs_in_each_worker_before_its_env(tmp_path):
    marker = tmp_path / "init"

    def init_fn():
        marker.with_suffix(f".{os.getpid()}").write_text("ready")

    def make_env():
        assert marker.with_suffix(f".{os.getpid()}").exists(), "the env was built before init_fn ran"
        return CountingEnv()

    collector = MultiSyncCollector([make_env] * 2, frames_per_batch=4, total_frames=4, init_fn=init_fn)
    next(iter(collector))
    collector.shutdown()
    assert len(list(tmp_path.glob("init.*"))) == 2
    with pytest.raises(TypeError, match="init_fn"):
        MultiSyncCollector(envs(1), frames_per_batch=4, init_fn="no")


@pytest.mark.parametrize("collector_class", [Collector, MultiSyncCollector])
def test_auto_register_policy_transforms(collector_class):
    """A policy that needs no TorchRL transform: every value collects from the env as it is (the
    recurrent TorchRL policies are in compat/test_policy_transforms.py)."""
    env = CountingEnv(max_steps=3)
    env_fn = env if collector_class is Collector else [lambda: CountingEnv(max_steps=3)]
    for value in (None, False, True):
        collector = collector_class(env_fn, weight_policy(1.0), frames_per_batch=4, total_frames=4,
                                    auto_register_policy_transforms=value)
        assert sorted(next(iter(collector))["observation"].reshape(-1).tolist()) == [0, 1, 2, 3]
        if collector_class is Collector:
            assert collector.env is env
        collector.shutdown()
    with pytest.raises(ValueError, match="auto_register_policy_transforms must be True, False or None, got 'yes'"):
        collector_class(env_fn, frames_per_batch=4, auto_register_policy_transforms="yes")


def test_trajectory_arguments_are_validated():
    for kwargs, match in [({"trajs_per_batch": 0}, "trajs_per_batch"), ({"traj_format": "list"}, "traj_format"),
                          ({"trajs_per_write": 2}, "trajs_per_write")]:
        with pytest.raises(ValueError, match=match):
            Collector(CountingEnv(), frames_per_batch=4, **kwargs)


@pytest.mark.parametrize("collector_class", [Collector, MultiSyncCollector])
def test_the_private_counters_torchrl_scripts_read_follow_the_batches_and_a_reload(collector_class):
    """``_frames`` and ``_iter``, read by TorchRL's own reloading test: frames collected and the index
    of the last batch, carried by ``state_dict``."""
    make = lambda: (Collector(CountingEnv(max_steps=3), CountingPolicy(), frames_per_batch=4, total_frames=20)  # noqa: E731
                    if collector_class is Collector else
                    collector_class(envs(2), CountingPolicy(), frames_per_batch=4, total_frames=20))
    collector = make()
    try:
        assert (collector._frames, collector._iter) == (0, -1)
        for index, _ in enumerate(collector):
            if index == 2:
                break
        assert (collector._frames, collector._iter) == (12, 2)
        state = collector.state_dict()
    finally:
        collector.shutdown()
    collector = make()
    try:
        collector.load_state_dict(state)
        assert (collector._frames, collector._iter) == (12, 2)
    finally:
        collector.shutdown()
