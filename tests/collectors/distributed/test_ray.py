"""RayCollector on a real local Ray (one per session: the ``ray_cluster`` fixture in conftest.py).

Deterministic envs (CountingEnv, whose observation counts the steps of its trajectory) and a policy
whose action is its only weight, so batches say exactly which weights collected them.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
from mocks import wait_until, weight_policy
from ray_check import live_actors

from rlharvest import WorkerError
from rlharvest.collectors.distributed import RayCollector, RayWeightUpdater
from rlharvest.data import ReplayBuffer
from rlharvest.envs import CountingEnv
from rlharvest.transport.ray import _FREE_WINDOW
from rlharvest.collectors.engine import engine_of

pytestmark = [pytest.mark.ray, pytest.mark.timeout(60), pytest.mark.usefixtures("ray_session")]

IDS = ("collector", "traj_ids")


def counting(max_steps: int = 2):
    return lambda: CountingEnv(max_steps=max_steps)


def make(count: int = 2, policy=None, **kwargs) -> RayCollector:
    kwargs.setdefault("frames_per_batch", 8)
    kwargs.setdefault("total_frames", -1)
    return RayCollector([counting()] * count, policy if policy is not None else weight_policy(1.0), **kwargs)


def set_weight(policy, value: float) -> None:
    with torch.no_grad():
        policy.module.weight.fill_(value)


def test_sync_batches_stack_actors_in_order_with_unique_ids_and_stats_ask_the_actors(ray_cluster):
    collector = make(sync=True, total_frames=16)
    iterator = iter(collector)
    batches = [next(iterator)]
    stats = collector.stats()
    assert stats["workers"] == stats["workers_alive"] == 2
    assert stats["worker_frames"] == stats["frames"] == 8  # sync: each actor's 4 frames, none in flight
    per_worker = collector.stats("per_worker")
    assert "frames" not in per_worker and "worker_frames" not in per_worker
    assert per_worker["worker_0/frames"] == per_worker["worker_1/frames"] == 4
    both = collector.stats("both", timeout=None)
    assert both["worker_frames"] == 8 and both["worker_1/frames"] == 4
    with pytest.raises(ValueError, match="timeout"):
        collector.stats(timeout=-1)
    batches += list(iterator)
    assert [tuple(b.shape) for b in batches] == [(2, 4), (2, 4)]
    assert batches[0]["observation"].reshape(2, 4).tolist() == [[0, 1, 2, 0]] * 2  # auto-reset past max_steps
    assert batches[1]["observation"].reshape(2, 4).tolist() == [[1, 2, 0, 1]] * 2  # each actor's env goes on
    ids = torch.cat([b[IDS].reshape(-1) for b in batches])
    per_actor = [set(torch.cat([b[IDS][w] for b in batches]).tolist()) for w in range(2)]
    assert not per_actor[0] & per_actor[1] and len(set(ids.tolist())) == 6  # 3 trajectories per actor
    assert collector.remote_collectors == []  # iteration shut it down, leaving no actor
    wait_until(lambda: not live_actors(ray_cluster), timeout=10.0, what="every actor dead")
    collector.shutdown()  # idempotent


def test_async_batches_first_ready_with_unique_ids_and_state_per_actor():
    collector = make(sync=False, total_frames=32)
    try:
        states = collector.state_dict()
        assert isinstance(states, list) and len(states) == 2
        collector.load_state_dict(states)
        collector.load_state_dict(states[0])
        with pytest.raises(ValueError, match="one per actor"):
            collector.load_state_dict(states * 2)
        assert isinstance(collector.set_seed(3), int) and collector.stats()["workers_alive"] == 2
        batches = list(collector)
        assert len(batches) == 4 and all(b.shape == (8,) for b in batches)
        seen: dict[int, set] = {}
        for batch in batches:
            ids = batch[IDS].tolist()
            actor = ids[0] % 2  # actor i's local id k is k * 2 + i
            assert all(i % 2 == actor for i in ids)
            seen.setdefault(actor, set()).update(ids)
        assert all(not seen[a] & seen[b] for a in seen for b in seen if a != b)
    finally:
        collector.shutdown()


def gated(path: str, timeout: float = 30.0):
    """An env constructor that returns only once ``path`` exists (and fails after ``timeout``)."""
    def make():
        import time

        deadline = time.monotonic() + timeout
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} was never created")
            time.sleep(0.02)
        return CountingEnv(max_steps=2)
    return make


def test_async_yields_the_first_actor_built_then_waits_for_the_others_first_batch(tmp_path):
    gate = tmp_path / "release"
    # the constructor returns while actor 1 cannot build its env (waiting for it would time out)
    collector = RayCollector([counting(), gated(str(gate))], weight_policy(1.0), frames_per_batch=8,
                             total_frames=-1, sync=False)
    try:
        iterator = iter(collector)
        first = next(iterator)  # does not wait for actor 1
        assert set((first[IDS] % 2).tolist()) == {0}
        gate.touch()
        # actor 0's next batches wait until actor 1 delivered its first (docs/collection.md, "A batch")
        assert set((next(iterator)[IDS] % 2).tolist()) == {1}
    finally:
        collector.shutdown()


def test_async_first_batches_come_from_every_actor():
    """Issue 33: 2 actors, 20-frame batches, 200 frames: all 10 batches came from the actor built
    first (counters 0-199 of one trajectory), the other's first batch never came."""
    collector = RayCollector([lambda: CountingEnv(max_steps=1000)] * 2, weight_policy(1.0), frames_per_batch=20,
                             total_frames=200, sync=False)
    actors = [int(batch[IDS][0]) % 2 for batch in collector]
    assert len(actors) == 10 and sorted(actors[:2]) == [0, 1], actors
    collector.shutdown()


