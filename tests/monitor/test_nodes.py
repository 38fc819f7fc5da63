"""A node started by hand says what it does (``rlharvest node``: one line per change of its state on
stderr; a node that finds no collector: tests/test_cli.py), the learner says it waits for nodes without any logging set up, and the monitor of a
``launcher="external"`` collector counts the nodes that joined and those refused (docs/monitoring.md,
docs/elastic.md). The nodes are real ``rlharvest node`` runs, forked from the session's zygote
(tests/fresh.py: the command's code, without an interpreter's ~3.5 s of imports each)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import fresh
import mocks
import pytest
from mocks import counting_env_7, wait_until, weight_policy
from scrape import scrape, value

from rlharvest.collectors.distributed import DistributedCollector
from rlharvest.collectors.engine.events import EventKind
from rlharvest.monitor import Monitor
from rlharvest.transport.torchdist_join import JoinService

pytestmark = pytest.mark.timeout(240)

TESTS = os.path.dirname(os.path.abspath(mocks.__file__))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(TESTS), TESTS])}


def said(stderr: str) -> list[str]:
    """What the node said, without the prefix (other lines, e.g. a library's warning, left out)."""
    return [line[len("rlharvest node: "):] for line in stderr.splitlines() if line.startswith("rlharvest node: ")]


@pytest.mark.usefixtures("zygote")
def test_joining_nodes_say_what_they_do_and_the_monitor_counts_joins_leaves_and_refusals(monkeypatch):
    # one slot: node a joins, leaves on SIGTERM, node b takes the slot back, node c finds it taken
    collector = DistributedCollector([counting_env_7], weight_policy(1.0), launcher="external", tcp_port=0,
                                     bind_address="127.0.0.1", frames_per_batch=8, total_frames=-1, sync=True,
                                     max_worker_restarts=1, preemption_grace=2.0)
    argv = collector.join_command()
    address = argv[5]
    nodes = [fresh.popen(argv, env=ENV, stderr=subprocess.PIPE, text=True)]
    try:
        with Monitor(collector) as monitor:
            batches = iter(collector)
            for _ in range(2):
                next(batches)
            nodes[0].send_signal(signal.SIGTERM)
            nodes.append(fresh.popen(argv, env=ENV, stderr=subprocess.PIPE, text=True))
            wait_until(lambda: next(batches) is None or collector.events.counts()[EventKind.JOIN] == 2, 120,
                       "node b taking the slot back")
            for _ in range(2):
                next(batches)
            # node c waits that long for a slot to empty before it is refused (5 s; node b kept the default:
            # node a may still hold the slot when b says hello)
            monkeypatch.setattr(JoinService, "SLOT_GRACE", 1.0)
            nodes.append(fresh.popen(argv, env=ENV, stderr=subprocess.PIPE, text=True))
            nodes[2].wait(120)  # refused once the slot stayed taken for JoinService.SLOT_GRACE seconds
            samples = scrape(monitor)
            assert value(samples, "rlharvest_joins_total") == 2
            assert value(samples, "rlharvest_joins_refused_total") == 1
            assert value(samples, "rlharvest_worker_preemptions_total") == 1
            assert value(samples, "rlharvest_worker_restarts_total") == 0  # a leave is not a failure
            assert value(samples, "rlharvest_workers_active") == 1
    finally:
        collector.shutdown()
        outputs = [node.stderr.read() for node in nodes]  # once each node ended (up to 120 s)
    assert [node.returncode for node in nodes] == [0, 0, 3]
    joined = [f"connecting to {address}", f"joined as node 0 of 1 ({address})", "collecting as node 0"]
    assert said(outputs[0]) == joined + ["left the collector on SIGTERM (preempted), after its rollout: exiting"]
    assert said(outputs[1]) == joined + ["the collector closed this node (it shut down, or removed this node): "
                                         "exiting"]
    assert said(outputs[2]) == [f"connecting to {address}",
                                f"the collector at {address} refused this node: every slot is taken."]


def test_the_learner_warns_that_it_waits_for_nodes_without_any_logging_set_up():
    script = textwrap.dedent("""
        from mocks import counting_env_7, weight_policy
        from rlharvest.collectors.distributed import DistributedCollector
        from rlharvest.errors import WorkerTimeoutError
        from rlharvest.transport.torchdist_join import JoinService

        JoinService.WARN_AFTER = 0.5  # said after 3 s by default: the wait below need not be longer than that
        collector = DistributedCollector([counting_env_7] * 2, weight_policy(1.0), launcher="external", tcp_port=0,
                                         bind_address="127.0.0.1", frames_per_batch=8, total_frames=16,
                                         worker_timeout=2.0)
        print(" ".join(collector.join_command()), flush=True)
        try:
            next(iter(collector))
        except WorkerTimeoutError:
            pass
        collector.shutdown()
    """)
    run = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    waiting = [line for line in run.stderr.splitlines() if "waiting for nodes to join" in line]
    assert len(waiting) == 1, run.stderr  # said once, at WARNING (Python's last resort prints it)
    assert "slots [0, 1]" in waiting[0] and waiting[0].endswith(run.stdout.strip())
