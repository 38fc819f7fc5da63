"""What replacing one worker costs, per backend, and what re-forming a gloo group costs.

    .venv/bin/python benchmarks/replace_worker.py [--repeats 5]

For each collector with workers (2 workers, CountingEnv, a 1-parameter policy, ``launcher="mp"``):
seconds for ``collector._replace_worker(1)`` (stop the worker, start its replacement, hand it the
current weights, wait until it is built), median and range over ``--repeats``. For the
``torchdist`` backend also the part of it spent forming the replacement's own two-rank group.

Then the alternative rlharvest does not take: re-forming one gloo group of every rank (main
process + N nodes, a fresh store prefix), timed from the moment every process is waiting to join,
next to forming one two-rank group (what a replacement forms). Nothing here is a test: timings
depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from mocks import CountingPolicy  # noqa: E402

from rlharvest.collectors import MultiSyncCollector  # noqa: E402
from rlharvest.collectors.distributed import DistributedCollector, RPCCollector  # noqa: E402
from rlharvest.envs import CountingEnv  # noqa: E402
from rlharvest.transport.ports import free_port_block  # noqa: E402


def _collector(name: str):
    envs = [lambda: CountingEnv(max_steps=100)] * 2
    if name == "mp":
        return MultiSyncCollector(envs, CountingPolicy(), frames_per_batch=8, total_frames=-1)
    cls = DistributedCollector if name == "torchdist" else RPCCollector
    return cls(envs, CountingPolicy(), frames_per_batch=8, total_frames=-1, sync=True, launcher="mp",
               tcp_port=free_port_block(3))


def replace_costs(name: str, repeats: int) -> dict:
    collector = _collector(name)
    try:
        collector.next()
        collector.update_policy_weights_()
        seconds, groups = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            collector._replace_worker(1)
            seconds.append(time.perf_counter() - start)
            groups.append(getattr(collector._backend, "last_group_seconds", None))
            collector.next()  # the replacement collects
    finally:
        collector.shutdown()
    out = {"median": statistics.median(seconds), "min": min(seconds), "max": max(seconds)}
    if groups[0] is not None:
        out["own group"] = statistics.median(groups)
    return out


def _join(rank: int, world: int, port: int, prefix: str, ready, go) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, False, datetime.timedelta(seconds=60))
    ready.set()
    go.wait()
    group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world, datetime.timedelta(seconds=60))
    group.barrier().wait()  # every rank connected before anyone leaves


def group_cost(nodes: int, world_size: int) -> float:
    """Seconds for rank 0 and ``world_size - 1`` waiting processes to form one gloo group."""
    port = free_port_block(1)
    store = dist.TCPStore("127.0.0.1", port, nodes + 1, True, datetime.timedelta(seconds=60), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    readies = [ctx.Event() for _ in range(world_size - 1)]
    procs = [ctx.Process(target=_join, args=(rank, world_size, port, "regroup", readies[rank - 1], go))
             for rank in range(1, world_size)]
    for proc in procs:
        proc.start()
    for ready in readies:
        ready.wait(60)
    start = time.perf_counter()
    go.set()
    group = dist.ProcessGroupGloo(dist.PrefixStore("regroup", store), 0, world_size, datetime.timedelta(seconds=60))
    group.barrier().wait()
    elapsed = time.perf_counter() - start
    for proc in procs:
        proc.join(30)
    del group  # only once every rank is done connecting to it
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"replacing worker 1 of 2 (median of {args.repeats}, seconds)")
    for name in ("mp", "torchdist", "rpc"):
        costs = replace_costs(name, args.repeats)
        extra = f", of which its own group {costs['own group']:.3f}" if "own group" in costs else ""
        print(f"  {name:10s} {costs['median']:.3f} (range {costs['min']:.3f}-{costs['max']:.3f}){extra}")
    print("forming a gloo group once every process waits (median of 3, seconds)")
    for nodes in (2, 4):
        pair = statistics.median(group_cost(nodes, 2) for _ in range(3))
        world = statistics.median(group_cost(nodes, nodes + 1) for _ in range(3))
        print(f"  {nodes} nodes: one two-rank group {pair:.3f}; one group of every rank ({nodes + 1}) {world:.3f}")


if __name__ == "__main__":
    main()
