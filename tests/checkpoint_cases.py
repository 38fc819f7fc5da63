"""Collectors of the checkpoint tests, built the same way in the test and in a fresh process.

``python -c "import checkpoint_cases; checkpoint_cases.main()" CASE CHECKPOINT OUT BATCHES`` builds
collector CASE, seeds it with another seed (the checkpoint must override it), loads CHECKPOINT,
collects BATCHES batches and ``torch.save``s them to OUT (docs/checkpoints.md).
"""

from __future__ import annotations

import functools
import sys
import warnings

import torch
from mocks import CountingPolicy
from tensordict.nn import TensorDictModule

from rlharvest.collectors import (AsyncBatchedCollector, AsyncCollector, Collector, MultiAsyncCollector,
                                  MultiSyncCollector)
from rlharvest.data import ReplayBuffer
from rlharvest.envs import ContinuousMockEnv, CountingEnv, GymEnv


def counting_worker_env(worker: int) -> CountingEnv:
    """Episodes of 5 steps whose observations tell the worker: 10*w, ..., 10*w + 4."""
    return CountingEnv(max_steps=10 * worker + 4, start_val=10 * worker)


def _policy(bias: float = 0.25) -> torch.nn.Module:
    """A deterministic policy with weights (action = tanh(W obs + b)) for continuous envs."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(7, 7)
    return TensorDictModule(torch.nn.Sequential(linear, torch.nn.Tanh()), in_keys=["observation"], out_keys=["action"])


def _ray(sync: bool):
    from rlharvest.collectors.distributed import RayCollector

    if sync:
        return RayCollector([functools.partial(ContinuousMockEnv, batch_size=(2,))] * 2, _policy(),
                            frames_per_batch=24, total_frames=240, sync=True)
    return RayCollector([functools.partial(counting_worker_env, w) for w in range(2)], CountingPolicy(),
                        frames_per_batch=4, total_frames=48, sync=False)


def _distributed(collector_class: str = "DistributedCollector", **kwargs):
    from rlharvest.collectors import distributed
    from rlharvest.transport.ports import free_port_block

    return getattr(distributed, collector_class)([functools.partial(ContinuousMockEnv, batch_size=(2,))] * 2, _policy(), launcher="mp",
                                tcp_port=free_port_block(3), frames_per_batch=24, total_frames=240, **kwargs)


CASES = {
    # random actions (the process's torch generator), step counts of max_frames_per_traj
    "counting": lambda: Collector(CountingEnv(max_steps=7, batch_size=(2,)), None, frames_per_batch=6,
                                  total_frames=60, max_frames_per_traj=5),
    # the env's own generator, a policy with weights and a tracked version
    "continuous": lambda: Collector(ContinuousMockEnv(batch_size=(2,)), _policy(), frames_per_batch=8,
                                    total_frames=80, track_policy_version=True),
    # gymnasium: the unwrapped env's physics and np_random, TimeLimit's step count
    "gym": lambda: Collector(GymEnv("CartPole-v1", max_episode_steps=12), None, frames_per_batch=10,
                             total_frames=100),
    "gym_vector": lambda: Collector(GymEnv("CartPole-v1", num_envs=3), None, frames_per_batch=15, total_frames=150),
    "multisync": lambda: MultiSyncCollector([functools.partial(ContinuousMockEnv, batch_size=(2,))] * 2, None,
                                            frames_per_batch=12, total_frames=120, max_frames_per_traj=7),
    # a worker killed and replaced, weights pushed, before the checkpoint (restarts spent: 1 of 2)
    "multisync_restarts": lambda: MultiSyncCollector([functools.partial(ContinuousMockEnv, batch_size=(2,))] * 2,
                                                     _policy(), frames_per_batch=12, total_frames=120,
                                                     max_worker_restarts=2),
    # every action is 1: worker w's observations go 10w, ..., 10w + 4, then a new episode
    "multiasync": lambda: MultiAsyncCollector([functools.partial(counting_worker_env, w) for w in range(2)],
                                              CountingPolicy(), frames_per_batch=4, total_frames=48),
    "distributed": lambda: _distributed(sync=True, max_worker_restarts=1),
    "rpc": lambda: _distributed("RPCCollector", sync=True),
    # a replay buffer that wraps around (capacity 20 < the frames written): iteration yields None
    "buffer": lambda: Collector(ContinuousMockEnv(batch_size=(2,)), _policy(), frames_per_batch=8, total_frames=80,
                                replay_buffer=ReplayBuffer(capacity=20)),
    # workers attach the shared storage and write their batches themselves, in whichever order they
    # finish (capacity: whole batches); the parent's checkpoint holds the buffer once
    "multisync_buffer": lambda: MultiSyncCollector([functools.partial(ContinuousMockEnv, batch_size=(2,))] * 2,
                                                   None, frames_per_batch=12, total_frames=120,
                                                   replay_buffer=ReplayBuffer(capacity=24)),
    # Ray actors (the session's Ray: a fresh process connects to it through RAY_ADDRESS)
    "ray": lambda: _ray(sync=True),
    "ray_async": lambda: _ray(sync=False),
    # one served policy, frames of both workers interleaved in flat batches (with "env_index")
    "async_batched": lambda: AsyncBatchedCollector([functools.partial(counting_worker_env, w) for w in range(2)],
                                                   policy=CountingPolicy(), frames_per_batch=6, total_frames=60,
                                                   transition_chunk_size=4),
    # AsyncCollector: one worker in a background process, its batch in flight at every checkpoint
    "async": lambda: AsyncCollector(functools.partial(counting_worker_env, 0), CountingPolicy(), frames_per_batch=4,
                                    total_frames=48),
}

SEED = 5
#: the cases whose resumed run collects to the end (no frame lost or repeated)
ASYNC_CASES = ("multiasync", "async", "ray_async", "async_batched")


def build(case: str):
    """Collector ``case``, seeded with :data:`SEED`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frames_per_batch rounding
        collector = CASES[case]()
    collector.set_seed(SEED)
    return collector


def main() -> None:
    case, checkpoint, out, batches = sys.argv[1:5]
    collector = CASES[case]()
    try:
        collector.set_seed(SEED + 1000)  # whatever it is seeded with, the checkpoint decides
        torch.manual_seed(1234)
        collector.load_state_dict(torch.load(checkpoint))  # weights_only: the checkpoint is plain
        iterator = iter(collector)
        if collector.replay_buffer is not None:  # the buffer after those batches, and a sample of it
            for _ in range(int(batches)):
                next(iterator)
            buffer = collector.replay_buffer
            torch.save({"buffer": buffer.state_dict(), "sample": buffer.sample(6)}, out)
            return
        collected = [next(iterator).clone() for _ in range(int(batches))]
        collected += [batch.clone() for batch in iterator] if case in ASYNC_CASES else []
        torch.save({"batches": collected, "frames": collector.stats()["frames"]}, out)
    finally:
        collector.shutdown()
