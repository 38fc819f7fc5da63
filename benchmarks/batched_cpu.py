"""Where the CPU goes in the batched layouts: CPU microseconds per frame, collector process vs its children.

    .venv/bin/python benchmarks/batched_cpu.py [--size big] [--rounds 3] [--seconds 3]

For 8 CartPole-v1 envs and the ``--size`` MLP (docs/performance.md, "Many envs, one batched policy"):
``Collector(ParallelEnv(8))``, ``AsyncBatchedCollector`` (one env per worker, and four), and
``MultiSyncCollector`` (per-worker inference), run one after the other ``--rounds`` times. Each line gives frames/s, the CPU time per
frame of the collector's process and of its child processes (from ``/proc``: user + system), the
cores used, and the load average. On a machine other work shares, CPU per frame moves much less
than frames/s, and ``cores`` shows how much of the machine a layout could use (a layout whose
parent and sub-envs wait for each other uses fewer cores than one whose workers run free). Linux
only; nothing here is a test.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import common  # noqa: E402
import rlharvest_envs as envs  # noqa: E402

from rlharvest.collectors import AsyncBatchedCollector, Collector, MultiSyncCollector  # noqa: E402
from rlharvest.envs import ParallelEnv  # noqa: E402

NUM_ENVS = common.BATCHED_MAIN_ENVS
LAYOUTS = {
    "Collector(ParallelEnv)": lambda size, **kw: Collector(ParallelEnv(NUM_ENVS, envs.make_cartpole_env),
                                                           envs.batched_policy(size), **kw),
    "AsyncBatchedCollector": lambda size, **kw: AsyncBatchedCollector(
        [envs.make_cartpole_env] * NUM_ENVS, policy=envs.batched_policy(size), env_backend="multiprocessing", **kw),
    "AsyncBatched, 4/worker": lambda size, **kw: AsyncBatchedCollector(
        [envs.make_cartpole_env] * NUM_ENVS, policy=envs.batched_policy(size), envs_per_worker=4,
        env_backend="multiprocessing", **kw),
    "MultiSync, per-worker": lambda size, **kw: MultiSyncCollector([envs.make_cartpole_env] * NUM_ENVS,
                                                                   envs.batched_policy(size), **kw),
}


def _ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _children(pid: int) -> list[int]:
    found = []
    for thread in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{thread}/children") as children:
                found += [int(child) for child in children.read().split()]
        except FileNotFoundError:
            pass
    return found


def _cpu_ticks() -> tuple[int, int]:
    """(ticks of this process, ticks of its live children)."""
    me = os.getpid()
    return _ticks(me), sum(_ticks(child) for child in _children(me))


def measure(layout: str, size: str, seconds: float) -> dict:
    collector = LAYOUTS[layout](size, frames_per_batch=200, total_frames=-1)
    batches = iter(collector)
    for _ in range(5):  # warm up: workers started, buffers laid out
        next(batches)
    ours0, children0 = _cpu_ticks()  # children are read while alive: their ticks vanish once they exit
    start, frames = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        frames += next(batches).numel()
    elapsed = time.perf_counter() - start
    ours1, children1 = _cpu_ticks()
    collector.shutdown()
    hz = os.sysconf("SC_CLK_TCK")
    return {"frames_per_s": frames / elapsed, "main_us": (ours1 - ours0) / hz / frames * 1e6,
            "children_us": (children1 - children0) / hz / frames * 1e6,
            "cores": (ours1 - ours0 + children1 - children0) / hz / elapsed, "load": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(common.BATCHED_POLICY_HIDDEN), default="big")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the benchmark sides run
    print(f"{'layout':24s} {'frames/s':>9s} {'main us/frame':>14s} {'children':>9s} {'total':>7s} {'cores':>6s} load")
    for _ in range(args.rounds):
        for layout in LAYOUTS:
            row = measure(layout, args.size, args.seconds)
            print(f"{layout:24s} {row['frames_per_s']:9.0f} {row['main_us']:14.1f} {row['children_us']:9.1f} "
                  f"{row['main_us'] + row['children_us']:7.1f} {row['cores']:6.2f} {row['load']:.1f}", flush=True)


if __name__ == "__main__":
    main()
