"""RayCollector.add_collectors on a real local Ray (the session's ``ray_cluster``, conftest.py).

CountingEnv's observation counts the steps of its trajectory, so a trajectory id that goes on
across batches is visible; the policy's action is its only weight, so batches say which weights
collected them. Actors added later get a longer-lived env (max_steps=5): with actions of 1 or 2, an
observation above 2 comes from them.
"""

from __future__ import annotations

import time

import pytest
import torch
from mocks import SlowCountingEnv, wait_until, weight_policy
from ray_check import live_actors

from rlharvest import WorkerError
from rlharvest.collectors.distributed import RayCollector
from rlharvest.data import ReplayBuffer
from rlharvest.envs import CountingEnv
from rlharvest.collectors.engine import engine_of

pytestmark = [pytest.mark.ray, pytest.mark.timeout(90), pytest.mark.usefixtures("ray_session")]

IDS = ("collector", "traj_ids")


def counting(max_steps: int = 2):
    return lambda: CountingEnv(max_steps=max_steps)


def broken():
    def build():
        raise ValueError("this env cannot be built")
    return build


def set_weight(policy, value: float) -> None:
    with torch.no_grad():
        policy.module.weight.fill_(value)


def stream(batches: list, row: int | None = None) -> tuple[torch.Tensor, ...]:
    """(ids, observations, actions) of one actor's batches (row ``row`` of sync batches), in order."""
    parts = [b if row is None else b[row] for b in batches]
    return tuple(torch.cat([p[key].flatten() for p in parts]) for key in (IDS, "observation", "action"))


def check_trajectories(streams: list[tuple[torch.Tensor, ...]]) -> None:
    """Within each actor's stream, a trajectory keeps its id and its counter moves by the action at
    every step (no frame lost or repeated, across the growth too); no id is shared by two actors."""
    owners: dict[int, int] = {}
    for actor, (ids, obs, actions) in enumerate(streams):
        for traj in ids.unique().tolist():
            assert owners.setdefault(traj, actor) == actor, f"trajectory id {traj} used by two actors"
            steps, moves = obs[ids == traj].float(), actions[ids == traj]
            assert (steps[1:] - steps[:-1] == moves[:-1]).all()


def test_sync_growth_adds_a_row_with_the_current_weights_and_unique_ids(ray_cluster):
    policy = weight_policy(1.0)
    collector = RayCollector([counting()], policy, frames_per_batch=4, total_frames=20, sync=True)
    try:
        seed = collector.set_seed(11)  # (it restarts episodes: before the first batch)
        iterator = iter(collector)
        first = next(iterator)
        assert first.shape == (1, 4) and len(collector) == 5
        set_weight(policy, 3.0)
        collector.update_policy_weights_()  # before growth: the new actor starts on these weights
        collector.add_collectors([counting(5)], 1, policy, {}, {"num_cpus": 1})
        assert collector.num_collectors == 2 and len(collector.remote_collectors) == 2
        assert collector.requested_frames_per_batch == 8 and len(collector) == 3  # 4 + 8 + 8 frames
        assert engine_of(collector).fleet.specs[1].seed == seed  # the seed chain goes on into the new actor
        stats = collector.stats()
        assert stats["workers"] == stats["workers_alive"] == 2 and stats["worker_1/restarts"] == 0
        assert len(collector.state_dict()) == 2
        second = next(iterator)
        assert second.shape == (2, 4) and second["action"].unique().tolist() == [3.0]
        assert second["observation"][1].flatten().tolist() == [0, 3, 0, 3]  # a fresh env, on the new weights
        set_weight(policy, 1.0)
        collector.update_policy_weights_(worker_ids=[1])  # reaches the new actor only
        third = next(iterator)
        assert third["action"][0].unique().tolist() == [3.0] and third["action"][1].unique().tolist() == [1.0]
        assert next(iterator, None) is None and engine_of(collector).tally.frames == 20  # total_frames, exactly
        assert first[IDS][0, -1] == second[IDS][0, 0]  # the trajectory running at the growth kept its id
        check_trajectories([stream([first, second, third], 0), stream([second, third], 1)])
        assert collector.remote_collectors == []  # iteration shut every actor down, the new one too
        wait_until(lambda: not live_actors(ray_cluster), timeout=10.0, what="every actor dead")
    finally:
        collector.shutdown()


