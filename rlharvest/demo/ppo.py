"""A small, self-contained PPO for discrete actions (no RL library, ~200 lines).

The learner owns two networks:

* the *policy* handed to the collector: ``TensorDictSequential(actor, sampler)``. The actor maps
  ``"observation"`` to ``"logits"``; the sampler draws ``"action"`` (an integer) and writes its
  ``"sample_log_prob"``. Both are plain key-to-key ``TensorDictModule``\\ s, so rlharvest runs them
  on its fast path (tensors in, tensors out, no TensorDict per step).
* a *value* network (``observation -> V``) that never leaves the learner.

``PPO.update(batch)`` runs one optimisation phase on a batch whose last dim is time, mutating the
actor's parameters in place; the caller then pushes them with ``collector.update_policy_weights_()``.

Advantages use GAE(gamma, lambda). Bootstrapping follows the done flags precisely:

* ``terminated`` (the pole fell): the next state has value 0;
* ``truncated`` (500-step time limit) or the end of a batch: bootstrap with ``V(next observation)``
  (the collector keeps the final observation under ``("next", "observation")``);
* the GAE recursion never crosses a trajectory boundary (``done`` or a change of trajectory id).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from tensordict import TensorDictBase
from tensordict.nn import InteractionType, TensorDictModule, TensorDictSequential
from torch import nn

from ..envs.utils import exploration_type

__all__ = ["PPOConfig", "PPO", "CategoricalSampler", "make_policy", "make_value", "gae"]


@dataclass
class PPOConfig:
    """PPO hyper-parameters (defaults tuned for CartPole-v1, see ``rlharvest/demo/run.py``)."""

    frames_per_batch: int = 2048
    epochs: int = 10
    minibatch_size: int = 256
    lr: float = 2.5e-3
    anneal_lr: bool = True      # linear decay to 0 over the frame budget
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_eps: float = 0.2
    entropy_coef: float = 0.0
    value_coef: float = 0.5
    max_grad_norm: float = 0.5
    hidden: int = 64

    def as_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------- networks
def _mlp(n_in: int, n_out: int, hidden: int, last_gain: float) -> nn.Sequential:
    net = nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                        nn.Linear(hidden, n_out))
    for layer in net:
        if isinstance(layer, nn.Linear):  # orthogonal init, as in most PPO implementations
            nn.init.orthogonal_(layer.weight, gain=last_gain if layer is net[-1] else 2 ** 0.5)
            nn.init.zeros_(layer.bias)
    return net


class CategoricalSampler(nn.Module):
    """``logits -> (action, log_prob)``: a sample (or the argmax in deterministic mode)."""

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs = logits.log_softmax(-1)
        if exploration_type() in (InteractionType.DETERMINISTIC, InteractionType.MODE):
            action = logits.argmax(-1)
        else:  # Gumbel-max trick: argmax(log p - log E), E ~ Exp(1); ~3x cheaper than multinomial per step
            action = (log_probs - torch.empty_like(log_probs).exponential_().log_()).argmax(-1)
        return action, log_probs.gather(-1, action.unsqueeze(-1)).squeeze(-1)


def make_policy(obs_dim: int, n_actions: int, hidden: int = 64) -> TensorDictSequential:
    """The collector's policy: observation -> logits -> (action, sample_log_prob)."""
    actor = _mlp(obs_dim, n_actions, hidden, last_gain=0.01)
    return TensorDictSequential(
        TensorDictModule(actor, in_keys=["observation"], out_keys=["logits"]),
        TensorDictModule(CategoricalSampler(), in_keys=["logits"], out_keys=["action", "sample_log_prob"]),
    )


def make_value(obs_dim: int, hidden: int = 64) -> nn.Module:
    return _mlp(obs_dim, 1, hidden, last_gain=1.0)


# ---------------------------------------------------------------------------------------------- GAE
@torch.no_grad()
def gae(reward, value, next_value, terminated, continues, gamma: float, lam: float):
    """Generalised advantage estimation on ``(rows, time)`` tensors.

    Args:
        reward, value, next_value: float ``(N, T)``; ``next_value`` is ``V(next observation)``.
        terminated: bool ``(N, T)``: no bootstrap from the next state.
        continues: bool ``(N, T)``: step ``t + 1`` of the row belongs to the same trajectory.

    Returns:
        ``(advantages, value targets)``, both ``(N, T)``.
    """
    delta = reward + gamma * next_value * (~terminated).float() - value
    carry = gamma * lam * continues.float()
    advantages = torch.empty_like(delta)
    running = torch.zeros_like(delta[:, 0])
    for t in range(delta.shape[1] - 1, -1, -1):
        running = delta[:, t] + carry[:, t] * running
        advantages[:, t] = running
    return advantages, advantages + value


