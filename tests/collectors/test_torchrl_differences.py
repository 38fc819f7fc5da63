"""Behaviours where rlharvest used to differ from TorchRL 0.14 (found by running TorchRL's own tests)."""

from __future__ import annotations

import os
import time

import pytest
import torch
from mocks import CountingPolicy, PrivateKeysPolicy, weight_policy

from rlharvest.collectors import (
    AsyncCollector,
    Collector,
    MultiAsyncCollector,
    MultiCollector,
    MultiSyncCollector,
)
from rlharvest.envs import CountingEnv, GymEnv
from rlharvest.policies import RandomPolicy
from rlharvest.weight_update import (
    DistributedWeightSyncScheme,
    MultiProcessWeightSyncScheme,
    NoWeightSyncScheme,
    RPCWeightSyncScheme,
    SharedMemWeightSyncScheme,
    WeightSyncScheme,
)

pytestmark = pytest.mark.timeout(90)


def envs(count: int, max_steps: int = 3):
    return [lambda: CountingEnv(max_steps=max_steps)] * count


@pytest.mark.parametrize("sync, expected", [(True, MultiSyncCollector), (False, MultiAsyncCollector),
                                            (None, MultiSyncCollector)])
def test_multi_collector_is_a_class_both_collectors_belong_to(sync, expected):
    kwargs = {} if sync is None else {"sync": sync}
    collector = MultiCollector(envs(2), frames_per_batch=4, total_frames=4, **kwargs)
    try:
        assert type(collector) is expected
        assert isinstance(collector, MultiCollector)
    finally:
        collector.shutdown()
    assert issubclass(MultiSyncCollector, MultiCollector) and issubclass(AsyncCollector, MultiCollector)


def test_a_concrete_multi_collector_refuses_a_contradicting_sync():
    with pytest.raises(TypeError, match="sync"):
        MultiSyncCollector(envs(2), frames_per_batch=4, sync=False)


def test_private_keys_are_kept_when_exclusion_is_switched_off():
    collector = Collector(CountingEnv(), PrivateKeysPolicy(), frames_per_batch=4, total_frames=8)
    collector._exclude_private_keys = False
    batch = next(iter(collector))
    assert "_dummy" in batch.keys() and ("out", "_dummy") in batch.keys(True, True)
    collector.shutdown()


@pytest.mark.parametrize("threshold", [-0.1, 1.5, "half", True])
def test_a_bad_preemptive_threshold_is_refused(threshold):
    with pytest.raises(ValueError, match="preemptive_threshold"):
        MultiSyncCollector(envs(2), frames_per_batch=4, preemptive_threshold=threshold)


def test_preemptive_threshold_of_one_never_preempts():
    collector = MultiSyncCollector(envs(2), CountingPolicy(), frames_per_batch=8, total_frames=16,
                                   preemptive_threshold=1.0)
    for batch in collector:
        assert (batch["collector", "traj_ids"] != -1).all()
    assert collector.preemptive_threshold == 1.0
    collector.shutdown()


def test_policy_version_survives_a_state_dict_round_trip():
    collector = Collector(CountingEnv(), CountingPolicy(), frames_per_batch=4, total_frames=8,
                          track_policy_version=True)
    collector.update_policy_weights_()
    collector.update_policy_weights_()
    next(iter(collector))
    state, saved = collector.state_dict(), collector.policy_version
    collector.shutdown()
    restored = Collector(CountingEnv(), CountingPolicy(), frames_per_batch=4, total_frames=8,
                         track_policy_version=True)
    restored.load_state_dict(state)
    assert restored.policy_version == saved == 2
    assert restored.state_dict()["frames"] == 4
    assert next(iter(restored))["policy_version"].eq(2).all()
    restored.update_policy_weights_()
    assert restored.policy_version == 3
    restored.shutdown()


def test_worker_policy_versions_survive_a_state_dict_round_trip():
    def make():
        return MultiSyncCollector(envs(2), weight_policy(1.0), frames_per_batch=8, total_frames=80,
                                  track_policy_version=True,
                                  weight_sync_schemes={"policy": MultiProcessWeightSyncScheme()})

    collector = make()
    collector.update_policy_weights_()
    collector.update_policy_weights_()
    state = collector.state_dict()
    saved = [state[f"worker{w}"]["policy_version"] for w in range(2)]
    collector.shutdown()
    assert saved == [2, 2]
    restored = make()
    restored.load_state_dict(state)
    again = restored.state_dict()
    assert [again[f"worker{w}"]["policy_version"] for w in range(2)] == saved
    batch = next(iter(restored))
    assert batch["policy_version"].eq(2).all()
    restored.shutdown()


