"""PPO on CartPole over a TorchRL ParallelEnv, written the way TorchRL's examples are, with
rlharvest's collector (the only rlharvest line is the collector import).

    python compat/examples/ppo_parallel.py --total-frames 50000
"""

from __future__ import annotations

import argparse
import functools

import torch
from tensordict.nn import TensorDictModule
from torchrl.data import LazyTensorStorage, ReplayBuffer, SamplerWithoutReplacement
from torchrl.envs import GymEnv, ParallelEnv, RewardSum, TransformedEnv
from torchrl.modules import MLP, OneHotCategorical, ProbabilisticActor, ValueOperator
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE

from rlharvest.collectors import Collector


def make_env(num_envs: int) -> TransformedEnv:
    return TransformedEnv(ParallelEnv(num_envs, functools.partial(GymEnv, "CartPole-v1")), RewardSum())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--total-frames", type=int, default=50_000)
    parser.add_argument("--frames-per-batch", type=int, default=1_000)
    parser.add_argument("--num-envs", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args(argv)
    torch.manual_seed(0)

    env = make_env(args.num_envs)
    logits = TensorDictModule(MLP(in_features=4, out_features=2, num_cells=[64, 64]), in_keys=["observation"],
                              out_keys=["logits"])
    actor = ProbabilisticActor(logits, in_keys=["logits"], spec=env.full_action_spec["action"],
                               distribution_class=OneHotCategorical, return_log_prob=True)
    critic = ValueOperator(MLP(in_features=4, out_features=1, num_cells=[64, 64]), in_keys=["observation"])
    advantage = GAE(gamma=0.99, lmbda=0.95, value_network=critic)
    loss = ClipPPOLoss(actor, critic, clip_epsilon=0.2, entropy_coeff=0.01)
    optimizer = torch.optim.Adam(loss.parameters(), lr=3e-4)
    buffer = ReplayBuffer(storage=LazyTensorStorage(args.frames_per_batch),
                          sampler=SamplerWithoutReplacement(), batch_size=256)

    collector = Collector(env, actor, frames_per_batch=args.frames_per_batch, total_frames=args.total_frames)
    frames, steps, returns = 0, 0, []
    for batch in collector:
        frames += batch.numel()
        done = batch["next", "done"].squeeze(-1)
        returns += batch["next", "episode_reward"][done].flatten().tolist()
        for _ in range(args.epochs):
            with torch.no_grad():
                advantage(batch)
            buffer.extend(batch.reshape(-1))
            for minibatch in buffer:
                losses = loss(minibatch)
                total = losses["loss_objective"] + losses["loss_critic"] + losses["loss_entropy"]
                optimizer.zero_grad()
                total.backward()
                optimizer.step()
                steps += 1
        collector.update_policy_weights_()
    collector.shutdown()
    recent = returns[-20:]
    summary = {"frames": frames, "optimizer_steps": steps, "episodes": len(returns),
               "mean_return_last_20": sum(recent) / max(1, len(recent))}
    print("done:", summary)
    return summary


if __name__ == "__main__":
    main()
