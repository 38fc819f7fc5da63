"""Off-policy training with a DistributedCollector whose nodes run TorchRL envs (Pendulum with a
TorchRL TransformedEnv), written the way TorchRL's distributed examples are; the only rlharvest line
is the collector import. Nodes are local processes (launcher="mp"); weights go back to them after
every optimisation round.

    python compat/examples/distributed_sac.py --total-frames 20000
"""

from __future__ import annotations

import argparse

import torch
from tensordict.nn import TensorDictModule
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs import Compose, GymEnv, RewardSum, StepCounter, TransformedEnv
from torchrl.modules import MLP, NormalParamExtractor, ProbabilisticActor, TanhNormal, ValueOperator
from torchrl.objectives import SACLoss, SoftUpdate

from rlharvest.collectors.distributed import DistributedCollector
from rlharvest.transport.ports import free_port_block


def make_env() -> TransformedEnv:
    return TransformedEnv(GymEnv("Pendulum-v1"), Compose(StepCounter(max_steps=200), RewardSum()))


def make_actor(env) -> ProbabilisticActor:
    net = torch.nn.Sequential(MLP(in_features=3, out_features=2, num_cells=[64, 64]), NormalParamExtractor())
    module = TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"])
    return ProbabilisticActor(module, in_keys=["loc", "scale"], spec=env.action_spec,
                              distribution_class=TanhNormal, return_log_prob=True)


class QNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP(in_features=4, out_features=1, num_cells=[64, 64])

    def forward(self, observation, action):
        return self.mlp(torch.cat([observation, action], -1))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--total-frames", type=int, default=20_000)
    parser.add_argument("--frames-per-batch", type=int, default=200)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--init-random-frames", type=int, default=1_000)
    args = parser.parse_args(argv)
    torch.manual_seed(0)

    env = make_env()
    actor = make_actor(env)
    qvalue = ValueOperator(QNet(), in_keys=["observation", "action"])
    loss = SACLoss(actor, qvalue, num_qvalue_nets=2)
    loss.make_value_estimator(gamma=0.99)
    target_update = SoftUpdate(loss, eps=0.995)
    optimizer = torch.optim.Adam(loss.parameters(), lr=3e-4)
    buffer = ReplayBuffer(storage=LazyTensorStorage(100_000), batch_size=128)

    collector = DistributedCollector([make_env] * args.nodes, actor, frames_per_batch=args.frames_per_batch,
                                     total_frames=args.total_frames, init_random_frames=args.init_random_frames,
                                     launcher="mp", tcp_port=free_port_block(3), sync=False)
    frames, updates, returns = 0, 0, []
    for batch in collector:
        frames += batch.numel()
        buffer.extend(batch.reshape(-1))
        done = batch["next", "done"].squeeze(-1)
        returns += batch["next", "episode_reward"][done].flatten().tolist()
        if len(buffer) < args.init_random_frames:
            continue
        for _ in range(2):
            losses = loss(buffer.sample())
            total = losses["loss_actor"] + losses["loss_qvalue"] + losses["loss_alpha"]
            optimizer.zero_grad()
            total.backward()
            optimizer.step()
            target_update.step()
            updates += 1
        collector.update_policy_weights_()
    collector.shutdown()
    recent = returns[-10:]
    summary = {"frames": frames, "updates": updates, "episodes": len(returns),
               "mean_return_last_10": sum(recent) / max(1, len(recent))}
    print("done:", summary)
    return summary


if __name__ == "__main__":
    main()
