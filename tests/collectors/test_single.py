"""Collector: the rollout loop in the calling process, its arguments and methods (docs/collection.md)."""

from __future__ import annotations

import pytest
import torch
from mocks import (ConstantObsEnv, CountingPolicy, PrivateKeysPolicy, StepCountEnv, TorchRLStyleCountingEnv, bias_policy,
                   wait_until)
from tensordict import TensorDict

from rlharvest.collectors import Collector, SyncDataCollector
from rlharvest.data import ReplayBuffer
from rlharvest.envs import ContinuousMockEnv, CountingEnv

pytestmark = pytest.mark.timeout(60)


def counting_collector(**kwargs):
    kwargs.setdefault("frames_per_batch", 10)
    kwargs.setdefault("total_frames", 30)
    return Collector(CountingEnv(max_steps=3), CountingPolicy(), **kwargs)


# ---------------------------------------------------------------------------------- batch layout
def test_batch_layout_counting():
    collector = counting_collector()
    batch = next(iter(collector))
    assert batch.batch_size == (10,)
    assert batch.names[-1] == "time"
    keys = set(batch.keys(True, True))
    for key in ["observation", "action", "done", "terminated", ("next", "observation"), ("next", "reward"),
                ("next", "done"), ("next", "terminated"), ("collector", "traj_ids")]:
        assert key in keys, key
    # The counter starts at 0, goes 1, 2, 3, 4 and ends once above max_steps=3: a new trajectory starts.
    assert batch["observation"].squeeze(-1).tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert batch["next", "observation"].squeeze(-1).tolist() == [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    assert batch["next", "done"].squeeze(-1).tolist() == [False, False, False, True] * 2 + [False, False]
    assert batch["collector", "traj_ids"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert not batch["done"].any()
    collector.shutdown()


def test_trajectory_spans_batches_and_batches_are_fresh_objects():
    collector = counting_collector(frames_per_batch=6, total_frames=12)
    first, second = list(collector)
    assert first["collector", "traj_ids"].tolist() == [0, 0, 0, 0, 1, 1]
    assert second["collector", "traj_ids"].tolist() == [1, 1, 2, 2, 2, 2]
    assert first["observation"].data_ptr() != second["observation"].data_ptr()


def test_batched_env_layout_and_traj_ids():
    collector = Collector(CountingEnv(max_steps=2, batch_size=(3,)), CountingPolicy(), frames_per_batch=12,
                          total_frames=12)
    batch = next(iter(collector))
    assert batch.batch_size == (3, 4) and batch.names == [None, "time"]
    ids = batch["collector", "traj_ids"]
    assert ids[:, 0].tolist() == [0, 1, 2]
    assert ids[:, 3].tolist() == [3, 4, 5]  # counter 0,1,2,3 -> ends after the third step
    collector.shutdown()


@pytest.mark.parametrize("with_smr", [True, False])
def test_torchrl_style_env_gives_the_same_batches(with_smr):
    """An env with only the TensorDict protocol members (like TorchRL's EnvBase) collects the same data."""
    reference = Collector(CountingEnv(max_steps=3, batch_size=(2,)), CountingPolicy(), frames_per_batch=20,
                          total_frames=40)
    duck = Collector(TorchRLStyleCountingEnv(max_steps=3, batch_size=(2,), with_step_and_maybe_reset=with_smr),
                     CountingPolicy(), frames_per_batch=20, total_frames=40)
    for expected, got in zip(reference, duck):
        for key in ["observation", ("next", "observation"), ("next", "done"), ("collector", "traj_ids")]:
            assert torch.equal(expected[key], got[key]), key
        assert got.names[-1] == "time"


def test_deprecated_alias_warns_and_isinstance_both_ways():
    with pytest.warns(DeprecationWarning, match="Collector"):
        old = SyncDataCollector(CountingEnv(), frames_per_batch=4, total_frames=4)
    assert isinstance(old, Collector)
    new = Collector(CountingEnv(), frames_per_batch=4, total_frames=4)
    assert isinstance(new, SyncDataCollector)


# ----------------------------------------------------------------- TorchRL's documented behaviours
def test_next_method_without_iter():
    collector = Collector(ContinuousMockEnv(), frames_per_batch=50, total_frames=300)
    assert collector.next().numel() == 50
    assert collector.next().numel() == 50
    for batch in collector:
        assert batch.numel() == 50
        break
    collector.shutdown()


def test_no_stopiteration_with_rounding():
    with pytest.warns(UserWarning, match="multiple"):
        collector = Collector(CountingEnv(batch_size=(16,)), frames_per_batch=173, total_frames=300)
    assert len(collector) == 2
    batches = [b for b in collector]
    assert len(batches) == 2 and all(b is not None for b in batches)
    assert batches[0].numel() == 176


def test_max_frames_per_traj_refuses_existing_step_counter():
    with pytest.raises(ValueError, match="step_count"):
        Collector(StepCountEnv(), frames_per_batch=10, max_frames_per_traj=3)


def test_split_trajs():
    collector = Collector(CountingEnv(max_steps=100, batch_size=(2,)), frames_per_batch=40, total_frames=80,
                          max_frames_per_traj=7, split_trajs=True)
    for batch in collector:
        assert batch.ndim == 2
        mask = batch["collector", "mask"]
        ids = batch["collector", "traj_ids"]
        assert mask.shape == batch.shape and ids.shape == batch.shape
        for row in range(batch.shape[0]):
            assert ids[row][mask[row]].unique().numel() == 1
            counts = batch["next", "step_count"][row][mask[row]].squeeze(-1)
            assert torch.all(counts[1:] - counts[:-1] == 1)


def test_max_frames_per_traj_truncates_and_counts():
    collector = Collector(CountingEnv(max_steps=100), frames_per_batch=10, total_frames=10, max_frames_per_traj=4)
    batch = next(iter(collector))
    assert batch["step_count"].squeeze(-1).tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert batch["next", "step_count"].squeeze(-1).tolist() == [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    assert batch["next", "truncated"].squeeze(-1).tolist() == [False, False, False, True] * 2 + [False] * 2
    assert batch["collector", "traj_ids"].tolist() == [0] * 4 + [1] * 4 + [2] * 2
    collector.shutdown()


@pytest.mark.parametrize("use_buffers", [True, False])
def test_traj_len_consistency(use_buffers):
    def run(frames_per_batch):
        torch.manual_seed(0)
        collector = Collector(ContinuousMockEnv(episode_length=7), frames_per_batch=frames_per_batch,
                              total_frames=20, use_buffers=use_buffers)
        collector.set_seed(0)
        torch.manual_seed(0)
        data = torch.cat([b for b in collector], dim=-1)
        return data[:20]

    reference = run(1)
    for frames_per_batch in (10, 20):
        other = run(frames_per_batch)
        for key in ["observation", "action", ("next", "observation"), ("collector", "traj_ids")]:
            assert torch.equal(reference[key], other[key]), (frames_per_batch, key)


def test_set_truncated():
    collector = Collector(ContinuousMockEnv(episode_length=100), frames_per_batch=8, total_frames=24,
                          set_truncated=True)
    ids_seen = []
    for batch in collector:
        assert batch["next", "truncated"][-1].all() and batch["next", "done"][-1].all()
        assert not batch["next", "truncated"][:-1].any()
        ids_seen.append(batch["collector", "traj_ids"].unique().tolist())
    assert ids_seen == [[0], [1], [2]]  # every batch starts a new episode


def test_set_truncated_requires_truncated_key():
    with pytest.raises(RuntimeError, match="truncated"):
        Collector(CountingEnv(), frames_per_batch=4, set_truncated=True)


@pytest.mark.parametrize("use_buffers", [True, False])
def test_unbatched_env_traj_ids_shape(use_buffers):
    collector = Collector(ConstantObsEnv(episode=6), frames_per_batch=30, total_frames=60, use_buffers=use_buffers)
    for batch in collector:
        assert batch.shape == (30,)
        ids = batch["collector", "traj_ids"]
        assert ids.shape == (30,) and (ids >= 0).all()
        assert ids.unique().numel() == 5


def test_replay_buffer_matches_manual_extend():
    def run(with_buffer: bool):
        torch.manual_seed(0)
        rb = ReplayBuffer(capacity=1000)
        kwargs = {"replay_buffer": rb, "local_init_rb": True} if with_buffer else {}
        collector = Collector(ContinuousMockEnv(), frames_per_batch=16, total_frames=64, **kwargs)
        for batch in collector:
            if with_buffer:
                assert batch is None
            else:
                rb.extend(batch)
        return rb

    auto, manual = run(True), run(False)
    assert len(auto) == len(manual) == 64 and auto.write_count == 64
    assert torch.equal(auto[:]["observation"], manual[:]["observation"])
    assert torch.equal(auto[:]["collector", "traj_ids"], manual[:]["collector", "traj_ids"])


def test_postproc_zeros():
    def zero(td):
        return td.apply(torch.zeros_like)

    collector = Collector(ContinuousMockEnv(), frames_per_batch=8, total_frames=16, postproc=zero)
    for batch in collector:
        assert all((leaf == 0).all() for leaf in batch.values(True, True))
    rb = ReplayBuffer(capacity=100)
    collector = Collector(ContinuousMockEnv(), frames_per_batch=8, total_frames=16, postproc=zero,
                          replay_buffer=rb, extend_buffer=True, local_init_rb=True)
    for _ in collector:
        pass
    sample = rb.sample(8)
    assert all((leaf == 0).all() for leaf in sample.values(True, True))


@pytest.mark.parametrize("total_frames", [-1, int(1e9)])
def test_start_fills_buffer(total_frames):
    rb = ReplayBuffer(capacity=10_000)
    collector = Collector(ContinuousMockEnv(), frames_per_batch=16, total_frames=total_frames, replay_buffer=rb,
                          local_init_rb=True)
    collector.start()
    try:
        wait_until(lambda: len(rb) >= 16, timeout=30, what="16 frames in the buffer")
        assert collector.is_running()
    finally:
        collector.async_shutdown(timeout=10)
    assert not collector.is_running()


def test_start_requires_buffer_and_pause_unsupported():
    collector = Collector(CountingEnv(), frames_per_batch=4)
    with pytest.raises(RuntimeError, match="replay_buffer"):
        collector.start()
    pause = collector.pause()  # the error comes when the block is entered
    with pytest.raises(NotImplementedError, match="pause"):
        with pause:
            pass
    collector.shutdown()


def test_start_update_policy():
    rb = ReplayBuffer(capacity=100_000)
    policy = bias_policy(0.0)
    collector = Collector(ContinuousMockEnv(obs_dim=1, action_dim=1), policy, frames_per_batch=16,
                          replay_buffer=rb, local_init_rb=True)
    collector.start()
    try:
        wait_until(lambda: rb.write_count >= 32, what="32 frames written")
        assert (rb.latest(16)["action"] == 0).all()
        new_weights = TensorDict.from_module(policy).detach().clone()
        new_weights["module", "bias"] += 1
        collector.update_policy_weights_(new_weights)
        wait_until(lambda: (rb.latest(16)["action"] == 1).all(), timeout=30, what="frames acted with the new weights")
    finally:
        collector.async_shutdown(timeout=10)


def test_init_random_frames_with_start():
    rb = ReplayBuffer(capacity=10_000)
    collector = Collector(ContinuousMockEnv(), bias_policy(5.0), frames_per_batch=32, init_random_frames=64,
                          replay_buffer=rb, local_init_rb=True)
    collector.start()
    try:
        wait_until(lambda: rb.write_count >= 256, timeout=30, what="256 frames written")
    finally:
        collector.async_shutdown(timeout=10)
    data = rb[:256]
    assert (data["action"][:64].abs() <= 1).all()   # random actions live in [-1, 1]
    assert (data["action"][64:] == 5).all()         # then the policy's


def test_excluded_keys():
    collector = Collector(CountingEnv(), PrivateKeysPolicy(), frames_per_batch=4, total_frames=8)
    for batch in collector:
        keys = set(batch.keys(True, True))
        assert "_dummy" not in keys and ("out", "_dummy") not in keys and ("_out", "dummy") not in keys
        assert "_out" not in batch.keys()


def test_private_keys_a_postproc_adds_are_excluded_too():
    """The rollout's own keys are all public here (its batches are not searched): the postproc's are."""
    def postproc(batch):
        batch["_note"] = batch["observation"].clone()
        batch["next", "_note"] = batch["observation"].clone()
        return batch

    collector = Collector(CountingEnv(batch_size=(2,)), CountingPolicy(), frames_per_batch=4, total_frames=8,
                          postproc=postproc)
    for batch in collector:
        keys = set(batch.keys(True, True))
        assert "_note" not in keys and ("next", "_note") not in keys and "observation" in keys


def test_collector_reloading():
    collector = Collector(CountingEnv(), frames_per_batch=10, total_frames=90)
    for i, _ in enumerate(collector):
        if i == 3:
            break
    state = collector.state_dict()
    assert state["frames"] == 40 and state["iter"] == 3
    collector.shutdown()
    restored = Collector(CountingEnv(), frames_per_batch=10, total_frames=90)
    restored.load_state_dict(state)
    assert restored.state_dict()["frames"] == 40 and restored.state_dict()["iter"] == 3
    restored.load_state_dict({**state, "frames": 90})
    assert list(restored) == []


def test_state_dict_contains_policy():
    collector = counting_collector()
    state = collector.state_dict()
    assert set(state) == {"policy_state_dict", "env_state_dict", "frames", "iter", "traj_pool", "rlharvest_resume"}
    assert torch.equal(state["policy_state_dict"]["weight"], torch.tensor(1.0))


# ---------------------------------------------------------------------------------- frames and lengths
def test_total_frames_endless_and_len():
    collector = Collector(CountingEnv(), frames_per_batch=5, total_frames=-1)
    with pytest.raises(RuntimeError, match="Non-terminating"):
        len(collector)
    for i, batch in enumerate(collector):
        if i == 5:
            break
    collector.shutdown()
    assert len(Collector(CountingEnv(), frames_per_batch=5, total_frames=None)._persistent_iterator or []) == 0


def test_total_frames_not_divisible_overshoots():
    with pytest.warns(UserWarning, match="overshoot"):
        collector = Collector(CountingEnv(), frames_per_batch=4, total_frames=10)
    assert sum(b.numel() for b in collector) == 12


def test_collector_closes_env_at_the_end():
    env = CountingEnv()
    collector = Collector(env, frames_per_batch=4, total_frames=8)
    list(collector)
    assert env.is_closed
    collector.shutdown()  # closing twice is fine


def test_reset_at_each_iter_gives_fresh_traj_ids():  # docs/torchrl-compatibility.md, "ids after a reset"
    collector = Collector(CountingEnv(max_steps=100), frames_per_batch=3, total_frames=9, reset_at_each_iter=True)
    batches = list(collector)
    assert [b["collector", "traj_ids"].tolist() for b in batches] == [[0, 0, 0], [1, 1, 1], [2, 2, 2]]
    assert all(b["observation"][0].item() == 0 for b in batches)


def test_reset_with_index():
    collector = Collector(CountingEnv(max_steps=100, batch_size=(2,)), CountingPolicy(), frames_per_batch=4)
    batch = collector.next()
    collector.reset(index=1)
    batch = collector.next()
    assert batch["observation"][:, 0].squeeze(-1).tolist() == [2, 0]
    assert batch["collector", "traj_ids"][:, 0].tolist() == [0, 2]
    single = Collector(CountingEnv(), frames_per_batch=4)
    with pytest.raises(RuntimeError, match="batched"):
        single.reset(index=0)
    collector.shutdown()
    single.shutdown()


def test_interruptor_stops_after_first_step():
    class Stopped:
        def collection_stopped(self):
            return True

    collector = Collector(CountingEnv(), frames_per_batch=10, total_frames=20, interruptor=Stopped())
    batch = collector.next()
    ids = batch["collector", "traj_ids"]
    assert ids[0] >= 0 and (ids[1:] == -1).all()
    collector.shutdown()


def test_steps_an_interrupted_batch_did_not_collect_are_zeros_and_id_minus_one():
    """Each batch has a buffer of its own: the steps a cut-short batch did not collect hold zeros (never the
    values of an earlier batch, nor whatever the memory held), and trajectory id -1."""
    class StopInSecondBatch:
        calls = 0

        def collection_stopped(self):
            self.calls += 1
            return self.calls > 10  # the first batch's 10 steps, then one step of the second

    collector = Collector(CountingEnv(max_steps=100), CountingPolicy(), frames_per_batch=10, total_frames=30,
                          interruptor=StopInSecondBatch())
    first, second = collector.next(), collector.next()
    assert first["observation"].squeeze(-1).tolist() == list(range(10))
    assert second["observation"].squeeze(-1).tolist() == [10] + [0] * 9
    assert second["next", "observation"].squeeze(-1).tolist() == [11] + [0] * 9
    assert second["action"].squeeze(-1).tolist() == [1] + [0] * 9
    assert second["collector", "traj_ids"].tolist() == [0] + [-1] * 9
    assert first["observation"].squeeze(-1).tolist() == list(range(10))  # the first batch kept its values
    collector.shutdown()


def test_init_random_frames_switches_at_batch_boundary():
    with pytest.warns(UserWarning, match="init_random_frames"):
        collector = Collector(ContinuousMockEnv(), bias_policy(5.0), frames_per_batch=10, total_frames=30,
                              init_random_frames=15)
    batches = list(collector)
    assert (batches[0]["action"].abs() <= 1).all() and (batches[1]["action"].abs() <= 1).all()
    assert (batches[2]["action"] == 5).all()


def test_exploration_type_is_ambient_during_rollout():
    from tensordict.nn import interaction_type

    from rlharvest import ExplorationType

    seen = []

    class Spy(torch.nn.Module):
        def forward(self, tensordict):
            seen.append(interaction_type())
            tensordict.set("action", torch.zeros(1, dtype=torch.int8))
            return tensordict

    collector = Collector(CountingEnv(), Spy(), frames_per_batch=2, total_frames=2,
                          exploration_type=ExplorationType.DETERMINISTIC)
    list(collector)
    assert set(seen) == {ExplorationType.DETERMINISTIC}


def test_devices_are_resolved():
    collector = Collector(CountingEnv(), frames_per_batch=4, device="cpu")
    assert collector.storing_device == collector.policy_device == collector.env_device == torch.device("cpu")
    assert collector.next().device == torch.device("cpu")
    collector.shutdown()


@pytest.mark.parametrize("devices, stored", [
    ({}, None), ({"env_device": "cpu"}, None), ({"policy_device": "cpu"}, None),
    ({"device": "cpu"}, "cpu"), ({"storing_device": "cpu"}, "cpu"), ({"env_device": "cpu", "policy_device": "cpu"}, "cpu"),
])
def test_batches_have_a_device_only_when_the_arguments_give_one(devices, stored):
    """The CPU env's own device does not decide where batches are stored (docs/collection.md, "Devices")."""
    collector = Collector(CountingEnv(), frames_per_batch=4, total_frames=8, **devices)
    batches = list(collector)
    assert [batch.device for batch in batches] == [torch.device(stored) if stored else None] * 2
    assert {leaf.device for leaf in batches[-1].values(True, True)} == {torch.device("cpu")}
    assert batches[-1].names[-1] == "time" and batches[-1].numel() == 4


def test_return_same_td():
    collector = Collector(CountingEnv(), frames_per_batch=4, total_frames=8, return_same_td=True)
    first, second = collector.next(), collector.next()
    assert first is second


def test_plain_module_is_wrapped_by_observation_names():
    class Net(torch.nn.Module):
        def forward(self, observation):
            return torch.ones_like(observation, dtype=torch.int8)

    collector = Collector(CountingEnv(), Net(), frames_per_batch=4, total_frames=4)
    assert (collector.next()["action"] == 1).all()


def test_policy_argument_errors():
    class Net(torch.nn.Module):
        def forward(self, pixels):
            return pixels

    with pytest.raises(TypeError, match="trust_policy"):
        Collector(CountingEnv(), Net(), frames_per_batch=4)

    class KeyedNet(torch.nn.Module):
        in_keys = ["observation"]

        def forward(self, observation):
            return observation

    with pytest.raises(RuntimeError, match="in_keys"):
        Collector(CountingEnv(), KeyedNet(), frames_per_batch=4)
    with pytest.raises(TypeError, match="policy_factory"):
        Collector(CountingEnv(), CountingPolicy(), policy_factory=CountingPolicy, frames_per_batch=4)


def test_policy_factory():
    collector = Collector(CountingEnv(), policy_factory=lambda: CountingPolicy(1.0), frames_per_batch=4,
                          total_frames=4)
    assert (collector.next()["action"] == 1).all()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"frames_per_batch": 0}, ValueError, "frames_per_batch"),
        ({"frames_per_batch": 4, "bogus": 1}, TypeError, "bogus"),
        ({"frames_per_batch": 4, "reset_when_done": False}, ValueError, "reset_when_done"),
        ({"frames_per_batch": 4, "exploration_type": "sometimes"}, ValueError, "exploration_type"),
        ({"frames_per_batch": 4, "replay_buffer": object()}, TypeError, "extend"),
        ({"frames_per_batch": 4, "replay_buffer": ReplayBuffer(10), "local_init_rb": True, "use_buffers": True}, TypeError, "use_buffers"),
        ({"frames_per_batch": 4, "create_env_kwargs": {"x": 1}}, RuntimeError, "create_env_kwargs"),
        ({"frames_per_batch": 4, "total_frames": "many"}, TypeError, "total_frames"),
    ],
)
def test_argument_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        Collector(CountingEnv(), **kwargs)


