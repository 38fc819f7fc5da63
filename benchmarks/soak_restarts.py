"""Soak run of restarts: collection goes on while a worker is SIGKILLed again and again.

    .venv/bin/python benchmarks/soak_restarts.py [--frames 500000] [--kill-every 50000]
                                                  [--frames-per-batch 1000] [--collector sync|async]

Two worker processes (CountingEnv, a 1-parameter policy stepping the counter by 1), a weight update
after every batch, and worker ``k % 2`` SIGKILLed from outside once every ``--kill-every`` frames.
Then the same run without kills. Reported, for each run:

* frames lost or duplicated: every trajectory's observations must step by exactly 1 and the
  frames must add up to ``--frames`` (both checked on every batch; must be 0);
* resident memory of this process after warm-up (the first kill interval) and at the end;
* open file descriptors and shared-memory segments mapped by this process after warm-up, at the
  end and after shutdown;
* throughput (frames/s), and the kill run's against the clean run.

Not a test: timings depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from mocks import weight_policy  # noqa: E402

from rlharvest.collectors import MultiAsyncCollector, MultiSyncCollector  # noqa: E402
from rlharvest.envs import CountingEnv  # noqa: E402

_IDS = ("collector", "traj_ids")


class FrameChecker:
    """Counts frames that break the CountingEnv invariants: a step that is not +1 within its
    trajectory (a frame lost, or one seen twice)."""

    def __init__(self) -> None:
        self.last: dict[int, int] = {}
        self.bad = 0
        self.frames = 0

    def check(self, batch) -> None:
        rows = batch.reshape(-1, batch.shape[-1]) if batch.batch_dims > 1 else batch.unsqueeze(0)
        ids, obs = rows.get(_IDS), rows["observation"].reshape(rows.shape)
        same = ids[:, 1:] == ids[:, :-1]
        self.bad += int(((obs[:, 1:] - obs[:, :-1] != 1) & same).sum())  # inside a row, vectorised
        self.bad += int((ids == -1).sum())
        for row in range(rows.shape[0]):  # across batches: each row's first and last trajectory only
            first, value = int(ids[row, 0]), int(obs[row, 0])
            if first in self.last and self.last[first] != value - 1:
                self.bad += 1
            self.last[int(ids[row, -1])] = int(obs[row, -1])
        self.frames += batch.numel()


def shm_entries() -> int:
    """Shared-memory segments this process maps (``/dev/shm`` files, unlinked ones included)."""
    return sum(1 for m in psutil.Process().memory_maps(grouped=True) if m.path.startswith("/dev/shm"))


def run(args, kills: bool) -> dict:
    collector_class = MultiSyncCollector if args.collector == "sync" else MultiAsyncCollector
    policy = weight_policy(1.0)
    collector = collector_class([lambda: CountingEnv(max_steps=500)] * 2, policy,
                                frames_per_batch=args.frames_per_batch, total_frames=args.frames,
                                max_worker_restarts=10_000 if kills else 0)
    process, checker, killed = psutil.Process(), FrameChecker(), 0
    warm = None
    start = time.perf_counter()
    for batch in collector:
        checker.check(batch)
        collector.update_policy_weights_()
        if warm is None and checker.frames >= args.kill_every:
            warm = dict(rss=process.memory_info().rss, fds=process.num_fds(), shm=shm_entries())
        if checker.frames % args.kill_every < args.frames_per_batch:
            progress(collector.stats())
        if kills and checker.frames >= (killed + 1) * args.kill_every and checker.frames < args.frames:
            os.kill(collector._requests.handles[killed % 2].process.pid, signal.SIGKILL)
            killed += 1
    elapsed = time.perf_counter() - start
    restarts = collector.stats()["restarts"]
    end = dict(rss=process.memory_info().rss, fds=process.num_fds(), shm=shm_entries())
    collector.shutdown()
    after = dict(fds=process.num_fds(), shm=shm_entries())
    return dict(kills=killed, restarts=restarts, frames=checker.frames, bad=checker.bad, seconds=elapsed,
                fps=checker.frames / elapsed, warm=warm, end=end, after_shutdown=after)


def progress(stats: dict) -> None:
    """One line on stderr, from what ``stats()`` reports (cheap enough to read after every batch)."""
    print(f"  {stats['frames']:>8} frames, {stats.get('frames_per_s_recent', 0.0):7.0f} frames/s, "
          f"{stats['restarts']} restarts; env {stats['time_env_s']:.1f} s, policy {stats['time_policy_s']:.1f} s, "
          f"transport {stats['time_transport_s']:.1f} s, waiting {stats['time_waiting_s']:.1f} s; weight sync "
          f"{stats.get('weight_sync_s_median', 0.0) * 1e3:.2f} ms (median)", file=sys.stderr, flush=True)


def report(name: str, result: dict) -> None:
    warm, end, after = result["warm"], result["end"], result["after_shutdown"]
    mb = 1 / 2**20
    print(f"{name}: {result['frames']} frames in {result['seconds']:.1f} s ({result['fps']:.0f} frames/s), "
          f"{result['kills']} kills, {result['restarts']} restarts, {result['bad']} frames lost or duplicated")
    print(f"  RSS after warm-up {warm['rss'] * mb:.1f} MB, at the end {end['rss'] * mb:.1f} MB "
          f"(+{(end['rss'] - warm['rss']) * mb:.1f} MB)")
    print(f"  fds after warm-up {warm['fds']}, at the end {end['fds']}, after shutdown {after['fds']}; "
          f"shared-memory segments mapped {warm['shm']} / {end['shm']} / {after['shm']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=500_000)
    parser.add_argument("--kill-every", type=int, default=50_000)
    parser.add_argument("--frames-per-batch", type=int, default=1000)
    parser.add_argument("--collector", choices=("sync", "async"), default="sync")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with_kills = run(args, kills=True)
    report("with kills", with_kills)
    clean = run(args, kills=False)
    report("without kills", clean)
    print(f"throughput with kills: {with_kills['fps'] / clean['fps']:.1%} of the clean run")


if __name__ == "__main__":
    main()
