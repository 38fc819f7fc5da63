"""SerialEnv and ParallelEnv: the same data as in-process batched envs, and the failure rules of workers."""

from __future__ import annotations

import functools
import os
import pickle
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest
import torch
from mocks import CountingPolicy, FaultyEnv, TorchRLStyleCountingEnv, wait_until
from process_check import process_gone

from rlharvest import WorkerError, WorkerTimeoutError
from rlharvest.collectors import Collector, MultiSyncCollector
from rlharvest.envs import CountingEnv, GymEnv, ParallelEnv, SerialEnv

pytestmark = pytest.mark.timeout(60)

BATCHED = [SerialEnv, ParallelEnv]


def _batches(env, policy=None, frames_per_batch=24, batches=3, seed=0, **kwargs) -> list:
    torch.manual_seed(seed)  # the random policy draws from the global generator of this process
    collector = Collector(env, policy, frames_per_batch=frames_per_batch, total_frames=frames_per_batch * batches,
                          **kwargs)
    out = [batch.clone() for batch in collector]
    collector.shutdown()
    return out


def _assert_same(first: list, second: list) -> None:
    assert len(first) == len(second)
    for a, b in zip(first, second):
        assert set(a.keys(True, True)) == set(b.keys(True, True))
        for key in a.keys(True, True):
            assert a.get(key).dtype == b.get(key).dtype, key
            assert torch.equal(a.get(key), b.get(key)), key


@pytest.mark.parametrize("batched", BATCHED)
def test_same_batches_as_counting_env_batched_in_process(batched):
    expected = _batches(CountingEnv(max_steps=2, batch_size=(3,)))  # random actions: resets at different steps
    got = _batches(batched(3, functools.partial(CountingEnv, max_steps=2)))
    _assert_same(got, expected)
    assert (got[0]["next", "done"].sum(-2) > 0).all()  # every row ended an episode ...
    assert len({tuple(row.tolist()) for row in got[0]["next", "done"].squeeze(-1)}) > 1  # ... at different steps


@pytest.mark.parametrize("batched", BATCHED)
def test_batched_sub_envs_and_truncation_match_in_process(batched):
    # max_frames_per_traj truncates rows the env did not end: those resets go to the sub-envs (RESET_ROWS)
    kwargs = {"max_frames_per_traj": 3}
    expected = _batches(CountingEnv(max_steps=4, batch_size=(2, 3)), **kwargs)
    got = _batches(batched(2, functools.partial(CountingEnv, max_steps=4, batch_size=(3,))), **kwargs)
    _assert_same(got, expected)
    assert got[0].batch_size == (2, 3, 4)


