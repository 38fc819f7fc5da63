"""What one ``collector.stats()`` call costs, next to one batch.

    .venv/bin/python benchmarks/stats_cost.py [--calls 20000]

For ``Collector``, ``MultiSyncCollector`` and ``MultiAsyncCollector`` (2 workers, CountingEnv,
a 1-parameter policy), after 50 batches and 64 weight updates (so every key is there: throughput,
time split, weight-sync latency, restarts): microseconds per ``stats()`` call (the default,
``workers="aggregate"``: no worker is asked), median of 5 rounds of ``--calls`` calls, next to the
microseconds one batch of 100 frames takes. Nothing here is a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from mocks import weight_policy  # noqa: E402

from rlharvest.collectors import Collector, MultiAsyncCollector, MultiSyncCollector  # noqa: E402
from rlharvest.envs import CountingEnv  # noqa: E402


def _per_call_us(function, calls: int) -> float:
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            function()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(rounds)


def measure(collector_class, calls: int) -> dict:
    envs = CountingEnv if collector_class is Collector else [CountingEnv] * 2
    collector = collector_class(envs, weight_policy(1.0), frames_per_batch=100, total_frames=-1)
    try:
        for _ in range(5):
            collector.next()
        start = time.perf_counter()
        for _ in range(50):
            collector.next()
        batch_us = (time.perf_counter() - start) / 50 * 1e6
        for _ in range(64):
            collector.update_policy_weights_()
        stats_us = _per_call_us(collector.stats, calls)
        keys = len(collector.stats())
    finally:
        collector.shutdown()
    return {"collector": collector_class.__name__, "stats_us": stats_us, "keys": keys, "batch_us": batch_us}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for collector_class in (Collector, MultiSyncCollector, MultiAsyncCollector):
        row = measure(collector_class, args.calls)
        print(f"{row['collector']:<20} stats(): {row['stats_us']:6.1f} us ({row['keys']} keys); one batch of 100 "
              f"frames: {row['batch_us']:8.1f} us -> {100 * row['stats_us'] / row['batch_us']:.2f} % of a batch")


if __name__ == "__main__":
    main()
