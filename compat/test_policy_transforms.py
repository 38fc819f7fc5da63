"""``auto_register_policy_transforms`` with a TorchRL recurrent policy (a GRU reading ``is_init`` and
its ``recurrent_state``) on TorchRL envs that lack them, on Collector, MultiSyncCollector and Evaluator.

The file also runs against TorchRL's next release (``RLHARVEST_TEST_LIBRARY=torchrl`` takes the
collectors from ``torchrl.collectors``; docs/torchrl-compatibility.md, "TorchRL's next release").
Where rlharvest differs on purpose (it never changes the env object it is given, and does not ask a
policy that reads no ``is_init`` for an ``InitTracker``), each test says what each library does.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings

import pytest
import torch
from torchrl.envs import GymEnv, InitTracker, SerialEnv, StepCounter, TensorDictPrimer, TransformedEnv
from torchrl_objects import PENDULUM, probabilistic_actor, recurrent_actor

LIBRARY = os.environ.get("RLHARVEST_TEST_LIBRARY", "rlharvest")
collectors = importlib.import_module(f"{LIBRARY}.collectors")

pytestmark = pytest.mark.timeout(120)


def keys(spec) -> set:
    return set(spec.keys(True, True))


def init_flags(env) -> int:
    """How many ``is_init`` entries the env's observations have."""
    return sum(1 for key in keys(env.full_observation_spec) if (key if isinstance(key, str) else key[-1]) == "is_init")


def check_recurrent_batch(batch) -> None:
    """The GRU ran on is_init and carried its state: the first step starts from zeros, later ones do not."""
    assert "is_init" in batch.keys() and "recurrent_state" in batch.keys()
    flat = batch.reshape(-1) if batch.batch_dims == 1 else batch[0]
    assert bool(flat["is_init"][0].all()) and not flat["is_init"][1:].any()
    assert flat["recurrent_state"][0].abs().sum() == 0 and flat["recurrent_state"][1:].abs().sum() > 0
    assert torch.equal(flat["recurrent_state"][1:], flat["next", "recurrent_state"][:-1])


def test_true_steps_the_env_with_the_transforms_appended_and_leaves_a_bare_env_alone():
    env = GymEnv(PENDULUM)
    collector = collectors.Collector(env, recurrent_actor(), frames_per_batch=10, total_frames=10,
                                     auto_register_policy_transforms=True)
    try:
        assert {"is_init", "recurrent_state"} <= keys(collector.env.full_observation_spec)
        assert init_flags(collector.env) == 1
        assert not {"is_init", "recurrent_state"} & keys(env.full_observation_spec)  # the given env: as it was
        check_recurrent_batch(next(iter(collector)))
    finally:
        collector.shutdown()


def test_true_with_a_transformed_env():
    env = TransformedEnv(GymEnv(PENDULUM), StepCounter())
    collector = collectors.Collector(env, recurrent_actor(), frames_per_batch=10, total_frames=10,
                                     auto_register_policy_transforms=True)
    try:
        check_recurrent_batch(next(iter(collector)))
        assert "is_init" in keys(collector.env.full_observation_spec) and init_flags(collector.env) == 1
        # TorchRL appends to the TransformedEnv it is given; rlharvest steps a new one around it
        appended_in_place = "is_init" in keys(env.full_observation_spec)
        assert appended_in_place == (LIBRARY == "torchrl")
        assert (collector.env is env) == (LIBRARY == "torchrl")
    finally:
        collector.shutdown()


def test_true_with_a_policy_factory_keeps_the_transforms_attached():
    collector = collectors.Collector(GymEnv(PENDULUM), policy_factory=recurrent_actor, frames_per_batch=10,
                                     total_frames=10, auto_register_policy_transforms=True)
    try:
        assert {"is_init", "recurrent_state"} <= keys(collector.env.full_observation_spec)
        assert collector.env.action_spec is not None
        assert all(transform.parent is not None for transform in collector.env.transform)
        check_recurrent_batch(next(iter(collector)))
    finally:
        collector.shutdown()


