"""Weight updates of RayCollector's actors: the direct channel of actors on the driver's node (no Ray
actor call per update), the object-store path, and failures while an update is applied.

Deterministic envs and a policy whose action is its only weight (tests/mocks.py), so batches say
exactly which weights collected them.
"""

from __future__ import annotations

import functools
import os
import threading
import time

import pytest
import torch
from mocks import ClockEnv, wait_until, weight_policy

from rlharvest import WorkerError
from rlharvest.collectors import Collector
from rlharvest.collectors.distributed import RayCollector, RayWeightSyncScheme
from rlharvest.envs import CountingEnv
from rlharvest.collectors.engine import engine_of

pytestmark = [pytest.mark.ray, pytest.mark.timeout(60), pytest.mark.usefixtures("ray_session")]


def counting():
    return CountingEnv(max_steps=2)


def set_weight(policy, value: float) -> None:
    with torch.no_grad():
        policy.module.weight.fill_(value)


def spy_and_start(collector: RayCollector) -> tuple:
    """``(sender, calls, iterator)``: the sender of the policy's weights, the list its actor calls
    are recorded in (``(actor, initial)`` per ``deliver_weights`` call), and the collector's iterator
    once the first batch is taken."""
    sender = engine_of(collector).weights.sender_schemes["policy"]._sender
    calls, send = [], sender._send

    def recorded(worker, version, body, initial):
        calls.append((worker, initial))
        return send(worker, version, body, initial)

    sender._send = recorded
    iterator = iter(collector)
    next(iterator)
    return sender, calls, iterator


def actions(batch) -> list:
    return [batch["action"][actor].unique().tolist() for actor in range(batch.shape[0])]


def segment_files(sender) -> list[str]:
    """The /dev/shm files of the sender's generation buffers."""
    return [f"/dev/shm/{generation.handle[0].lstrip('/')}" for generation in sender.book.pool._generations.values()]


def test_updates_of_actors_on_this_node_take_the_direct_channel_and_shared_memory_leaving_no_segment():
    policy = weight_policy(1.0)
    collector = Collector(counting, policy, backend="ray", num_collectors=2, sync=True, frames_per_batch=8,
                          weight_sync_schemes={"policy": RayWeightSyncScheme()})
    try:
        assert isinstance(collector, RayCollector) and collector.num_collectors == 2
        sender, calls, iterator = spy_and_start(collector)
        set_weight(policy, 5.0)  # no update: the actors must not see the learner's tensors
        assert actions(next(iterator)) == [[1.0], [1.0]]
        set_weight(policy, 2.0)
        collector.update_policy_weights_()  # returns once both actors acknowledged
        assert actions(next(iterator)) == [[2.0], [2.0]]
        set_weight(policy, 6.0)
        collector.update_policy_weights_(worker_ids=[1])  # a subset: only actor 1 is told
        assert actions(next(iterator)) == [[2.0], [6.0]]
        assert calls == [] and set(sender._server.conns) == {0, 1}
        assert sender._server.board.tolist() == [1, 2]  # the version announced to each actor
        assert sender.book.current == {0: 0, 1: 1}  # each actor runs on a generation of its own
        files = segment_files(sender)
        assert len(files) == 2 and all(os.path.exists(path) for path in files)
        set_weight(policy, 8.0)
        collector.update_policy_weights_()  # into the one generation neither actor runs on
        assert actions(next(iterator)) == [[8.0], [8.0]] and len(segment_files(sender)) == 3
        files = segment_files(sender)
    finally:
        collector.shutdown()
    assert not [path for path in files if os.path.exists(path)]


def test_a_replacement_on_this_node_opens_a_channel_of_its_own(ray_cluster):
    policy = weight_policy(1.0)
    collector = RayCollector([counting], policy, frames_per_batch=4, sync=True)
    try:
        sender, calls, iterator = spy_and_start(collector)
        ray_cluster.kill(collector.remote_collectors[0])
        wait_until(lambda: not engine_of(collector).fleet.requests.handles[0].is_alive(), timeout=20.0, what="the actor's death")
        engine_of(collector).fleet.renew(0)
        assert calls == [(0, True)] and next(iterator)["action"].unique().tolist() == [1.0]
        set_weight(policy, 5.0)
        collector.update_policy_weights_()
        assert next(iterator)["action"].unique().tolist() == [5.0] and calls == [(0, True)]
    finally:
        collector.shutdown()


def test_weights_cascade_through_the_channel_into_a_multisync_collector_inside_an_actor():
    policy = weight_policy(1.0)
    collector = RayCollector([counting], policy, frames_per_batch=8, sync=True, collector_class="sync",
                             num_workers_per_collector=2)
    try:
        sender, calls, iterator = spy_and_start(collector)
        set_weight(policy, 7.0)
        collector.update_policy_weights_()  # the actor's MultiSyncCollector forwards it to its workers
        batch = next(iterator)
        assert batch.shape[:2] == (1, 2)  # actor, its sub-workers
        assert batch["action"].unique().tolist() == [7.0] and calls == []
    finally:
        collector.shutdown()


