"""A stranger who reaches every port of a collector (docs/security.md), on loopback: it cannot pair
with the learner in a node's place, inject a batch, or exhaust the learner's descriptors or memory;
the collection goes on meanwhile.

The stranger runs in this process (a thread), with torch's own clients: it is what any local user
can run. Everything it sends goes to 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import threading

import fresh
import psutil
import pytest
import torch
import torch.distributed as dist
from mocks import CountingPolicy, check_trajectories, counting_env_7 as counting_env, wait_until, weight_policy
from process_check import process_gone

from rlharvest.collectors.distributed import DistributedCollector
from rlharvest.envs import CountingEnv
from rlharvest.transport.ports import free_port_block

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("zygote")]

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(os.path.dirname(HERE))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(TESTS), TESTS]), "TORCH_CPP_LOG_LEVEL": "ERROR"}


class Stranger:
    """Registers as rank 1 of the group of slot ``rank``'s ``generation``-th node in the store at
    ``port`` (the way torch's TCPStore rendezvous lets anyone), before that node exists.

    ``outcome``: ``"no store"`` (it could not even reach one), ``"paired"`` (the learner formed the
    group with it: the hijack) or ``"unpaired: ..."`` (the group never formed).
    """

    def __init__(self, port: int, rank: int, generation: int) -> None:
        self.port, self.rank, self.generation = port, rank, generation
        self.outcome: str | None = None
        self.registered = threading.Event()
        self.group = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self.registered.wait(60.0), "the stranger neither registered nor gave up"

    def _store(self):
        # A store on loopback answers in milliseconds; where there is none (the port speaks rlharvest's
        # channel), torch's client retries until this timeout (5 s here cost 5 s per stranger).
        return dist.TCPStore("127.0.0.1", self.port, None, False, datetime.timedelta(seconds=2))

    def _run(self) -> None:
        try:
            store, probe = self._store(), self._store()
        except Exception as err:  # nothing there speaks torch's store protocol
            self.outcome = f"no store ({type(err).__name__})"
            self.registered.set()
            return
        before = probe.num_keys()
        builder = threading.Thread(target=self._build, args=(store,), daemon=True)
        builder.start()
        try:
            wait_until(lambda: probe.num_keys() > before or not builder.is_alive(), 20.0, "the stranger's entry")
        finally:
            self.registered.set()
        builder.join(90.0)

    def _build(self, store) -> None:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=60)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        try:
            prefixed = dist.PrefixStore(f"group/{self.rank}/{self.generation}", store)
            self.group = dist.ProcessGroupGloo(prefixed, 1, 2, options)
            self.outcome = "paired"
        except RuntimeError as err:
            self.outcome = f"unpaired: {err}"

    def join(self) -> None:
        self._thread.join(90.0)


@pytest.fixture
def nodes():
    """Nodes started with a collector's join command; any still running at the end is killed."""
    started: list[fresh.FreshProcess | subprocess.Popen] = []
    yield started
    for node in started:
        if node.poll() is None:
            node.kill()
        node.wait(30.0)


def start_node(argv: list[str], started: list) -> fresh.FreshProcess:
    """The join command, forked from the session's zygote (tests/fresh.py)."""
    node = fresh.popen([sys.executable, *argv[1:]], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       text=True)
    started.append(node)
    return node


def test_a_stranger_registered_in_the_store_before_a_node_joins_does_not_pair_with_the_learner(nodes):
    """The hijack of issue 36: a stranger registers the rank of the next node to join; the learner
    must not take it as its peer, and the node that joins collects as usual."""
    collector = DistributedCollector([counting_env], weight_policy(1.0), launcher="external", tcp_port=0,
                                     bind_address="127.0.0.1", frames_per_batch=8, total_frames=32, sync=True)
    try:
        stranger = Stranger(int(collector.tcp_port), rank=1, generation=0)
        start_node(collector.join_command(), nodes)
        batches = [batch.clone() for batch in collector]
    finally:
        collector.shutdown()
    stranger.join()
    assert stranger.outcome != "paired", "a stranger on the store became the learner's peer"
    assert [tuple(b.shape) for b in batches] == [(1, 8)] * 4
    check_trajectories(batches, 32)


def test_a_stranger_registered_for_a_replacement_does_not_pair_with_the_learner():
    """The same for an ``"mp"`` replacement: the stranger registers the next generation of node 1's
    rank; node 1 is killed and replaced, and the replacement (not the stranger) collects."""
    policy = CountingPolicy(1.0)
    collector = DistributedCollector([lambda: CountingEnv(max_steps=1000)] * 2, policy, launcher="mp",
                                     tcp_port=free_port_block(3), frames_per_batch=20, total_frames=-1, sync=True,
                                     max_worker_restarts=1)
    try:
        assert (collector.next()["action"] == 1).all()
        stranger = Stranger(int(collector.tcp_port), rank=2, generation=1)
        victim = collector.worker_pids()[1]
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: process_gone(victim),
                   30.0, "the killed node's exit")
        for value in (2.0, 3.0):
            with torch.no_grad():
                policy.weight.fill_(value)
            collector.update_policy_weights_()
            batch = collector.next()
            assert (batch["action"] == value).all() and batch.shape[0] == 2
        assert collector.stats()["restarts"] == 1
    finally:
        collector.shutdown()
    stranger.join()
    assert stranger.outcome != "paired", "a stranger on the store became the replacement's group"


