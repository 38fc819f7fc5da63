"""Three models updated at once, each through one of TorchRL's own weight-sync scheme objects, in a
collector with two worker processes (the pattern of TorchRL's examples/collectors/multi_weight_updates.py;
the only rlharvest line is the collector import).

The models: the policy (in the workers), a module transforming the env's observations (in each
worker's env: ``"env.transform[0].module"``), and a module the replay buffer applies to what is
written into it (``"replay_buffer.transform[0].module"``). After the first batch, each gets weights
that make its output a constant of its own: a marker. The batches written after the update show
whether each model's weights arrived: the action is the policy's marker, the next observation the
env module's, the stored observation the buffer module's.

    python compat/examples/multi_model_weights.py --batches 4
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs import GymEnv
from torchrl.envs.transforms.module import ModuleTransform
from torchrl.weight_update import MultiProcessWeightSyncScheme

from rlharvest.collectors import Collector

FRAMES_PER_BATCH = 100
MARKERS = {"policy": 0.25, "env.transform[0].module": 0.5, "replay_buffer.transform[0].module": 0.75}


def observation_module() -> TensorDictModule:
    return TensorDictModule(torch.nn.Linear(3, 3), in_keys=["observation"], out_keys=["observation"])


def policy_module() -> TensorDictModule:
    return TensorDictModule(torch.nn.Linear(3, 1), in_keys=["observation"], out_keys=["action"])


def pendulum_with_observation_module() -> GymEnv:
    return GymEnv("Pendulum-v1").append_transform(ModuleTransform(module_factory=observation_module, no_grad=True))


def constant_output(module: TensorDictModule, value: float) -> TensorDict:
    """Weights of ``module``'s shape that make it output ``value`` whatever its input."""
    weights = TensorDict.from_module(module).data.clone().zero_()
    weights["module", "bias"].fill_(value)
    return weights


def markers_seen(written: TensorDict) -> dict:
    """For each model, whether every frame of ``written`` shows its marker."""
    def everywhere(values: torch.Tensor, marker: float) -> bool:
        return bool(torch.isclose(values, torch.full_like(values, marker)).all())
    return {"policy": everywhere(written["action"], MARKERS["policy"]),
            "env.transform[0].module": everywhere(written["next", "observation"], MARKERS["env.transform[0].module"]),
            "replay_buffer.transform[0].module": everywhere(written["observation"],
                                                            MARKERS["replay_buffer.transform[0].module"])}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=4)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    buffer = ReplayBuffer(storage=LazyTensorStorage(10_000, shared_init=True),
                          transform_factory=partial(ModuleTransform, module_factory=observation_module, inverse=True,
                                                    no_grad=True))
    schemes = {"policy": MultiProcessWeightSyncScheme(strategy="state_dict"),
               "env.transform[0].module": MultiProcessWeightSyncScheme(strategy="tensordict"),
               "replay_buffer.transform[0].module": MultiProcessWeightSyncScheme(strategy="tensordict")}
    collector = Collector(create_env_fn=pendulum_with_observation_module, num_collectors=2, sync=True,
                          policy_factory=policy_module, frames_per_batch=FRAMES_PER_BATCH,
                          total_frames=FRAMES_PER_BATCH * args.batches, max_frames_per_traj=50, device="cpu",
                          storing_device="cpu", weight_sync_schemes=schemes, replay_buffer=buffer)
    sizes, before, after = [], None, []
    for index, _ in enumerate(collector):
        sizes.append(len(buffer))
        written = buffer[len(buffer) - FRAMES_PER_BATCH:len(buffer)]
        if index == 0:
            before = markers_seen(written)
            collector.update_policy_weights_(weights_dict={
                "policy": constant_output(policy_module(), MARKERS["policy"]),
                "env.transform[0].module": constant_output(observation_module(), MARKERS["env.transform[0].module"]),
                "replay_buffer.transform[0].module": constant_output(
                    observation_module(), MARKERS["replay_buffer.transform[0].module"]),
            })
        else:
            after.append(markers_seen(written))
    collector.shutdown()
    summary = {"buffer_sizes": sizes, "before_update": before,
               "after_update": {model_id: bool(after) and all(seen[model_id] for seen in after) for model_id in MARKERS}}
    print(f"done: {summary}")
    return summary


if __name__ == "__main__":
    main()
