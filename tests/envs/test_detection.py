"""Env detection: factories vs instances, and when the array fast path may run (docs/envs.md)."""

from __future__ import annotations

import functools

import pytest
import torch
from mocks import CountingPolicy, TorchRLStyleCountingEnv

from rlharvest.collectors import Collector, MultiSyncCollector
from rlharvest.envs import CountingEnv
from rlharvest.envs.adapters import (
    ArrayEnvAdapter,
    TensorDictEnvAdapter,
    env_attr,
    is_env,
    is_env_factory,
    make_env_adapter,
    uses_array_protocol,
)

pytestmark = pytest.mark.timeout(60)


class HostileAttributes(TorchRLStyleCountingEnv):
    """Like TorchRL's batched envs: asking for an attribute it lacks runs code that must not run.

    (An unstarted ``ParallelEnv`` raises, a ``SerialEnv`` recurses, a started one forwards the
    question to its sub-envs.)
    """

    forwarded: list = []

    def __getattr__(self, name):
        HostileAttributes.forwarded.append(name)
        raise RuntimeError(f"{name!r} was forwarded to the sub-envs")


class OverridesStep(CountingEnv):
    """A user subclass whose step() adds its own entry: the fast path would skip it."""

    calls = 0

    def step(self, tensordict):
        OverridesStep.calls += 1
        tensordict = super().step(tensordict)
        tensordict.set(("next", "bonus"), torch.ones(1))
        return tensordict


class OverridesArrays(CountingEnv):
    """Subclasses that implement the array protocol themselves keep the fast path."""

    def _step_arrays(self, actions):
        return super()._step_arrays(actions)


def _dummy_factory():
    return CountingEnv()


@pytest.mark.parametrize("factory", [
    CountingEnv, TorchRLStyleCountingEnv, HostileAttributes, _dummy_factory, lambda: CountingEnv(),
    functools.partial(CountingEnv, max_steps=3),
])
def test_classes_functions_and_partials_are_factories(factory):
    assert not is_env(factory)
    assert is_env_factory(factory)


def test_instances_of_the_protocol_are_envs_and_nothing_runs_to_tell():
    HostileAttributes.forwarded.clear()
    for env in (CountingEnv(), TorchRLStyleCountingEnv(), HostileAttributes()):
        assert is_env(env) and not is_env_factory(env)
    assert env_attr(HostileAttributes(), "_has_dynamic_specs", "absent") == "absent"
    assert HostileAttributes.forwarded == []
    assert not is_env(object()) and not is_env(42)


def test_the_fast_path_is_chosen_from_the_type():
    assert uses_array_protocol(CountingEnv())
    assert uses_array_protocol(OverridesArrays())
    assert not uses_array_protocol(OverridesStep())
    assert not uses_array_protocol(TorchRLStyleCountingEnv())
    patched = CountingEnv()
    patched.step = lambda td: td
    assert not uses_array_protocol(patched)
    assert isinstance(make_env_adapter(CountingEnv()), ArrayEnvAdapter)
    assert isinstance(make_env_adapter(OverridesStep()), TensorDictEnvAdapter)


def test_an_overridden_step_is_called_and_its_output_collected():
    OverridesStep.calls = 0
    collector = Collector(OverridesStep(max_steps=3), CountingPolicy(), frames_per_batch=8, total_frames=8)
    batch = next(iter(collector))
    assert OverridesStep.calls == 8
    assert batch["next", "bonus"].eq(1).all()
    assert batch["observation"].squeeze(-1).tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    collector.shutdown()


def test_a_patched_step_on_an_instance_is_called():
    env = CountingEnv(max_steps=3)
    calls = []
    original = env.step

    def step(tensordict):
        calls.append(1)
        return original(tensordict)

    env.step = step
    collector = Collector(env, CountingPolicy(), frames_per_batch=6, total_frames=6)
    batch = next(iter(collector))
    assert len(calls) == 6
    assert batch["next", "observation"].squeeze(-1).tolist() == [1, 2, 3, 4, 1, 2]
    collector.shutdown()


def test_an_env_with_forwarding_getattr_runs_in_a_collector():
    HostileAttributes.forwarded.clear()
    collector = Collector(HostileAttributes(max_steps=3), CountingPolicy(), frames_per_batch=8, total_frames=16)
    batches = list(collector)
    assert [b.numel() for b in batches] == [8, 8]
    assert batches[0]["observation"].squeeze(-1).tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert HostileAttributes.forwarded == []
    collector.shutdown()


@pytest.mark.parametrize("factory", [CountingEnv, functools.partial(CountingEnv, max_steps=3)])
def test_a_factory_builds_the_env_in_process(factory):
    collector = Collector(factory, CountingPolicy(), frames_per_batch=4, total_frames=4)
    batch = next(iter(collector))
    assert batch["observation"].squeeze(-1).tolist()[:4] == [0, 1, 2, 3]
    collector.shutdown()


@pytest.mark.timeout(90)
def test_env_classes_as_worker_factories():
    collector = MultiSyncCollector([CountingEnv, HostileAttributes], CountingPolicy(), frames_per_batch=8,
                                   total_frames=16)
    batches = list(collector)
    assert [tuple(b.shape) for b in batches] == [(2, 4), (2, 4)]
    assert batches[0]["observation"][0].squeeze(-1).tolist() == [0, 1, 2, 3]
    assert batches[0]["observation"][1].squeeze(-1).tolist() == [0, 1, 2, 3]
    collector.shutdown()
