"""What reconfiguring the envs of a running collector costs: ``setattr_env`` against rebuilding the
collector, TorchRL 0.14.1's only way (docs/collection.md, "Reconfiguring running envs").

    .venv/bin/python benchmarks/reconfigure.py [--workers 16] [--calls 30] [--rebuilds 2]
        [--torchrl-python /work/main/.venv-torchrl14/bin/python]

Both sides run a ``MultiSyncCollector`` of ``--workers`` worker processes stepping a cheap counting
env (rlharvest's ``CountingEnv``, TorchRL's own ``CountingEnv`` of ``torchrl.testing``), one batch
collected before anything is measured. rlharvest: the median of ``--calls`` calls of
``setattr_env("max_steps", k)`` (each returns once every worker has it). TorchRL: the median of
``--rebuilds`` rebuilds (shut the collector down, build it again with the new env argument, collect its
first batch), in a subprocess of the TorchRL venv. Printed: both medians, their ratio, and the load
average before and after (the machine is shared: a ratio measured in one run is the figure to read).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from rlharvest.collectors import MultiSyncCollector  # noqa: E402
from rlharvest.envs import CountingEnv  # noqa: E402

TORCHRL_PYTHON = "/work/main/.venv-torchrl14/bin/python"

#: the TorchRL side, run in its own venv: prints the median rebuild in milliseconds
TORCHRL_SIDE = textwrap.dedent('''
    import os, statistics, sys, time
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    torch.set_num_threads(1)
    from torchrl.collectors import MultiSyncCollector
    from torchrl.envs.utils import RandomPolicy
    from torchrl.testing.mocking_classes import CountingEnv

    def make_env(max_steps):
        return CountingEnv(max_steps=max_steps)

    def build(workers, max_steps):
        import functools
        env = make_env(max_steps)
        collector = MultiSyncCollector([functools.partial(make_env, max_steps)] * workers,
                                       RandomPolicy(env.action_spec), frames_per_batch=4 * workers,
                                       total_frames=-1)
        next(iter(collector))
        return collector

    if __name__ == "__main__":
        workers, rebuilds = int(sys.argv[1]), int(sys.argv[2])
        collector = build(workers, 100)
        seconds = []
        for k in range(rebuilds):
            start = time.perf_counter()
            collector.shutdown()
            collector = build(workers, 101 + k)
            seconds.append(time.perf_counter() - start)
        collector.shutdown()
        print(1000 * statistics.median(seconds))
''')


def rlharvest_median_ms(workers: int, calls: int) -> float:
    collector = MultiSyncCollector([CountingEnv] * workers, frames_per_batch=4 * workers, total_frames=-1)
    try:
        collector.next()
        seconds = []
        for k in range(calls):
            start = time.perf_counter()
            collector.setattr_env("max_steps", 100 + k)
            seconds.append(time.perf_counter() - start)
        assert collector.call_env("__getattribute__", "max_steps") == [100 + calls - 1] * workers
        collector.next()
        return 1000 * statistics.median(seconds)
    finally:
        collector.shutdown()


def torchrl_median_ms(python: str, workers: int, rebuilds: int) -> float:
    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "torchrl_rebuild.py")
        with open(script, "w") as file:
            file.write(TORCHRL_SIDE)
        done = subprocess.run([python, script, str(workers), str(rebuilds)], capture_output=True, text=True,
                              timeout=1800, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--rebuilds", type=int, default=2)
    parser.add_argument("--torchrl-python", default=TORCHRL_PYTHON)
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    ours = rlharvest_median_ms(args.workers, args.calls)
    print(f"rlharvest setattr_env, {args.workers} workers: median {ours:.1f} ms over {args.calls} calls", flush=True)
    theirs = torchrl_median_ms(args.torchrl_python, args.workers, args.rebuilds)
    load_after = os.getloadavg()
    print(f"TorchRL 0.14.1 rebuild, {args.workers} workers: median {theirs:.0f} ms over {args.rebuilds} rebuilds")
    print(f"ratio (rebuild / setattr_env): {theirs / ours:.0f}x; goal setattr_env <= 50 ms: "
          f"{'met' if ours <= 50 else 'not met'}")
    print(f"load average (1, 5, 15 min) before {load_before[0]:.1f} {load_before[1]:.1f} {load_before[2]:.1f}, "
          f"after {load_after[0]:.1f} {load_after[1]:.1f} {load_after[2]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
