"""What watching a collector costs it: frames/s of a ``MultiSyncCollector`` with and without a
``Monitor`` whose page is open in headless Chromium (polling twice a second) while another process
scrapes ``/metrics`` every 100 ms, as Prometheus would (docs/performance.md, "The monitor").

    .venv/bin/python benchmarks/monitor_cost.py [--pairs 6] [--seconds 4] [--workers 2]

Rounds without and with the monitor alternate in one run (each pair in a random order), each measured
after a second of warm-up; the median of the per-pair ratios is the figure (and the ratio of the medians),
with the machine's load average beside it, the CPU the browser and the scraper used (the watchers' own
load on this machine), and the CPU time one ``/metrics`` and one ``/api/stats`` answer take in the
learner's process. Needs Debian's chromium and chromium-driver (tests/browser.py). Nothing here is a test.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))

from browser import Browser  # noqa: E402
from mocks import weight_policy  # noqa: E402

from rlharvest.collectors import MultiSyncCollector  # noqa: E402
from rlharvest.envs import CountingEnv  # noqa: E402
from rlharvest.monitor import Monitor  # noqa: E402

#: the scraping process: GET /metrics every 100 ms until its stdin closes (bounded: at most 10 minutes)
SCRAPER = """
import sys, threading, time, urllib.request
url, stop = sys.argv[1], threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
start, scrapes = time.monotonic(), 0
while not stop.is_set() and time.monotonic() < start + 600:
    urllib.request.urlopen(url, timeout=5).read()
    scrapes += 1
    stop.wait(max(0.0, start + 0.1 * scrapes - time.monotonic()))  # one every 100 ms
print(scrapes)
"""


def frames_per_s(collector, batches, seconds: float) -> float:
    """Frames per second of ``batches`` over ``seconds``, after one second of warm-up."""
    warm = time.monotonic() + 1.0
    while time.monotonic() < warm:
        next(batches)
    start, frames = time.monotonic(), 0
    while time.monotonic() - start < seconds:
        frames += next(batches).numel()
    return frames / (time.monotonic() - start)


def _cpu_seconds(processes: list) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def watched_round(collector, batches, browser: Browser, seconds: float) -> tuple[float, float, float]:
    """Frames per second while the page polls and a process scrapes; the scrapes per second; and the
    share of one core the browser and the scraper used meanwhile (the watchers' own load on this machine)."""
    with Monitor(collector) as monitor:
        browser.driver.get(monitor.url)
        scraper = subprocess.Popen([sys.executable, "-c", SCRAPER, monitor.url + "metrics"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
        watchers = psutil.Process(browser.service.process.pid).children(recursive=True) + [psutil.Process(scraper.pid)]
        start, cpu = time.monotonic(), _cpu_seconds(watchers)
        try:
            rate = frames_per_s(collector, batches, seconds)
            watching = (_cpu_seconds(watchers) - cpu) / (time.monotonic() - start)
        finally:
            out, _ = scraper.communicate("", timeout=30)
        scraped = int(out.strip() or 0) / (time.monotonic() - start)
        browser.driver.get("about:blank")
    return rate, scraped, watching


def request_costs(collector, calls: int = 300) -> tuple[float, float]:
    """Milliseconds of CPU time (this thread's: what a busy machine does not inflate) one ``/metrics``
    and one ``/api/stats`` answer take to build (each a fresh read of the collector: no read shared),
    median of 3 rounds of ``calls``."""
    from prometheus_client.exposition import generate_latest

    with Monitor(collector) as monitor:
        monitor.reader.max_age = 0.0
        costs = []
        for build in (lambda: generate_latest(monitor.registry), lambda: monitor.stats_json(0)):
            rounds = []
            for _ in range(3):
                start = time.thread_time()
                for _ in range(calls):
                    build()
                rounds.append((time.thread_time() - start) / calls * 1e3)
            costs.append(statistics.median(rounds))
    return costs[0], costs[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--frames-per-batch", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    collector = MultiSyncCollector([CountingEnv] * args.workers, weight_policy(1.0),
                                   frames_per_batch=args.frames_per_batch, total_frames=-1)
    browser = Browser()
    plain, watched, scrapes, watchers = [], [], [], []
    load_before = os.getloadavg()
    try:
        batches = iter(collector)
        next(batches)
        for _ in range(16):  # the weight-update histogram is part of every answer, as in a training run
            collector.update_policy_weights_()
        for pair in range(args.pairs):
            order = ["plain", "watched"]
            random.Random(pair).shuffle(order)
            for kind in order:
                if kind == "plain":
                    plain.append(frames_per_s(collector, batches, args.seconds))
                else:
                    rate, scraped, watching = watched_round(collector, batches, browser, args.seconds)
                    watched.append(rate)
                    scrapes.append(scraped)
                    watchers.append(watching)
            print(f"pair {pair + 1}: without {plain[-1]:,.0f} frames/s, with the monitor {watched[-1]:,.0f} "
                  f"frames/s ({scrapes[-1]:.1f} scrapes/s; browser and scraper {100 * watchers[-1]:.0f} % of a "
                  f"core)", flush=True)
        metrics_ms, api_ms = request_costs(collector)
    finally:
        browser.quit()
        collector.shutdown()
    load_after = os.getloadavg()
    ratio = statistics.median(watched) / statistics.median(plain)
    pairs = [w / p for w, p in zip(watched, plain)]
    print(f"one /metrics answer: {metrics_ms:.2f} ms, one /api/stats answer: {api_ms:.2f} ms of CPU in the learner's "
          f"process; 10 scrapes and 2 polls a second: {(10 * metrics_ms + 2 * api_ms) / 10:.2f} % of one core")
    print(f"MultiSyncCollector, {args.workers} workers, CountingEnv, {args.frames_per_batch} frames per batch: "
          f"median without {statistics.median(plain):,.0f} frames/s, with the monitor "
          f"{statistics.median(watched):,.0f} frames/s -> ratio {ratio:.3f} ({100 * (1 - ratio):+.1f} % lost); "
          f"median of the per-pair ratios {statistics.median(pairs):.3f} (each pair ran within ~10 s: what a "
          f"changing load moves less), per pair {[round(pair, 3) for pair in pairs]}; load average "
          f"{load_before[0]:.1f} before, {load_after[0]:.1f} after ({os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