def test_resets_at_different_steps_per_sub_env():
    max_steps = [1, 2, 4]
    fns = [functools.partial(CountingEnv, max_steps=m) for m in max_steps]
    parallel = _batches(ParallelEnv(3, fns), CountingPolicy())
    _assert_same(parallel, _batches(SerialEnv(3, fns), CountingPolicy()))
    for row, m in enumerate(max_steps):  # each row is exactly that sub-env run alone
        alone = _batches(CountingEnv(max_steps=m), CountingPolicy(), frames_per_batch=8)
        for got, want in zip(parallel, alone):
            for key in ("observation", ("next", "observation"), ("next", "done"), "action"):
                assert torch.equal(got[row].get(key), want.get(key)), (row, key)
    ids = parallel[0]["collector", "traj_ids"]
    assert len(set(ids.flatten().tolist())) == sum(-(-8 // (m + 1)) for m in max_steps)  # unique per episode


@pytest.mark.parametrize("batched", BATCHED)
def test_tensordict_protocol_sub_envs(batched):
    # envs that only have the TensorDict protocol (like TorchRL's) go through the same buffers
    expected = _batches(CountingEnv(max_steps=2, batch_size=(2,)))
    got = _batches(batched(2, functools.partial(TorchRLStyleCountingEnv, max_steps=2)))
    _assert_same(got, expected)


@pytest.mark.parametrize("batched", BATCHED)
def test_env_protocol_and_specs(batched):
    env = batched(2, CountingEnv)
    try:
        assert env.batch_size == (2,) and env.observation_spec["observation"].shape == (2, 1)
        assert env.full_action_spec["action"].shape == (2, 1) and env.done_keys == ["done", "terminated"]
        td = env.rand_action(env.reset())
        td = env.step(td)
        assert td["next", "observation"].shape == (2, 1) and td["next", "reward"].shape == (2, 1)
        stepped, root = env.step_and_maybe_reset(td.exclude("next").update({"action": torch.ones(2, 1)}))
        assert root["observation"].shape == (2, 1) and not root["done"].any()
        assert env.fake_tensordict()["next", "reward"].shape == (2, 1)
    finally:
        env.close()
    assert env.is_closed
    with pytest.raises(RuntimeError, match="already closed"):
        env.close()
    env.close(raise_if_closed=False)


@pytest.mark.parametrize("batched", BATCHED)
def test_set_seed_gives_distinct_reproducible_seeds(batched):
    def first_observations(cls):
        env = cls(3, functools.partial(GymEnv, "CartPole-v1"))
        try:
            assert env.set_seed(5) == 8  # the seed the next env should use, like every env
            return env.reset()["observation"]
        finally:
            env.close()

    observations = first_observations(batched)
    assert len({tuple(row.tolist()) for row in observations}) == 3  # sub-envs are seeded apart
    assert torch.equal(observations, first_observations(batched))  # and reproducibly
    assert torch.equal(observations, first_observations(SerialEnv if batched is ParallelEnv else ParallelEnv))
    single = GymEnv("CartPole-v1")
    single.set_seed(6)  # sub-env 1 got seed 5 + 1
    assert torch.equal(single.reset()["observation"], observations[1])


def test_sub_env_exception_is_a_worker_error_naming_it():
    kwargs = [{"bad": [1], "worker_idx": i, "after_steps": 2} for i in range(3)]
    env = ParallelEnv(3, FaultyEnv, create_env_kwargs=kwargs)
    collector = Collector(env, frames_per_batch=30, total_frames=-1)
    with pytest.raises(WorkerError) as info:
        collector.next()
    err = info.value
    assert err.worker_idx == 1 and str(err).startswith("sub-env 1:")
    assert isinstance(err, ValueError) and "injected failure" in str(err)
    assert "_step_arrays" in err.remote_traceback
    collector.shutdown()
    assert env.is_closed


def test_sub_env_that_fails_to_build():
    def broken():
        raise RuntimeError("no such simulator")

    with pytest.raises(WorkerError, match="sub-env 0: building the sub-env failed with RuntimeError: no such"):
        ParallelEnv(2, [broken, CountingEnv])


def test_killed_sub_env_is_detected_as_a_death():
    # worker_timeout is far above the test's timeout: only noticing the death itself can pass
    env = ParallelEnv(3, functools.partial(CountingEnv, max_steps=10**6), worker_timeout=1000.0)
    try:
        env.rand_action(env.reset())
        victim = env._pool.processes[2].pid
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(WorkerError, match="sub-env 2: the sub-env process died.*SIGKILL") as info:
            for _ in range(10**6):
                env.step(env.rand_action(env.reset()))
        assert info.value.worker_idx == 2 and not isinstance(info.value, WorkerTimeoutError)
        with pytest.raises(WorkerError):  # the env stays broken
            env.reset()
    finally:
        env.close()


def test_hung_sub_env_times_out():
    kwargs = [{"bad": [0], "worker_idx": i, "after_steps": 1, "mode": "hang"} for i in range(2)]
    env = ParallelEnv(2, FaultyEnv, create_env_kwargs=kwargs, worker_timeout=1.0)
    try:
        td = env.reset()
        with pytest.raises(WorkerTimeoutError, match="sub-env 0: no answer to 'step'"):
            for _ in range(5):
                td = env.step(env.rand_action(td))["next"]
    finally:
        env.close()  # terminates the hung sub-env (the autouse fixture checks that none is left)


_ORPHAN_SCRIPT = textwrap.dedent("""
    import sys, time
    from rlharvest.envs import CountingEnv, ParallelEnv
    env = ParallelEnv(3, CountingEnv)
    print(" ".join(str(p.pid) for p in env._pool.processes), flush=True)
    time.sleep(120)
""")


def test_sub_envs_exit_when_the_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN_SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 3 and all(psutil.pid_exists(p) for p in pids)
    finally:
        parent.kill()
        parent.wait(10)
    wait_until(lambda: all(process_gone(p) for p in pids), timeout=5.0,
               what=f"the exit of sub-env processes {pids} after their parent was killed")


def test_parallel_env_in_worker_processes():
    make = functools.partial(ParallelEnv, 2, functools.partial(CountingEnv, max_steps=3))
    collector = MultiSyncCollector([make, make], CountingPolicy(), frames_per_batch=32, total_frames=64)
    batches = [batch for batch in collector]
    collector.shutdown()
    assert [b.batch_size for b in batches] == [torch.Size([2, 2, 8])] * 2
    ids = batches[0]["collector", "traj_ids"]
    assert ids.unique().numel() == 2 * 2 * 2  # 8 steps of episodes of 4 steps, ids unique across workers


def test_serial_for_single_and_bad_arguments():
    env = ParallelEnv(1, CountingEnv, serial_for_single=True)
    assert type(env) is SerialEnv
    env.close()
    with pytest.raises(ValueError, match="memmap=True is not supported"):
        ParallelEnv(2, CountingEnv, memmap=True)
    with pytest.raises(ValueError, match="num_workers must be a positive int"):
        SerialEnv(0, CountingEnv)
    with pytest.raises(ValueError, match="worker_timeout must be a positive, finite number of seconds, got inf"):
        SerialEnv(2, CountingEnv, worker_timeout=float("inf"))  # every wait ends
    with pytest.raises(ValueError, match="create_env_fn has 3 entries for num_workers=2"):
        SerialEnv(2, [CountingEnv] * 3)
    with pytest.raises(TypeError, match="callable returning an env"):
        SerialEnv(2, CountingEnv())
    with pytest.raises(ValueError, match="does not stack"):
        SerialEnv(2, [CountingEnv, functools.partial(CountingEnv, batch_size=(2,))])
    env = SerialEnv(2, CountingEnv)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(env)
    env.close()


def test_spawned_sub_envs_give_the_same_data():
    fn = functools.partial(CountingEnv, max_steps=2)
    got = _batches(ParallelEnv(2, fn, mp_start_method="spawn"), frames_per_batch=8, batches=2)
    _assert_same(got, _batches(CountingEnv(max_steps=2, batch_size=(2,)), frames_per_batch=8, batches=2))


class _NonTensorEnv(CountingEnv):
    """A CountingEnv whose observations also carry a string (non-tensor data)."""

    def _reset_arrays(self, mask=None):
        return {**super()._reset_arrays(mask), "instruction": "go"}


def test_non_tensor_entries_are_refused_by_name():
    with pytest.raises(TypeError, match="'instruction' is a str"):
        SerialEnv(2, _NonTensorEnv)
