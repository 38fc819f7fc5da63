"""Weights a policy cannot take are refused by the learner, before anything is sent (docs/weights.md,
"What update_policy_weights_ accepts"): weights for a policy without parameters, names missing or
extra, a tensor of another shape (one torch would broadcast included). Every collector, every form the
weights come in; the workers keep running the weights they had, and a fitting update still goes through.

The policy's action is its only weight (tests/mocks.py), so batches say which weights collected them.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from mocks import weight_policy
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

from rlharvest.collectors import (AsyncBatchedCollector, Collector, MultiAsyncCollector, MultiSyncCollector,
                                  MultiProcessedWeightUpdater, VanillaWeightUpdater)
from rlharvest.collectors.distributed import DistributedCollector, DistributedWeightUpdater, RPCCollector
from rlharvest.envs import CountingEnv
from rlharvest.errors import ParameterFreeModelError, WeightNamesError, WeightShapeError
from rlharvest.transport.ports import free_port_block
from rlharvest.weight_update import MultiProcessWeightSyncScheme, SharedMemWeightSyncScheme

pytestmark = pytest.mark.timeout(120)


def ones(observation: torch.Tensor) -> torch.Tensor:
    return torch.ones(observation.shape, dtype=torch.float32)


def parameter_free():
    """A policy over a function: no parameters, no buffers."""
    return TensorDictModule(ones, in_keys=["observation"], out_keys=["action"])


def envs(count: int) -> list:
    return [functools.partial(CountingEnv, max_steps=1000)] * count


def _nodes(cls, policy, **kwargs):
    return cls(envs(1), policy, launcher="mp", tcp_port=free_port_block(3), frames_per_batch=4, total_frames=-1,
               **kwargs)


COLLECTORS = {
    "Collector": lambda policy, **kw: Collector(envs(1)[0], policy, frames_per_batch=4, total_frames=-1, **kw),
    "MultiSyncCollector": lambda policy, **kw: MultiSyncCollector(envs(2), policy, frames_per_batch=4,
                                                                  total_frames=-1, **kw),
    "MultiAsyncCollector": lambda policy, **kw: MultiAsyncCollector(envs(2), policy, frames_per_batch=4,
                                                                    total_frames=-1, **kw),
    "AsyncBatchedCollector": lambda policy, **kw: AsyncBatchedCollector(envs(2), policy=policy, frames_per_batch=4,
                                                                        total_frames=-1, **kw),
    "DistributedCollector": lambda policy, **kw: _nodes(DistributedCollector, policy, **kw),
    "RPCCollector": lambda policy, **kw: _nodes(RPCCollector, policy, **kw),
}


def build(name: str, policy, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the legacy updaters say they are legacy
        return COLLECTORS[name](policy, **kwargs)


def actions_of(batches, count: int = 2) -> set:
    return {value for _ in range(count) for value in next(batches)["action"].unique().tolist()}


def refused_then_fitting(collector, bad, error: type, *needles: str):
    """``bad`` is refused with ``error`` naming ``needles``; the workers still run weight 1, then take 2."""
    batches = iter(collector)
    try:
        assert actions_of(batches) == {1.0}
        with pytest.raises(error) as info:
            collector.update_policy_weights_(bad)
        message = str(info.value)
        assert all(needle in message for needle in needles), message
        assert "\\n" not in message, message  # lines, not the repr of a string
        assert actions_of(batches) == {1.0}  # nothing was sent
        collector.update_policy_weights_(weight_policy(2.0))
        for _ in range(20):  # the async collectors may hand out batches collected before
            if actions_of(batches, 1) == {2.0}:
                break
        else:
            raise AssertionError("the fitting update never reached the workers")
    finally:
        collector.shutdown()


@pytest.mark.parametrize("name", list(COLLECTORS))
def test_weights_for_a_policy_without_parameters_are_refused_in_the_learner(name):
    collector = build(name, parameter_free())
    batches = iter(collector)
    try:
        assert actions_of(batches) == {1.0}
        with pytest.raises(ParameterFreeModelError) as info:
            collector.update_policy_weights_(weight_policy(2.0))
        assert isinstance(info.value, KeyError) and isinstance(info.value, RuntimeError)  # as TorchRL's two cases
        assert "has no parameters" in str(info.value) and "module.weight" in str(info.value), str(info.value)
        collector.update_policy_weights_()  # without weights: fine, as before
        assert actions_of(batches) == {1.0}
    finally:
        collector.shutdown()


@pytest.mark.parametrize("name", list(COLLECTORS))
def test_a_shape_mismatch_names_the_parameter_and_both_shapes(name):
    bad = TensorDict({"module": {"weight": torch.full((3,), 5.0)}}, [])
    refused_then_fitting(build(name, weight_policy(1.0)), bad, WeightShapeError,
                         "module.weight", "[3] given", "[1] expected")


class Holder(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)


FORMS = {
    "module": lambda weights: TensorDictModule(Holder(weights), in_keys=["observation"], out_keys=["action"]),
    "TensorDict": lambda weights: TensorDict({"module": {"weight": weights}}, []),
    "state_dict": lambda weights: {"module.weight": weights},
}


@pytest.mark.parametrize("form", list(FORMS))
def test_every_form_of_weights_is_checked(form):
    # a tensor torch would broadcast into the parameter: silently wrong weights before
    bad = FORMS[form](torch.tensor(5.0))
    refused_then_fitting(build("MultiSyncCollector", weight_policy(1.0)), bad, WeightShapeError,
                         "module.weight", "[] given", "[1] expected")


def test_names_missing_and_extra_are_lines_and_a_key_error():
    bad = TensorDict({"module": {"weight": torch.ones(1), "offset": torch.ones(1)}, "extra": torch.ones(2)}, [])
    collector = build("MultiSyncCollector", weight_policy(1.0))
    try:
        with pytest.raises(KeyError) as info:
            collector.update_policy_weights_(bad)
        assert isinstance(info.value, WeightNamesError)
        assert str(info.value).splitlines()[1:] == ["  extra: extra, module.offset"], str(info.value)
    finally:
        collector.shutdown()


def test_weights_dict_is_checked_for_every_model_before_any_is_sent():
    collector = build("MultiSyncCollector", weight_policy(1.0),
                      weight_sync_schemes={"policy": MultiProcessWeightSyncScheme()})
    batches = iter(collector)
    try:
        assert actions_of(batches) == {1.0}
        with pytest.raises(WeightShapeError, match="module.weight"):
            collector.update_policy_weights_(weights_dict={"policy": {"module.weight": torch.ones(2)}})
        assert actions_of(batches) == {1.0}
    finally:
        collector.shutdown()


@pytest.mark.parametrize("scheme", [SharedMemWeightSyncScheme, MultiProcessWeightSyncScheme])
def test_with_a_scheme_given(scheme):
    refused_then_fitting(build("MultiAsyncCollector", weight_policy(1.0), weight_sync_schemes={"policy": scheme()}),
                         {"module.weight": torch.ones(1, 1)}, WeightShapeError, "[1, 1] given", "[1] expected")


@pytest.mark.parametrize("name, updater", [
    ("Collector", lambda policy: VanillaWeightUpdater.from_policy(policy)),
    ("MultiSyncCollector", lambda policy: MultiProcessedWeightUpdater()),
    ("DistributedCollector", lambda policy: DistributedWeightUpdater()),
])
def test_through_a_legacy_updater(name, updater):
    policy = weight_policy(1.0)
    refused_then_fitting(build(name, policy, weight_updater=updater(policy)), {"module.weight": torch.ones(2)},
                         WeightShapeError, "module.weight", "[2] given", "[1] expected")


@pytest.mark.ray
@pytest.mark.usefixtures("ray_session")
def test_ray_actors_are_not_sent_what_their_policy_cannot_take():
    from rlharvest.collectors.distributed import RayCollector

    collector = RayCollector(envs(1), parameter_free(), frames_per_batch=4, total_frames=-1)
    try:
        with pytest.raises(ParameterFreeModelError, match="has no parameters"):
            collector.update_policy_weights_(weight_policy(2.0))
    finally:
        collector.shutdown()
    refused_then_fitting(RayCollector(envs(1), weight_policy(1.0), frames_per_batch=4, total_frames=-1),
                         {"module.weight": torch.ones(3)}, WeightShapeError, "module.weight", "[3] given")
