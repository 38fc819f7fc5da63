"""Worker-process collectors (MultiSync, MultiAsync, AsyncCollector): batches, ordering, weights, replay
buffers, running free and profiling (docs/collection.md, docs/weights.md)."""

from __future__ import annotations

import os
import time

import pytest
import torch
from mocks import ClockEnv, ConstantObsEnv, CountingPolicy, Unpicklable, bias_policy, wait_until, weight_policy
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

from rlharvest.collectors import (
    AsyncCollector,
    MultiAsyncCollector,
    MultiCollector,
    MultiProcessedWeightUpdater,
    MultiSyncCollector,
    MultiSyncDataCollector,
)
from rlharvest.data import ReplayBuffer
from rlharvest.envs import ContinuousMockEnv, CountingEnv
from rlharvest.weight_update import MultiProcessWeightSyncScheme, SharedMemWeightSyncScheme

pytestmark = pytest.mark.timeout(90)


def envs(n=2, **kwargs):
    return [lambda: CountingEnv(**kwargs)] * n


# ------------------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("num_env", [1, 3, 4])
def test_collector_batch_size(num_env):
    make = [lambda: CountingEnv(max_steps=7, batch_size=(num_env,))] * 2
    with MultiAsyncCollector(make, frames_per_batch=20, total_frames=40) as collector:
        batch = next(iter(collector))
        assert batch.numel() == -(-20 // num_env) * num_env and batch.names[-1] == "time"
    with MultiSyncCollector(make, frames_per_batch=20, total_frames=40) as collector:
        batch = next(iter(collector))
        assert batch.numel() == -(-20 // num_env // 2) * num_env * 2 and batch.names[-1] == "time"


def test_frames_per_batch_per_worker():
    with pytest.raises(ValueError, match="exactly one value per worker"):
        MultiSyncCollector(envs(2), frames_per_batch=[10], total_frames=20)
    with MultiAsyncCollector(envs(2), frames_per_batch=[15, 5], total_frames=40) as collector:
        assert [b.numel() for b in collector] == [20, 20]
    with MultiSyncCollector(envs(2), frames_per_batch=[6, 2], total_frames=16, cat_results=-1) as collector:
        assert [b.numel() for b in collector] == [8, 8]


def test_ordering_stack_cat_and_preemption():
    make = [lambda i=i: ConstantObsEnv(value=i, delay=0.05 if i % 2 else 0.0) for i in range(8)]
    with MultiSyncCollector(make[:4], frames_per_batch=16, total_frames=16) as collector:
        batch = next(iter(collector))
        for worker in range(4):
            assert (batch["observation"][worker] == worker).all()
    with MultiSyncCollector(make[:4], frames_per_batch=16, total_frames=16, cat_results=-1) as collector:
        batch = next(iter(collector))
        assert batch.shape == (16,)
        for worker in range(4):
            assert (batch["observation"][4 * worker: 4 * worker + 4] == worker).all()
    with MultiSyncCollector(make, frames_per_batch=8 * 20, total_frames=8 * 20, preemptive_threshold=0.5) as collector:
        batch = next(iter(collector))
        ids = batch["collector", "traj_ids"]
        for worker in range(1, 8, 2):
            assert (ids[worker, 1:] == -1).any(), worker  # slow workers were told to stop early
        assert batch["collector", "mask"].shape == batch.shape
        assert torch.equal(batch["collector", "mask"], ids != -1)


def test_preemption_zero_threshold():
    with MultiSyncCollector(envs(2, max_steps=100), frames_per_batch=200, total_frames=200,
                            preemptive_threshold=0.0) as collector:
        batch = next(iter(collector))
        assert int(batch["collector", "mask"].sum()) < 200


def test_split_trajs_after_set_seed():
    with MultiSyncCollector(envs(2, max_steps=3), frames_per_batch=20, total_frames=40, split_trajs=True) as collector:
        collector.set_seed(42)
        for batch in collector:
            firsts = batch["collector", "traj_ids"][:, 0]
            assert firsts.unique().numel() == firsts.numel()


@pytest.mark.parametrize("cat_results", ["stack", 0])
def test_unique_traj_ids_across_workers(cat_results):
    make = [lambda: CountingEnv(max_steps=2, batch_size=(3,))] * 3
    with MultiSyncCollector(make, frames_per_batch=36, total_frames=108, cat_results=cat_results) as collector:
        per_row: dict[int, set] = {}
        for batch in collector:
            ids = batch["collector", "traj_ids"].reshape(-1, batch.shape[-1])
            for row, row_ids in enumerate(ids):
                per_row.setdefault(row, set()).update(row_ids.tolist())
        rows = list(per_row.values())
        assert len(rows) == 9  # 3 workers x 3 sub-envs
        for i, a in enumerate(rows):
            for b in rows[i + 1:]:
                assert a.isdisjoint(b)  # a sub-env continues its own trajectories, never another's


# ------------------------------------------------------------------------------------- weights
@pytest.mark.parametrize("collector_class", [MultiSyncCollector, MultiAsyncCollector])
@pytest.mark.parametrize("scheme", [None, "multiprocess", "sharedmem"])
def test_update_weights(collector_class, scheme):
    policy = weight_policy(1.0)
    schemes = {None: None, "multiprocess": {"policy": MultiProcessWeightSyncScheme()},
               "sharedmem": {"policy": SharedMemWeightSyncScheme()}}[scheme]
    with collector_class(envs(2), policy, frames_per_batch=8, total_frames=-1, weight_sync_schemes=schemes) as c:
        expected = policy.state_dict()
        for worker in ("worker0", "worker1"):
            got = c.state_dict()[worker]["policy_state_dict"]
            assert torch.equal(got["module.weight"], expected["module.weight"])
        with torch.no_grad():
            policy.module.weight.fill_(3.0)
        c.update_policy_weights_()
        for worker in ("worker0", "worker1"):
            assert c.state_dict()[worker]["policy_state_dict"]["module.weight"].item() == 3.0
        for i, batch in enumerate(c):
            assert (batch["action"] == 3).all()
            if i == 2:
                break


@pytest.mark.parametrize("collector_class", [MultiSyncCollector, MultiAsyncCollector])
def test_every_update_of_many_reaches_the_workers(collector_class):
    """Workers alternate between two weight generations and reuse what they built for each: every
    update must still be the one applied, also when the trainer replaces a parameter or its .data."""
    policy = weight_policy(1.0)
    with collector_class(envs(2), policy, frames_per_batch=8, total_frames=-1, track_policy_version=True) as c:
        batches = iter(c)
        for value in range(2, 9):
            with torch.no_grad():
                if value == 5:
                    policy.module.weight = torch.nn.Parameter(torch.full_like(policy.module.weight, value))
                elif value == 7:
                    policy.module.weight.data = torch.full_like(policy.module.weight, value)
                else:
                    policy.module.weight.fill_(value)
            c.update_policy_weights_()
            states = c.state_dict()
            assert [states[f"worker{w}"]["policy_state_dict"]["module.weight"].item() for w in (0, 1)] == [value] * 2
            batch = next(batches)
            if collector_class is MultiSyncCollector:
                assert (batch["action"] == value).all()
                assert (batch["policy_version"] == value - 1).all()  # stamped by the workers
        assert c.policy_version == 7


def worker_policies(collector) -> list[int]:
    return [os.sched_getscheduler(pid) for pid in collector.worker_pids()]


def test_workers_run_under_sched_batch_unless_told_otherwise(monkeypatch):
    """Workers must not preempt the learner when they wake up (SCHED_BATCH); the variable opts out."""
    learner = os.sched_getscheduler(0)
    with MultiSyncCollector(envs(2), frames_per_batch=8, total_frames=-1) as c:
        assert worker_policies(c) == [os.SCHED_BATCH] * 2
        assert next(iter(c)).numel() == 8
    assert os.sched_getscheduler(0) == learner  # the main process keeps its own
    monkeypatch.setenv("RLHARVEST_WORKER_SCHED", "normal")
    with MultiAsyncCollector(envs(2), frames_per_batch=8, total_frames=-1) as c:
        assert worker_policies(c) == [learner] * 2
    monkeypatch.setenv("RLHARVEST_WORKER_SCHED", "fifo")
    with pytest.raises(ValueError, match=r"RLHARVEST_WORKER_SCHED must be one of \('batch', 'normal'\), got 'fifo'"):
        MultiSyncCollector(envs(2), frames_per_batch=8, total_frames=-1)


@pytest.mark.parametrize("mode", ["scheme", "legacy"])
def test_policy_factory_with_explicit_weights(mode):
    factory = lambda: weight_policy(1.0)  # noqa: E731
    if mode == "scheme":
        scheme = SharedMemWeightSyncScheme()
        scheme.init_on_sender(model=factory(), devices=["cpu", "cpu"])
        kwargs = {"weight_sync_schemes": {"policy": scheme}}
    else:
        kwargs = {"weight_updater": MultiProcessedWeightUpdater}
    with pytest.warns() if mode == "legacy" else _nothing():
        collector = MultiSyncCollector(envs(2), policy_factory=factory, frames_per_batch=8, total_frames=40, **kwargs)
    with collector:
        weights = TensorDict.from_module(factory()).detach().clone()
        for i, batch in enumerate(collector):
            if i == 2:
                assert (batch["action"] != 0).all()
                collector.update_policy_weights_(weights.zero_())
            if i == 3:
                assert (batch["action"] == 0).all()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_unpicklable_policy_with_factory():
    policy = Unpicklable()
    with MultiSyncCollector(envs(2), policy, policy_factory=lambda: Unpicklable(), frames_per_batch=8,
                            total_frames=16) as collector:
        assert (next(iter(collector))["action"] == 1).all()
        with torch.no_grad():
            policy.inner.module.weight.fill_(5.0)
        collector.update_policy_weights_()
        assert (next(iter(collector))["action"] == 5).all()


def test_per_worker_weights_with_distinct_factories():
    factories = [lambda b=b: bias_policy(float(b)) for b in range(3)]
    with MultiSyncCollector([lambda: ContinuousMockEnv(obs_dim=1, action_dim=1)] * 3, policy_factory=factories,
                            frames_per_batch=12, total_frames=-1) as collector:
        batch = collector.next()
        for worker in range(3):
            assert (batch["action"][worker] == worker).all()
        weights = TensorDict.from_module(bias_policy(10.0)).detach()
        collector.update_policy_weights_({0: weights})
        batch = collector.next()
        assert (batch["action"][0] == 10).all()
        assert (batch["action"][1] == 1).all() and (batch["action"][2] == 2).all()


def test_update_worker_ids_and_errors():
    policy = weight_policy(1.0)
    with MultiSyncCollector(envs(2), policy, frames_per_batch=8, total_frames=-1) as collector:
        weights = TensorDict.from_module(policy).detach().clone()
        weights["module", "weight"].fill_(4.0)
        collector.update_policy_weights_(weights, worker_ids=1)
        batch = collector.next()
        assert (batch["action"][0] == 1).all() and (batch["action"][1] == 4).all()
        with pytest.raises(ValueError, match="Worker 5 not registered"):
            collector.update_policy_weights_(weights, worker_ids=[5])
        with pytest.raises(KeyError, match="Available models"):
            collector.update_policy_weights_(weights_dict={"critic": weights})
        with pytest.raises(ValueError, match="per-worker|per_worker"):
            MultiProcessWeightSyncScheme().prepare_weights({0: weights}, "policy", None)


def test_fresh_weights_after_update_returns():
    """Every frame collected after update_policy_weights_ returns uses the new weights."""
    policy = weight_policy(1.0)
    with MultiAsyncCollector([lambda: ClockEnv(delay=0.001)] * 2, policy, frames_per_batch=20,
                             total_frames=-1) as collector:
        returned_at = {}
        for i, batch in enumerate(collector):
            clock, action = batch["next", "clock"].squeeze(-1), batch["action"].squeeze(-1)
            for version, t_return in returned_at.items():
                later = clock > t_return
                assert (action[later] >= version).all(), (version, action[later])
            if i in (2, 5, 8):
                version = float(i)
                with torch.no_grad():
                    policy.module.weight.fill_(version)
                collector.update_policy_weights_()
                returned_at[version] = time.monotonic()
            if i == 12:
                break


def test_update_at_each_batch():
    policy = weight_policy(1.0)
    for collector_class in (MultiSyncCollector, MultiAsyncCollector):
        with collector_class(envs(2), policy, frames_per_batch=8, total_frames=-1, update_at_each_batch=True) as c:
            for i, batch in enumerate(c):
                with torch.no_grad():
                    policy.module.weight.fill_(float(i + 2))
                if i == 4:
                    break
            weights = [c.state_dict()[f"worker{w}"]["policy_state_dict"]["module.weight"].item() for w in (0, 1)]
            if collector_class is MultiSyncCollector:
                assert weights == [5.0, 5.0]  # pushed before the request of batch 4 (set to 5 after batch 3)
            else:
                assert max(weights) >= 4.0  # each re-launched worker got the weights of its re-launch


def test_cascading_through_register_scheme_receiver():
    """A collector that is itself fed by a parent forwards the weights it receives to its workers."""
    parent_policy = weight_policy(1.0)
    parent_scheme = SharedMemWeightSyncScheme(sync=False)
    parent_scheme.init_on_sender(model=parent_policy, num_workers=1, devices=["cpu"])
    parent_scheme.connect()
    receiver = parent_scheme.__class__.__new__(parent_scheme.__class__)
    receiver.__setstate__(parent_scheme.__getstate__())
    child_policy = weight_policy(0.0)
    with MultiSyncCollector(envs(2), child_policy, frames_per_batch=8, total_frames=-1, worker_idx=0,
                            weight_recv_schemes={"policy": receiver}) as child:
        assert child_policy.module.weight.item() == 1.0  # initial weights from the parent
        assert (child.next()["action"] == 1).all()
        with torch.no_grad():
            parent_policy.module.weight.fill_(7.0)
        parent_scheme.send()
        child.receive_weights()
        assert (child.next()["action"] == 7).all()
        parent_scheme._sender.wait_acks(parent_scheme.version, [0], 10.0)
    parent_scheme.shutdown()


# ------------------------------------------------------------------------------------- replay buffers
@pytest.mark.parametrize("collector_class, frames", [(MultiSyncCollector, 32), (MultiAsyncCollector, 16)])
def test_replay_buffer_written_by_workers(collector_class, frames):
    rb = ReplayBuffer(capacity=10_000)
    collector = collector_class([lambda: CountingEnv(max_steps=100)] * 2, frames_per_batch=frames, total_frames=256,
                                replay_buffer=rb, local_init_rb=True, max_frames_per_traj=7)
    with collector:
        for k, batch in enumerate(collector, start=1):
            assert batch is None
            if collector_class is MultiSyncCollector:
                assert len(rb) == frames * k
            else:
                assert len(rb) >= frames * k
    assert len(rb) == rb.write_count >= 256
    data = rb[:256]  # written during iteration: whole rollouts (in-flight ones may end partial at shutdown)
    per_rollout = frames // 2 if collector_class is MultiSyncCollector else frames
    steps = data["step_count"].reshape(-1, per_rollout)
    ids = data["collector", "traj_ids"].reshape(-1, per_rollout)
    for step_row, id_row in zip(steps, ids):
        diffs = step_row[1:].squeeze(-1) - step_row[:-1].squeeze(-1)
        assert ((diffs == 1) | (step_row[1:].squeeze(-1) == 0)).all()
        assert (id_row[1:] >= id_row[:-1]).all()


@pytest.mark.parametrize("collector_class", [MultiSyncCollector, MultiAsyncCollector])
@pytest.mark.parametrize("total_frames", [-1, int(1e9)])
def test_start_multi(collector_class, total_frames):
    rb = ReplayBuffer(capacity=100_000)
    collector = collector_class(envs(2), frames_per_batch=16, total_frames=total_frames, replay_buffer=rb,
                                local_init_rb=True)
    collector.start()
    try:
        wait_until(lambda: len(rb) >= 16, timeout=30, what="16 frames in the buffer")
    finally:
        collector.async_shutdown(timeout=10)


def test_pause():
    rb = ReplayBuffer(capacity=1_000_000)
    collector = AsyncCollector(lambda: CountingEnv(), frames_per_batch=16, replay_buffer=rb, local_init_rb=True)
    collector.start()
    try:
        wait_until(lambda: rb.write_count >= 32, what="32 frames written")
        with collector.pause():
            count = rb.write_count
            time.sleep(1.0)  # the behaviour under test: nothing is written during a pause
            assert rb.write_count == count
        wait_until(lambda: rb.write_count > count, timeout=30, what="writes after the pause")
    finally:
        collector.async_shutdown(timeout=10)
    with MultiSyncCollector(envs(2), frames_per_batch=8) as idle:
        with pytest.raises(RuntimeError, match="cannot be paused"):
            with idle.pause():
                pass


def test_start_update_policy():
    rb = ReplayBuffer(capacity=1_000_000)
    policy = bias_policy(0.0)
    collector = MultiAsyncCollector([lambda: ContinuousMockEnv(obs_dim=1, action_dim=1)] * 2, policy,
                                    frames_per_batch=16, replay_buffer=rb, local_init_rb=True)
    collector.start()
    try:
        wait_until(lambda: rb.write_count >= 64, what="64 frames written")
        weights = TensorDict.from_module(policy).detach().clone()
        weights["module", "bias"] += 1
        collector.update_policy_weights_(weights)
        wait_until(lambda: (rb.latest(16)["action"] == 1).all(), timeout=30, what="frames acted with the new weights")
    finally:
        collector.async_shutdown(timeout=10)


def test_init_random_frames_with_start():
    rb = ReplayBuffer(capacity=100_000)
    collector = MultiSyncCollector([lambda: ContinuousMockEnv()] * 2, bias_policy(5.0), frames_per_batch=32,
                                   init_random_frames=64, replay_buffer=rb, local_init_rb=True)
    collector.start()
    try:
        wait_until(lambda: rb.write_count >= 256, timeout=30, what="256 frames written")
    finally:
        collector.async_shutdown(timeout=10)


# ------------------------------------------------------------------------------------- profiling, queries
def test_enable_profile_multi_sync(tmp_path):
    with MultiSyncCollector(envs(2), frames_per_batch=8, total_frames=40) as collector:
        collector.enable_profile(workers=[0, 5], num_rollouts=3, warmup_rollouts=1,
                                 save_path=tmp_path / "trace_{worker_idx}.json")
        assert collector.profile_config.num_rollouts == 3
        assert len(list(collector)) == 5
    assert (tmp_path / "trace_0.json").exists() and not (tmp_path / "trace_1.json").exists()


def linear_policy() -> TensorDictModule:
    torch.manual_seed(0)  # deterministic: batches differ only by the env's seeded noise
    return TensorDictModule(torch.nn.Linear(7, 7), in_keys=["observation"], out_keys=["action"])


@pytest.mark.parametrize("cls", [AsyncCollector, MultiAsyncCollector])
def test_set_seed_between_async_batches_holds_from_the_next_batch(cls):
    make = (lambda: ContinuousMockEnv(episode_length=50))
    with cls(make if cls is AsyncCollector else [make], linear_policy(), frames_per_batch=10,
             total_frames=-1) as collector:
        collector.set_seed(3)
        batches = iter(collector)
        first = next(batches)  # the next batch is in flight while the caller holds this one
        collector.set_seed(3)  # as TorchRL: it is dropped, and the seeded envs start again
        again, later = next(batches), next(batches)
        assert torch.equal(again["observation"], first["observation"])
        assert not torch.equal(later["observation"], first["observation"])


def test_seed_state_reset_and_queries():
    with MultiSyncCollector([lambda: ContinuousMockEnv(batch_size=(2,))] * 2, frames_per_batch=8,
                            total_frames=-1) as collector:
        assert collector.set_seed(10) == 14  # chained: 10 -> 12 -> 14 (two sub-envs each)
        first = collector.next()["observation"]
        assert not torch.equal(first[0], first[1])  # uncorrelated workers
        collector.set_seed(10)
        assert torch.equal(collector.next()["observation"], first)
        state = collector.state_dict()
        assert set(state) == {"worker0", "worker1", "frames", "iter", "traj_pool", "rlharvest_resume"}
        collector.load_state_dict(state)
        collector.reset()
        collector.reset([True, False])
        assert collector.getattr_env("obs_dim") == 7
        assert collector.getattr_policy("action_spec") is not None
        assert collector.cascade_execute("workers[1].env.obs_dim") == 7
        assert collector.cascade_execute("workers.requested_frames_per_batch") == [4, 4]
        assert collector.cascade_execute("num_workers") == 2
        with pytest.raises(AttributeError):
            collector.cascade_execute("workers[0].nope")


def test_track_policy_version_in_workers():  # docs/torchrl-compatibility.md, "policy versions"
    policy = weight_policy(1.0)
    with MultiSyncCollector(envs(2), policy, frames_per_batch=8, total_frames=-1, track_policy_version=True) as c:
        assert (c.next()["policy_version"] == 0).all()
        c.update_policy_weights_()
        assert c.policy_version == 1
        assert (c.next()["policy_version"] == 1).all()
        c.increment_version()
        assert (c.next()["policy_version"] == 2).all()


def test_deprecated_names_and_factory_function():
    with pytest.warns(DeprecationWarning, match="MultiSyncCollector"):
        old = MultiSyncDataCollector(envs(2), frames_per_batch=4, total_frames=4)
    with old:
        assert isinstance(old, MultiSyncCollector)
    with MultiCollector(envs(2), sync=False, frames_per_batch=4, total_frames=4) as collector:
        assert isinstance(collector, MultiAsyncCollector)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"cat_results": "concat"}, ValueError, "cat_results"),
        ({"device": ["cpu"] * 3}, RuntimeError, "one per worker"),
        ({"reset_when_done": False}, ValueError, "reset_when_done"),
        ({"policy_factory": [CountingPolicy] * 3}, ValueError, "exactly one value per worker"),
    ],
)
def test_argument_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        MultiSyncCollector(envs(2), frames_per_batch=8, **kwargs)


