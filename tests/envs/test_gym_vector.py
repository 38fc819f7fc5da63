"""Gymnasium vector envs in every vectorization and autoreset mode (docs/envs.md, "Gymnasium vector envs"):
every stored transition is a real step, a sub-env's next step starts where the last one ended unless its
episode ended, an ended episode is followed by a fresh one; in the calling process and in worker
processes. What cannot be made right is refused when the GymEnv is built, naming the mode and the fix."""

from __future__ import annotations

import functools

import gymnasium as gym
import numpy as np
import pytest
import torch
from cartpole_checks import NUM_ENVS, cartpole_vector, check_batches, check_cartpole_rows, collect_checked
from gymnasium.vector.utils import batch_space
from tensordict.nn import TensorDictModule

from rlharvest import WorkerError
from rlharvest.collectors import Collector, MultiAsyncCollector, MultiSyncCollector
from rlharvest.envs import GymEnv, ParallelEnv

pytestmark = pytest.mark.timeout(120)

MODES = gym.vector.AutoresetMode
#: the vector envs rlharvest drives: gymnasium's SyncVectorEnv and AsyncVectorEnv in every autoreset mode
ACCEPTED = [(vectorization, mode.name) for vectorization in ("sync", "async")
            for mode in (MODES.NEXT_STEP, MODES.SAME_STEP, MODES.DISABLED)]


def cartpole_gym_env(vectorization: str, mode: str | None = None, **vector_kwargs) -> GymEnv:
    """tests/cartpole_checks.py's CartPole vector env in a GymEnv, seeded (module-level: pickles)."""
    env = GymEnv(cartpole_vector(vectorization, mode, **vector_kwargs))
    env.set_seed(0)
    return env


# ------------------------------------------------------------------------------- in this process
@pytest.mark.parametrize("vectorization, mode", ACCEPTED)
def test_every_transition_is_a_real_step_in_a_collector(vectorization, mode):
    torch.manual_seed(0)
    batches, totals = collect_checked(Collector(cartpole_gym_env(vectorization, mode), frames_per_batch=NUM_ENVS * 100,
                                                total_frames=NUM_ENVS * 200))
    assert [b.shape for b in batches] == [torch.Size([NUM_ENVS, 100])] * 2
    # random actions end a CartPole episode in ~20 steps: many ends, by the pole and by the time limit
    assert totals["ends"] >= 10 and totals["truncations"] >= 1, totals


@pytest.mark.parametrize("vectorization, mode", ACCEPTED)
def test_max_frames_per_traj_resets_the_sub_envs_it_truncates(vectorization, mode):
    """The collector's own truncation resets sub-envs the env did not end: alone, and afresh."""
    torch.manual_seed(0)
    collector = Collector(cartpole_gym_env(vectorization, mode), frames_per_batch=NUM_ENVS * 60,
                          total_frames=NUM_ENVS * 60, max_frames_per_traj=7)
    try:
        batch = collector.next()
        check_cartpole_rows(batch)
        assert batch["next", "truncated"].any()
        steps = batch["collector", "traj_ids"]
        assert max(int((steps == traj).sum()) for traj in steps.unique()) <= 7
    finally:
        collector.shutdown()


def test_gym_env_from_an_id_is_right_too():
    torch.manual_seed(0)
    env = GymEnv("CartPole-v1", num_envs=NUM_ENVS, max_episode_steps=25)
    env.set_seed(0)
    collector = Collector(env, frames_per_batch=NUM_ENVS * 100, total_frames=NUM_ENVS * 100)
    try:
        assert check_batches([collector.next()])["ends"] >= 10
    finally:
        collector.shutdown()


# ------------------------------------------------------------------------------- in worker processes
def _collect_in_workers(collector_cls, make_env, batches: int = 2) -> list:
    collector = collector_cls([make_env, make_env], None, frames_per_batch=2 * NUM_ENVS * 50,
                              total_frames=batches * 2 * NUM_ENVS * 50)
    try:
        return [batch.clone() for batch in collector]
    finally:
        collector.shutdown()


@pytest.mark.parametrize("vectorization, mode", ACCEPTED)
@pytest.mark.parametrize("collector_cls", [MultiSyncCollector, MultiAsyncCollector])
def test_every_transition_is_a_real_step_in_worker_processes(collector_cls, vectorization, mode):
    batches = _collect_in_workers(collector_cls, functools.partial(cartpole_gym_env, vectorization, mode))
    assert check_batches(batches)["ends"] >= 5


