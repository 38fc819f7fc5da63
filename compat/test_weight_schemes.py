"""TorchRL's own weight-sync scheme objects given to rlharvest's collectors: each runs as rlharvest's
scheme of the same kind with the same settings; those without an equivalent are refused by name
(docs/torchrl-compatibility.md, "Weight-sync schemes")."""

from __future__ import annotations

import pytest
import torch
import torchrl.weight_update as torchrl_schemes
from collector_kinds import make_collector
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.envs import GymEnv

import rlharvest.weight_update as ours
from rlharvest.collectors import Collector, MultiSyncCollector
from rlharvest.weight_update.torchrl_schemes import own_schemes

pytestmark = pytest.mark.timeout(120)


def pendulum() -> GymEnv:
    return GymEnv("Pendulum-v1")


def constant_policy(value: float) -> TensorDictModule:
    module = torch.nn.Linear(3, 1)
    with torch.no_grad():
        module.weight.zero_()
        module.bias.fill_(value)
    return TensorDictModule(module, in_keys=["observation"], out_keys=["action"])


@pytest.mark.parametrize("theirs, expected_class, settings", [
    (torchrl_schemes.NoWeightSyncScheme(), ours.NoWeightSyncScheme, {"strategy_str": "tensordict"}),
    (torchrl_schemes.SharedMemWeightSyncScheme(sync=False, per_worker_weights=True), ours.SharedMemWeightSyncScheme,
     {"sync": False, "per_worker_weights": True}),
    (torchrl_schemes.MultiProcessWeightSyncScheme(strategy="state_dict", sync=False),
     ours.MultiProcessWeightSyncScheme, {"strategy_str": "state_dict", "sync": False}),
    (torchrl_schemes.DistributedWeightSyncScheme(backend="gloo", sync=False, timeout=5.0),
     ours.DistributedWeightSyncScheme, {"backend": "gloo", "sync": False, "timeout": 5.0}),
    (torchrl_schemes.RPCWeightSyncScheme(strategy="state_dict"), ours.RPCWeightSyncScheme, {"strategy_str": "state_dict"}),
    (torchrl_schemes.RayWeightSyncScheme(strategy="state_dict", backend="nccl"), ours.RayWeightSyncScheme,
     {"strategy_str": "state_dict", "backend": "nccl"}),
])
def test_each_torchrl_scheme_becomes_ours_with_its_settings(theirs, expected_class, settings):
    translated = own_schemes({"policy": theirs}, "weight_sync_schemes")["policy"]
    assert type(translated) is expected_class
    assert {name: getattr(translated, name) for name in settings} == settings


def test_a_torchrl_shared_memory_scheme_moves_the_policy_weights():
    """Example 2 of TorchRL's examples/collectors/weight_sync_collectors.py, with per-worker weights."""
    collector = MultiSyncCollector([pendulum, pendulum], constant_policy(0.5), frames_per_batch=20, total_frames=60,
                                   weight_sync_schemes={"policy": torchrl_schemes.SharedMemWeightSyncScheme(
                                       per_worker_weights=True)})
    try:
        batches = iter(collector)
        assert set(next(batches)["action"].flatten().tolist()) == {0.5}
        scheme = collector._weight_sync_schemes["policy"]
        assert type(scheme) is ours.SharedMemWeightSyncScheme and scheme.per_worker_weights
        collector.update_policy_weights_(TensorDict.from_module(constant_policy(-0.25)))
        assert set(next(batches)["action"].flatten().tolist()) == {-0.25}
    finally:
        collector.shutdown()


@pytest.mark.parametrize("kind, theirs", [
    ("distributed", lambda: torchrl_schemes.DistributedWeightSyncScheme(backend="gloo")),
    ("rpc", lambda: torchrl_schemes.RPCWeightSyncScheme()),
])
def test_a_torchrl_node_scheme_moves_the_policy_weights_to_the_nodes(kind, theirs, free_port):
    """TorchRL's schemes for nodes (torch.distributed, RPC) given to rlharvest's collector of that kind:
    the nodes collect with the weights pushed, as with rlharvest's own scheme of the same name."""
    collector = make_collector(kind, pendulum, constant_policy(0.5), port=free_port, frames_per_batch=20,
                               total_frames=-1, weight_sync_schemes={"policy": theirs()})
    try:
        assert set(collector.next()["action"].flatten().tolist()) == {0.5}
        collector.update_policy_weights_(TensorDict.from_module(constant_policy(-0.25)))
        assert set(collector.next()["action"].flatten().tolist()) == {-0.25}
    finally:
        collector.shutdown()


class OwnMultiProcessScheme(torchrl_schemes.MultiProcessWeightSyncScheme):
    """A user's subclass: its code runs only with TorchRL's collectors."""


def initialised_no_sync_scheme():
    scheme = torchrl_schemes.NoWeightSyncScheme()
    scheme.init_on_sender(model_id="policy")
    return scheme


@pytest.mark.parametrize("build, error, message", [
    (lambda: MultiSyncCollector([pendulum] * 2, constant_policy(0.0), frames_per_batch=20,
                                weight_sync_schemes={"env.transform[0]": torchrl_schemes.RayModuleTransformScheme()}),
     TypeError, r"weight_sync_schemes\['env.transform\[0\]'\] is TorchRL's RayModuleTransformScheme, which rlharvest "
                r"has no equivalent of. Accepted: .*MultiProcessWeightSyncScheme"),
    (lambda: MultiSyncCollector([pendulum] * 2, constant_policy(0.0), frames_per_batch=20,
                                weight_sync_schemes={"policy": OwnMultiProcessScheme()}),
     TypeError, r"OwnMultiProcessScheme, a subclass of TorchRL's MultiProcessWeightSyncScheme"),
    (lambda: MultiSyncCollector([pendulum] * 2, constant_policy(0.0), frames_per_batch=20,
                                weight_sync_schemes={"policy": initialised_no_sync_scheme()}),
     ValueError, r"weight_sync_schemes\['policy'\] is TorchRL's NoWeightSyncScheme already initialised"),
    (lambda: MultiSyncCollector([pendulum] * 2, constant_policy(0.0), frames_per_batch=20,
                                weight_sync_schemes={"policy": "shared"}),
     TypeError, r"weight_sync_schemes\['policy'\] must be a weight-sync scheme, got builtins.str"),
    (lambda: Collector(pendulum, constant_policy(0.0), frames_per_batch=20,
                       weight_recv_schemes={"policy": torchrl_schemes.MultiProcessWeightSyncScheme()}),
     TypeError, r"weight_recv_schemes\['policy'\] is TorchRL's MultiProcessWeightSyncScheme: a receiver"),
    # Example 1 of TorchRL's weight_sync_collectors.py (TorchRL's own Collector fails on it too)
    (lambda: Collector(pendulum, constant_policy(0.0), frames_per_batch=20,
                       weight_sync_schemes={"policy": torchrl_schemes.MultiProcessWeightSyncScheme()}),
     ValueError, r"weight_sync_schemes\['policy'\] is a MultiProcessWeightSyncScheme, which sends weights to worker"),
])
def test_schemes_refused_by_name(build, error, message):
    with pytest.raises(error, match=message):
        build()
