"""Every rlharvest collector with every kind of TorchRL env: GymEnv, a TransformedEnv with
StepCounter and RewardSum, SerialEnv and ParallelEnv (given as factories, as TorchRL's examples do)."""

from __future__ import annotations

import pytest
from collector_kinds import KINDS, STACKED, check_transitions, make_collector
from torchrl_objects import ENV_MAKERS, gym_env, q_value_actor, serial_env

pytestmark = pytest.mark.timeout(120)


# TorchRL's ParallelEnv in a node is built by the node's one worker loop whatever the collector class:
# the "distributed" and "rpc" rows run it there; the other torch.distributed classes would spawn the
# same sub-env processes again (~10 s each, TorchRL's start method being spawn).
CASES = [pytest.param(kind, env_name, id=f"{kind}-{env_name}") for kind in KINDS for env_name in ENV_MAKERS
         if not (env_name == "parallel" and kind in ("distributed_sync", "distributed_async"))]


@pytest.mark.parametrize("kind, env_name", CASES)
def test_torchrl_envs_in_every_collector(kind, env_name, free_port):
    make_env = ENV_MAKERS[env_name]
    sub_envs = 2 if env_name in ("serial", "parallel") else 1
    collector = make_collector(kind, make_env, q_value_actor(), port=free_port, frames_per_batch=40,
                               total_frames=120)
    try:
        batches = list(collector)
    finally:
        collector.shutdown()
    assert sum(b.numel() for b in batches) == 120
    for batch in batches:
        assert batch.names[-1] == "time"
        expected = ((2,) if kind in STACKED else ()) + ((sub_envs,) if sub_envs > 1 else ())
        assert tuple(batch.shape[:-1]) == expected
        keys = set(batch.keys(True, True))
        assert {"observation", "action", "action_value", "chosen_action_value", ("next", "reward"),
                ("next", "done"), ("collector", "traj_ids")} <= keys
        check_transitions(batch, kind)
        if env_name == "transformed":
            assert ("next", "episode_reward") in keys
            steps = batch["step_count"].squeeze(-1)
            following = batch["next", "step_count"].squeeze(-1)
            assert (following == steps + 1).all()
            assert int(following.max()) <= 40


def test_env_instances_as_create_env_fn():
    """TorchRL users also pass env instances (batched ones included), started or not."""
    for env in (gym_env(), serial_env(), _started(serial_env())):
        collector = make_collector("collector", env, q_value_actor(), frames_per_batch=20, total_frames=20)
        batch = next(iter(collector))
        collector.shutdown()
        assert batch.numel() == 20
        check_transitions(batch, "collector")


def _started(env):
    env.reset()
    return env


def test_trajectory_ids_are_unique_across_workers_and_nodes(free_port):
    for kind in ("multisync", "distributed"):
        collector = make_collector(kind, gym_env, q_value_actor(), port=free_port, frames_per_batch=200,
                                   total_frames=400)
        try:
            for batch in collector:
                rows = [set(row.tolist()) for row in batch["collector", "traj_ids"]]
                assert not rows[0] & rows[1]
        finally:
            collector.shutdown()


def test_max_frames_per_traj_with_a_torchrl_env():
    collector = make_collector("collector", gym_env, q_value_actor(epsilon=None), frames_per_batch=60,
                               total_frames=60, max_frames_per_traj=7)
    batch = next(iter(collector))
    collector.shutdown()
    steps = batch["next", "step_count"].squeeze(-1)
    assert int(steps.max()) == 7
    at_limit = steps == 7
    assert batch["next", "truncated"].squeeze(-1)[at_limit].all()
    assert batch["next", "done"].squeeze(-1)[at_limit].all()
    check_transitions(batch, "collector")