def learner_fds() -> int:
    return psutil.Process().num_fds()


def test_a_flood_on_every_port_exhausts_neither_descriptors_nor_memory(nodes):
    """Idle connections, connect-and-close loops and 7 MiB of garbage on every port the learner
    listens on while a node collects (the command port of nodes that join, open for the collector's
    life; gloo's ports close once their pair formed): the learner's descriptors and memory stay
    bounded, and the batches keep coming."""
    me = psutil.Process()

    def listening() -> set[int]:
        return {c.laddr.port for c in me.net_connections("inet") if c.status == "LISTEN"}

    before = listening()  # what earlier tests of this pytest process may still hold until collected
    collector = DistributedCollector([counting_env], weight_policy(1.0), launcher="external", tcp_port=0,
                                     bind_address="127.0.0.1", frames_per_batch=8, total_frames=-1, sync=True)
    clients: list[socket.socket] = []
    try:
        start_node(collector.join_command(), nodes)
        batches = iter(collector)
        next(batches)
        ports = sorted(listening() - before)
        assert ports == [int(collector.tcp_port)], ports  # gloo's ports closed after pairing
        fds, rss = learner_fds(), me.memory_info().rss
        blob = os.urandom(7 << 20)
        for port in ports:
            for _ in range(300):
                with_timeout = socket.socket()
                with_timeout.settimeout(0.5)
                try:
                    with_timeout.connect(("127.0.0.1", port))
                except OSError:
                    with_timeout.close()
                    continue
                clients.append(with_timeout)
            for _ in range(300):  # connect and close: a listener that kept these would leak them
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    pass
            for _ in range(20):
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                    sock.settimeout(1.0)
                    sock.sendall(blob)
        mine = len(clients)
        assert next(batches).shape == (1, 8)
        # the learner's own descriptors (beyond the test's client sockets): at most the handshakes in flight
        assert learner_fds() - mine - fds <= 40, (learner_fds(), mine, fds)
        assert me.memory_info().rss - rss < 64 << 20
        for sock in clients:
            sock.close()
        clients.clear()
        wait_until(lambda: learner_fds() <= fds + 10, 30.0, "the learner's descriptors to come back")
        assert next(batches).shape == (1, 8)
    finally:
        for sock in clients:
            sock.close()
        collector.shutdown()


def test_a_node_holding_the_key_gets_no_pickle_of_its_choosing_unpickled(nodes, tmp_path, caplog):
    """A node that joined with the key file (in place of a node that died) sends, as its READY
    reply, a pickle that would run a command in the learner: the learner refuses it, drops the node
    (one more restart), and collects with the next node that joins."""
    marker = tmp_path / "pwned"
    # the evil node sends no heartbeat after its reply: it is found dead after heartbeat_timeout
    collector = DistributedCollector([counting_env], weight_policy(1.0), launcher="external", tcp_port=0,
                                     bind_address="127.0.0.1", frames_per_batch=8, total_frames=-1, sync=True,
                                     max_worker_restarts=2, heartbeat_timeout=4.0)
    argv = collector.join_command()
    quiet = dict(env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # after the first death the evil node joins (tests/attackers.py), after the second a real one; both
    # forked from the session's zygote
    evil = [argv[5], argv[7], str(marker)]  # the collector's address, its key file, the marker
    joiners = iter([lambda: fresh.current().start("attackers:evil_ready_node", evil, **quiet),
                    lambda: fresh.popen(argv, **quiet)])

    class Restarts(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "restarting node" in record.getMessage():
                start = next(joiners, None)
                if start is not None:
                    nodes.append(start())

    handler = Restarts()
    logging.getLogger("rlharvest.restarts").addHandler(handler)
    try:
        start_node(argv, nodes)
        batches = iter(collector)
        assert next(batches).shape == (1, 8)
        nodes[0].kill()
        with caplog.at_level(logging.WARNING, logger="rlharvest"):
            for _ in range(3):
                assert next(batches).shape == (1, 8)
        stats = collector.stats()
    finally:
        logging.getLogger("rlharvest.restarts").removeHandler(handler)
        collector.shutdown()
    assert not marker.exists(), "a node made the learner run a command"
    assert "is refused: a pickle: the node runs an older rlharvest" in caplog.text
    assert stats["restarts"] == 2
