"""Nodes that join a running DistributedCollector from anywhere (``launcher="external"``, docs/elastic.md).

Every node here runs the collector's ``join_command()`` on loopback, forked from the session's zygote
(tests/fresh.py: the command's own process, without importing torch again); a node never started by the
collector is ended by the test (SIGKILL, SIGTERM) or exits when the collector shuts down.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import stat
import subprocess
import sys
import threading

import fresh
import psutil
import pytest
from mocks import check_trajectories, counting_env_7 as counting_env, wait_until, weight_policy

from rlharvest.collectors.distributed import DistributedCollector
from rlharvest.errors import WorkerTimeoutError

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("zygote")]


@pytest.fixture(autouse=True)
def started():
    """The nodes a test starts; any still running when it ends (it failed) is killed."""
    nodes: list[fresh.FreshProcess] = []
    _STARTED.append(nodes)
    yield nodes
    _STARTED.pop()
    for node in nodes:
        if node.poll() is None:
            node.kill()
            node.wait(30.0)


def make(count: int, **kwargs) -> DistributedCollector:
    return DistributedCollector([counting_env] * count, weight_policy(1.0), launcher="external", tcp_port=0,
                                bind_address="127.0.0.1", **kwargs)


_STARTED: list[list[fresh.FreshProcess]] = []


def start_node(argv: list[str], **popen) -> fresh.FreshProcess:
    """Run the join command: this interpreter, as the collector names it."""
    assert argv[:5] == [sys.executable, "-m", "rlharvest", "node", "--join"]
    node = fresh.popen(argv, **popen)
    _STARTED[-1].append(node)
    return node


def ended(nodes: list[fresh.FreshProcess], timeout: float = 60.0) -> list[int]:
    wait_until(lambda: all(node.poll() is not None for node in nodes), timeout, "the nodes' exit")
    return [node.returncode for node in nodes]


class Logged(logging.Handler):
    """Sets ``seen`` when a record of ``logger`` says ``what``."""

    def __init__(self, logger: str, what: str, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.what, self.seen, self.logger = what, threading.Event(), logging.getLogger(logger)
        self._level = self.logger.level
        if self.logger.getEffectiveLevel() > level:
            self.logger.setLevel(level)
        self.logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if self.what in record.getMessage():
            self.seen.set()

    def __enter__(self) -> "Logged":
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self._level)


def start_when(logged: Logged, argv: list[str], started: list) -> threading.Thread:
    """Start a node once ``logged`` saw its record (the collector then waits for a node to join)."""
    def run() -> None:
        if logged.seen.wait(120.0):
            started.append(start_node(argv))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_nodes_join_collect_and_a_node_too_many_or_without_the_key_is_refused(tmp_path, caplog, monkeypatch):
    from rlharvest.transport.torchdist_join import JoinService

    monkeypatch.setattr(JoinService, "SLOT_GRACE", 1.0)  # a node too many waits for a slot that long (5 s)
    collector = make(2, frames_per_batch=8, total_frames=32, sync=True)
    argv = collector.join_command()
    key_file = argv[-1]
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    with open(key_file) as handle:
        assert handle.read().strip() not in " ".join(argv)  # the key never is on a command line
    nodes = [start_node(argv) for _ in range(2)]
    wrong = tmp_path / "wrong"
    wrong.write_text(secrets.token_hex(32))  # another collector's key
    wrong.chmod(0o600)
    batches, refused = [], []
    with caplog.at_level(logging.WARNING, logger="rlharvest"):
        for batch in collector:
            batches.append(batch.clone())
            if len(batches) == 1:  # every slot is taken: a third node is refused, a stranger dropped
                refused = [start_node(argv, stderr=subprocess.PIPE, text=True),
                           start_node(argv[:-1] + [str(wrong)], stderr=subprocess.PIPE, text=True)]
                codes = ended(refused, 120.0)
                assert codes[0] == 3 and "refused this node" in refused[0].stderr.read()
                assert codes[1] == 5  # it refuses the collector: not the learner of its key
        stats = collector.stats()
    collector.shutdown()
    assert [tuple(b.shape) for b in batches] == [(2, 4)] * 4
    check_trajectories(batches, 32)
    assert (stats["workers"], stats["restarts"]) == (2, 0)
    assert ended(nodes) == [0, 0]
    assert not os.path.exists(key_file)
    log = caplog.text
    assert "refused: every slot is taken" in log and "dropped a connection" in log
    for node in refused:
        node.stderr.close()


def test_a_killed_node_is_replaced_by_the_next_join_and_a_leave_is_not_counted():
    collector = make(2, frames_per_batch=8, total_frames=64, sync=True, max_worker_restarts=1, preemption_grace=2.0)
    argv = collector.join_command()
    nodes = [start_node(argv) for _ in range(2)]
    batches, threads = [], []
    with Logged("rlharvest.restarts", "restarting node") as died, \
            Logged("rlharvest.restarts", "was preempted") as left:
        for batch in collector:
            batches.append(batch.clone())
            if len(batches) == 2:
                threads.append(start_when(died, argv, nodes))
                nodes[1].kill()
            if len(batches) == 4:
                wait_until(lambda: len(nodes) == 3, 60.0, "the replacement node's start")
                threads.append(start_when(left, argv, nodes))
                nodes[0].send_signal(signal.SIGTERM)
        stats = collector.stats()
    collector.shutdown()
    for thread in threads:
        thread.join(5.0)
    assert (stats["restarts"], stats["preemptions"], stats["workers"]) == (1, 1, 2)
    causes = sorted(stats[f"worker_{index}/restart_causes"] for index in (0, 1))
    assert causes[1].startswith("preempted: ") and not causes[0].startswith("preempted")  # one death, one leave
    assert [tuple(b.shape) for b in batches] == [(2, 4)] * 8
    check_trajectories(batches, 64)
    codes = ended(nodes)
    assert codes[1] == -signal.SIGKILL and codes[0] == codes[2] == codes[3] == 0


def test_shutdown_returns_once_the_nodes_that_joined_have_exited():
    """The collector cannot wait for a process of another host: a node keeps its command socket open
    until its process ends, and shutdown() waits (within its deadline) for the socket to close."""
    collector = make(2, frames_per_batch=8, total_frames=16, sync=True)
    nodes = [start_node(collector.join_command()) for _ in range(2)]
    try:
        assert sum(batch.numel() for batch in collector) == 16
    finally:
        collector.shutdown()
    running = [node.pid for node in nodes if _running(node.pid)]
    assert running == [], f"nodes still running when shutdown() returned: {running}"
    assert ended(nodes) == [0, 0]


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (an ended child not reaped yet by the zygote has ended)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_node_that_finds_every_slot_taken_takes_one_that_empties_within_the_grace():
    """The collector says it replaces a node a moment before it empties the slot: a node started on
    that word (or just before) must not be refused."""
    collector = make(1, frames_per_batch=4, total_frames=-1, sync=True, max_worker_restarts=1)
    argv = collector.join_command()
    first = start_node(argv)
    batches = iter(collector)
    assert next(batches).shape == (1, 4)
    with Logged("rlharvest", "waits up to 5 s for a slot", logging.INFO) as waiting:
        second = start_node(argv)
        assert waiting.seen.wait(60.0), "the second node was not told to wait"
    first.kill()
    assert [next(batches).shape for _ in range(2)] == [(1, 4)] * 2  # the death found, the second node took over
    stats = collector.stats()
    collector.shutdown()
    assert (stats["restarts"], stats["workers"]) == (1, 1)
    assert ended([first, second]) == [-signal.SIGKILL, 0]


def test_a_slot_left_empty_takes_the_next_node_that_joins():
    collector = make(2, frames_per_batch=8, total_frames=-1, sync=True)  # no restarts: a leave empties the slot
    argv = collector.join_command()
    nodes = [start_node(argv) for _ in range(2)]
    with Logged("rlharvest.restarts", "was preempted") as left:
        collector_iter = iter(collector)
        batches = [next(collector_iter).clone() for _ in range(2)]
        nodes[1].send_signal(signal.SIGTERM)
        wait_until(lambda: left.seen.is_set() or batches.append(next(collector_iter).clone()), 120.0, "the leave")
    with Logged("rlharvest", "joined slot", logging.INFO) as joined:
        nodes.append(start_node(argv))
        assert joined.seen.wait(120.0), "the new node did not join"
    batches += [next(collector_iter).clone() for _ in range(3)]
    stats = collector.stats()
    collector.shutdown()
    shapes = [tuple(b.shape) for b in batches]
    # the batch the leaving node was collecting is complete (it finished its rollout), those after its
    # leave hold one rollout, and once a node joined the empty slot, two again
    assert shapes[:2] == [(2, 4)] * 2 and shapes[-3:] == [(2, 4)] * 3 and set(shapes) <= {(2, 4), (1, 4)}
    assert (stats["preemptions"], stats["restarts"], stats["workers"]) == (1, 0, 2)
    check_trajectories(batches, sum(b.numel() for b in batches))
    assert ended(nodes) == [0, 0, 0]


def test_the_first_batch_waits_for_the_nodes_and_names_the_empty_slots(monkeypatch, caplog):
    from rlharvest.transport.torchdist_join import JoinService

    monkeypatch.setattr(JoinService, "LOG_EVERY", 0.5)  # every 10 s by default
    collector = make(3, frames_per_batch=6, total_frames=12, sync=True, worker_timeout=2.0)
    command = " ".join(collector.join_command())
    with caplog.at_level(logging.INFO, logger="rlharvest"):
        with pytest.raises(WorkerTimeoutError, match=r"no node joined slots \[0, 1, 2\] within 2 s"):
            next(iter(collector))
    collector.shutdown()
    waiting = [r.getMessage() for r in caplog.records if "waiting for nodes to join" in r.getMessage()]
    assert waiting and "slots [0, 1, 2]" in waiting[0] and waiting[0].endswith(command), waiting


def test_arguments_that_do_not_fit_joining_nodes_are_refused():
    with pytest.raises(ValueError, match="launcher must be one of"):
        DistributedCollector([counting_env], frames_per_batch=4, launcher="elsewhere")
    with pytest.raises(ValueError, match="backend in"):
        make(1, frames_per_batch=4, backend="mpi")
    with pytest.raises(ValueError, match="slurm_kwargs does not apply"):
        make(1, frames_per_batch=4, slurm_kwargs={"timeout_min": 5})
    collector = make(1, frames_per_batch=4)
    with pytest.raises(NotImplementedError, match="launcher='external'"):
        collector.add_collectors([counting_env])
    collector.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        collector.join_command()
