"""The policy's module hooks run on every step, whichever path the rollout takes to call the policy
(docs/collection.md, "Policies"): the fast path never calls past a hook of the user's."""

from __future__ import annotations

import pytest
import torch
from mocks import CallCounter, weight_policy
from tensordict.nn import TensorDictSequential

from rlharvest.collectors import AsyncBatchedCollector, Collector, MultiSyncCollector
from rlharvest.envs import CountingEnv
from rlharvest.policies import ObservationModule, RandomPolicy

pytestmark = pytest.mark.timeout(90)


class ZeroRandomPolicy(RandomPolicy):
    """A RandomPolicy whose forward is the user's: action 0."""

    def forward(self, tensordict):
        return tensordict.set("action", torch.zeros_like(self.sample()["action"]))


def hooked_policy(kind: str, env=None):
    """action = 1 from ``weight_policy`` (or random, from ``env``'s spec); a forward hook setting it to 0
    and counting its calls under ``"forward_calls"``, a forward pre-hook counting its own under
    ``"pre_calls"``. On a sequential: the forward hook on the sequential, the pre-hook on the module inside it."""
    module = RandomPolicy(env.full_action_spec) if kind == "random" else weight_policy(1.0)
    policy = TensorDictSequential(module) if kind == "sequential" else module
    policy.register_forward_hook(CallCounter("forward_calls", action=0.0))
    module.register_forward_pre_hook(CallCounter("pre_calls"))
    return policy


def assert_hooked(batch, first_call: int) -> None:
    """Each step ran each hook once, in order from ``first_call``, and the forward hook's action held."""
    steps = batch.shape[-1]
    expected = torch.arange(first_call, first_call + steps).expand(batch.shape)
    for key in ("forward_calls", "pre_calls"):
        assert torch.equal(batch[key].squeeze(-1), expected), (key, batch[key].squeeze(-1))
    assert (batch["action"] == 0).all()
    assert (batch["next", "observation"] == 0).all()  # the counter never moved: the env took the hook's action


@pytest.mark.parametrize("kind", ["module", "sequential", "random"])
@pytest.mark.parametrize("batch_size", [(), (3,)])
def test_hooks_run_once_a_step_in_process(kind, batch_size):
    frames = 12 if batch_size else 8
    env = CountingEnv(max_steps=50, batch_size=batch_size)
    collector = Collector(env, hooked_policy(kind, env), frames_per_batch=frames, total_frames=2 * frames)
    batches = [batch.clone() for batch in collector]
    collector.shutdown()
    steps = batches[0].shape[-1]
    assert_hooked(batches[0], 1)
    assert_hooked(batches[1], steps + 1)


@pytest.mark.parametrize("kind", ["module", "sequential"])
def test_hooks_run_once_a_step_in_workers(kind):
    with MultiSyncCollector([lambda: CountingEnv(max_steps=50)] * 2, hooked_policy(kind), frames_per_batch=16,
                            total_frames=32) as collector:
        batches = [batch.clone() for batch in collector]
    for batch, first_call in zip(batches, (1, 9)):
        assert batch.shape == (2, 8)
        assert_hooked(batch, first_call)


@pytest.mark.parametrize("kind", ["module", "sequential"])
def test_hooks_run_in_the_policy_server(kind):
    """AsyncBatchedCollector: the server's one call for many envs' requests runs the hooks too."""
    collector = AsyncBatchedCollector([lambda: CountingEnv(max_steps=50)] * 2, policy=hooked_policy(kind),
                                      frames_per_batch=8, total_frames=16, env_backend="threading")
    batches = [batch.clone() for batch in collector]
    collector.shutdown()
    for batch in batches:
        assert (batch["forward_calls"] > 0).all() and (batch["pre_calls"] > 0).all()
        assert (batch["action"] == 0).all() and (batch["next", "observation"] == 0).all()


@pytest.mark.parametrize("kind", ["module", "sequential", "observation_module"])
def test_hook_added_during_a_run_is_honoured_from_the_next_step(kind):
    if kind == "observation_module":  # a plain module the collector wraps: its wrapper is collector.policy
        policy = ObservationModule(weight_policy(1.0).module, ["observation"], ["action"])
    else:
        policy = weight_policy(1.0) if kind == "module" else TensorDictSequential(weight_policy(1.0))
    collector = Collector(CountingEnv(max_steps=50), policy, frames_per_batch=5, total_frames=15)
    hook, handle = CallCounter("ignored", action=0.0), None
    actions = []
    for batch in collector:  # the next batch is collected when asked for: after the hook is added or removed
        actions.append(batch["action"].squeeze(-1).tolist())
        if handle is None:
            handle = collector.policy.register_forward_hook(hook)
        else:
            handle.remove()
    collector.shutdown()
    assert actions == [[1] * 5, [0] * 5, [1] * 5]
    assert hook.calls == 5


class HookingEnv(CountingEnv):
    """A CountingEnv that puts ``hook`` on ``policy`` during its third step."""

    def __init__(self, policy, hook) -> None:
        super().__init__(max_steps=50)
        self.policy, self.hook, self.steps = policy, hook, 0

    def _step_arrays(self, actions):
        self.steps += 1
        if self.steps == 3:
            self.policy.register_forward_hook(self.hook)
        return super()._step_arrays(actions)


def test_hook_added_within_a_batch_runs_from_the_next_step():
    policy, hook = weight_policy(1.0), CallCounter("ignored", action=0.0)
    collector = Collector(HookingEnv(policy, hook), policy, frames_per_batch=6, total_frames=6)
    batch = next(iter(collector))
    collector.shutdown()
    assert batch["action"].squeeze(-1).tolist() == [1, 1, 1, 0, 0, 0] and hook.calls == 3


def test_global_module_hook_runs_for_the_policy():
    policy = weight_policy(1.0)
    calls = []

    def global_hook(module, args, output):
        if module is policy:
            calls.append(len(calls))
            output.set("action", torch.zeros_like(output.get("action")))

    handle = torch.nn.modules.module.register_module_forward_hook(global_hook)
    try:
        collector = Collector(CountingEnv(max_steps=50), policy, frames_per_batch=6, total_frames=6)
        batch = next(iter(collector))
        collector.shutdown()
    finally:
        handle.remove()
    assert len(calls) == 6
    assert (batch["action"] == 0).all()


def test_random_policy_subclass_forward_runs():
    env = CountingEnv(max_steps=50)
    collector = Collector(env, ZeroRandomPolicy(env.full_action_spec), frames_per_batch=6, total_frames=6)
    batch = next(iter(collector))
    collector.shutdown()
    assert (batch["action"] == 0).all() and (batch["next", "observation"] == 0).all()
