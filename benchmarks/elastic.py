"""What elastic collection costs (docs/elastic.md): adding and removing workers, and preemptions.

    /work/main/.venv/bin/python benchmarks/elastic.py [--repeats 3] [--rounds 2] [--seconds 30]
        [--only calls|preemptions] [--backends MultiSyncCollector ... RayCollector]

(a) Seconds for ``add_collectors([env])`` and ``remove_collectors([i])`` to return on a running
collector (2 workers, CountingEnv, a 1-parameter policy, ``launcher="mp"`` for nodes), median and
range over ``--repeats``: each repeat adds one worker, collects a batch, removes it, collects a
batch. ``DistributedCollector`` nodes cannot be added (``NotImplementedError``): only their removal
is timed (a third node is started with the collector for each removal instead).

(b) Frames/s of a 2-node async ``DistributedCollector`` (``launcher="mp"``,
``max_worker_restarts=10``) while 10 SIGTERMs, spaced over ``--seconds``, preempt a node (each
replaced through the launcher), against the same run with no preemption; the two variants
alternate, ``--rounds`` times each, in one run, after a warm-up run that is not reported. The load
average is printed before each run: this machine is shared, compare figures of the same run only.
Nothing here is a test.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

TESTS = str(Path(__file__).resolve().parents[1] / "tests")
sys.path.insert(0, TESTS)

from mocks import CountingPolicy  # noqa: E402

from rlharvest.collectors import MultiAsyncCollector, MultiSyncCollector  # noqa: E402
from rlharvest.collectors.distributed import DistributedCollector, RayCollector, RPCCollector  # noqa: E402
from rlharvest.envs import CountingEnv  # noqa: E402
from rlharvest.transport.ports import free_port_block  # noqa: E402

BACKENDS = ("MultiSyncCollector", "MultiAsyncCollector", "DistributedCollector", "RPCCollector", "RayCollector")


def make_env() -> CountingEnv:
    return CountingEnv(max_steps=100)


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _collector(name: str, workers: int = 2):
    envs = [make_env] * workers
    kwargs = {"frames_per_batch": 8 * workers, "total_frames": -1}
    if name == "MultiSyncCollector":
        return MultiSyncCollector(envs, CountingPolicy(), **kwargs)
    if name == "MultiAsyncCollector":
        return MultiAsyncCollector(envs, CountingPolicy(), **kwargs)
    if name == "RayCollector":
        return RayCollector(envs, CountingPolicy(), sync=True, remote_configs={"num_cpus": 0.5}, **kwargs)
    cls = DistributedCollector if name == "DistributedCollector" else RPCCollector
    return cls(envs, CountingPolicy(), sync=True, launcher="mp", tcp_port=free_port_block(3), **kwargs)


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def call_times(name: str, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds of each ``add_collectors`` and ``remove_collectors`` (adds are empty where nodes cannot join)."""
    adds, removes = [], []
    if name == "DistributedCollector":  # no add_collectors: a collector of 3 nodes per removal
        for _ in range(repeats):
            collector = _collector(name, 3)
            try:
                collector.next()
                start = time.perf_counter()
                collector.remove_collectors([2])
                removes.append(time.perf_counter() - start)
                collector.next()
            finally:
                collector.shutdown()
        return adds, removes
    collector = _collector(name)
    try:
        collector.next()
        for _ in range(repeats):
            start = time.perf_counter()
            collector.add_collectors([make_env])
            adds.append(time.perf_counter() - start)
            collector.next()
            start = time.perf_counter()
            collector.remove_collectors([collector.active_workers[-1]])
            removes.append(time.perf_counter() - start)
            collector.next()
    finally:
        collector.shutdown()
    return adds, removes


def preemption_run(preempt: bool, seconds: float, count: int = 10) -> dict:
    """Frames/s of a 2-node async DistributedCollector over ``seconds``, with ``count`` SIGTERMs to a
    node spaced evenly (``preempt``) or none."""
    collector = DistributedCollector([make_env] * 2, CountingPolicy(), frames_per_batch=50, total_frames=-1,
                                     sync=False, launcher="mp", tcp_port=free_port_block(3), max_worker_restarts=10,
                                     preemption_grace=2.0)
    sent = 0
    try:
        collector.next()  # both nodes up and collecting
        frames, start = 0, time.perf_counter()
        interval = seconds / (count + 1)
        for batch in collector:
            frames += batch.numel()
            now = time.perf_counter() - start
            if now >= seconds:
                break
            if preempt and sent < count and now >= interval * (sent + 1):
                pid = collector.worker_pids()[sent % 2]
                if pid is not None:
                    os.kill(pid, signal.SIGTERM)
                    sent += 1
        elapsed = time.perf_counter() - start
        stats = collector.stats()
    finally:
        collector.shutdown()
    return {"fps": frames / elapsed, "sent": sent, "preemptions": stats["preemptions"], "restarts": stats["restarts"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--only", choices=("calls", "preemptions"))
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("rlharvest.restarts").setLevel(logging.ERROR)  # one warning per preemption
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores")
    if args.only != "preemptions":
        if "RayCollector" in args.backends:
            import ray

            # actors import the policy's module (tests/mocks.py) by name
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))
            ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2, log_to_driver=False)
        print(f"\n(a) seconds to return, 1 worker, median (range) of {args.repeats}")
        print(f"{'collector':22s} {'add_collectors':>22s} {'remove_collectors':>22s}  load before")
        for name in args.backends:
            before = load()
            adds, removes = call_times(name, args.repeats)
            add = _spread(adds) if adds else "n/a (cannot add)"
            print(f"{name:22s} {add:>22s} {_spread(removes):>22s}  {before}", flush=True)
    if args.only != "calls":
        print(f"\n(b) 2-node async DistributedCollector, {args.seconds:g} s per run, frames/s")
        print(f"{'run':28s} {'frames/s':>10s} {'SIGTERMs':>9s} {'preemptions':>12s} {'restarts':>9s}  load before")
        # not reported: the first collector with restarts starts the forkserver replacements come
        # from, seconds of CPU importing torch in the background that would weigh on the first run
        preemption_run(True, min(10.0, args.seconds), count=2)
        results: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for preempt in (False, True):
                before = load()
                run = preemption_run(preempt, args.seconds)
                results[preempt].append(run["fps"])
                label = "10 preemptions, replaced" if preempt else "no preemption"
                print(f"{label:28s} {run['fps']:10.0f} {run['sent']:9d} {run['preemptions']:12d} "
                      f"{run['restarts']:9d}  {before}", flush=True)
        ratio = statistics.median(results[True]) / statistics.median(results[False])
        print(f"median with preemptions / without: {ratio:.2f}")


if __name__ == "__main__":
    main()
