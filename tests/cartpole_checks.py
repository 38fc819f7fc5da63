"""What a batch of CartPole sub-envs must show, whatever vectorizes them: each stored transition is one
real step of the physics, the next step of a sub-env starts where the last one ended unless its
episode ended, and an ended episode is followed by a fresh one (tests/envs/test_gym_vector.py and the
compat suite's TorchRL GymWrapper checks)."""

from __future__ import annotations

import gymnasium as gym
import torch

NUM_ENVS = 3
RESET_BOUND = 0.05  # a fresh CartPole state is drawn from [-0.05, 0.05]^4


def cartpole_vector(vectorization: str, mode: str | None = None, **vector_kwargs) -> gym.vector.VectorEnv:
    """``NUM_ENVS`` CartPole sub-envs with a time limit of 25 steps (episodes end by truncation too),
    in autoreset mode ``mode`` (an ``AutoresetMode`` name; None: the vectorization's own)."""
    if mode is not None:
        vector_kwargs["autoreset_mode"] = gym.vector.AutoresetMode[mode]
    return gym.make_vec("CartPole-v1", num_envs=NUM_ENVS, vectorization_mode=vectorization,
                        vector_kwargs=vector_kwargs, max_episode_steps=25)


def cartpole_step(observation: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """The next CartPole observation (gymnasium's Euler integration), in float64."""
    gravity, cart_mass, pole_mass, half_length, force_mag, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    total_mass = cart_mass + pole_mass
    x, x_dot, theta, theta_dot = observation.double().unbind(-1)
    force = torch.where(action > 0, force_mag, -force_mag).double()
    cos, sin = torch.cos(theta), torch.sin(theta)
    temp = (force + pole_mass * half_length * theta_dot**2 * sin) / total_mass
    theta_acc = (gravity * sin - cos * temp) / (half_length * (4.0 / 3.0 - pole_mass * cos**2 / total_mass))
    x_acc = temp - pole_mass * half_length * theta_acc * cos / total_mass
    return torch.stack([x + tau * x_dot, x_dot + tau * x_acc, theta + tau * theta_dot,
                        theta_dot + tau * theta_acc], -1)


def chosen_actions(action: torch.Tensor) -> torch.Tensor:
    """The index of each action, one-hot or not (the last dim of a one-hot CartPole action is 2)."""
    return action.argmax(-1) if action.shape[-1] == 2 else action.reshape(action.shape[:-1])


def check_cartpole_rows(batch) -> dict[str, int]:
    """Assert the three properties on a ``(sub-envs, time)`` batch of CartPole; returns counts of ends.

    * every transition is a real step: ``next observation == physics(observation, action)``, reward 1
      (a NEXT_STEP reset stored as a step has reward 0 and a fresh observation instead);
    * continuity: the observation of step t + 1 is the next observation of step t unless t ended;
    * fresh states: after an end, a new trajectory id and a freshly drawn state.
    """
    obs, nxt = batch["observation"], batch["next", "observation"]
    done = batch["next", "done"].squeeze(-1)
    traj = batch["collector", "traj_ids"]
    assert obs.dim() == 3 and obs.shape[-1] == 4, obs.shape
    expected = cartpole_step(obs, chosen_actions(batch["action"]))
    wrong = (expected - nxt.double()).abs().amax(-1) > 1e-4
    assert not wrong.any(), f"{int(wrong.sum())} transitions are not a step of the physics, at {wrong.nonzero().tolist()[:5]}"
    assert (batch["next", "reward"] == 1).all(), "a transition with reward 0: a reset stored as a step"
    cut = ((obs[:, 1:] != nxt[:, :-1]).any(-1) & ~done[:, :-1])
    assert not cut.any(), f"{int(cut.sum())} steps do not start where the last one ended, at {cut.nonzero().tolist()[:5]}"
    assert (traj[:, 1:] == traj[:, :-1])[~done[:, :-1]].all(), "a trajectory id changed within an episode"
    assert (traj[:, 1:] != traj[:, :-1])[done[:, :-1]].all(), "an episode's end kept its trajectory id"
    fresh = obs[:, 1:][done[:, :-1]]
    assert (fresh.abs() <= RESET_BOUND).all(), "a step after an end does not start from a fresh state"
    truncated = batch["next", "truncated"].squeeze(-1) if ("next", "truncated") in batch.keys(True) else done & False
    return {"ends": int(done.sum()), "truncations": int(truncated.sum())}


def check_continues(previous, batch) -> None:
    """The first step of ``batch`` starts where the last step of ``previous`` ended, row by row, unless
    that step ended its episode (then the state is fresh)."""
    last_next, first = previous["next", "observation"][:, -1], batch["observation"][:, 0]
    ended = previous["next", "done"][:, -1].squeeze(-1)
    assert (first[~ended] == last_next[~ended]).all(), "a batch does not start where the last one ended"
    assert (first[ended].abs() <= RESET_BOUND).all()


def check_batches(batches: list) -> dict[str, int]:
    """:func:`check_cartpole_rows` on each batch (any leading dims: workers, sub-envs), the counts summed."""
    totals = {"ends": 0, "truncations": 0}
    for batch in batches:
        for name, count in check_cartpole_rows(batch.reshape(-1, batch.shape[-1])).items():
            totals[name] += count
    return totals


def collect_checked(collector) -> tuple[list, dict[str, int]]:
    """Every batch of ``collector`` (shut down after), each checked, and each continuing the last."""
    try:
        batches = [batch.clone() for batch in collector]
    finally:
        collector.shutdown()
    totals = check_batches(batches)
    for previous, batch in zip(batches, batches[1:]):
        check_continues(previous, batch)
    return batches, totals
