"""DQN on CartPole written the way TorchRL's examples are, with rlharvest's collector.

The only rlharvest line is the collector import (was ``from torchrl.collectors import Collector``).
A random warm-up (``init_random_frames``) fills the replay buffer before the first gradient step;
the Q-value actor writes Q-values beside the action, so random and policy batches share a layout.

    python compat/examples/dqn_cartpole.py --total-frames 20000
"""

from __future__ import annotations

import argparse

import torch
from tensordict.nn import TensorDictSequential
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs import GymEnv, RewardSum, TransformedEnv
from torchrl.modules import MLP, EGreedyModule, QValueActor
from torchrl.objectives import DQNLoss, SoftUpdate

from rlharvest.collectors import Collector


def make_env() -> TransformedEnv:
    return TransformedEnv(GymEnv("CartPole-v1"), RewardSum())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--total-frames", type=int, default=20_000)
    parser.add_argument("--frames-per-batch", type=int, default=100)
    parser.add_argument("--init-random-frames", type=int, default=1_000)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)
    torch.manual_seed(0)

    env = make_env()
    actor = QValueActor(MLP(in_features=4, out_features=2, num_cells=[64, 64]), in_keys=["observation"],
                        spec=env.action_spec)
    greedy = EGreedyModule(env.action_spec, eps_init=1.0, eps_end=0.05, annealing_num_steps=args.total_frames // 2)
    policy = TensorDictSequential(actor, greedy)
    loss = DQNLoss(actor, action_space=env.action_spec, delay_value=True)
    loss.make_value_estimator(gamma=0.99)
    target_update = SoftUpdate(loss, eps=0.99)
    optimizer = torch.optim.Adam(loss.parameters(), lr=1e-3)
    buffer = ReplayBuffer(storage=LazyTensorStorage(50_000), batch_size=args.batch_size)

    collector = Collector(make_env, policy,
                          frames_per_batch=args.frames_per_batch, total_frames=args.total_frames,
                          init_random_frames=args.init_random_frames)
    frames, updates, returns = 0, 0, []
    for batch in collector:
        frames += batch.numel()
        buffer.extend(batch.reshape(-1))
        done = batch["next", "done"].squeeze(-1)
        returns += batch["next", "episode_reward"][done].flatten().tolist()
        greedy.step(batch.numel())
        if len(buffer) < args.init_random_frames:
            continue
        for _ in range(4):
            loss_value = loss(buffer.sample())["loss"]
            optimizer.zero_grad()
            loss_value.backward()
            optimizer.step()
            target_update.step()
            updates += 1
        collector.update_policy_weights_()
    collector.shutdown()
    recent = returns[-20:]
    summary = {"frames": frames, "updates": updates, "episodes": len(returns),
               "mean_return_last_20": sum(recent) / max(1, len(recent))}
    print("done:", summary)
    return summary


if __name__ == "__main__":
    main()
