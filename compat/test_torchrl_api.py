"""TorchRL-side API a user's code keeps after switching the collector imports: model ids written
against the env TorchRL's collector builds, TorchRL's ``service_backend`` context, and a legacy
updater written against TorchRL's worker pipes."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl import service_backend as torchrl_service_backend
from torchrl.envs import Compose, GymEnv, RewardSum
from torchrl.envs.transforms.module import ModuleTransform
from torchrl_objects import recurrent_actor

from rlharvest.collectors import Collector, MultiAsyncCollector, WeightUpdaterBase
from rlharvest.collectors.distributed import RPCCollector
from rlharvest.weight_update import MultiProcessWeightSyncScheme

pytestmark = pytest.mark.timeout(120)


def observation_module() -> TensorDictModule:
    return TensorDictModule(torch.nn.Linear(3, 3), in_keys=["observation"], out_keys=["observation"])


def pendulum_policy() -> TensorDictModule:
    return TensorDictModule(torch.nn.Linear(3, 1), in_keys=["observation"], out_keys=["action"])


def env_with_module_transform() -> GymEnv:
    """TorchRL's examples/collectors/multi_weight_updates.py: one transform, not a Compose."""
    return GymEnv("Pendulum-v1").append_transform(ModuleTransform(module_factory=observation_module, no_grad=True))


def env_with_composed_transforms():
    return GymEnv("Pendulum-v1").append_transform(
        Compose(RewardSum(), ModuleTransform(module_factory=observation_module, no_grad=True)))


def batch_after_zeroing_the_env_module(make_env, model_id: str, policy_factory, **kwargs):
    """A two-worker collector's batch after zero weights were sent to ``model_id`` (the env's module)."""
    collector = Collector(make_env, num_collectors=2, sync=True, policy_factory=policy_factory, frames_per_batch=40,
                          total_frames=120, weight_sync_schemes={"policy": MultiProcessWeightSyncScheme(),
                                                                 model_id: MultiProcessWeightSyncScheme()}, **kwargs)
    try:
        batches = iter(collector)
        assert next(batches)["next", "observation"].abs().sum() > 0
        zeros = TensorDict.from_module(observation_module()).data.zero_()
        collector.update_policy_weights_(weights_dict={model_id: zeros})
        return next(batches)
    finally:
        collector.shutdown()


@pytest.mark.parametrize("make_env, model_id", [
    (env_with_module_transform, "env.transform[0].module"),
    (env_with_composed_transforms, "env.transform[1].module"),  # TorchRL lists a Compose's members
])
def test_env_model_id_indexes_the_transforms_as_torchrl_does(make_env, model_id):
    batch = batch_after_zeroing_the_env_module(make_env, model_id, pendulum_policy, max_frames_per_traj=50)
    assert batch["next", "observation"].abs().sum() == 0  # the workers' env module got them


@pytest.mark.parametrize("max_frames_per_traj", [None, 50])
def test_env_model_id_indexes_the_env_given_when_the_collector_appends_policy_transforms(max_frames_per_traj):
    """With auto_register_policy_transforms=True, TorchRL appends the recurrent policy's transforms to
    the env's own list; rlharvest steps a new env around it, and reads the ids through both."""
    batch = batch_after_zeroing_the_env_module(env_with_module_transform, "env.transform[0].module", recurrent_actor,
                                               max_frames_per_traj=max_frames_per_traj,
                                               auto_register_policy_transforms=True)
    assert batch["next", "observation"].abs().sum() == 0 and batch["recurrent_state"].abs().sum() > 0


def test_env_model_id_of_torchrl_step_counter_is_refused_by_name():
    collector = Collector(env_with_module_transform, pendulum_policy(), max_frames_per_traj=50, frames_per_batch=10)
    with pytest.raises(ValueError, match="StepCounter"):
        collector.get_model("env.transform[1]")
    assert collector.get_model("env.transform[0].module") is collector.env.transform.module
    collector.shutdown()


def pendulum_env() -> GymEnv:
    return GymEnv("Pendulum-v1")


def test_torchrl_service_backend_context_is_honoured(free_port):
    with torchrl_service_backend("rpc"):
        collector = Collector(pendulum_env, num_collectors=2, sync=True, frames_per_batch=8, total_frames=8,
                              backend_options={"launcher": "mp", "tcp_port": free_port})
    try:
        assert type(collector) is RPCCollector and collector.num_workers == 2
    finally:
        collector.shutdown()
    with torchrl_service_backend("process"):
        collectors = [Collector(pendulum_env, num_collectors=2, frames_per_batch=8),
                      Collector(pendulum_env, backend="direct", frames_per_batch=8)]  # an explicit backend wins
    for collector in collectors:
        collector.shutdown()
    assert [type(c) for c in collectors] == [MultiAsyncCollector, Collector]
    with torchrl_service_backend("thread"):
        with pytest.raises(ValueError, match="torchrl.service_backend context"):
            Collector(pendulum_env, num_collectors=2, frames_per_batch=8)


class PipeUpdater(WeightUpdaterBase):
    """TorchRL's examples/collectors/mp_collector_mps.py: an updater that hands CPU copies of its
    weights to each worker through ``collector.pipes`` and waits for the worker's reply."""

    def __init__(self, weights: TensorDict, num_workers: int) -> None:
        self.weights = weights
        self.num_workers = num_workers
        self.replies = []

    def _get_server_weights(self) -> TensorDict:
        return self.weights.cpu()

    def _maybe_map_weights(self, server_weights: TensorDict) -> TensorDict:
        return server_weights

    def all_worker_ids(self) -> list[int]:
        return list(range(self.num_workers))

    def _sync_weights_with_worker(self, worker_id: int, server_weights: TensorDict) -> TensorDict:
        self.collector.pipes[worker_id].send((server_weights, "update"))
        self.replies.append(self.collector.pipes[worker_id].recv())
        return server_weights


def test_legacy_updater_written_against_torchrl_worker_pipes():
    weights = TensorDict.from_module(pendulum_policy()).data
    updater = PipeUpdater(weights, 2)
    with pytest.warns(DeprecationWarning, match="legacy weight-update API"):
        collector = Collector(pendulum_env, num_collectors=2, sync=True, policy_factory=pendulum_policy,
                              frames_per_batch=40, total_frames=200, weight_updater=updater)
    try:
        batches = iter(collector)
        assert next(batches)["action"].abs().sum() > 0
        weights.zero_()
        collector.update_policy_weights_()
        assert updater.replies == [(None, "updated")] * 2
        assert next(batches)["action"].abs().sum() == 0  # both workers run the zeroed weights
        with pytest.raises(NotImplementedError, match=r"pipes\[1\].send\(\) takes \(weights, 'update'\) only, got 'seed'"):
            collector.pipes[1].send((0, "seed"))
        with pytest.raises(RuntimeError, match=r"pipes\[0\].recv\(\): no reply is due"):
            collector.pipes[0].recv()
    finally:
        collector.shutdown()
