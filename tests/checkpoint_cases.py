"""Collectors of the checkpoint tests, built the same way in the test and in a fresh process.

:func:`main`, with ``CASE CHECKPOINT OUT BATCHES`` as its arguments, builds collector CASE, seeds it
with another seed (the checkpoint must override it), loads CHECKPOINT, collects BATCHES batches and
``torch.save``s them to OUT (docs/checkpoints.md), with the pids of the processes it started (a
ParallelEnv's sub-envs, workers): the test checks none survives. The tests run it in a fresh process
forked from the session's zygote (:mod:`fresh`); ``python -c "import checkpoint_cases;
checkpoint_cases.main()" CASE CHECKPOINT OUT BATCHES`` runs it by hand.
"""

from __future__ import annotations

import functools
import pathlib
import sys
import threading
import warnings

import psutil
import torch

import fresh

from rlharvest.collectors.engine import engine_of
from mocks import CountingPolicy
from tensordict.nn import TensorDictModule

from rlharvest.checkpoint import EpisodeRestartWarning
from rlharvest.collectors import (AsyncBatchedCollector, AsyncCollector, Collector, MultiAsyncCollector,
                                  MultiSyncCollector)
from rlharvest.data import ReplayBuffer
from rlharvest.envs import ContinuousMockEnv, CountingEnv, GymEnv, ParallelEnv, SerialEnv

TRAJ_IDS = ("collector", "traj_ids")


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


def _distributed(collector_class: str = "DistributedCollector", sync: bool = True, **kwargs):
    """Two nodes started by the mp launcher: sync, continuous envs and a policy with weights; async,
    the counting envs of the async cases (one cycle 10w, ..., 10w + 4 per node)."""
    from rlharvest.collectors import distributed
    from rlharvest.transport.ports import free_port_block

    if sync:
        envs, policy, frames = [functools.partial(ContinuousMockEnv, batch_size=(2,))] * 2, _policy(), dict(
            frames_per_batch=24, total_frames=240)
    else:
        envs, policy, frames = [functools.partial(counting_worker_env, w) for w in range(2)], CountingPolicy(), dict(
            frames_per_batch=4, total_frames=48)
    return getattr(distributed, collector_class)(envs, policy, launcher="mp", tcp_port=free_port_block(3), sync=sync,
                                                 **frames, **kwargs)


class NoisyEnv(ContinuousMockEnv):
    """ContinuousMockEnv (resets drawn from its own generator) whose steps add noise drawn from the
    process's global torch generator: in a ParallelEnv, the sub-env process's."""

    def __init__(self) -> None:
        super().__init__(episode_length=6)

    def _step_arrays(self, actions):
        observations, reward, terminated, truncated = super()._step_arrays(actions)
        self.obs = self.obs + 0.01 * torch.randn(self.obs.shape)
        return {"observation": self.obs}, reward, terminated, truncated


