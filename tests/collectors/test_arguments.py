"""Bad arguments fail in the constructor with an error naming the argument (before any process starts)."""

from __future__ import annotations

import math
import sys
import warnings

import gymnasium
import pytest

from rlharvest.collectors import AsyncBatchedCollector, Collector, MultiAsyncCollector, MultiSyncCollector
from rlharvest.collectors.distributed import DistributedCollector, DistributedSyncCollector, RPCCollector
from rlharvest.data import ReplayBuffer
from rlharvest.envs import CountingEnv, GymEnv
from rlharvest.transport.ports import free_port_block

pytestmark = pytest.mark.timeout(60)

MULTI = [MultiSyncCollector, MultiAsyncCollector]
DISTRIBUTED = [DistributedCollector, DistributedSyncCollector, RPCCollector]


@pytest.mark.parametrize("cls", MULTI + [DistributedSyncCollector])
@pytest.mark.parametrize("value, error", [("10", TypeError), (10.0, TypeError), (True, TypeError), (0, ValueError),
                                          (-4, ValueError)])
def test_frames_per_batch_type_and_value(cls, value, error):
    kwargs = {"launcher": "mp"} if cls is DistributedSyncCollector else {}
    with pytest.raises(error, match="frames_per_batch"):
        cls([CountingEnv] * 2, frames_per_batch=value, **kwargs)


@pytest.mark.parametrize("cls", MULTI)
def test_frames_per_batch_list_values(cls):
    with pytest.raises(TypeError, match="frames_per_batch"):
        cls([CountingEnv] * 2, frames_per_batch=[4, "4"])


@pytest.mark.parametrize("value", [[4, 6], [4]])
def test_a_collector_takes_one_frames_per_batch_not_a_list(value):
    with pytest.raises(TypeError, match=r"frames_per_batch must be a positive int, got \[4.*one value per worker"):
        Collector(CountingEnv, frames_per_batch=value)


BAD_SECONDS = [(0, ValueError), (-1.0, ValueError), (math.inf, ValueError), (math.nan, ValueError),
               ("5", TypeError), (None, TypeError)]


@pytest.mark.parametrize("cls", MULTI)
@pytest.mark.parametrize("value, error", BAD_SECONDS)
def test_multi_worker_timeout_positive_and_finite(cls, value, error):
    with pytest.raises(error, match="worker_timeout"):
        cls([CountingEnv] * 2, frames_per_batch=8, worker_timeout=value)


TIMEOUTS = [(cls, name) for cls in DISTRIBUTED for name in ("worker_timeout", "heartbeat_timeout", "handshake_timeout")
            if not (cls is RPCCollector and name == "handshake_timeout")]  # torch RPC has no handshake of ours


@pytest.mark.parametrize("cls, name", TIMEOUTS)
@pytest.mark.parametrize("value, error", BAD_SECONDS[:5])
def test_distributed_timeouts_positive_and_finite(cls, name, value, error):
    with pytest.raises(error, match=name):
        cls([CountingEnv] * 2, frames_per_batch=8, launcher="mp", tcp_port=free_port_block(3), **{name: value})


@pytest.mark.parametrize("cls", DISTRIBUTED)
@pytest.mark.parametrize("value, error", [("abc", TypeError), (1.5, TypeError), (True, TypeError), (-1, ValueError),
                                          (65534, ValueError), (70000, ValueError)])
def test_tcp_port_is_checked_in_the_constructor(cls, value, error):
    with pytest.raises(error, match="tcp_port"):
        cls([CountingEnv] * 2, frames_per_batch=8, launcher="mp", tcp_port=value)


def test_tcp_port_from_the_environment_is_checked(monkeypatch):
    monkeypatch.setenv("TCP_PORT", "not-a-port")
    with pytest.raises(TypeError, match=r"tcp_port \(from \$TCP_PORT\)"):
        DistributedCollector([CountingEnv] * 2, frames_per_batch=8, launcher="mp")


@pytest.mark.parametrize("cls", [DistributedCollector, RPCCollector])
def test_tcp_port_zero_picks_free_ports(cls):
    with cls([CountingEnv] * 2, frames_per_batch=8, total_frames=16, launcher="mp", tcp_port=0) as collector:
        assert int(collector.tcp_port) > 0
        assert sum(batch.numel() for batch in collector) == 16


def test_submitit_delayed_needs_a_known_port_and_key(monkeypatch):
    monkeypatch.delenv("RLHARVEST_AUTHKEY", raising=False)
    with pytest.raises(ValueError, match="tcp_port=0"):
        DistributedCollector([CountingEnv], frames_per_batch=8, launcher="submitit_delayed", tcp_port=0)
    with pytest.raises(ValueError, match="RLHARVEST_AUTHKEY"):
        DistributedCollector([CountingEnv], frames_per_batch=8, launcher="submitit_delayed", tcp_port=free_port_block(3))
    with pytest.raises(ValueError, match="authkey must hold at least 16 bytes"):
        DistributedCollector([CountingEnv], frames_per_batch=8, launcher="mp", authkey="abcd")


