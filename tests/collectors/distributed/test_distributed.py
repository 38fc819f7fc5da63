"""DistributedCollector with launcher="mp" and 2 nodes: batches, trajectory ids, weights, seeds, running
free; DistributedSyncCollector (docs/collection.md)."""

from __future__ import annotations

import functools
import os
import signal
import socket
import time

import pytest
import torch
from mocks import About, CountingPolicy, StructuredEnv, wait_until
from tensordict import LazyStackedTensorDict, TensorDict

from rlharvest import WorkerError
from rlharvest.collectors import Collector, MultiAsyncCollector, MultiSyncCollector
from rlharvest.collectors.distributed import DistributedCollector, DistributedDataCollector, DistributedWeightUpdater
from rlharvest.envs import ContinuousMockEnv, CountingEnv
from rlharvest.transport.ports import free_port_block
from rlharvest.transport.wire import allow_from_nodes
from rlharvest.collectors.engine import engine_of

pytestmark = pytest.mark.timeout(120)


def make(envs=None, **kwargs):
    kwargs.setdefault("launcher", "mp")
    kwargs.setdefault("tcp_port", free_port_block(3))
    envs = envs or [ContinuousMockEnv] * 2
    return DistributedCollector(envs, kwargs.pop("policy", None), **kwargs)


@pytest.mark.parametrize("frames_per_batch", [50, 100])
def test_basic(frames_per_batch):
    with make(frames_per_batch=frames_per_batch, total_frames=1000) as collector:
        total = 0
        for batch in collector:
            assert batch.numel() == frames_per_batch and batch.names[-1] == "time"
            total += batch.numel()
        assert total == 1000


def test_total_is_next_multiple():
    with make(frames_per_batch=200, total_frames=1000) as collector:
        assert sum(b.numel() for b in collector) == 1000
    with make(frames_per_batch=300, total_frames=1000) as collector:
        assert sum(b.numel() for b in collector) == 1200


@pytest.mark.parametrize("sync", [True, False])
def test_sync_and_async_traj_ids_never_collide(sync):  # docs/torchrl-compatibility.md, "trajectory ids across nodes"
    with make(frames_per_batch=50, total_frames=200, sync=sync) as collector:
        per_node: dict[int, set] = {0: set(), 1: set()}
        total = 0
        for batch in collector:
            assert batch.numel() == 50
            total += 50
            ids = batch["collector", "traj_ids"]
            if sync:
                assert batch.shape == (2, 25)
                for node in (0, 1):
                    per_node[node] |= set(ids[node].tolist())
            else:
                node = int(ids[0]) % 2
                assert (ids % 2 == node).all()
                per_node[node] |= set(ids.tolist())
        assert total == 200
        assert per_node[0].isdisjoint(per_node[1])


@pytest.mark.parametrize("collector_class", [Collector, MultiSyncCollector, MultiAsyncCollector, "sync"])
def test_node_collector_classes(collector_class):
    with make(frames_per_batch=50, total_frames=200, collector_class=collector_class) as collector:
        sizes = [b.numel() for b in collector]
        assert all(size == 50 for size in sizes) and sum(sizes) == 200


@pytest.mark.parametrize("sync", [True, False])
@pytest.mark.parametrize("collector_class", ["single", "sync", "async"])
@pytest.mark.parametrize("source", ["policy", "factory"])
def test_update_policy(sync, collector_class, source):
    envs = [lambda: CountingEnv(max_steps=100)] * 2
    if source == "policy":
        policy = CountingPolicy(1.0)
        kwargs = {"policy": policy}
    else:
        kwargs = {"policy_factory": lambda: CountingPolicy(1.0)}
    with make(envs, frames_per_batch=50, total_frames=300, sync=sync, collector_class=collector_class,
              **kwargs) as collector:
        batches = []
        for i, batch in enumerate(collector):
            batches.append(batch)
            if i == 0:
                if source == "policy":
                    with torch.no_grad():
                        policy.weight.fill_(2.0)
                    collector.update_policy_weights_()
                else:
                    collector.update_policy_weights_(TensorDict({"weight": torch.tensor(2.0)}, []))
        assert (batches[0]["action"] == 1).all()
        assert (batches[-1]["action"] == 2).all()
        assert sum(b.numel() for b in batches) == 300


