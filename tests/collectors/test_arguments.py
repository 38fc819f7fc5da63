"""Bad arguments fail in the constructor with an error naming the argument (before any process starts)."""

from __future__ import annotations

import math
import warnings

import pytest

from rlharvest.collectors import MultiAsyncCollector, MultiSyncCollector
from rlharvest.collectors.distributed import DistributedCollector, DistributedSyncCollector, RPCCollector
from rlharvest.data import ReplayBuffer
from rlharvest.envs import CountingEnv
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