def test_an_env_that_has_them_gets_nothing_more():
    policy = recurrent_actor()
    prepared = GymEnv(PENDULUM, policy=policy)  # TorchRL's env appends them itself when given the policy
    collector = collectors.Collector(prepared, policy, frames_per_batch=10, total_frames=10,
                                     auto_register_policy_transforms=True)
    try:
        transforms = list(collector.env.transform)
        assert sum(isinstance(t, InitTracker) for t in transforms) == 1
        assert sum(isinstance(t, TensorDictPrimer) for t in transforms) == 1
        check_recurrent_batch(next(iter(collector)))
    finally:
        collector.shutdown()


def test_an_init_tracker_inside_a_serial_env_counts():
    env = SerialEnv(2, lambda: TransformedEnv(GymEnv(PENDULUM), InitTracker()))
    collector = collectors.Collector(env, recurrent_actor(), frames_per_batch=10, total_frames=10,
                                     auto_register_policy_transforms=True)
    try:
        assert init_flags(collector.env) == 1 and "recurrent_state" in keys(collector.env.full_observation_spec)
        check_recurrent_batch(next(iter(collector)))
    finally:
        collector.shutdown()


def test_none_warns_naming_the_argument_and_the_policy_fails_without_is_init():
    with pytest.warns(FutureWarning, match="auto_register_policy_transforms"):
        with pytest.raises(KeyError, match="is_init"):
            collectors.Collector(GymEnv(PENDULUM), recurrent_actor(), frames_per_batch=10, total_frames=10)


def test_false_says_nothing_and_appends_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with pytest.raises(KeyError, match="is_init"):
            collectors.Collector(GymEnv(PENDULUM), recurrent_actor(), frames_per_batch=10, total_frames=10,
                                 auto_register_policy_transforms=False)


def test_a_policy_that_reads_no_is_init():
    """TorchRL asks an InitTracker of every nn.Module policy (and warns without one); rlharvest only of
    one that reads ``is_init`` or declares a recurrent state."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        collector = collectors.Collector(GymEnv(PENDULUM), probabilistic_actor(), frames_per_batch=10,
                                         total_frames=10)
        collector.shutdown()
    told = any(issubclass(w.category, FutureWarning) and "auto_register_policy_transforms" in str(w.message)
               for w in caught)
    assert told == (LIBRARY == "torchrl")
    collector = collectors.Collector(GymEnv(PENDULUM), probabilistic_actor(), frames_per_batch=10, total_frames=10,
                                     auto_register_policy_transforms=True)
    try:
        assert ("is_init" in keys(collector.env.full_observation_spec)) == (LIBRARY == "torchrl")
        assert next(iter(collector)).numel() == 10
    finally:
        collector.shutdown()


def test_multi_sync_workers_append_them_where_they_build_the_env():
    collector = collectors.MultiSyncCollector([functools.partial(GymEnv, PENDULUM)] * 2, policy_factory=recurrent_actor,
                                              frames_per_batch=20, total_frames=40,
                                              auto_register_policy_transforms=True)
    try:
        for batch in collector:
            assert batch.numel() == 20
            for rollout in batch.reshape(-1, batch.shape[-1]).unbind(0) if batch.batch_dims > 1 else [batch]:
                check_recurrent_batch(rollout)
            break
    finally:
        collector.shutdown()


def test_evaluator_collector_kwargs_reach_its_collector():
    evaluator = collectors.Evaluator(GymEnv(PENDULUM), recurrent_actor(), num_trajectories=2, max_steps=8,
                                     collector_kwargs={"auto_register_policy_transforms": True})
    try:
        result = evaluator.evaluate()
        assert result["eval/num_episodes"] == 2 and result["eval/episode_length"] == 8
    finally:
        evaluator.shutdown()


def test_a_policy_module_without_in_keys_is_collected_as_it_is():
    """TorchRL's own mocks (``HeterogeneousCountingEnvPolicy``) subclass ``TensorDictModuleBase`` with a
    ``__call__`` of their own and no ``in_keys``: looking for the transforms a policy needs must not read
    ``in_keys`` it does not have (both libraries collect; neither appends anything)."""
    from torchrl.testing.mocking_classes import HeterogeneousCountingEnv, HeterogeneousCountingEnvPolicy

    env = HeterogeneousCountingEnv()
    policy = HeterogeneousCountingEnvPolicy(env.input_spec["full_action_spec"])
    collector = collectors.Collector(env, policy, frames_per_batch=4, total_frames=8)
    try:
        shapes = [tuple(batch.shape) for batch in collector]
    finally:
        collector.shutdown()
    assert shapes == [(4,), (4,)]