def test_async_growth_serves_the_new_actor_with_the_current_weights_and_exact_total():
    # the first actor takes 80 ms a batch: the added one collects some of the 11 batches left even on
    # a loaded machine (with two fast actors, the first could collect them all before the second ran)
    policy = weight_policy(1.0)
    collector = RayCollector([SlowCountingEnv], policy, frames_per_batch=4, total_frames=48, sync=False)
    try:
        iterator = iter(collector)
        batches = [next(iterator)]
        set_weight(policy, 2.0)
        collector.update_policy_weights_()
        collector.add_collectors(counting(5))
        assert collector.requested_frames_per_batch == 4 and len(collector) == 12
        batches += list(iterator)
        assert len(batches) == 12 and all(b.shape == (4,) for b in batches)
        assert sum(b.numel() for b in batches) == 48 == engine_of(collector).tally.frames
        assert all(b["action"].unique().tolist() == [2.0] for b in batches[1:])
        # a batch comes from one actor; the new one's env counts past 2 (max_steps=5)
        per_actor: dict[int, list] = {0: [batches[0]]}
        for batch in batches[1:]:
            per_actor.setdefault(1 if (batch["observation"] > 2).any() else 0, []).append(batch)
        assert 1 in per_actor, "the new actor collected"
        check_trajectories([stream(per_actor[0]), stream(per_actor[1])])
    finally:
        collector.shutdown()


def test_an_added_actor_runs_free_into_the_replay_buffer_and_pauses_with_the_others():
    buffer = ReplayBuffer(capacity=2000)
    collector = RayCollector([counting()], weight_policy(1.0), frames_per_batch=4, total_frames=-1, sync=False,
                             replay_buffer=buffer)
    collector.add_collectors([counting(5)])  # before iterating: fine too

    def from_both() -> bool:  # the new actor's env counts past 2
        return len(buffer) >= 32 and bool((buffer.sample(len(buffer))["observation"] > 2).any())

    collector.start()
    try:
        wait_until(from_both, timeout=30.0, what="frames of both actors in the buffer")
        with collector.pause():  # both actors stopped: nothing more is written meanwhile
            frozen = len(buffer)
            time.sleep(0.5)
            assert len(buffer) == frozen
        wait_until(lambda: len(buffer) > frozen, timeout=30.0, what="collection resumed")
    finally:
        collector.async_shutdown()
    assert collector.remote_collectors == []


def test_a_new_actor_that_fails_to_start_is_named_and_the_others_go_on():
    collector = RayCollector([counting()], frames_per_batch=4, total_frames=-1, sync=True)
    try:
        iterator = iter(collector)
        next(iterator)
        with pytest.raises(WorkerError, match="cannot be built") as info:
            collector.add_collectors([broken()])
        assert info.value.worker_idx == 1
        assert collector.num_collectors == 1 and len(engine_of(collector).backend.handles) == 1
        assert next(iterator).shape == (1, 4)
    finally:
        collector.shutdown()


def test_a_killed_new_actor_is_replaced_within_the_restart_budget(ray_cluster):
    policy = weight_policy(1.0)
    collector = RayCollector([counting()], policy, frames_per_batch=4, total_frames=-1, sync=True,
                             max_worker_restarts=1)
    try:
        iterator = iter(collector)
        next(iterator)
        collector.add_collectors([counting(5)])
        used = set(next(iterator)[IDS].flatten().tolist())
        set_weight(policy, 4.0)
        collector.update_policy_weights_()
        ray_cluster.kill(collector.remote_collectors[1])
        batch = next(iterator)
        assert batch.shape == (2, 4) and batch["action"].unique().tolist() == [4.0]
        assert not used & set(batch[IDS][1].tolist())  # the replacement's trajectories are new ones
        assert collector.stats()["worker_1/restarts"] == 1
    finally:
        collector.shutdown()


def test_add_collectors_checks_its_arguments_and_when_it_is_called():
    holder = []

    def grow_inside(batch):
        holder[0].add_collectors([counting()])
        return batch

    collector = RayCollector([counting()], frames_per_batch=4, total_frames=-1, sync=True)
    try:
        for call, match in [
            (lambda: collector.add_collectors([]), "create_env_fn"),
            (lambda: collector.add_collectors([counting()] * 2, collector_kwargs=[{}]), "collector_kwargs"),
            (lambda: collector.add_collectors([counting()] * 2, remote_configs=[{}] * 3), "remote_configs"),
            (lambda: collector.add_collectors([counting()], num_envs=0), "num_envs"),
            (lambda: collector.add_collectors([counting()], num_envs=2), "num_envs must be 1"),
            (lambda: collector.add_collectors([counting()], policy=weight_policy(1.0)), "policy"),
            (lambda: collector.add_collectors([counting()], collector_kwargs={"frames_per_batch": 8}),
             "frames_per_batch"),
        ]:
            with pytest.raises(ValueError, match=match):
                call()
        assert collector.num_collectors == 1  # nothing was started
    finally:
        collector.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        collector.add_collectors([counting()])
    collector = RayCollector([counting()], frames_per_batch=4, total_frames=-1, sync=True, postproc=grow_inside)
    holder.append(collector)
    with pytest.raises(RuntimeError, match="between two batches"):
        next(iter(collector))  # the error shuts the collector down
    assert collector.remote_collectors == []