def test_async_raises_an_actor_failure_to_build_at_the_first_batch():
    def broken():
        raise RuntimeError("no env for actor 1")

    collector = RayCollector([counting(), broken], weight_policy(1.0), frames_per_batch=8, total_frames=-1,
                             sync=False)
    try:
        iterator = iter(collector)
        with pytest.raises(WorkerError, match="no env for actor 1") as info:
            for _ in range(200):  # actor 0 may deliver batches before actor 1's failure arrives
                next(iterator)
        assert info.value.worker_idx == 1 and isinstance(info.value, RuntimeError)
    finally:
        collector.shutdown()


def sender_of(collector: RayCollector):
    return engine_of(collector).weights.sender_schemes["policy"]._sender


def test_actors_on_another_node_get_updates_through_the_object_store(ray_cluster):
    policy = weight_policy(1.0)
    collector = make(policy=policy, sync=True)
    try:
        iterator = iter(collector)
        next(iterator)
        engine_of(collector).fleet.requests.handles[1].node_id = "another-node"  # as Ray would report an actor placed elsewhere
        set_weight(policy, 3.0)
        collector.update_policy_weights_()
        assert next(iterator)["action"].unique().tolist() == [3.0]
        sender = sender_of(collector)
        assert sender.book.current == {0: 0} and not sender.book.pending  # only actor 0 runs on a generation
        sender._driver_node = "a-third-node"  # the replacement counts as remote: it gets a reference
        ray_cluster.kill(collector.remote_collectors[0])
        wait_until(lambda: not engine_of(collector).fleet.requests.handles[0].is_alive(), timeout=20.0, what="the actor's death")
        engine_of(collector).fleet.renew(0)
        assert next(iterator)["action"].unique().tolist() == [3.0] and 0 not in sender.book.current
    finally:
        collector.shutdown()


class FrameCounter:
    """A replay buffer living in a Ray actor of its own: keeps each batch's observations."""

    def __init__(self) -> None:
        self.observations: list = []

    def extend(self, data) -> int:
        self.observations.extend(data["observation"].reshape(-1).tolist())
        return len(self.observations)

    def frames(self) -> list:
        return self.observations