@pytest.mark.parametrize("sync", [True, False])
def test_update_interval_pushes_in_place_changes(sync):
    policy = CountingPolicy(1.0)
    with make([lambda: CountingEnv(max_steps=100)] * 2, policy=policy, frames_per_batch=20, total_frames=120,
              sync=sync, update_interval=1) as collector:
        batches = []
        for i, batch in enumerate(collector):
            batches.append(batch)
            if i == 0:
                with torch.no_grad():
                    policy.weight.fill_(2.0)
        assert (batches[0]["action"] == 1).all() and (batches[-1]["action"] == 2).all()


def test_update_after_each_batch_and_max_interval():
    policy = CountingPolicy(1.0)
    with make([lambda: CountingEnv(max_steps=100)] * 2, policy=policy, frames_per_batch=20, total_frames=200,
              sync=False, max_weight_update_interval=0) as collector:
        for i, batch in enumerate(collector):
            if i == 1:
                with torch.no_grad():
                    policy.weight.fill_(3.0)
            if i >= 4:
                assert (batch["action"] == 3).all()
                # every update resets the served node's counter (TorchRL's never does)
                assert max(engine_of(collector).schedule.since_update) <= 1
    with make([lambda: CountingEnv(max_steps=100)] * 2, policy=policy, frames_per_batch=20, total_frames=80,
              sync=True, update_after_each_batch=True) as collector:
        with torch.no_grad():
            policy.weight.fill_(4.0)
        assert all((b["action"] == 4).all() for b in collector)


def test_next_without_iter():
    with make(frames_per_batch=50, total_frames=500) as collector:
        assert collector.next().numel() == 50
        assert collector.next().numel() == 50
        for i, batch in enumerate(collector):
            assert batch.numel() == 50
            if i == 1:
                break


def test_endless():  # docs/torchrl-compatibility.md, "endless collection"
    with make(frames_per_batch=20, total_frames=-1) as collector:
        with pytest.raises(RuntimeError, match="Non-terminating"):
            len(collector)
        for i, _ in enumerate(collector):
            if i == 15:
                break
        assert i == 15


def test_seed_api_and_errors():  # docs/torchrl-compatibility.md, "set_seed on distributed collectors", "async_shutdown"
    policy = CountingPolicy()
    collector = make([lambda: CountingEnv(max_steps=100, batch_size=(2,))] * 2, policy=policy, frames_per_batch=20,
                     total_frames=100)
    try:
        assert collector.set_seed(7) == 11  # 7 -> 9 -> 11: chained through both nodes
        with pytest.raises(ValueError):
            collector.update_policy_weights_(policy, weights=policy)
        with pytest.raises(ValueError, match="weights_dict"):
            collector.update_policy_weights_(weights_dict={"policy": {}}, model_id="policy")
        with pytest.raises(KeyError, match="critic"):
            collector.update_policy_weights_(weights_dict={"critic": TensorDict.from_module(policy)})
        assert set(collector.state_dict()) >= {"worker0", "worker1", "frames", "iter", "rlharvest_resume"}
        # pause() outside start() raises when entered (start/pause themselves work: "running free" below)
        pause = collector.pause()
        with pytest.raises(RuntimeError, match="cannot be paused"):
            with pause:
                pass
        assert collector.cascade_execute("num_workers") == 2
        with pytest.raises(ValueError, match="non-callable"):
            collector.cascade_execute("num_workers", 1)
        assert collector.cascade_execute("workers[1].env.max_steps") == 100
        collector.init_updater()  # no legacy updater: no-op
        assert collector.worker_idx is None  # None at the top level, as TorchRL documents
    finally:
        collector.async_shutdown()
    assert engine_of(collector).life.closed