@pytest.mark.parametrize("mode", ["NEXT_STEP", "SAME_STEP", "DISABLED"])
def test_every_transition_is_a_real_step_in_parallel_env_sub_envs(mode):
    """Each GymEnv a sub-env of a ParallelEnv, its resets done in the sub-env's process."""
    torch.manual_seed(0)
    env = ParallelEnv(2, functools.partial(cartpole_gym_env, "sync", mode))
    collector = Collector(env, frames_per_batch=2 * NUM_ENVS * 60, total_frames=2 * NUM_ENVS * 60)
    try:
        assert check_batches([collector.next()])["ends"] >= 5
    finally:
        collector.shutdown()


# ------------------------------------------------------------------------------- refused
def test_a_next_step_env_whose_reset_ignores_the_mask_is_refused():
    """gymnasium's CartPoleVectorEnv (what make_vec picks for CartPole): NEXT_STEP, reset() resets all."""
    vector = gym.make_vec("CartPole-v1", num_envs=4)
    try:
        assert type(vector).__name__ == "CartPoleVectorEnv"
        with pytest.raises(ValueError, match=r"CartPoleVectorEnv \(CartPole-v1\) in autoreset mode NEXT_STEP") as info:
            GymEnv(vector)
        message = str(info.value)
        assert "does not read options['reset_mask']" in message
        assert "Fix: gym.make_vec('CartPole-v1', num_envs=4, vectorization_mode='sync'" in message
        assert "GymEnv('CartPole-v1', num_envs=4)" in message
    finally:
        vector.close()


@pytest.mark.parametrize("mode", ["NEXT_STEP", "SAME_STEP", "DISABLED"])
def test_gymnasium_vector_wrappers_pass_the_mask_on(mode):
    """The unwrapped env decides: a wrapper's reset hands ``options`` to the env it wraps."""
    torch.manual_seed(0)
    env = GymEnv(gym.wrappers.vector.RecordEpisodeStatistics(cartpole_vector("sync", mode)))
    env.set_seed(0)
    _, totals = collect_checked(Collector(env, frames_per_batch=NUM_ENVS * 100, total_frames=NUM_ENVS * 200))
    assert totals["ends"] >= 10
    wrapped = gym.wrappers.vector.RecordEpisodeStatistics(gym.make_vec("CartPole-v1", num_envs=2))
    with pytest.raises(ValueError, match="CartPoleVectorEnv .* NEXT_STEP"):
        GymEnv(wrapped)
    wrapped.close()


def test_an_async_next_step_env_without_shared_memory_is_refused():
    """gymnasium 1.4's AsyncVectorEnv(shared_memory=False) keeps a sub-env's pending NEXT_STEP reset through
    a masked reset: its next step would be a reset again."""
    vector = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="async",
                          vector_kwargs={"autoreset_mode": MODES.NEXT_STEP, "shared_memory": False})
    try:
        with pytest.raises(ValueError, match="autoreset mode NEXT_STEP.*Fix: AsyncVectorEnv.*shared_memory=True"):
            GymEnv(vector)
    finally:
        vector.close()
    for mode in ("SAME_STEP", "DISABLED"):  # those modes need no pending reset cleared: accepted
        env = cartpole_gym_env("async", mode, shared_memory=False)
        torch.manual_seed(0)
        with Collector(env, frames_per_batch=NUM_ENVS * 100, total_frames=NUM_ENVS * 100) as collector:
            assert check_batches([collector.next()])["ends"] >= 10


def _cartpole_vector_env() -> GymEnv:
    return GymEnv(gym.make_vec("CartPole-v1", num_envs=2))


def test_a_refused_env_in_a_worker_is_a_worker_error_naming_the_mode():
    with pytest.raises(WorkerError, match="autoreset mode NEXT_STEP"):
        MultiSyncCollector([_cartpole_vector_env], None, frames_per_batch=20, total_frames=40)