def test_a_spec_less_random_policy_takes_the_envs_spec():
    policy = RandomPolicy()
    with pytest.raises(RuntimeError, match="action_spec"):
        policy.sample()
    collector = Collector(CountingEnv(), policy, frames_per_batch=4, total_frames=4)
    batch = next(iter(collector))
    assert policy.action_spec is not None and batch["action"].shape == (4, 1)
    collector.shutdown()
    collector = MultiSyncCollector(envs(2), policy_factory=RandomPolicy, frames_per_batch=4, total_frames=4)
    assert next(iter(collector))["action"].shape == (2, 2, 1)
    collector.shutdown()


@pytest.mark.parametrize("scheme", [SharedMemWeightSyncScheme, MultiProcessWeightSyncScheme,
                                    DistributedWeightSyncScheme, RPCWeightSyncScheme])
def test_a_collector_refuses_schemes_that_need_workers_at_once(scheme):
    with pytest.raises(ValueError, match="weight_sync_schemes\\['policy'\\].*no.*worker|has none"):
        Collector(CountingEnv(), CountingPolicy(), frames_per_batch=4, weight_sync_schemes={"policy": scheme()})


def test_a_collector_accepts_a_scheme_without_workers():
    collector = Collector(CountingEnv(), CountingPolicy(), frames_per_batch=4, total_frames=4,
                          weight_sync_schemes={"policy": NoWeightSyncScheme()})
    collector.update_policy_weights_()
    collector.shutdown()


@pytest.mark.parametrize("backend, expected", [
    ("none", NoWeightSyncScheme), ("direct", NoWeightSyncScheme), ("shared", SharedMemWeightSyncScheme),
    ("thread", SharedMemWeightSyncScheme), ("process", MultiProcessWeightSyncScheme),
    ("multiprocessing", MultiProcessWeightSyncScheme), ("distributed", DistributedWeightSyncScheme),
    ("rpc", RPCWeightSyncScheme),
])
def test_scheme_from_backend(backend, expected):
    scheme = WeightSyncScheme.from_backend(backend, timeout=5.0)
    assert type(scheme) is expected and scheme.timeout == 5.0


def test_scheme_from_an_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of .*'shared'.*got 'nccl'"):
        WeightSyncScheme.from_backend("nccl")


def test_env_rollout_arguments():
    env = CountingEnv(max_steps=2)
    ones = lambda td: td.set("action", torch.ones(1, dtype=torch.int8))  # noqa: E731
    assert env.rollout(10, ones).batch_size == (3,)                      # stops at the first done
    long = env.rollout(10, ones, break_when_any_done=False)
    assert long["observation"].squeeze(-1).tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    seen = []
    start = env.reset()
    start.set("observation", torch.full((1,), 1, dtype=torch.int32))
    env.count = start["observation"].clone()
    out = env.rollout(10, ones, callback=lambda e, td: seen.append(td["next", "observation"].item()),
                      auto_reset=False, tensordict=start)
    assert out["observation"].squeeze(-1).tolist() == [1, 2] and seen == [2, 3]
    assert out.names[-1] == "time"
    with pytest.raises(RuntimeError, match="tensordict"):
        env.rollout(3, auto_reset=False)
    gym = GymEnv("CartPole-v1")
    truncated = gym.rollout(5, break_when_any_done=False, set_truncated=True)
    assert truncated["next", "truncated"][-1].all() and truncated["next", "done"][-1].all()
    gym.close()


def test_a_scheme_initialised_by_the_user_reads_the_collectors_policy():
    """A SharedMemWeightSyncScheme set up with params_map before the collector exists: a later
    update_policy_weights_() reads the collector's policy, reaches the workers, and refreshes the
    buffers the user gave (as TorchRL's, which workers read directly)."""
    from tensordict import TensorDict

    policy = weight_policy(1.0)
    buffers = TensorDict.from_module(policy).clone().share_memory_()
    scheme = SharedMemWeightSyncScheme()
    scheme.init_on_sender(params_map={0: buffers, 1: buffers})
    collector = MultiSyncCollector(envs(2), policy, frames_per_batch=8, total_frames=-1,
                                   weight_sync_schemes={"policy": scheme})
    try:
        iterator = iter(collector)
        assert next(iterator)["action"].eq(1).all()
        with torch.no_grad():
            policy.module.weight.fill_(0.0)
        collector.update_policy_weights_()
        assert next(iterator)["action"].eq(0).all()
        assert buffers["module", "weight"].eq(0).all()
    finally:
        collector.shutdown()