# ---------------------------------------------------------------------------------------------- learner
class PPO:
    """Clipped-surrogate PPO; :meth:`update` mutates the policy's parameters in place."""

    def __init__(self, policy: TensorDictSequential, value: nn.Module, config: PPOConfig, total_frames: int):
        self.config = config
        self.policy = policy
        self.actor = policy[0].module  # the logits network; the sampler has no parameters
        self.value = value
        self.total_frames = max(1, int(total_frames))
        self.optimizer = torch.optim.Adam([*self.actor.parameters(), *self.value.parameters()],
                                          lr=config.lr, eps=1e-5)

    def _prepare(self, batch: TensorDictBase) -> dict[str, torch.Tensor]:
        """Flatten any batch layout to ``(rows, time)`` and compute advantages."""
        steps = batch.shape[-1]
        rows = batch.shape[:-1].numel()

        def get(key, squeeze=False):
            x = batch.get(key)
            x = x.reshape(rows, steps, *x.shape[batch.ndim:])
            return x.squeeze(-1) if squeeze else x

        obs, next_obs = get("observation"), get(("next", "observation"))
        traj = get(("collector", "traj_ids"))
        done, terminated = get(("next", "done"), True), get(("next", "terminated"), True)
        valid = traj != -1  # steps an interrupted rollout did not collect
        continues = torch.zeros_like(done)
        continues[:, :-1] = ~done[:, :-1] & (traj[:, 1:] == traj[:, :-1]) & valid[:, 1:]
        with torch.no_grad():
            value = self.value(obs).squeeze(-1)
            next_value = self.value(next_obs).squeeze(-1)
        advantages, returns = gae(get(("next", "reward"), True).float(), value, next_value, terminated,
                                  continues, self.config.gamma, self.config.gae_lambda)
        flat = {"observation": obs, "action": get("action"), "log_prob": get("sample_log_prob"),
                "advantage": advantages, "return": returns}
        flat = {k: v[valid] for k, v in flat.items()}
        adv = flat["advantage"]
        flat["advantage"] = (adv - adv.mean()) / (adv.std() + 1e-8)
        return flat

    def update(self, batch: TensorDictBase, frames_done: int) -> dict[str, float]:
        """One optimisation phase (``epochs`` passes of minibatches) on ``batch``."""
        cfg = self.config
        if cfg.anneal_lr:
            for group in self.optimizer.param_groups:
                group["lr"] = cfg.lr * max(0.0, 1.0 - frames_done / self.total_frames)
        data = self._prepare(batch)
        n = data["advantage"].shape[0]
        stats = {"policy_loss": 0.0, "value_loss": 0.0, "entropy": 0.0, "clip_fraction": 0.0}
        count = 0
        for _ in range(cfg.epochs):
            for idx in torch.randperm(n).split(cfg.minibatch_size):
                mb = {k: v[idx] for k, v in data.items()}
                log_probs = self.actor(mb["observation"]).log_softmax(-1)
                new_log_prob = log_probs.gather(-1, mb["action"].unsqueeze(-1)).squeeze(-1)
                ratio = (new_log_prob - mb["log_prob"]).exp()
                adv = mb["advantage"]
                surrogate = torch.min(ratio * adv, ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * adv)
                entropy = -(log_probs.exp() * log_probs).sum(-1).mean()
                value_loss = (self.value(mb["observation"]).squeeze(-1) - mb["return"]).pow(2).mean()
                loss = -surrogate.mean() - cfg.entropy_coef * entropy + cfg.value_coef * value_loss
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                # actor and critic are clipped apart: large value gradients must not shrink the actor's
                nn.utils.clip_grad_norm_(self.actor.parameters(), cfg.max_grad_norm)
                nn.utils.clip_grad_norm_(self.value.parameters(), cfg.max_grad_norm)
                self.optimizer.step()
                stats["policy_loss"] += -surrogate.mean().item()
                stats["value_loss"] += value_loss.item()
                stats["entropy"] += entropy.item()
                stats["clip_fraction"] += ((ratio - 1).abs() > cfg.clip_eps).float().mean().item()
                count += 1
        stats = {k: v / max(count, 1) for k, v in stats.items()}
        stats["lr"] = self.optimizer.param_groups[0]["lr"]
        return stats
