"""Checkpoints of collectors over rlharvest's own SerialEnv and ParallelEnv (docs/checkpoints.md): every
sub-env's state is captured where it runs (a ParallelEnv's in its process, that process's generators
included), so a collector built again in a fresh process continues bit for bit, without an
EpisodeRestartWarning; a sub-env whose state cannot be captured still gives one warning naming it."""

from __future__ import annotations

import pytest
import torch
from checkpoint_cases import (BATCHED_CASES, TRAJ_IDS, UncapturableCountingEnv, assert_identical, batched_env,
                              interrupted, relabel_new_ids, resume_in_fresh_process)
from mocks import wait_until
from process_check import process_gone

from rlharvest.checkpoint import CHECKPOINT_KEY, EpisodeRestartWarning
from rlharvest.collectors import Collector
from rlharvest.envs import CountingEnv, ParallelEnv, SerialEnv
from rlharvest.envs.state import EnvStateUnavailable

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("zygote")]

BATCHED = {"serial": SerialEnv, "parallel": ParallelEnv}


def _sections(state: dict) -> list[dict]:
    """rlharvest's part of the collector and of each worker's checkpoint (where the env's state is)."""
    workers = [state[key][CHECKPOINT_KEY] for key in sorted(state) if key.startswith("worker")]
    return workers or [state[CHECKPOINT_KEY]]


@pytest.mark.parametrize("case", sorted(BATCHED_CASES))
def test_batched_envs_resume_bit_for_bit_in_a_fresh_process(case, tmp_path):
    state, expected = interrupted(case, 3, 4)
    for section in _sections(state):
        assert "env" in section and "episode" in section and "env_unavailable" not in section
    resumed = resume_in_fresh_process(case, state, tmp_path, 4)
    assert resumed["restarts"] == []  # no EpisodeRestartWarning: every episode continues
    if case.startswith("collector"):
        for want, got in zip(expected, resumed["batches"], strict=True):
            assert_identical(want, got)
        # the episodes in flight at the checkpoint continue with their ids
        assert resumed["batches"][0][TRAJ_IDS][..., 0].tolist() == expected[0][TRAJ_IDS][..., 0].tolist()
    else:  # new episodes take ids from the shared counter in the order workers reach it
        for want, got in zip(expected, resumed["batches"], strict=True):
            assert_identical(want, got, skip=[TRAJ_IDS])
        first_new = int(state["traj_pool"]["traj_id"])
        for want, got in zip(relabel_new_ids(expected, first_new), relabel_new_ids(resumed["batches"], first_new)):
            assert torch.equal(want, got)
    if "parallel" in case:  # the fresh process's sub-env processes (and workers) are gone with it
        assert len(resumed["children"]) >= 2
        wait_until(lambda: all(process_gone(pid) for pid in resumed["children"]), timeout=30,
                   what=lambda: f"the fresh process's children {resumed['children']} exiting")


@pytest.mark.parametrize("kind", sorted(BATCHED))
def test_a_sub_env_that_cannot_be_captured_gives_one_warning_naming_it(kind):
    def make():
        env = BATCHED[kind](2, [CountingEnv, UncapturableCountingEnv])
        return Collector(env, frames_per_batch=4, total_frames=40)

    source = make()
    seen = next(iter(source))[TRAJ_IDS].tolist()
    state = source.state_dict()
    source.shutdown()
    reason = state[CHECKPOINT_KEY]["env_unavailable"]
    assert "sub-env 1 (UncapturableCountingEnv" in reason and "'lock'" in reason
    restored = make()
    try:
        with pytest.warns(EpisodeRestartWarning, match=r"sub-env 1 \(UncapturableCountingEnv.*'lock'") as caught:
            restored.load_state_dict(state)
        assert len([w for w in caught if issubclass(w.category, EpisodeRestartWarning)]) == 1
        ids = next(iter(restored))[TRAJ_IDS].tolist()
    finally:
        restored.shutdown()
    flat = [value for row in ids for value in row]
    assert min(flat) >= int(state["traj_pool"]["traj_id"]) and not set(flat) & {v for row in seen for v in row}


@pytest.mark.parametrize("kind", sorted(BATCHED))
def test_capture_and_restore_state_replay_the_same_steps(kind):
    """The env alone: steps after restore_state() are those after capture_state(), sub-env noise included
    (a ParallelEnv's sub-envs draw it from their process's generator, part of their state; a SerialEnv's
    from this process's, which the collector's checkpoint holds, so the test puts it back itself)."""
    env = batched_env(kind, "noisy")
    try:
        env.set_seed(3)
        env.reset()
        action = {"action": torch.full((2, 7), 0.5)}
        for _ in range(4):  # past an episode's end (6 steps): rows reset themselves
            env._step_arrays(action)
        state, generator = env.capture_state(), torch.get_rng_state()
        first = [env._step_arrays(action)[0]["observation"].clone() for _ in range(5)]
        env.restore_state(state)
        if kind == "serial":
            torch.set_rng_state(generator)
        again = [env._step_arrays(action)[0]["observation"].clone() for _ in range(5)]
    finally:
        env.close()
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)


def test_a_state_of_another_number_of_sub_envs_is_refused():
    source, other = SerialEnv(2, CountingEnv), SerialEnv(3, CountingEnv)
    try:
        state = source.capture_state()
        with pytest.raises(EnvStateUnavailable, match="the checkpoint holds 2 sub-envs, this SerialEnv has 3"):
            other.restore_state(state)
    finally:
        source.close()
        other.close()


@pytest.mark.parametrize("kind", sorted(BATCHED))
def test_a_closed_batched_env_has_no_state_to_capture(kind):
    env = BATCHED[kind](2, CountingEnv)
    state = env.capture_state()
    env.close()
    with pytest.raises(EnvStateUnavailable, match=f"the {BATCHED[kind].__name__} is closed"):
        env.capture_state()
    with pytest.raises(EnvStateUnavailable, match="is closed"):
        env.restore_state(state)