def test_cat_results_only_for_multisync_and_close_env_refused():
    with pytest.raises(ValueError, match="cat_results"):
        MultiAsyncCollector(envs(2), frames_per_batch=8, cat_results=0)
    collector = MultiSyncCollector(envs(2), frames_per_batch=8)
    with pytest.raises(RuntimeError, match="close_env"):
        collector.shutdown(close_env=False)
    collector.shutdown()
    collector.shutdown()


def test_spawn_start_method_with_lambdas():
    with MultiSyncCollector([lambda: CountingEnv(max_steps=3)] * 2, CountingPolicy(), frames_per_batch=8,
                            total_frames=16, mp_start_method="spawn") as collector:
        assert [b.numel() for b in collector] == [8, 8]


@pytest.mark.parametrize("collector_class", [MultiSyncCollector, MultiAsyncCollector])
@pytest.mark.parametrize("devices, stored", [({}, None), ({"device": "cpu"}, "cpu")])
def test_batches_from_workers_have_the_device_a_worker_stores_on(collector_class, devices, stored):
    with collector_class([CountingEnv] * 2, frames_per_batch=8, total_frames=16, **devices) as collector:
        batches = list(collector)
    assert [batch.device for batch in batches] == [torch.device(stored) if stored else None] * 2



class SlowFirstStepEnv(CountingEnv):
    """CountingEnv counting from 10000, whose first step (after it is built) takes ``delay`` seconds: a
    worker that becomes ready late, as a Ray actor importing torch does."""

    def __init__(self, delay: float = 0.5) -> None:
        super().__init__(max_steps=10**6, start_val=10_000)
        self.delay = delay

    def _step_arrays(self, actions):
        if self.delay:
            time.sleep(self.delay)
            self.delay = 0.0
        return super()._step_arrays(actions)