def test_start_writes_into_a_replay_buffer_that_is_a_ray_actor():
    import ray

    buffer = ray.remote(num_cpus=0)(FrameCounter).remote()  # no CPU: the two collector actors hold both
    collector = make(sync=False, replay_buffer=buffer)
    try:
        collector.start()
        wait_until(lambda: len(ray.get(buffer.frames.remote())) >= 64, timeout=30.0, what="64 frames in the actor")
        with collector.pause():
            frozen = len(ray.get(buffer.frames.remote()))
            time.sleep(0.3)
            assert len(ray.get(buffer.frames.remote())) == frozen  # paused: nothing more is written
    finally:
        collector.async_shutdown()
    frames = ray.get(buffer.frames.remote())
    assert len(frames) >= 64 and set(frames) <= {0, 1, 2}
    assert collector.remote_collectors == []
    ray.kill(buffer)


class SlowBuffer(ReplayBuffer):
    """A replay buffer that takes 20 ms per write: far slower than actors stepping CountingEnv."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.writes = 0

    def extend(self, data):
        time.sleep(0.02)
        self.writes += 1
        return super().extend(data)


def test_actors_running_free_wait_for_a_slower_replay_buffer():
    # Unbounded, the actors pushed ~1000 batches/s at a buffer taking 50: pause() then had to write
    # everything queued meanwhile, and the parent's polls grew until one went unanswered.
    buffer = SlowBuffer(capacity=100_000)
    collector = make(frames_per_batch=4, sync=False, replay_buffer=buffer)
    collector.start()
    try:
        with pytest.raises(RuntimeError, match=r"before start\(\)"):
            collector.add_collectors([counting()])
        wait_until(lambda: buffer.writes >= 20, timeout=30.0, what="the buffer written while the actors push")
        before = buffer.writes
        with collector.pause():  # writes what was pushed before the pause, then stops the actors
            queued = buffer.writes - before
        # per actor: a window taken by the worker pool, one pulled, one waiting in the actor, the
        # rollout under way, one more finished while the pause is on its way (the pipeline refills as
        # the buffer writes: 30 against the bound without it, once in six runs) and the one the pause cuts
        # short; plus the write under way when ``before`` was read (it counts once done). Unbounded,
        # it is hundreds.
        assert queued <= 2 * (3 * _FREE_WINDOW + 3) + 1, queued
        written = buffer.writes
        wait_until(lambda: buffer.writes > written, timeout=30.0, what="collection resumed")
    finally:
        collector.async_shutdown()
    assert collector.remote_collectors == []
    assert set(buffer.sample(len(buffer))["observation"].unique().tolist()) <= {0, 1, 2}


def test_replay_write_mode_writes_the_actors_complete_trajectories():
    buffer = ReplayBuffer(capacity=1000)
    collector = make(sync=True, replay_buffer=buffer, replay_write_mode="trajectory", trajs_per_write=1)
    try:
        iterator = iter(collector)
        next(iterator), next(iterator)  # each actor stepped 8 times: two episodes of 3 ended, 2 steps pending
        steps = buffer[:len(buffer)]
        assert len(buffer) == 12 and int(steps["next", "done"].sum()) == 4  # whole episodes only
        stats = collector.stats()
        assert (stats["replay_written_frames"], stats["completed_trajectories"]) == (12, 4)
        assert (stats["trajectory_completed_frames"], stats["trajectory_pending_frames"]) == (12, 4)
    finally:
        collector.shutdown()


def test_a_killed_actor_raises_worker_error_naming_it(ray_cluster):
    # worker_timeout far beyond the test's own timeout: only noticing the death ends the wait in time
    collector = make(sync=True, worker_timeout=600.0)
    try:
        iterator = iter(collector)
        next(iterator)
        ray_cluster.kill(collector.remote_collectors[1])
        with pytest.raises(WorkerError) as info:
            next(iterator)
            next(iterator)
        assert info.value.worker_idx == 1 and "actor" in str(info.value)
    finally:
        collector.shutdown()


def test_the_legacy_updater_pushes_to_the_listed_actors():
    policy = weight_policy(1.0)
    collector = make(policy=policy, sync=True, weight_updater=RayWeightUpdater(remote_collectors=[None, None]))
    try:
        iterator = iter(collector)
        next(iterator)
        set_weight(policy, 2.0)
        collector.update_policy_weights_(policy, worker_ids=[0])
        batch = next(iterator)
        assert batch["action"][0].unique().tolist() == [2.0] and batch["action"][1].unique().tolist() == [1.0]
    finally:
        collector.shutdown()


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="num_collectors"):
        RayCollector(counting(), frames_per_batch=8, num_collectors=0)
    with pytest.raises(ValueError, match="remote_configs"):
        RayCollector([counting()] * 2, frames_per_batch=8, remote_configs=[{}])
    with pytest.raises(TypeError, match="launcher"):
        RayCollector([counting()], frames_per_batch=8, launcher="mp")
    with pytest.raises(ValueError, match="trajs_per_write"):  # whole rollouts have no trajectories to count
        RayCollector([counting()], frames_per_batch=8, replay_buffer=ReplayBuffer(capacity=8),
                     replay_write_mode="rollout", trajs_per_write=2)
    with pytest.raises(ValueError, match="replay_write_mode"):
        RayCollector([counting()], frames_per_batch=8, replay_write_mode="trajectory")


def test_missing_ray_names_the_extra(monkeypatch):
    from rlharvest.transport.ray import require_ray

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"rlharvest\[ray\]"):
        require_ray()


def test_with_restarts_a_killed_actor_is_replaced_and_collection_goes_on(ray_cluster):
    policy = weight_policy(1.0)
    collector = make(policy=policy, sync=True, max_worker_restarts=1)
    try:
        iterator = iter(collector)
        used = set(next(iterator)[IDS].reshape(-1).tolist())
        set_weight(policy, 3.0)
        collector.update_policy_weights_()
        ray_cluster.kill(collector.remote_collectors[1])
        batches = [next(iterator) for _ in range(3)]
        for batch in batches:
            assert batch.shape == (2, 4) and batch["action"].unique().tolist() == [3.0]  # complete, current weights
            obs, ids = batch["observation"].squeeze(-1), batch[IDS]
            same_traj = ids[:, 1:] == ids[:, :-1]
            assert ((obs[:, 1:] - obs[:, :-1])[same_traj] == 1).all()  # no frame twice or skipped
        stats = collector.stats()
        assert stats["restarts"] == 1 and stats["worker_1/restarts"] == 1
        assert not used & set(batches[-1][IDS][1].tolist())  # the replacement's trajectories are new ones
    finally:
        collector.shutdown()


@pytest.mark.timeout(120)
def test_stats_of_an_actor_that_does_not_answer_is_left_out_after_the_timeout(tmp_path):
    gate = tmp_path / "release"
    collector = RayCollector([counting(), gated(str(gate))], weight_policy(1.0), frames_per_batch=8,
                             total_frames=-1, sync=False)  # actor 1 is stuck building its env
    try:
        iterator = iter(collector)
        next(iterator)  # actor 0's (it then collects its next batch, and answers after it)
        start = time.monotonic()
        stats = collector.stats("both", timeout=2.0)
        assert time.monotonic() - start < 10
        assert stats["workers"] == 2 and stats["workers_alive"] == 1
        # actor 1's only keys are those kept here without asking it (its restarts and preemptions)
        assert "worker_0/frames" in stats and not any(key.startswith("worker_1/") for key in stats
                                                      if not key.startswith(("worker_1/restart", "worker_1/preempt")))
        gate.touch()
        for _ in range(3):
            next(iterator)  # the late answer of actor 1 does not disturb collection
        assert collector.stats(timeout=30.0)["workers_alive"] == 2
    finally:
        collector.shutdown()