def test_values_asked_of_nodes_and_batches_of_any_structure_come_back():
    """Nodes send wire format 2, never pickles (docs/security.md, "What a node's messages can do"): a
    batch that fits no flat buffer (sub-TensorDicts, a lazy stack, text) arrives whole, a class of the
    user's comes back once allowed, and a value the format cannot hold, or of a class not allowed, is
    that call's error, not the node's end."""
    allow_from_nodes(About)
    with make([functools.partial(StructuredEnv, heterogeneous=True)], frames_per_batch=6, total_frames=-1,
              sync=True) as collector:
        batch = collector.next()
        assert batch["agents"].batch_size == (1, 6, 2) and isinstance(batch["parts"], LazyStackedTensorDict)
        assert list(batch["note"][0])[:4] == ["reset", "step 1", "step 2", "reset"]
        about = collector.getattr_env("about")
        assert isinstance(about, About) and about.name == "structured" and about.agents.tolist() == [0, 1]
        with pytest.raises(WorkerError, match="ClassNotAllowed: a node sent a rlharvest.envs.specs.Composite, which "
                                              "the main process does not rebuild from nodes: allow the class with"):
            collector.getattr_env("observation_spec")
        with pytest.raises(WorkerError, match="a node cannot send a builtins.method"):
            collector.getattr_env("reset")
        assert collector.next()["agents"].batch_size == (1, 6, 2)
        assert collector.stats()["restarts"] == 0


def test_enable_profile_on_nodes(tmp_path):  # docs/torchrl-compatibility.md, "enable_profile on distributed collectors"
    with make(frames_per_batch=20, total_frames=100, sync=True) as collector:
        collector.enable_profile(workers=[1], num_rollouts=2, warmup_rollouts=1,
                                 save_path=str(tmp_path / "node_{worker_idx}.json"))
        list(collector)
    assert (tmp_path / "node_1.json").exists() and not (tmp_path / "node_0.json").exists()


def test_argument_errors():
    envs = [ContinuousMockEnv] * 2
    with pytest.raises(ValueError, match="launcher"):
        DistributedCollector(envs, frames_per_batch=10, launcher="ssh")
    with pytest.raises(ValueError, match="backend"):
        DistributedCollector(envs, frames_per_batch=10, launcher="mp", backend="tcp")
    with pytest.raises(RuntimeError, match="nccl"):
        DistributedCollector(envs, frames_per_batch=10, launcher="mp", backend="nccl")
    with pytest.raises(ValueError, match="collector_class"):
        DistributedCollector(envs, frames_per_batch=10, launcher="mp", collector_class="parallel")
    with pytest.raises(RuntimeError, match="Cannot dispatch"):
        DistributedCollector(envs, frames_per_batch=11, launcher="mp", sync=True)
    with pytest.raises(RuntimeError, match="conflicting"):
        DistributedCollector(envs, frames_per_batch=10, launcher="mp", update_after_each_batch=True,
                             max_weight_update_interval=2)
    with pytest.raises(ValueError, match="update_interval"):
        DistributedCollector(envs, frames_per_batch=10, launcher="mp", update_interval=0)
    with pytest.raises(RuntimeError, match="num_workers_per_collector"):
        DistributedCollector(envs, frames_per_batch=10, launcher="mp", num_workers_per_collector=2)
    with pytest.raises(ValueError, match="one dict per node"):
        DistributedCollector(envs, frames_per_batch=10, launcher="mp", collector_kwargs=[{}])
    with pytest.raises(TypeError, match="weight_updater"):
        DistributedCollector(envs, frames_per_batch=10, launcher="mp", weight_updater=DistributedWeightUpdater(),
                             weight_sync_schemes={})
    with pytest.warns(UserWarning, match="no-op"):
        collector = make(policy=lambda td: td.set("action", torch.zeros(7)), frames_per_batch=10, total_frames=10)
    collector.shutdown()


def test_tcp_port_default_and_env_variable(monkeypatch):
    port = free_port_block(3)
    monkeypatch.setenv("TCP_PORT", str(port))
    with DistributedCollector([ContinuousMockEnv] * 2, frames_per_batch=10, total_frames=10, launcher="mp") as c:
        assert c.tcp_port == str(port)
        assert len(list(c)) == 1


def test_port_in_use_is_named_quickly():
    port = free_port_block(3)
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", port))
    blocker.listen(1)
    try:
        start = time.monotonic()
        with pytest.raises(OSError, match=str(port)):
            make(frames_per_batch=10, tcp_port=port)
        assert time.monotonic() - start < 5
    finally:
        blocker.close()