# ------------------------------------------------------------------------------- vector envs of users
class WalkVectorEnv(gym.vector.VectorEnv):
    """Sub-env i walks right by its action (0 or 1) and its episode ends at position 3 + i. ``reset()``
    resets every sub-env, ``options`` or not; autoreset as ``autoreset_mode`` says."""

    def __init__(self, num_envs: int = 3, autoreset_mode=MODES.SAME_STEP) -> None:
        self.num_envs = num_envs
        self.metadata = {"autoreset_mode": autoreset_mode}
        self.single_observation_space = gym.spaces.Box(0, 100, (1,), np.float32)
        self.single_action_space = gym.spaces.Discrete(2)
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self.goal = 3 + np.arange(num_envs)
        self.position = np.zeros(num_envs)
        self.pending = np.zeros(num_envs, dtype=np.bool_)  # NEXT_STEP: reset at the next step

    def _obs(self):
        return self.position[:, None].astype(np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.position[:] = 0
        self.pending[:] = False
        return self._obs(), {}

    def step(self, actions):
        mode = self.metadata["autoreset_mode"]
        reward = np.ones(self.num_envs)
        self.position += np.where(self.pending, 0, actions)
        ended = (self.position >= self.goal) & ~self.pending
        info = {}
        if mode == MODES.NEXT_STEP:
            self.position[self.pending] = 0
            reward[self.pending] = 0
            self.pending = ended.copy()
        elif mode == MODES.SAME_STEP and ended.any():
            info = {"final_obs": self._obs(), "_final_obs": ended}
            self.position[ended] = 0
        return self._obs(), reward, ended, np.zeros(self.num_envs, dtype=np.bool_), info


class MaskedWalkVectorEnv(WalkVectorEnv):
    """A WalkVectorEnv whose reset honours ``options["reset_mask"]``."""

    def reset(self, *, seed=None, options=None):
        rows = (options or {}).get("reset_mask")
        if rows is None:
            return super().reset(seed=seed)
        self.position[rows] = 0
        self.pending[rows] = False
        return self._obs(), {}


def _walk_right() -> TensorDictModule:
    """Always action 1 (walk right)."""
    return TensorDictModule(lambda observation: torch.ones(observation.shape[:-1], dtype=torch.int64),
                            in_keys=["observation"], out_keys=["action"])


def _walk_batch(env: GymEnv, **kwargs):
    with Collector(env, _walk_right(), frames_per_batch=3 * 12, total_frames=3 * 12, **kwargs) as collector:
        return collector.next()


def _assert_walks(batch) -> None:
    """Row i walks 0, 1, ..., 3 + i then starts at 0 again: every step a real one."""
    for row in range(3):
        cycle = list(range(3 + row))
        assert batch["observation"][row].reshape(-1).tolist() == (cycle * 12)[:12]
        assert batch["next", "observation"][row].reshape(-1).tolist() == ([x + 1 for x in cycle] * 12)[:12]
        assert (batch["next", "reward"] == 1).all()


@pytest.mark.parametrize("mode", [MODES.NEXT_STEP, MODES.DISABLED])
def test_a_user_vector_env_whose_reset_reads_the_mask_runs_in_any_mode(mode):
    _assert_walks(_walk_batch(GymEnv(MaskedWalkVectorEnv(autoreset_mode=mode), categorical_action_encoding=True)))


def test_a_same_step_env_needs_no_masked_reset():
    _assert_walks(_walk_batch(GymEnv(WalkVectorEnv(autoreset_mode=MODES.SAME_STEP), categorical_action_encoding=True)))


@pytest.mark.parametrize("mode", ["NEXT_STEP", "DISABLED"])
def test_a_user_vector_env_whose_reset_ignores_the_mask_is_refused(mode):
    with pytest.raises(ValueError, match=f"WalkVectorEnv in autoreset mode {mode}.*Fix: give it autoreset_mode SAME_STEP"):
        GymEnv(WalkVectorEnv(autoreset_mode=MODES[mode]))


def test_a_vector_env_without_an_autoreset_mode_is_refused():
    env = MaskedWalkVectorEnv()
    env.metadata = {}
    with pytest.raises(ValueError, match=r"metadata\['autoreset_mode'\] is None"):
        GymEnv(env)


def test_max_frames_per_traj_is_refused_when_the_env_cannot_reset_sub_envs_alone():
    env = GymEnv(WalkVectorEnv(autoreset_mode=MODES.SAME_STEP), categorical_action_encoding=True)
    assert not env.partial_reset
    with pytest.raises(ValueError, match=r"max_frames_per_traj=2 .*\(partial_reset is False\)"):
        Collector(env, _walk_right(), frames_per_batch=30, max_frames_per_traj=2)
    # a masked reset asked for directly is refused too, naming the sub-envs (it would reset them all)
    env.reset()
    with pytest.raises(RuntimeError, match=r"cannot reset sub-envs \[1\] alone"):
        env.reset(env.reset().set("_reset", torch.tensor([[False], [True], [False]])))
    # ... but when every sub-env is to be reset, one reset() does it
    td = env.reset().set("_reset", torch.ones(3, 1, dtype=torch.bool))
    assert env.reset(td)["observation"].reshape(-1).tolist() == [0, 0, 0]