def test_async_first_batches_come_from_every_worker_and_a_replacement_s_first_goes_first():
    """A worker that is ready late (at the start, or a replacement) delivers its first batch before any
    other worker's next one (docs/collection.md, "A batch"); before, the worker ready first delivered
    batch after batch while the other stepped its first (issue 33)."""
    collector = MultiAsyncCollector([lambda: CountingEnv(max_steps=10**6), SlowFirstStepEnv], weight_policy(1.0),
                                    frames_per_batch=4, total_frames=-1, max_worker_restarts=1)
    try:
        iterator = iter(collector)
        starts = [int(next(iterator)["observation"][0]) for _ in range(2)]
        assert sorted(start >= 10_000 for start in starts) == [False, True], starts  # one batch of each
        os.kill(collector.worker_pids()[1], 9)
        starts, met = [], None
        while 10_000 not in starts and len(starts) < 100:
            starts.append(int(next(iterator)["observation"][0]))
            if met is None and collector.restart_causes:
                met = len(starts) - 1  # the batch whose wait met the kill (the replacement started then)
        # the replacement's first batch (its fresh env counts from 10000) comes at once, not after more
        # of worker 0's
        assert met is not None and 10_000 in starts[met:met + 2], (met, starts)
    finally:
        collector.shutdown()