class UncapturableCountingEnv(CountingEnv):
    """A CountingEnv holding a lock, which cannot be copied: its state cannot be captured."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()


def cartpole() -> GymEnv:
    return GymEnv("CartPole-v1", max_episode_steps=12)


_BATCHED = {"serial": SerialEnv, "parallel": ParallelEnv}
_SUB_ENVS = {"gym": (cartpole, None), "noisy": (NoisyEnv, _policy)}


def batched_env(kind: str, sub_env: str):
    """A SerialEnv or ParallelEnv of two sub-envs ``sub_env``."""
    return _BATCHED[kind](2, _SUB_ENVS[sub_env][0])


def _batched_case(collector: str, kind: str, sub_env: str):
    """``collector`` over a batched env of ``kind`` (serial/parallel) of two ``sub_env`` (gym/noisy)."""
    policy = _SUB_ENVS[sub_env][1]
    policy = policy() if policy is not None else None  # gym: random actions (the process's generator)
    make = functools.partial(batched_env, kind, sub_env)
    if collector == "collector":
        return Collector(make(), policy, frames_per_batch=10, total_frames=100)
    return MultiSyncCollector([make] * 2, policy, frames_per_batch=20, total_frames=200)


#: Collector and MultiSyncCollector over SerialEnv/ParallelEnv of CartPole or NoisyEnv
BATCHED_CASES = {f"{collector}_{kind}_{sub_env}": functools.partial(_batched_case, collector, kind, sub_env)
                 for collector in ("collector", "multisync") for kind in _BATCHED for sub_env in _SUB_ENVS}


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
    # async nodes: each node's batch goes out as it is ready, one in flight at every checkpoint
    "distributed_async": lambda: _distributed(sync=False),
    "rpc_async": lambda: _distributed("RPCCollector", sync=False),
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
    **BATCHED_CASES,
}

SEED = 5
#: the cases whose resumed run collects to the end (no frame lost or repeated)
ASYNC_CASES = ("multiasync", "async", "ray_async", "async_batched", "distributed_async", "rpc_async")


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
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", EpisodeRestartWarning)
            collector.load_state_dict(torch.load(checkpoint))  # weights_only: the checkpoint is plain
        for warning in caught:  # shown as they would be; the restarts also go to the test
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
        restarts = [str(w.message) for w in caught if issubclass(w.category, EpisodeRestartWarning)]
        iterator = iter(collector)
        if collector.replay_buffer is not None:  # the buffer after those batches, and a sample of it
            for _ in range(int(batches)):
                next(iterator)
            buffer = collector.replay_buffer
            torch.save({"buffer": buffer.state_dict(), "sample": buffer.sample(6), "restarts": restarts}, out)
            return
        collected = [next(iterator).clone() for _ in range(int(batches))]
        collected += [batch.clone() for batch in iterator] if case in ASYNC_CASES else []
        started = [child.pid for child in psutil.Process().children(recursive=True)]
        frames = engine_of(collector).tally.frames  # a RayCollector shut itself down at the end of its iteration
        torch.save({"batches": collected, "frames": frames, "children": started,
                    "restarts": restarts}, out)
    finally:
        collector.shutdown()


# ---------------------------------------------------------------------------------- the tests' side
def resume_in_fresh_process(case: str, state, tmp_path: pathlib.Path, batches: int, timeout: float = 100) -> dict:
    """Build ``case`` in a new Python process (forked from the session's zygote: tests/fresh.py), load
    ``state`` from a file, collect ``batches``. The test must use the ``zygote`` fixture."""
    checkpoint, out, log = tmp_path / "checkpoint.pt", tmp_path / "batches.pt", tmp_path / "fresh.log"
    torch.save(state, checkpoint)
    status = fresh.current().run([case, str(checkpoint), str(out), str(batches)], log, timeout)
    assert status == 0, log.read_text()[-4000:]
    return torch.load(out, weights_only=False)


def assert_identical(expected, got, skip=()) -> None:
    keys = set(expected.keys(True, True)) - set(skip)
    assert keys == set(got.keys(True, True)) - set(skip)
    for key in keys:
        a, b = expected.get(key), got.get(key)
        assert a.dtype == b.dtype and torch.equal(a, b), (key, a, b)


def interrupted(case: str, before: int, after: int, change=None):
    """Run ``case`` for ``before`` batches, checkpoint it, then ``after`` more: (checkpoint, those batches)."""
    collector = build(case)
    try:
        iterator = iter(collector)
        for _ in range(before):
            next(iterator)
        if change is not None:
            change(collector)
        state = collector.state_dict()
        return state, [next(iterator).clone() for _ in range(after)]
    finally:
        collector.shutdown()


def relabel_new_ids(batches: list, first_new: int) -> list:
    """Trajectory ids from ``first_new`` on renumbered by first appearance (workers take ids from a shared
    counter in whatever order they get to it); ids of episodes that continue keep their value."""
    mapping: dict[int, int] = {}
    out = []
    for batch in batches:
        ids = batch[TRAJ_IDS].clone()
        for index, value in enumerate(ids.flatten().tolist()):
            if value >= first_new:
                ids.view(-1)[index] = mapping.setdefault(value, first_new + len(mapping))
        out.append(ids)
    return out
