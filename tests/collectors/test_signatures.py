"""Collectors that take their parent's arguments show every parameter, and check calls against them."""

from __future__ import annotations

import inspect

import pytest

from rlharvest.collectors import AsyncCollector, MultiAsyncCollector, MultiSyncCollector
from rlharvest.collectors.distributed import DistributedCollector, DistributedSyncCollector, RayCollector, RPCCollector
from rlharvest.envs import CountingEnv


def parameters(cls) -> list[str]:
    return list(inspect.signature(cls).parameters)


def test_derived_signatures_list_every_parameter():
    parent = parameters(DistributedCollector)
    expected = [p for p in parent if p not in ("update_interval", "authkey", "handshake_timeout")]  # RPC has neither
    at = expected.index("tcp_port") + 1
    own = ["visible_devices", "tensorpipe_options", "trajs_per_batch", "trajs_per_write", "traj_format"]
    assert parameters(RPCCollector) == expected[:at] + own + expected[at:]
    dropped = {"sync", "update_after_each_batch", "weight_updater", "weight_sync_schemes", "weight_recv_schemes",
               "replay_buffer", "autoscale"}  # nodes run free: nobody waits in the iterator
    assert parameters(DistributedSyncCollector) == [p for p in parent if p not in dropped]
    assert inspect.signature(DistributedSyncCollector).parameters["update_interval"].default == 1
    assert parameters(AsyncCollector) == parameters(MultiAsyncCollector) == parameters(MultiSyncCollector)
    assert parameters(MultiSyncCollector)[:3] == ["create_env_fn", "policy", "num_workers"]  # not the dispatch's


@pytest.mark.parametrize("make, name", [
    (lambda: DistributedSyncCollector([CountingEnv], frames_per_batch=4, launcher="mp", sync=True), "sync"),
    (lambda: RPCCollector([CountingEnv], frames_per_batch=4, launcher="mp", update_interval=2), "update_interval"),
    (lambda: AsyncCollector(CountingEnv, frames_per_batch=4, bogus=1), "bogus"),
])
def test_arguments_outside_the_signature_are_refused(make, name):
    with pytest.raises(TypeError, match=f"got an unexpected keyword argument '{name}'"):
        make()


@pytest.mark.parametrize("cls", [AsyncCollector, DistributedSyncCollector, RPCCollector, RayCollector])
def test_the_constructor_shows_the_derived_signature(cls):
    """inspect.signature(cls.__init__) is what TorchRL's tests and IDEs read, beside the class's."""
    assert list(inspect.signature(cls.__init__).parameters) == ["self", *parameters(cls)]
