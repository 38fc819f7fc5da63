"""The monitor's page in a real browser (headless Chromium, tests/browser.py): one row per active worker,
the frames growing without a reload, a killed worker's restart in its row and in the timeline, an
autoscale decision with its reason, and a DistributedCollector's nodes (docs/monitoring.md)."""

from __future__ import annotations

import os
import signal
import socket

import pytest
from mocks import SlowCountingEnv, counting_env_7, wait_until, weight_policy
from process_check import process_gone

from rlharvest.collectors import Autoscale, MultiAsyncCollector, MultiSyncCollector
from rlharvest.collectors.distributed import DistributedCollector
from rlharvest.collectors.engine import engine_of
from rlharvest.monitor import Monitor

# one Chromium per pytest process: these tests run in one process under ``-n 2 --dist loadgroup``
pytestmark = [pytest.mark.timeout(180), pytest.mark.xdist_group("browser")]

#: what the page shows, read in one call
READ_PAGE = """
const cell = (row, name) => row.querySelector(`[data-field="${name}"]`).textContent;
return {
  frames: document.querySelector('[data-metric="frames"]').textContent,
  rows: [...document.querySelectorAll('tr[data-worker]')].map((row) => ({
    index: row.dataset.worker, host: cell(row, 'host'), state: cell(row, 'state'), frames: cell(row, 'frames'),
    restarts: cell(row, 'restarts')})),
  events: [...document.querySelectorAll('#timeline [data-event]')].map((item) => [item.dataset.event, item.textContent]),
  status: document.getElementById('status').dataset.state,
  marker: window.rlhMarker || null,
};
"""


class Page:
    """The monitor's page loaded once in the session's browser."""

    def __init__(self, browser, monitor: Monitor) -> None:
        self.driver = browser.driver
        self.driver.get(monitor.url)
        self.driver.execute_script("window.rlhMarker = 'loaded once'")  # a reload would lose it

    def read(self) -> dict:
        return self.driver.execute_script(READ_PAGE)

    def wait(self, condition, what: str, timeout: float = 30.0) -> dict:
        seen: list[dict] = []

        def holds() -> bool:
            seen[:] = [self.read()]
            return condition(seen[0])

        wait_until(holds, timeout, lambda: f"{what} (the page shows {seen[-1] if seen else None})")
        assert seen[0]["marker"] == "loaded once", "the page was reloaded"
        return seen[0]


def test_one_row_per_worker_and_the_frames_grow_without_a_reload(browser, tmp_path):
    collector = MultiSyncCollector([counting_env_7] * 3, weight_policy(1.0), frames_per_batch=12, total_frames=-1)
    batches = iter(collector)
    with Monitor(collector) as monitor:
        next(batches)
        page = Page(browser, monitor)
        shown = page.wait(lambda p: len(p["rows"]) == 3 and p["frames"] == "12", "three rows and 12 frames")
        assert [row["index"] for row in shown["rows"]] == ["0", "1", "2"]
        assert {row["host"] for row in shown["rows"]} == {socket.gethostname()}
        assert {row["state"] for row in shown["rows"]} == {"collecting"} and shown["status"] == "running"
        for _ in range(4):
            next(batches)
            collector.update_policy_weights_()
        page.wait(lambda p: p["frames"] == "60" and [r["frames"] for r in p["rows"]] == ["20"] * 3, "60 frames")
        browser.driver.save_screenshot(str(tmp_path / "monitor.png"))
        assert (tmp_path / "monitor.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    collector.shutdown()


def test_a_killed_workers_restart_shows_in_its_row_and_the_timeline(browser):
    collector = MultiSyncCollector([counting_env_7] * 2, weight_policy(1.0), frames_per_batch=8, total_frames=-1,
                                   max_worker_restarts=1)
    batches = iter(collector)
    with Monitor(collector) as monitor:
        next(batches)
        page = Page(browser, monitor)
        page.wait(lambda p: len(p["rows"]) == 2 and p["frames"] == "8", "two rows")
        pid = engine_of(collector).fleet.requests.handles[1].process.pid
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: process_gone(pid), 10, f"worker 1 (pid {pid}) gone")
        wait_until(lambda: next(batches) is None or collector.events.counts()["restart"] == 1, 60, "the restart")
        # the page polls twice a second: the restart shows at its next poll
        shown = page.wait(lambda p: [r["restarts"] for r in p["rows"]] == ["0", "1"]
                          and any(kind == "restart" for kind, _ in p["events"]), "the restart")
        [restart] = [text for kind, text in shown["events"] if kind == "restart"]
        assert "restarting worker 1" in restart and "died" in restart
    collector.shutdown()


def test_an_autoscale_decision_shows_in_the_timeline_with_its_reason(browser):
    def slow_env():
        return SlowCountingEnv(max_steps=7, delay=0.01)

    lenient = {"window": 4, "cooldown": 4, "grow_above": 0.5, "shrink_below": 0.3}  # test_autoscale_workers.py
    collector = MultiAsyncCollector([slow_env], weight_policy(1.0), frames_per_batch=12, total_frames=-1,
                                    autoscale=Autoscale(1, 3, **lenient))
    batches = iter(collector)
    with Monitor(collector) as monitor:
        next(batches)
        page = Page(browser, monitor)
        page.wait(lambda p: len(p["rows"]) == 1, "one row")
        wait_until(lambda: next(batches) is None or collector.events.counts()["autoscale"] >= 1, 60, "a decision")
        shown = page.wait(lambda p: any(kind == "autoscale" for kind, _ in p["events"]) and len(p["rows"]) == 2,
                          "the decision and the added worker's row")
        [decision] = [text for kind, text in shown["events"] if kind == "autoscale"]
        assert "add workers [1]" in decision and "why: learner_wait" in decision
    collector.shutdown()


def test_a_distributed_collectors_nodes_have_their_rows(browser):
    collector = DistributedCollector([counting_env_7] * 2, weight_policy(1.0), launcher="mp", tcp_port=0,
                                     bind_address="127.0.0.1", frames_per_batch=8, total_frames=-1, sync=True)
    batches = iter(collector)
    with Monitor(collector) as monitor:
        next(batches)
        page = Page(browser, monitor)
        page.wait(lambda p: [r["index"] for r in p["rows"]] == ["0", "1"] and p["frames"] == "8", "two rows")
        for _ in range(3):
            next(batches)
        shown = page.wait(lambda p: p["frames"] == "32", "32 frames")
        assert [row["frames"] for row in shown["rows"]] == ["16", "16"]
        assert [row["host"] for row in shown["rows"]] == [socket.gethostname()] * 2
    collector.shutdown()
