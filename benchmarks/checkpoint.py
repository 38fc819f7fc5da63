"""How big a collector's checkpoint is, and how long saving and loading it take (docs/checkpoints.md).

    .venv/bin/python benchmarks/checkpoint.py [--collectors single multisync distributed parallel_env] [--repeats 3]

Each collector is the demo's (``rlharvest demo``: CartPole-v1 through ``GymEnv``, the PPO policy, 2048
frames per batch, 2 workers or nodes, ``launcher="mp"``), built by the demo's own ``build_collector``;
``parallel_env`` and ``serial_env`` are a ``Collector`` over a ``ParallelEnv``/``SerialEnv`` of two
of the demo's CartPoles.
After two batches: bytes of ``torch.save(collector.state_dict())`` (with the envs' states, and with
``env_state=False``); seconds of ``state_dict()`` + ``torch.save`` to a file (save), and of
``torch.load`` + ``load_state_dict()`` into a second collector built with the same arguments (load),
medians over ``--repeats``. Nothing here is a test: timings depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from rlharvest.collectors import Collector
from rlharvest.demo.ppo import PPOConfig, make_policy
from rlharvest.demo.run import build_collector, make_env
from rlharvest.envs import ParallelEnv, SerialEnv

#: a Collector over a batched env of two of the demo's envs
BATCHED = {"parallel_env": ParallelEnv, "serial_env": SerialEnv}


def _build(name: str):
    policy = make_policy(4, 2, PPOConfig().hidden)
    if name in BATCHED:
        collector = Collector(BATCHED[name](2, make_env), policy, frames_per_batch=2048, total_frames=2048 * 100)
        collector.set_seed(0)
        return collector
    workers = 1 if name == "single" else 2
    collector = build_collector(name, policy, workers, 2048, 2048 * 100)
    collector.set_seed(0)
    return collector


def measure(name: str, repeats: int) -> dict:
    source, target = _build(name), _build(name)
    try:
        iterator = iter(source)
        next(iterator), next(iterator)
        path = os.path.join(tempfile.mkdtemp(), "checkpoint.pt")
        saves, loads = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            torch.save(source.state_dict(), path)
            saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            target.load_state_dict(torch.load(path))
            loads.append(time.perf_counter() - start)
        size = os.path.getsize(path)
        torch.save(source.state_dict(env_state=False), path)
        lean = os.path.getsize(path)
        os.remove(path)
    finally:
        source.shutdown()
        target.shutdown()
    return {"collector": name, "bytes": size, "bytes_env_state_false": lean,
            "save_s": statistics.median(saves), "load_s": statistics.median(loads)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collectors", nargs="+", default=["single", "multisync", "distributed"],
                        choices=["single", "multisync", "distributed", "rpc", *BATCHED])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| collector | checkpoint | env_state=False | save (state_dict + torch.save) | load (torch.load + load_state_dict) |")
    print("|---|---|---|---|---|")
    for name in args.collectors:
        row = measure(name, args.repeats)
        print(f"| {name} | {row['bytes'] / 1024:.1f} KiB | {row['bytes_env_state_false'] / 1024:.1f} KiB | "
              f"{row['save_s'] * 1000:.1f} ms | {row['load_s'] * 1000:.1f} ms |")


if __name__ == "__main__":
    main()