def test_dead_node_raises_worker_error_naming_it():
    collector = make(frames_per_batch=20, total_frames=-1, sync=True)
    try:
        collector.next()
        os.kill(collector.worker_pids()[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerError) as info:
            for _ in range(100):
                collector.next()
        assert info.value.worker_idx == 1 and "node" in str(info.value)
        assert time.monotonic() - start < 10
    finally:
        collector.shutdown()


def test_deprecated_alias():
    with pytest.warns(DeprecationWarning, match="DistributedCollector"):
        collector = DistributedDataCollector([ContinuousMockEnv] * 2, frames_per_batch=10, total_frames=10,
                                             launcher="mp", tcp_port=free_port_block(3))
    with collector:
        assert isinstance(collector, DistributedCollector)


def test_legacy_distributed_weight_updater():
    policy = CountingPolicy(1.0)
    updater = DistributedWeightUpdater(policy_weights=TensorDict.from_module(policy), num_workers=2)
    with pytest.warns(DeprecationWarning):
        collector = make([lambda: CountingEnv(max_steps=100)] * 2, policy=policy, frames_per_batch=20,
                         total_frames=-1, sync=True, weight_updater=updater)
    with collector:
        with torch.no_grad():
            policy.weight.fill_(5.0)
        collector.update_policy_weights_(worker_ids=1)
        batch = collector.next()
        assert (batch["action"][0] == 1).all() and (batch["action"][1] == 5).all()
        with pytest.raises(ValueError, match="Worker 2 not registered"):
            collector.update_policy_weights_(worker_ids=2)


# ------------------------------------------------------------------------- running free (issue 4 item 2)
def test_start_pause_and_async_shutdown():
    from rlharvest.data import ReplayBuffer

    rb = ReplayBuffer(capacity=1_000_000)
    collector = make([lambda: CountingEnv(max_steps=100)] * 2, frames_per_batch=20, replay_buffer=rb)
    with pytest.raises(RuntimeError, match="cannot be paused"):
        with collector.pause():
            pass
    collector.start()
    try:
        wait_until(lambda: rb.write_count >= 100, timeout=30, what="100 frames written")
        with pytest.raises(RuntimeError, match="already running"):
            collector.start()
        with collector.pause():
            count = rb.write_count
            time.sleep(0.5)  # the behaviour under test: nothing is written during a pause
            assert rb.write_count == count  # writes stop inside the block
        wait_until(lambda: rb.write_count > count, timeout=30, what="writes after the pause")  # and resume after it
    finally:
        start = time.monotonic()
        collector.async_shutdown(timeout=10)
        assert time.monotonic() - start < 5
    ids = rb[:]["collector", "traj_ids"]
    assert set((ids % 2).tolist()) == {0, 1}  # both nodes wrote, ids remapped (docs/collection.md)
    assert (ids >= 0).all()


def test_start_requires_buffer():
    with make(frames_per_batch=20) as collector:
        with pytest.raises(RuntimeError, match="replay_buffer"):
            collector.start()


def test_start_with_weight_updates_while_running():
    from rlharvest.data import ReplayBuffer

    rb = ReplayBuffer(capacity=1_000_000)
    policy = CountingPolicy(1.0)
    collector = make([lambda: CountingEnv(max_steps=1000)] * 2, policy=policy, frames_per_batch=20, replay_buffer=rb)
    collector.start()
    try:
        wait_until(lambda: rb.write_count >= 100, what="100 frames written")
        with torch.no_grad():
            policy.weight.fill_(0.0)
        collector.update_policy_weights_()
        marker = rb.write_count
        wait_until(lambda: rb.write_count >= marker + 200, timeout=30, what="200 frames written after the update")
        assert (rb.latest(40)["action"] == 0).all()
    finally:
        collector.async_shutdown(timeout=10)


# ---------------------------------------------------------------------- DistributedSyncCollector
def test_distributed_sync_collector():
    from rlharvest.collectors.distributed import DistributedSyncCollector

    policy = CountingPolicy(1.0)
    collector = DistributedSyncCollector([lambda: CountingEnv(max_steps=100)] * 2, policy, frames_per_batch=20,
                                         total_frames=200, launcher="mp", tcp_port=free_port_block(3))
    with collector:
        batches = []
        for i, batch in enumerate(collector):
            assert batch.shape == (2, 10) and batch.names[-1] == "time"
            batches.append(batch)
            if i == 0:
                with torch.no_grad():
                    policy.weight.fill_(2.0)  # pushed by itself before the next batches (update_interval=1)
        assert sum(b.numel() for b in batches) == 200
        assert (batches[0]["action"] == 1).all() and (batches[-1]["action"] == 2).all()
        ids = torch.stack([b["collector", "traj_ids"] for b in batches])
        assert set(ids[:, 0].flatten().tolist()).isdisjoint(ids[:, 1].flatten().tolist())
        for method in (collector.update_policy_weights_, lambda: collector.set_seed(0), collector.state_dict,
                       collector.start):
            with pytest.raises(NotImplementedError):
                method()


def test_distributed_sync_collector_update_racing_the_last_step():
    """An update that reaches a node after its last env step, while it waits for the main process to take
    its batch, is applied during that wait: the main process waits for the ack before taking the batch
    (it deadlocked until the heartbeat timeout). One frame per node per batch makes the race frequent."""
    from rlharvest.collectors.distributed import DistributedSyncCollector

    policy = CountingPolicy(1.0)
    collector = DistributedSyncCollector([lambda: CountingEnv(max_steps=100)] * 2, policy, frames_per_batch=2,
                                         total_frames=2000, launcher="mp", tcp_port=free_port_block(3),
                                         heartbeat_timeout=5.0)
    with collector:
        count = 0
        for i, batch in enumerate(collector):
            count += 1
            with torch.no_grad():
                policy.weight.fill_(float(i % 7 + 1))
    assert count == 1000


def test_distributed_sync_collector_slow_learner_is_not_a_dead_node():
    """Nodes waiting for the main process to take their batch keep sending heartbeats."""
    from rlharvest.collectors.distributed import DistributedSyncCollector

    with DistributedSyncCollector([CountingEnv] * 2, frames_per_batch=4, total_frames=8, launcher="mp",
                                  tcp_port=free_port_block(3), heartbeat_timeout=1.0) as collector:
        for batch in collector:
            assert batch.numel() == 4
            time.sleep(2.5)  # a learner step longer than heartbeat_timeout


def test_waiting_for_an_ack_longer_than_heartbeat_timeout_is_not_a_dead_node():
    """A node acknowledges an update between two env steps; a step may outlast heartbeat_timeout.
    Its heartbeats keep arriving meanwhile, and the main process must read them while it waits."""
    from mocks import ConstantObsEnv

    policy = CountingPolicy(1.0)
    with make([lambda: ConstantObsEnv(delay=1.6)], policy=policy, frames_per_batch=2, total_frames=-1,
              sync=False, heartbeat_timeout=1.0) as collector:
        collector.next()  # the node is now in the middle of the next rollout (async)
        with torch.no_grad():
            policy.weight.fill_(2.0)
        start = time.monotonic()
        collector.update_policy_weights_()  # acknowledged after the current step (<= 1.6 s)
        assert time.monotonic() - start < 5


def test_distributed_sync_collector_validation_and_endless():
    from rlharvest.collectors.distributed import DistributedSyncCollector

    with pytest.raises(RuntimeError, match="Cannot dispatch"):
        DistributedSyncCollector([ContinuousMockEnv] * 2, frames_per_batch=11, launcher="mp")
    with pytest.raises(RuntimeError, match="divisible"):
        DistributedSyncCollector([ContinuousMockEnv] * 2, frames_per_batch=10, total_frames=15, launcher="mp")
    with DistributedSyncCollector([ContinuousMockEnv] * 2, frames_per_batch=10, total_frames=-1, launcher="mp",
                                  tcp_port=free_port_block(3)) as collector:  # endless, several nodes
        for i, batch in enumerate(collector):
            if i == 4:
                break
        assert i == 4


def test_a_legacy_push_that_does_not_wait_leaves_the_scheme_waiting_for_later_sends():
    """``DistributedWeightUpdater(sync=False)`` pushes without waiting for that push only: the scheme
    the collector sends everything else through keeps waiting for acknowledgements."""

    class RecordingScheme:
        sync = True

        def send(self, weights=None, worker_ids=None, *, wait=None):
            self.call = (weights, worker_ids, wait)

    scheme = RecordingScheme()
    weights = type("Weights", (), {"sender_schemes": {"policy": scheme}})()
    holder = type("Holder", (), {"_engine": type("Engine", (), {"weights": weights})()})()
    DistributedCollector.push_legacy_weights(holder, 1, "weights", wait=False)
    assert scheme.call == ("weights", [1], False)
    assert scheme.sync is True
