"""The screenshot of docs/monitoring.md (docs/img/monitor.png): a MultiSyncCollector of three workers
with autoscaling, weight updates after every batch and a worker killed on purpose, seen in the session
browser of the page tests (tests/browser.py) after ~25 s.

Run from the repository's root: ``.venv/bin/python tests/monitor/screenshot.py [OUT.png]``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

from browser import Browser  # noqa: E402
from mocks import SlowCountingEnv, weight_policy  # noqa: E402

from rlharvest.collectors import Autoscale, MultiSyncCollector  # noqa: E402
from rlharvest.collectors.engine import engine_of  # noqa: E402
from rlharvest.monitor import Monitor  # noqa: E402


def env():
    return SlowCountingEnv(max_steps=50, delay=0.002)


def main(out: str = "docs/img/monitor.png", seconds: float = 25.0) -> None:
    torch.set_num_threads(1)
    collector = MultiSyncCollector([env] * 3, weight_policy(1.0), frames_per_batch=120, total_frames=-1,
                                   max_worker_restarts=2, autoscale=Autoscale(2, 4, window=6, cooldown=6))
    browser = Browser()
    try:
        browser.driver.set_window_size(1366, 900)  # a laptop screen
        with Monitor(collector) as monitor:
            batches = iter(collector)
            next(batches)
            browser.driver.get(monitor.url)
            start, killed = time.monotonic(), False
            while time.monotonic() - start < seconds:
                next(batches)
                time.sleep(0.01)  # the learner's work
                collector.update_policy_weights_()
                if not killed and time.monotonic() - start > seconds / 2:
                    killed = True
                    os.kill(engine_of(collector).fleet.requests.handles[1].process.pid, signal.SIGKILL)
            time.sleep(1.0)  # two polls of the page
            browser.driver.save_screenshot(out)
    finally:
        browser.quit()
        collector.shutdown()
    print(f"wrote {out}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
