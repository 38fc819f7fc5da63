"""A linear policy writing float values as CartPole's one-hot action, the way two of TorchRL's own
collector examples do, with rlharvest's collectors (the only rlharvest lines are the imports).

TorchRL's envs read such an action as ``value.long().argmax(-1)``; rlharvest's collectors hand it to
the env as it is and warn once (in each process that collects) which spec was read, and how.

1. An ``AsyncBatchedCollector`` over 4 CartPole envs, one batched ``nn.Linear(4, 2)`` call for the
   envs that are ready.
2. A ``Collector`` with ``num_collectors=3, sync=True`` (three worker processes) whose policy weights
   travel through shared memory (``SharedMemWeightSyncScheme``), updated after every batch.

    python compat/examples/float_actions.py --total-frames 1000
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.envs import GymEnv

from rlharvest.collectors import AsyncBatchedCollector, Collector
from rlharvest.weight_update import SharedMemWeightSyncScheme


def make_env() -> GymEnv:
    return GymEnv("CartPole-v1")


def linear_policy() -> TensorDictModule:
    return TensorDictModule(nn.Linear(4, 2), in_keys=["observation"], out_keys=["action"])


def async_batched(total_frames: int) -> dict:
    collector = AsyncBatchedCollector(create_env_fn=[make_env] * 4, policy=linear_policy(), frames_per_batch=200,
                                      total_frames=total_frames, max_batch_size=4, device="cpu")
    frames, float_actions = 0, True
    for batch in collector:
        frames += batch.numel()
        float_actions &= batch["action"].dtype == torch.float32
    collector.shutdown()
    return {"frames": frames, "float_actions": bool(float_actions)}


def shared_memory_workers(total_frames: int) -> dict:
    policy = linear_policy()
    collector = Collector(create_env_fn=make_env, num_collectors=3, sync=True, policy=policy, frames_per_batch=192,
                          total_frames=total_frames, weight_sync_schemes={"policy": SharedMemWeightSyncScheme(
                              strategy="tensordict")})
    frames, updates = 0, 0
    for batch in collector:
        frames += batch.numel()
        with torch.no_grad():
            policy.module.bias.add_(0.1)
        collector.update_policy_weights_(TensorDict.from_module(policy))
        updates += 1
    collector.shutdown()
    return {"frames": frames, "updates": updates}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--total-frames", type=int, default=1_000)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    summary = {"async_batched": async_batched(args.total_frames),
               "shared_memory_workers": shared_memory_workers(args.total_frames)}
    print(f"done: {summary}")
    return summary


if __name__ == "__main__":
    main()