def test_a_model_inside_the_workers_envs_is_updated_from_given_weights():
    """weight_sync_schemes for "env.transform[0]": the main process has no env, so the update brings
    its weights (TorchRL's documented pattern for env-side modules)."""
    from mocks import OffsetCountingEnv
    from tensordict import TensorDict

    collector = MultiSyncCollector(
        [lambda: OffsetCountingEnv(max_steps=3)] * 2, CountingPolicy(), frames_per_batch=8, total_frames=-1,
        weight_sync_schemes={"policy": SharedMemWeightSyncScheme(), "env.transform[0]": SharedMemWeightSyncScheme()})
    try:
        iterator = iter(collector)
        assert next(iterator)["observation"].min() == 0
        shifted = TensorDict({"offset": torch.full((1,), 10.0)}, batch_size=[])
        collector.update_policy_weights_(weights_dict={"env.transform[0]": shifted})
        assert next(iterator)["next", "observation"].min() >= 10  # the root of step 0 was observed before
    finally:
        collector.shutdown()


def test_a_multi_async_collector_serving_a_parent_collects_on_demand():
    """Inside a node, a MultiAsyncCollector does not prefetch: the batch after an update the parent
    pushed (here: an update of this collector between two batches) uses the new weights."""
    policy = CountingPolicy()
    collector = MultiAsyncCollector(envs(1), policy, frames_per_batch=50, total_frames=-1, worker_idx=0)
    try:
        iterator = iter(collector)
        assert next(iterator)["action"].eq(1).all()
        time.sleep(0.2)  # a prefetching collector would have finished its next batch meanwhile
        with torch.no_grad():
            policy.weight.add_(1)
        collector.update_policy_weights_()
        assert next(iterator)["action"].eq(2).all()
    finally:
        collector.shutdown()


class _RecordingFactory:
    """A policy factory that records the pid of every process that calls it."""

    def __init__(self, path) -> None:
        self.path = path

    def __call__(self):
        with open(self.path, "a") as file:
            file.write(f"{os.getpid()}\n")
        return weight_policy(1.0)


@pytest.mark.parametrize("collector_class", [MultiSyncCollector, MultiAsyncCollector])
def test_a_policy_factory_runs_only_in_the_workers(collector_class, tmp_path):
    calls = tmp_path / "calls"
    collector = collector_class(envs(2), policy_factory=_RecordingFactory(calls), frames_per_batch=8, total_frames=16)
    batches = list(collector)
    collector.shutdown()
    pids = [int(line) for line in calls.read_text().split()]
    assert len(batches) == 2 and len(pids) == 2 and len(set(pids)) == 2 and os.getpid() not in pids


@pytest.mark.parametrize("collector_class", [Collector, MultiSyncCollector])
def test_trajectory_ids_continue_after_a_state_dict_is_loaded(collector_class):
    """Ids in a replay buffer stay unique: a reloaded collector continues the episodes in flight at the
    checkpoint with their ids, and hands out ids after the saved ones to new episodes (docs/checkpoints.md;
    asynchronous collectors: tests/collectors/test_checkpoint.py)."""
    def make():
        env_fn = envs(1)[0] if collector_class is Collector else envs(2)
        return collector_class(env_fn, CountingPolicy(), frames_per_batch=8, total_frames=-1)

    collector = make()
    iterator = iter(collector)
    seen = set()
    for _ in range(3):
        batch = next(iterator)
        seen |= set(batch["collector", "traj_ids"].flatten().tolist())
    in_flight = set(batch["collector", "traj_ids"][..., -1].flatten().tolist())
    state = collector.state_dict()
    collector.shutdown()
    saved = int(state["traj_pool"]["traj_id"])
    assert saved > max(seen)
    restored = make()
    restored.load_state_dict(state)
    resumed = iter(restored)
    ids = set().union(*(next(resumed)["collector", "traj_ids"].flatten().tolist() for _ in range(3)))
    restored.shutdown()
    # no finished episode's id comes back; ids between the last seen and the saved counter were taken
    # by the episodes that began at the end of the last batch
    assert ids & seen <= in_flight and max(ids) >= saved
