"""Strangers for the attack tests (docs/security.md): what any local user can run against a collector.

* :class:`Squatter`: idle connections to a port from several loopback addresses, each retaken as
  soon as the listener closes it (:func:`squatter_process`: in a process of its own);
* :class:`PortFlooder`: waits for a process to listen on a new port (gloo's, while a pair forms)
  and opens many connections to it;
* :func:`marking_env`: an env constructor that leaves a file behind when another process runs it
  (proof that an impostor's spec ran in a node);
* :func:`evil_ready_node`: a node holding the key file whose READY reply is a pickle that would run a
  command in the learner; :func:`slow_join_node`: the join command on a busy host (both run in a
  process forked from the session's zygote: tests/fresh.py).
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading

import psutil
from mocks import wait_until

from rlharvest.envs import CountingEnv


class Squatter:
    """One process holding ``count`` idle connections to ``port`` from the loopback addresses
    ``sources``, retaking each one as soon as the listener closes it."""

    def __init__(self, port: int, sources: list[str], count: int) -> None:
        self.port, self.sources = port, sources
        self.sockets = [self._connect(sources[index % len(sources)]) for index in range(count)]
        self.retaken = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._hold, daemon=True)
        self._thread.start()

    def _connect(self, source: str) -> socket.socket:
        sock = socket.socket()
        sock.bind((source, 0))
        sock.connect(("127.0.0.1", self.port))
        return sock

    def _hold(self) -> None:
        while not self._stop.is_set():
            readable, _, _ = select.select(self.sockets, [], [], 0.01)
            for sock in readable:
                try:
                    if sock.recv(4096):
                        continue  # the greeting: stay silent
                except OSError:
                    pass
                source = sock.getsockname()[0]
                sock.close()
                self.sockets[self.sockets.index(sock)] = self._retake(source)
                self.retaken += 1

    def _retake(self, source: str) -> socket.socket:
        while True:  # as long as it takes (the listener is busy, the kernel out of ports a moment)
            try:
                return self._connect(source)
            except OSError:
                if self._stop.wait(0.01):
                    raise

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        for sock in self.sockets:
            sock.close()


SQUATTER = """
import sys
from attackers import Squatter
from mocks import wait_until
squatter = Squatter(int(sys.argv[1]), sys.argv[3:], int(sys.argv[2]))
wait_until(lambda: squatter.retaken >= int(sys.argv[2]), 30.0, "the squatter to retake its slots")
print("ready", flush=True)
sys.stdin.read()  # until the test closes it
squatter.close()
"""


def squatter_process(port: int, sources: list[str], count: int, env: dict):
    """A :class:`Squatter` in a process of its own (a stranger shares no interpreter with the learner),
    ready once it retook as many connections as it holds; it stops when its stdin closes."""
    process = subprocess.Popen([sys.executable, "-c", SQUATTER, str(port), str(count), *sources], env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready", "the squatter never held its connections"
    return process


def listening(pid: int, family: int) -> set[int]:
    """The ports process ``pid`` listens on, in ``family``."""
    return {c.laddr.port for c in psutil.Process(pid).net_connections("inet")
            if c.status == "LISTEN" and c.family == family}


class PortFlooder:
    """Opens ``count`` connections to the first port process ``pid`` starts listening on at ``host``
    (not one of ``ignore``), and keeps them (non-blocking: a connection the kernel never completes
    costs the flooder nothing)."""

    def __init__(self, pid: int, host: str, count: int, ignore: set[int] = frozenset(), timeout: float = 60.0) -> None:
        self.pid, self.host, self.count, self.timeout = pid, host, count, timeout
        self.family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.ignore = set(ignore) | listening(pid, self.family)
        self.port: int | None = None
        self.sockets: list[socket.socket] = []
        self.done = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            wait_until(lambda: listening(self.pid, self.family) - self.ignore, self.timeout, "a new listening port")
        except (AssertionError, psutil.Error):  # the process never listened again, or ended
            return
        self.port = min(listening(self.pid, self.family) - self.ignore)
        for _ in range(self.count):
            sock = socket.socket(self.family, socket.SOCK_STREAM)
            sock.setblocking(False)
            sock.connect_ex((self.host, self.port))
            self.sockets.append(sock)
        self.done.set()

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


def marking_env(path: str, owner_pid: int) -> CountingEnv:
    """A counting env that creates ``path`` when a process other than ``owner_pid`` builds it."""
    if os.getpid() != owner_pid:
        with open(path, "w"):
            pass
    return CountingEnv(max_steps=7)


class _Boom:
    """Unpickled, creates the file ``path`` (``touch``): what a pickle from a node could make the learner run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, ("touch " + self.path,))


def evil_ready_node() -> int:
    """``sys.argv[1:]``: the collector's address (``host:port``), its key file, the marker's path. Joins
    with the key, sends as its READY reply a pickle that would create the marker, and waits until the
    learner closes the channel."""
    import pickle

    from rlharvest.protocol import READY, Reply
    from rlharvest.transport.keys import parse_node_key
    from rlharvest.transport.torchdist_join import join_collector

    host, port = sys.argv[1].rsplit(":", 1)
    with open(sys.argv[2]) as key:
        seat = join_collector(host, int(port), parse_node_key(key.read(), "the key file"), timeout=60.0)
    seat.conn.send_bytes(pickle.dumps(Reply(READY, seat.index, value=_Boom(sys.argv[3]))))
    seat.conn.recv_bytes()  # until the learner closes the channel
    return 0


def slow_join_node() -> int:
    """``sys.argv[1:]``: seconds, then the arguments of ``rlharvest`` (``node --join ...``). The node
    command, whose forming of its pair with the learner starts that many seconds late (a node on a busy
    host: the learner's side of the group waits meanwhile)."""
    import time

    import rlharvest.transport.torchdist_join as join
    from rlharvest.cli import main

    delay, pair = float(sys.argv[1]), join.form_pair

    def slowly(*args, **kwargs):
        time.sleep(delay)
        return pair(*args, **kwargs)

    join.form_pair = slowly
    return main(sys.argv[2:])
