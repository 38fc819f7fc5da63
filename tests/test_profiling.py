"""ProfileConfig and enable_profile on a Collector (docs/collection.md, "Running free, profiling, seeds")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlharvest.collectors import Collector, ProfileConfig
from rlharvest.envs import CountingEnv
from rlharvest.collectors.engine import engine_of

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("warmup", [2, 3])
def test_profile_config_validation(warmup):
    with pytest.raises(ValueError, match="num_rollouts .* must be greater than warmup_rollouts"):
        ProfileConfig(num_rollouts=2, warmup_rollouts=warmup)
    with pytest.raises(ValueError, match="warmup_rollouts must be >= 0"):
        ProfileConfig(warmup_rollouts=-1)


def test_profile_config_paths_and_workers():
    config = ProfileConfig()
    assert config.get_save_path(0) == Path("./collector_profile_0.json")
    assert ProfileConfig(save_path="/tmp/t_{worker_idx}.json").get_save_path(3) == Path("/tmp/t_3.json")
    assert config.should_profile_worker(0) and not config.should_profile_worker(1)
    assert ProfileConfig(workers=[1, 2]).should_profile_worker(2)
    assert config.activities == ["cpu", "cuda"] and len(config.get_activities()) >= 1
    with pytest.warns(UserWarning, match="disabled"):
        assert ProfileConfig(activities=["tpu"]).get_activities() == []


def test_enable_profile_single_collector(tmp_path):
    collector = Collector(CountingEnv(), frames_per_batch=8, total_frames=40)
    save_path = tmp_path / "traces" / "trace_{worker_idx}.json"
    collector.enable_profile(workers=[0], num_rollouts=3, warmup_rollouts=1, save_path=save_path)
    assert collector.profile_config.num_rollouts == 3
    assert len(list(collector)) == 5
    trace = tmp_path / "traces" / "trace_0.json"
    assert trace.exists()
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(1 for e in events if e.get("name") == "collector_rollout") == 2  # warm-up rollout skipped


def test_enable_profile_on_trace_ready(tmp_path):
    seen = []
    collector = Collector(CountingEnv(), frames_per_batch=8, total_frames=24)
    collector.enable_profile(num_rollouts=2, warmup_rollouts=0, on_trace_ready=seen.append)
    list(collector)
    assert len(seen) == 1


def test_enable_profile_cannot_call_after_iteration():
    collector = Collector(CountingEnv(), frames_per_batch=8, total_frames=24)
    next(iter(collector))
    with pytest.raises(RuntimeError, match="Cannot enable profiling after iteration"):
        collector.enable_profile()
    collector.shutdown()


def test_enable_profile_replaces_config_and_validates():
    collector = Collector(CountingEnv(), frames_per_batch=8)
    assert collector.profile_config is None
    collector.enable_profile(num_rollouts=4)
    collector.enable_profile(num_rollouts=5, warmup_rollouts=2)
    assert collector.profile_config.num_rollouts == 5
    with pytest.raises(ValueError):
        collector.enable_profile(num_rollouts=1, warmup_rollouts=1)
    collector.shutdown()


def test_disable_profile_stops_profiling_here_and_in_workers(tmp_path):
    from rlharvest.collectors import Collector, MultiSyncCollector
    from rlharvest.envs import CountingEnv

    collector = Collector(CountingEnv(), frames_per_batch=4, total_frames=-1)
    collector.disable_profile()  # not profiling: nothing to do
    collector.enable_profile(num_rollouts=3, warmup_rollouts=1, save_path=str(tmp_path / "single.json"))
    collector.disable_profile()
    assert collector.profile_config is None and engine_of(collector).profiler is None
    next(iter(collector))
    collector.shutdown()
    multi = MultiSyncCollector([CountingEnv] * 2, frames_per_batch=4, total_frames=-1)
    multi.enable_profile(workers=[0, 1], num_rollouts=3, warmup_rollouts=1,
                         save_path=str(tmp_path / "trace_{worker_idx}.json"))
    assert all(config is not None for config in multi.get_distant_attr("profile_config"))
    multi.disable_profile()
    assert multi.profile_config is None
    assert multi.get_distant_attr("profile_config") == [None, None]
    multi.shutdown()