def test_return_same_td_with_a_replay_buffer_yields_the_batch_itself():
    """As TorchRL: return_same_td hands the collector's own batch over and leaves the buffer to the caller."""
    rb = ReplayBuffer(100)
    seen = []
    collector = Collector(CountingEnv(), frames_per_batch=4, total_frames=8, replay_buffer=rb, return_same_td=True,
                          local_init_rb=True, postproc=lambda td: seen.append(td) or td)
    first = next(iter(collector))
    assert first is seen[0] and first.numel() == 4
    assert len(rb) == 0
    rb.extend(first)
    assert len(rb) == 4
    collector.shutdown()


def test_extend_buffer_false_writes_steps_and_rejects_postproc():
    rb = ReplayBuffer(100)
    with pytest.warns(DeprecationWarning):
        collector = Collector(CountingEnv(), frames_per_batch=4, total_frames=8, replay_buffer=rb,
                              extend_buffer=False, local_init_rb=True)
    list(collector)
    assert len(rb) == 8
    with pytest.raises(TypeError, match="extend_buffer"), pytest.warns(DeprecationWarning):
        Collector(CountingEnv(), frames_per_batch=4, replay_buffer=ReplayBuffer(10), extend_buffer=False,
                  postproc=lambda td: td, local_init_rb=True)


def test_local_init_rb_warns_only_when_passed_false():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not passing it (or passing True, today's behaviour) is silent
        Collector(CountingEnv(), frames_per_batch=4, replay_buffer=ReplayBuffer(10))
        Collector(CountingEnv(), frames_per_batch=4, replay_buffer=ReplayBuffer(10), local_init_rb=True)
    with pytest.warns(FutureWarning, match="local_init_rb=False"):
        Collector(CountingEnv(), frames_per_batch=4, replay_buffer=ReplayBuffer(10), local_init_rb=False)


def test_worker_idx_defaults_to_none():  # docs/torchrl-compatibility.md, "worker_idx"
    assert Collector(CountingEnv(), frames_per_batch=4).worker_idx is None
    assert Collector(CountingEnv(), frames_per_batch=4, worker_idx=3).worker_idx == 3


def test_shutdown_is_idempotent():
    collector = counting_collector()
    collector.shutdown()
    collector.shutdown()
    collector.async_shutdown(timeout=1, close_env=False)
