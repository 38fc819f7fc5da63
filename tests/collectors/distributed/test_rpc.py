"""RPCCollector and RPCWeightUpdater: batches, ids, weights, seeds and errors over torch RPC."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from mocks import CountingPolicy, wait_until
from tensordict import TensorDict

from rlharvest import WorkerError
from rlharvest.collectors.distributed import RPCCollector, RPCDataCollector, RPCWeightUpdater
from rlharvest.data import ReplayBuffer
from rlharvest.envs import ContinuousMockEnv, CountingEnv
from rlharvest.transport.ports import free_port_block

pytestmark = pytest.mark.timeout(120)


def make(envs=None, **kwargs):
    kwargs.setdefault("launcher", "mp")
    kwargs.setdefault("tcp_port", free_port_block(3))
    return RPCCollector(envs or [ContinuousMockEnv] * 2, kwargs.pop("policy", None), **kwargs)


# ------------------------------------------------------------ RPCWeightUpdater with fake remotes
class FakeFuture:
    def __init__(self, log, index):
        self.log, self.index = log, index

    def wait(self):
        self.log.append(("waited", self.index))


class FakeRemote:
    def __init__(self, log, index):
        self.log, self.index = log, index

    def rpc_async(self):
        return self

    def update_policy_weights_(self, payload):
        self.log.append(("called", self.index, payload))
        return FakeFuture(self.log, self.index)


def test_push_weights_targets_one_remote_waits_and_runs_hook_once():
    log, hooks = [], []
    refs = [FakeRemote(log, i) for i in range(3)]
    weights = TensorDict({"w": torch.ones(1)}, [])
    updater = RPCWeightUpdater(["info"] * 3, object, refs, weights, 3)
    updater.register_post_hook(lambda: hooks.append(1))
    updater.push_weights(worker_ids=[2])
    assert [entry[:2] for entry in log] == [("called", 2), ("waited", 2)]
    assert log[0][2] is weights and hooks == [1]


def test_push_weights_forms_and_alias():  # docs/torchrl-compatibility.md, "RPCWeightUpdater"
    log = []
    refs = [FakeRemote(log, i) for i in range(3)]
    default = TensorDict({"w": torch.zeros(1)}, [])
    other = TensorDict({"w": torch.ones(1)}, [])
    updater = RPCWeightUpdater(None, object, refs, default, 3)
    updater.push_weights(policy_or_weights=other, worker_ids=1)  # what __call__ passes
    assert log[0][2] is other
    log.clear()
    updater.update_weights(other)  # documented alias: all workers
    assert sorted(e[1] for e in log if e[0] == "called") == [0, 1, 2]
    log.clear()
    updater(other, worker_ids=[0])  # __call__
    assert [e[1] for e in log if e[0] == "called"] == [0]
    log.clear()
    updater.push_weights(wait=False)
    assert [e[0] for e in log] == ["called"] * 3 and log[0][2] is default
    assert updater.all_worker_ids() == [0, 1, 2]
    assert RPCWeightUpdater.from_policy(CountingPolicy()) is None
    for hook in ("_sync_weights_with_worker", "_get_server_weights", "_maybe_map_weights"):
        with pytest.raises(NotImplementedError):
            getattr(updater, hook)(**({"server_weights": None} if hook == "_sync_weights_with_worker" else {}))\
                if hook == "_sync_weights_with_worker" else getattr(updater, hook)(*([] if hook == "_get_server_weights" else [None]))
    first = object.__new__(RPCCollector)
    updater.register_collector(first)
    with pytest.raises(RuntimeError, match="already registered"):
        updater.register_collector(object.__new__(RPCCollector))


# ------------------------------------------------------------------------- real remote references
def test_rpc_weight_updater_on_real_nodes():
    policy = CountingPolicy(1.0)
    with make([lambda: CountingEnv(max_steps=100)] * 2, policy=policy, frames_per_batch=20, total_frames=-1,
              sync=True) as collector:
        assert (collector.next()["action"] == 1).all()
        hooks = []
        with pytest.warns(DeprecationWarning):
            collector.weight_updater = RPCWeightUpdater(collector.collector_infos, collector.collector_class,
                                                        collector.collector_rrefs, collector.policy_weights,
                                                        collector.num_workers)
        collector.weight_updater.register_post_hook(lambda: hooks.append(1))
        with torch.no_grad():
            policy.weight.fill_(3.0)
        collector.update_policy_weights_(worker_ids=[1])  # legacy mode: goes through push_weights
        batch = collector.next()
        assert (batch["action"][0] == 1).all() and (batch["action"][1] == 3).all()
        assert hooks == [1]
        collector.weight_updater.push_weights(TensorDict({"weight": torch.tensor(4.0)}, []))
        assert (collector.next()["action"] == 4).all()


def test_remote_references_of_a_second_group_after_a_node_was_replaced_in_the_first():
    """torch binds its RRef context to the first RPC agent of the process, and resolved an RRef's owner
    through that agent's group: after a first group in which node 1 (rank 2) was replaced (rank 2 left
    its membership), the RRefs of a second group's node 1 could not find their owner ("could not find
    destination id 2"); nor could those of a node at a rank the first group never had (rank 3 here).
    collector_rrefs find their node by name (docs/restarts.md)."""
    first = make([lambda: CountingEnv(max_steps=100)], policy=CountingPolicy(1.0), frames_per_batch=10,
                 total_frames=-1, sync=True, max_worker_restarts=1)
    try:
        first.next()
        first.add_collectors([lambda: CountingEnv(max_steps=100)])  # rank 2
        first.next()
        os.kill(first.worker_pids()[1], signal.SIGKILL)
        first.next()  # node 1 replaced: rank 2 leaves the group, rank 3 joins
        assert [cause.kind for cause in first.restart_causes] == ["died"]
    finally:
        first.shutdown()
    policy = CountingPolicy(1.0)
    with make([lambda: CountingEnv(max_steps=100)] * 3, policy=policy, frames_per_batch=30, total_frames=-1,
              sync=True) as collector:  # ranks 1, 2, 3
        collector.next()
        assert [ref.owner().name for ref in collector.collector_rrefs] == [info.name for info in collector.collector_infos]
        with pytest.warns(DeprecationWarning):
            collector.weight_updater = RPCWeightUpdater(collector.collector_infos, collector.collector_class,
                                                        collector.collector_rrefs, collector.policy_weights, 3)
        with torch.no_grad():
            policy.weight.fill_(3.0)
        collector.update_policy_weights_(worker_ids=[1, 2])
        batch = collector.next()
        assert (batch["action"][0] == 1).all() and (batch["action"][1:] == 3).all()


# ------------------------------------------------------------------------- core behaviours
@pytest.mark.parametrize("sync", [True, False])
def test_basic_batches_and_ids(sync):
    with make(frames_per_batch=50, total_frames=200, sync=sync) as collector:
        total, per_node = 0, {0: set(), 1: set()}
        for batch in collector:
            assert batch.numel() == 50 and batch.names[-1] == "time"
            total += batch.numel()
            ids = batch["collector", "traj_ids"]
            if sync:
                assert batch.shape == (2, 25)
                per_node[0] |= set(ids[0].tolist())
                per_node[1] |= set(ids[1].tolist())
            else:
                per_node[int(ids[0]) % 2] |= set(ids.tolist())
        assert total == 200 and per_node[0].isdisjoint(per_node[1])


@pytest.mark.parametrize("collector_class", ["single", "sync", "async"])
def test_node_classes_and_update(collector_class):
    policy = CountingPolicy(1.0)
    with make([lambda: CountingEnv(max_steps=100)] * 2, policy=policy, frames_per_batch=50, total_frames=300,
              collector_class=collector_class) as collector:
        batches = []
        for i, batch in enumerate(collector):
            batches.append(batch)
            if i == 0:
                with torch.no_grad():
                    policy.weight.fill_(2.0)
                collector.update_policy_weights_()
        assert all(b.numel() == 50 for b in batches) and sum(b.numel() for b in batches) == 300
        assert (batches[0]["action"] == 1).all() and (batches[-1]["action"] == 2).all()


def test_update_with_factory_and_explicit_weights():
    with make([lambda: CountingEnv(max_steps=100)] * 2, policy_factory=lambda: CountingPolicy(1.0),
              frames_per_batch=20, total_frames=-1, sync=True) as collector:
        assert (collector.next()["action"] == 1).all()
        collector.update_policy_weights_(TensorDict({"weight": torch.tensor(2.0)}, []), worker_ids=[0])
        batch = collector.next()
        assert (batch["action"][0] == 2).all() and (batch["action"][1] == 1).all()


def test_next_endless_seed_and_errors():  # docs/torchrl-compatibility.md, "endless collection", "tensorpipe_options"
    with make([lambda: CountingEnv(batch_size=(2,))] * 2, frames_per_batch=20, total_frames=-1) as collector:
        assert collector.next().numel() == 20 and collector.next().numel() == 20
        with pytest.raises(RuntimeError, match="Non-terminating"):
            len(collector)
        for i, _ in enumerate(collector):
            if i == 5:
                break
        assert collector.set_seed(3) == 7
        assert set(collector.state_dict()) >= {"worker0", "worker1", "frames", "iter", "rlharvest_resume"}
        assert collector.cascade_execute("num_workers") == 2


def test_tensorpipe_options_are_merged():  # docs/torchrl-compatibility.md, "tensorpipe_options"
    with make(frames_per_batch=20, total_frames=20, tensorpipe_options={"num_worker_threads": 4}) as collector:
        assert collector.tensorpipe_options == {"num_worker_threads": 4}
        assert len(list(collector)) == 1


def test_dead_node_raises_worker_error():
    collector = make(frames_per_batch=20, total_frames=-1, sync=True)
    try:
        collector.next()
        os.kill(collector.worker_pids()[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerError) as info:
            for _ in range(200):
                collector.next()
        assert info.value.worker_idx == 0
        assert time.monotonic() - start < 15
    finally:
        collector.shutdown()


def test_deprecated_alias_and_visible_devices_check():
    with pytest.warns(DeprecationWarning, match="RPCCollector"):
        collector = RPCDataCollector([ContinuousMockEnv] * 2, frames_per_batch=10, total_frames=10, launcher="mp",
                                     tcp_port=free_port_block(3))
    with collector:
        assert isinstance(collector, RPCCollector) and len(list(collector)) == 1
    with pytest.raises(ValueError, match="visible_devices"):
        RPCCollector([ContinuousMockEnv] * 2, frames_per_batch=10, launcher="mp", visible_devices=["cpu"])


def test_start_writes_into_the_replay_buffer_until_async_shutdown():
    buffer = ReplayBuffer(capacity=10_000)
    collector = make(frames_per_batch=20, total_frames=-1, replay_buffer=buffer)
    try:
        collector.start()
        wait_until(lambda: len(buffer) >= 60, timeout=30.0, what="60 frames in the buffer")
        with collector.pause():
            paused = len(buffer)
            time.sleep(0.3)
            assert len(buffer) == paused  # nothing written while paused
        wait_until(lambda: len(buffer) > paused, timeout=30.0, what="more frames after the pause")
    finally:
        collector.async_shutdown()
    obs, ids = buffer[:]["observation"], buffer[:]["collector", "traj_ids"]
    assert obs.shape[0] == len(buffer) and (ids >= 0).all()
