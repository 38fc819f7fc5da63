"""AsyncBatchedCollector: envs in workers, one batched policy in the collector's process."""

from __future__ import annotations

import functools
import os
import signal
import time

import pytest
import torch
from mocks import CountingPolicy, FaultyEnv, wait_until

from rlharvest import WorkerError, WorkerTimeoutError
from rlharvest.collectors import AsyncBatchedCollector
from rlharvest.data import ReplayBuffer
from rlharvest.envs import CountingEnv

pytestmark = pytest.mark.timeout(60)

BACKENDS = ["multiprocessing", "threading"]


class SlowCountingEnv(CountingEnv):
    """A CountingEnv whose every step takes ``delay`` seconds."""

    def __init__(self, delay: float = 0.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.delay = delay

    def _step_arrays(self, actions):
        time.sleep(self.delay)
        return super()._step_arrays(actions)


class RaisingPolicy(CountingPolicy):
    """A CountingPolicy that raises once its weight is negative."""

    def forward(self, tensordict):
        if float(self.weight) < 0:
            raise ValueError("negative weight")
        return super().forward(tensordict)


def _collect(collector) -> list:
    batches = [batch.clone() if batch is not None else None for batch in collector]
    collector.shutdown()
    return batches


def _per_env(batches: list) -> dict[int, list]:
    """Per env, its frames in the order they were collected (``(observation, next observation, id, version)``)."""
    frames: dict[int, list] = {}
    for batch in batches:
        for row in range(batch.shape[0]):
            frames.setdefault(int(batch["env_index"][row]), []).append((
                int(batch["observation"][row]), int(batch["next", "observation"][row]),
                int(batch["collector", "traj_ids"][row]), int(batch["policy_version"][row])))
    return frames


@pytest.mark.parametrize("backend", BACKENDS)
def test_flat_batches_of_exactly_frames_per_batch(backend):
    collector = AsyncBatchedCollector([CountingEnv] * 3, policy=CountingPolicy(), frames_per_batch=30,
                                      total_frames=100, env_backend=backend)
    batches = _collect(collector)
    assert [b.batch_size for b in batches] == [torch.Size([30])] * 3 + [torch.Size([10])]  # the last one is cut
    keys = set(batches[0].keys(True, True))
    assert {"observation", "action", "env_index", "policy_version", ("collector", "traj_ids"),
            ("next", "observation"), ("next", "reward"), ("next", "done"), ("next", "terminated")} <= keys
    frames = _per_env(batches)
    assert frames and set(frames) <= {0, 1, 2}  # every env delivering is checked with unbounded frames below
    for env_frames in frames.values():  # each env's frames are consecutive steps of its own episodes
        for (obs, nxt, _, _), (next_obs, _, _, _) in zip(env_frames, env_frames[1:]):
            assert nxt == obs + 1 and next_obs == (0 if nxt > 5 else nxt)


@pytest.mark.parametrize("backend", BACKENDS)
def test_trajectory_ids_are_unique_across_envs(backend):
    collector = AsyncBatchedCollector([CountingEnv] * 4, policy=CountingPolicy(), frames_per_batch=48,
                                      total_frames=-1, env_backend=backend, envs_per_worker=2)
    batches: list = []
    try:
        # Which worker delivers first is up to the scheduler (threads share the GIL): collect at least
        # 5 batches and until every env delivered, within a bound.
        for batch in collector:
            batches.append(batch.clone())
            seen = set(torch.cat([b["env_index"] for b in batches]).tolist())
            if (len(batches) >= 5 and len(seen) == 4) or len(batches) >= 200:
                break
    finally:
        collector.shutdown()
    frames = _per_env(batches)
    assert set(frames) == {0, 1, 2, 3}
    owner: dict[int, int] = {}
    for env, env_frames in frames.items():
        for obs, _, traj, _ in env_frames:
            assert owner.setdefault(traj, env) == env  # an id never appears in two envs
        ids = [traj for _, _, traj, _ in env_frames]
        for (obs, _, traj, _), previous in zip(env_frames[1:], ids):
            assert (traj == previous) == (obs != 0)  # a new id exactly when a new episode starts


def test_a_slow_env_does_not_hold_up_the_fast_ones():
    fns = [CountingEnv, CountingEnv, lambda: SlowCountingEnv(delay=0.05)]
    collector = AsyncBatchedCollector(fns, policy=CountingPolicy(), frames_per_batch=40, total_frames=240,
                                      transition_chunk_size=2)
    frames = _per_env(_collect(collector))
    fast, slow = min(len(frames[0]), len(frames[1])), len(frames.get(2, []))
    assert fast >= 5 * max(slow, 1), (len(frames[0]), len(frames[1]), slow)


@pytest.mark.parametrize("backend", BACKENDS)
def test_weight_update_visible_in_the_next_batch(backend):
    policy = CountingPolicy(weight=1.0)
    collector = AsyncBatchedCollector([CountingEnv] * 2, policy=policy, frames_per_batch=40, total_frames=-1,
                                      transition_chunk_size=4, env_backend=backend)
    try:
        first = collector.next()
        assert (first["action"] == 1).all() and (first["policy_version"] == 0).all()
        with torch.no_grad():
            policy.weight.fill_(0.0)  # not applied until update_policy_weights_: the server runs a copy
        second = collector.next()
        assert (second["action"] == 1).all() and (second["policy_version"] == 0).all()
        collector.update_policy_weights_()
        assert collector.policy_version == 1
        third = collector.next()
        versions, actions = third["policy_version"], third["action"].squeeze(-1)
        assert (versions == 1).any()  # frames already in flight are older; the next batch has new ones
        assert (actions[versions == 1] == 0).all() and (actions[versions == 0] == 1).all()
        fourth = collector.next()
        assert (fourth["policy_version"] == 1).all() and (fourth["action"] == 0).all()
    finally:
        collector.shutdown()


def test_yield_completed_trajectories():
    collector = AsyncBatchedCollector([CountingEnv] * 3, policy=CountingPolicy(), frames_per_batch=12,
                                      total_frames=60, yield_completed_trajectories=True)
    trajectories = _collect(collector)
    assert sum(t.numel() for t in trajectories) >= 60 and len(trajectories) == 10
    ids = set()
    for trajectory in trajectories:
        assert trajectory.batch_size == (6,) and trajectory["env_index"].unique().numel() == 1
        assert trajectory["observation"].squeeze(-1).tolist() == list(range(6))
        assert trajectory["next", "done"].squeeze(-1).tolist() == [False] * 5 + [True]
        (traj,) = trajectory["collector", "traj_ids"].unique().tolist()
        assert traj not in ids
        ids.add(traj)


def test_server_batches_whichever_envs_are_ready_up_to_max_batch_size():
    collector = AsyncBatchedCollector([CountingEnv] * 4, policy=CountingPolicy(), frames_per_batch=80,
                                      total_frames=160, max_batch_size=2)
    _collect(collector)
    stats = collector.server_stats()
    assert stats["max_batch_frames"] <= 2 and stats["frames"] >= 160
    collector = AsyncBatchedCollector([CountingEnv] * 4, policy=CountingPolicy(), frames_per_batch=80,
                                      total_frames=160, min_batch_size=4, server_timeout=1.0)
    _collect(collector)
    stats = collector.server_stats()
    assert stats["max_batch_frames"] == 4 and stats["frames"] / stats["batches"] > 2


class _ObservationEcho(torch.nn.Module):
    """action = 1; ``echo`` = the observation as bfloat16, a dtype numpy lacks (the server's rows fall back to torch)."""

    def forward(self, observation: torch.Tensor):
        return torch.ones_like(observation), observation.to(torch.bfloat16) * 2


@pytest.mark.parametrize("envs_per_worker", [1, 2])
def test_each_worker_gets_the_outputs_of_its_own_rows(envs_per_worker):
    from tensordict.nn import TensorDictModule

    policy = TensorDictModule(_ObservationEcho(), in_keys=["observation"], out_keys=["action", "echo"])
    collector = AsyncBatchedCollector([functools.partial(CountingEnv, max_steps=3 + env) for env in range(4)],
                                      policy=policy, frames_per_batch=40, total_frames=120,
                                      envs_per_worker=envs_per_worker)
    batches = _collect(collector)
    for batch in batches:
        assert batch["echo"].dtype == torch.bfloat16
        assert torch.equal(batch["echo"], (batch["observation"] * 2).to(torch.bfloat16))
        assert torch.equal(batch["action"], torch.ones_like(batch["observation"]))
    assert sum(b.numel() for b in batches) == 120


def test_replay_buffer_hook_seeds_and_policy_factory():
    buffer = ReplayBuffer(capacity=1000)
    seen = []
    collector = AsyncBatchedCollector([CountingEnv] * 2, policy_factory=CountingPolicy, frames_per_batch=20,
                                      total_frames=60, replay_buffer=buffer, post_collect_hook=seen.append)
    assert collector.set_seed(3) == 5
    before = []
    collector.set_pre_collect_hook(lambda: before.append(len(buffer)))  # set after start: still ours
    assert list(collector) == [None, None, None]
    assert collector.stats()["frames"] == 60 and collector.stats()["workers"] == 2
    collector.shutdown()
    assert len(buffer) == 60 and [b.numel() for b in seen] == [20, 20, 20] and before == [0, 20, 40]


def test_start_collects_into_the_replay_buffer_in_the_background():
    buffer = ReplayBuffer(capacity=10_000)
    policy = CountingPolicy()
    collector = AsyncBatchedCollector([CountingEnv] * 2, policy=policy, frames_per_batch=20, total_frames=-1,
                                      replay_buffer=buffer)
    assert collector.getattr_policy("weight") is policy.weight
    collector.start()
    with pytest.raises(RuntimeError, match="already running"):
        collector.start()
    try:
        wait_until(lambda: len(buffer) >= 100, timeout=30, what="100 frames in the buffer")
        assert collector.is_running()
    finally:
        collector.async_shutdown()
    assert not collector.is_running()


def test_policy_error_is_raised_as_it_is():
    policy = RaisingPolicy()
    collector = AsyncBatchedCollector([CountingEnv] * 2, policy=policy, frames_per_batch=20, total_frames=-1)
    collector.next()
    with torch.no_grad():
        policy.weight.fill_(-1.0)
    collector.update_policy_weights_()
    with pytest.raises(ValueError, match="negative weight"):
        for _ in range(100):
            collector.next()
    collector.shutdown()


def test_env_exception_names_the_worker():
    kwargs = [{"bad": [1], "worker_idx": i, "after_steps": 3} for i in range(2)]
    collector = AsyncBatchedCollector([FaultyEnv] * 2, policy=CountingPolicy(), frames_per_batch=20,
                                      total_frames=-1, create_env_kwargs=kwargs)
    with pytest.raises(WorkerError) as info:
        for _ in range(100):
            collector.next()
    assert info.value.worker_idx == 1 and isinstance(info.value, ValueError)
    collector.shutdown()


def test_killed_worker_is_detected_as_a_death():
    # worker_timeout is far above the test's timeout: only noticing the death itself can pass
    collector = AsyncBatchedCollector([CountingEnv] * 2, policy=CountingPolicy(), frames_per_batch=20,
                                      total_frames=-1, worker_timeout=1000.0)
    try:
        collector.next()
        os.kill(collector.worker_pids()[0], signal.SIGKILL)
        with pytest.raises(WorkerError, match="SIGKILL") as info:
            for _ in range(10**4):
                collector.next()
        assert info.value.worker_idx == 0 and not isinstance(info.value, WorkerTimeoutError)
    finally:
        collector.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_envs_that_do_not_stack_are_refused_at_construction(backend):
    fns = [CountingEnv, functools.partial(CountingEnv, batch_size=(2,))]
    with pytest.raises(ValueError, match="does not stack with the first worker's"):
        AsyncBatchedCollector(fns, policy=CountingPolicy(), frames_per_batch=20, env_backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_policy_failing_on_the_first_root_raises_its_own_error(backend):
    policy = RaisingPolicy()
    with torch.no_grad():
        policy.weight.fill_(-1.0)
    with pytest.raises(ValueError, match="negative weight"):
        AsyncBatchedCollector([CountingEnv] * 2, policy=policy, frames_per_batch=20, env_backend=backend)


def test_a_worker_that_fails_to_build_is_named():
    def broken():
        raise RuntimeError("no such simulator")

    with pytest.raises(WorkerError, match="no such simulator") as info:
        AsyncBatchedCollector([CountingEnv, broken], policy=CountingPolicy(), frames_per_batch=20)
    assert info.value.worker_idx == 1


@pytest.mark.parametrize("kwargs, error, match", [
    ({"transport": object()}, ValueError, "transport="),
    ({"server_config": object()}, ValueError, "server_config="),
    ({"worker_affinity": [[0]]}, ValueError, "worker_affinity="),
    ({"weight_sync": object()}, ValueError, "weight_sync="),
    ({"reset_at_each_iter": True}, ValueError, "reset_at_each_iter=True"),
    ({"env_backend": "ray"}, ValueError, "env_backend must be one of"),
    ({"envs_per_worker": 2}, ValueError, "does not divide the 3 envs"),
    ({"no_such_option": 1}, TypeError, "no_such_option"),
])
def test_unsupported_arguments_are_refused_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        AsyncBatchedCollector([CountingEnv] * 3, policy=CountingPolicy(), frames_per_batch=30, **kwargs)


@pytest.mark.parametrize("frames_per_batch, error, match", [
    ([10, 10, 10], TypeError, r"frames_per_batch must be an int for AsyncBatchedCollector, got \[10, 10, 10\]"),
    (None, TypeError, "frames_per_batch is required"),
])
def test_frames_per_batch_is_one_int_named_in_the_error(frames_per_batch, error, match):
    with pytest.raises(error, match=match):
        AsyncBatchedCollector([CountingEnv] * 3, policy=CountingPolicy(), frames_per_batch=frames_per_batch)


def test_policy_and_policy_factory_are_exclusive():
    with pytest.raises(TypeError, match="mutually exclusive"):
        AsyncBatchedCollector([CountingEnv], policy=CountingPolicy(), policy_factory=CountingPolicy,
                              frames_per_batch=10)
    with pytest.raises(TypeError, match="one of policy or policy_factory"):
        AsyncBatchedCollector([CountingEnv], frames_per_batch=10)


def test_start_needs_a_replay_buffer():
    collector = AsyncBatchedCollector([CountingEnv], policy=CountingPolicy(), frames_per_batch=10)
    with pytest.raises(RuntimeError, match="replay_buffer"):
        collector.start()
    collector.shutdown()