def test_use_shared_memory_false_takes_an_actor_call_per_update():
    policy = weight_policy(1.0)
    collector = RayCollector([counting] * 2, policy, frames_per_batch=8, sync=True,
                             weight_sync_schemes={"policy": RayWeightSyncScheme(use_shared_memory=False)})
    try:
        sender, calls, iterator = spy_and_start(collector)
        set_weight(policy, 9.0)
        collector.update_policy_weights_()
        assert actions(next(iterator)) == [[9.0], [9.0]]
        assert sorted(calls) == [(0, False), (1, False)] and sender._server is None and sender.book.pool is None
    finally:
        collector.shutdown()


def test_every_frame_observed_after_an_update_returned_uses_the_new_weights():
    policy = weight_policy(1.0)
    collector = RayCollector([ClockEnv] * 2, policy, frames_per_batch=16, sync=False)
    try:
        iterator = iter(collector)
        next(iterator)
        for value in (2.0, 3.0):
            set_weight(policy, value)
            collector.update_policy_weights_()
            returned = time.monotonic()
            later = 0
            while later < 32:  # frames of both actors, collected while running free
                batch = next(iterator)
                after = batch["clock"].squeeze(-1) > returned
                later += int(after.sum())
                assert batch["action"].squeeze(-1)[after].unique().tolist() in ([value], [])
    finally:
        collector.shutdown()


class MarkedSlowClock(ClockEnv):
    """Looks for updates only every 5 s (between env steps), and says when it is inside a step."""

    def __init__(self, marker: str) -> None:
        super().__init__(delay=5.0)
        self.marker = marker

    def _step_arrays(self, actions):
        with open(self.marker, "w"):
            pass
        return super()._step_arrays(actions)


def test_an_actor_killed_while_an_update_waits_for_it_raises_worker_error_naming_it(ray_cluster, tmp_path):
    marker = tmp_path / "stepping"
    collector = RayCollector([ClockEnv, functools.partial(MarkedSlowClock, str(marker))], weight_policy(1.0),
                             frames_per_batch=2, sync=False,
                             weight_sync_schemes={"policy": RayWeightSyncScheme(timeout=600.0)})
    try:
        iterator = iter(collector)
        next(iterator)  # actor 0's batch; actor 1 may still be building (async does not wait for it)
        wait_until(marker.exists, timeout=60.0, what="actor 1 entering its 5 s env step")
        killer = threading.Timer(0.3, ray_cluster.kill, args=(collector.remote_collectors[1],))
        killer.start()
        try:
            # with a 600 s weight timeout, only noticing the death ends the wait within the test's timeout
            with pytest.raises(WorkerError) as info:
                collector.update_policy_weights_()
        finally:
            killer.join()
        assert info.value.worker_idx == 1 and "actor" in str(info.value) and "died" in str(info.value)
    finally:
        collector.shutdown()


def test_without_epoll_actors_on_this_node_are_told_by_actor_calls(monkeypatch):
    from rlharvest.transport import ray_weights

    monkeypatch.setattr(ray_weights, "channel_supported", lambda: False)  # as on a host without epoll
    policy = weight_policy(1.0)
    collector = RayCollector([counting] * 2, policy, frames_per_batch=8, sync=True)
    try:
        sender, calls, iterator = spy_and_start(collector)
        set_weight(policy, 4.0)
        collector.update_policy_weights_()
        assert actions(next(iterator)) == [[4.0], [4.0]]
        assert sorted(calls) == [(0, False), (1, False)] and sender._server is None
        assert sender.book.current == {0: 0, 1: 0}  # both swapped the same shared-memory generation in
    finally:
        collector.shutdown()


def test_the_generations_updates_alternate_between_are_mapped_while_the_actors_are_built():
    # Creating a 4 MB generation and mapping it in every actor made each of the first two updates of
    # a 1M-parameter policy 3-5x slower than the next ones.
    policy = weight_policy(1.0)
    collector = RayCollector([counting] * 2, policy, frames_per_batch=8, sync=True)
    try:
        sender = engine_of(collector).weights.sender_schemes["policy"]._sender
        made = sorted(sender.book.pool._generations)
        assert len(made) == 2
        bodies, body_of = [], sender._shm_body
        sender._shm_body = lambda worker, generation: bodies.append(body_of(worker, generation)) or bodies[-1]
        iterator = iter(collector)
        next(iterator)
        for value in (2.0, 3.0, 4.0):
            set_weight(policy, value)
            collector.update_policy_weights_()
            assert actions(next(iterator)) == [[value], [value]]
        assert sorted(sender.book.pool._generations) == made  # no generation created for an update
        assert len(bodies) == 6 and all(handle is None for _, _, handle in bodies)  # none sent again
    finally:
        collector.shutdown()