@pytest.mark.parametrize("cls", [MultiSyncCollector])
def test_no_local_init_rb_warning_unless_passed_false(cls):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        cls([CountingEnv], frames_per_batch=8, total_frames=8, replay_buffer=ReplayBuffer(100)).shutdown()
    with pytest.warns(FutureWarning, match="local_init_rb=False"):
        cls([CountingEnv], frames_per_batch=8, total_frames=8, replay_buffer=ReplayBuffer(100),
            local_init_rb=False).shutdown()


# ------------------------------------------------------------------------- errors that name the fix
GYM_ADVICE = 'wrap it in GymEnv (GymEnv(env)), or pass a factory that builds it (e.g. lambda: GymEnv("CartPole-v1"))'
WITH_WORKERS = {
    "MultiSyncCollector": lambda env: MultiSyncCollector([env, env], frames_per_batch=8),
    "MultiAsyncCollector": lambda env: MultiAsyncCollector(env, num_workers=2, frames_per_batch=8),
    "AsyncBatchedCollector": lambda env: AsyncBatchedCollector([env, env], policy_factory=_no_policy,
                                                               frames_per_batch=8),
    "DistributedCollector": lambda env: DistributedCollector([env, env], launcher="mp", frames_per_batch=8),
    "RPCCollector": lambda env: RPCCollector([env, env], launcher="mp", frames_per_batch=8),
}


def _no_policy():
    raise AssertionError("never called: the collector is refused before any worker starts")


@pytest.mark.parametrize("name", list(WITH_WORKERS))
@pytest.mark.parametrize("make", [lambda: gymnasium.make("CartPole-v1"),
                                  lambda: gymnasium.make_vec("CartPole-v1", num_envs=2)], ids=["Env", "VectorEnv"])
def test_a_gymnasium_env_for_workers_is_refused_in_the_constructor_naming_the_fix(name, make):
    env = make()
    with pytest.raises(TypeError) as info:  # in this process, before any worker starts (conftest checks)
        WITH_WORKERS[name](env)
    assert str(info.value).startswith(f"create_env_fn[0] is a gymnasium env ({type(env).__name__}), which no ")
    assert str(info.value).endswith(f"can build its env from: {GYM_ADVICE}."), str(info.value)


def test_a_gymnasium_env_given_to_a_collector_or_added_to_workers_names_the_fix():
    env = gymnasium.make("CartPole-v1")
    with pytest.raises(TypeError, match=r"create_env_fn is a gymnasium env \(TimeLimit\), not an env of rlharvest"):
        Collector(env, frames_per_batch=8)
    with pytest.raises(TypeError, match="returned a gymnasium env .* return it wrapped in GymEnv"):
        Collector(lambda: gymnasium.make("CartPole-v1"), frames_per_batch=8)
    collector = MultiSyncCollector([CountingEnv], frames_per_batch=8, total_frames=-1)
    try:
        with pytest.raises(TypeError, match="no worker process can build its env from: wrap it in GymEnv"):
            collector.add_collectors([env])
        assert collector.active_workers == [0]
    finally:
        collector.shutdown()
    wrapped = MultiSyncCollector([GymEnv(env)] * 2, frames_per_batch=8, total_frames=16)  # what the message says
    try:
        assert [batch.numel() for batch in wrapped] == [8, 8]
    finally:
        wrapped.shutdown()


@pytest.mark.parametrize("cls", [DistributedCollector, RPCCollector])
def test_without_submitit_the_default_launcher_names_the_one_machine_launcher(cls, monkeypatch):
    monkeypatch.setitem(sys.modules, "submitit", None)  # what `import submitit` does where it is not installed
    with pytest.raises(ImportError) as info:
        cls([CountingEnv], frames_per_batch=8)
    message = str(info.value)
    assert "launcher='submitit' (the default)" in message and "pip install 'rlharvest[slurm]'" in message
    assert "To run the nodes on this machine, pass launcher='mp'" in message, message


def test_frames_per_batch_not_divisible_by_the_workers_says_what_each_batch_holds():
    with pytest.warns(UserWarning) as caught:
        collector = MultiSyncCollector([CountingEnv] * 3, frames_per_batch=10, total_frames=24)
    try:
        assert [batch.numel() for batch in collector] == [12, 12]  # rounded up, as TorchRL does
    finally:
        collector.shutdown()
    assert [str(w.message) for w in caught if "divisible" in str(w.message)] == [
        "frames_per_batch=10 is not divisible by the 3 workers: each collects 4 frames, so every batch holds 12 "
        "frames, not 10 (a multiple of 3, 9 or 12, gives batches of exactly that size)."]
    with pytest.raises(RuntimeError, match=r"Cannot dispatch 10 frames across 3 nodes: .* divisible by 3 \(9 or 12\)"):
        DistributedSyncCollector([CountingEnv] * 3, frames_per_batch=10, launcher="mp")
