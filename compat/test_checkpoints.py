"""Checkpoints with TorchRL's envs and policies (docs/checkpoints.md): rlharvest cannot capture a
TorchRL env's state, so after a load its episodes restart, with new trajectory ids and one warning
naming the env; the rest of the checkpoint (weights, counters, generators) is restored, and a
checkpoint of TorchRL's own format still loads."""

from __future__ import annotations

import pytest
import torch
from collector_kinds import make_collector
from torchrl_objects import gym_env, q_value_actor

from rlharvest.checkpoint import CHECKPOINT_KEY, EpisodeRestartWarning

pytestmark = pytest.mark.timeout(120)
TRAJ_IDS = ("collector", "traj_ids")


@pytest.mark.parametrize("kind", ["collector", "multisync"])
def test_a_torchrl_env_restarts_its_episode_with_one_warning(kind):
    def make():
        return make_collector(kind, gym_env, q_value_actor(), frames_per_batch=20, total_frames=200)

    source = make()
    iterator = iter(source)
    seen = set()
    for _ in range(2):
        seen |= set(next(iterator)[TRAJ_IDS].flatten().tolist())
    state = source.state_dict()
    source.shutdown()
    part = state[CHECKPOINT_KEY] if kind == "collector" else state["worker0"][CHECKPOINT_KEY]
    assert "not an rlharvest env" in part["env_unavailable"] and "episode" not in part
    restored = make()
    try:
        with pytest.warns(EpisodeRestartWarning, match="torchrl.envs") as caught:
            restored.load_state_dict(state)
        assert len([w for w in caught if issubclass(w.category, EpisodeRestartWarning)]) == (1 if kind == "collector"
                                                                                             else 2)
        assert restored.state_dict()["frames"] == 40
        ids = set(next(iter(restored))[TRAJ_IDS].flatten().tolist())
    finally:
        restored.shutdown()
    assert not ids & seen and min(ids) >= int(state["traj_pool"]["traj_id"])


def test_a_torchrl_format_checkpoint_still_loads():
    source = make_collector("collector", gym_env, q_value_actor(), frames_per_batch=20, total_frames=100)
    next(iter(source))
    state = {key: value for key, value in source.state_dict().items() if key != CHECKPOINT_KEY}
    source.shutdown()
    restored = make_collector("collector", gym_env, q_value_actor(), frames_per_batch=20, total_frames=100)
    try:
        restored.load_state_dict(state)  # TorchRL's keys only: counters and weights, episodes restart
        assert restored.state_dict()["frames"] == 20
        weights = restored.state_dict()["policy_state_dict"]
        assert all(torch.equal(weights[name], value) for name, value in state["policy_state_dict"].items())
        assert len(list(restored)) == 4
    finally:
        restored.shutdown()
