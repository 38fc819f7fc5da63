"""Nodes that join a running collector from anywhere (``launcher="external"``, docs/elastic.md).

The collector starts no node: its slots (one per env constructor) are filled by nodes that join.
It keeps its command port (``tcp_port + 1``) open for its whole life. A joining node
(``python -m rlharvest node --join HOST:PORT --key-file PATH``) reads that port's number from the
store at ``HOST:PORT`` (a number can only make it fail), opens the authenticated command channel
(:mod:`rlharvest.transport.channel`: each side proves it holds the key before anything is
unpickled) and says ``("join", pid, hostname)``. On that same channel the main process answers

* ``("refused", reason)`` when no slot is empty (logged at WARNING, the channel closed), or
* ``("slot", rank, generation, backend, kwargs)``: the node forms a group of its own with the main
  process under that rank and generation, exactly as a replacement does (``rendezvous.node_group``),
  says ``("hello", rank, ...)``, and receives its spec (env constructor, policy, weight channel).

The group is formed and the hello read by an acceptor thread, so a node joins while the collector
collects; the collector takes the joined node when it starts that slot (``TorchDistBackend``:
``start_all`` for the first nodes, ``start_one`` for a replacement), always on its own thread.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..errors import CollectorUnreachable, JoinRefused, WorkerTimeoutError
from .channel import Channel, open_channel
from .launchers import LaunchedNode
from .ports import wait_for_listener
from .rendezvous import CONTROL_KEY, Rendezvous, _wait_in_thread, group_store, make_process_group, node_group

__all__ = ["JoinRefused", "JoinService", "JoinedNode", "Seat", "join_collector"]

logger = logging.getLogger("rlharvest")


class JoinedNode(LaunchedNode):
    """A node that joined from elsewhere, as the collector sees it: only through its channel."""

    pid = None  # not a process of this machine (even when it runs here)

    def __init__(self, remote_pid: int, hostname: str, address: str) -> None:
        self.remote_pid, self.hostname, self.address = remote_pid, hostname, address
        self._stopped = False

    def is_alive(self) -> bool:
        return not self._stopped  # its handle sees the rest: its channel closing, its heartbeats

    def _ended(self, timeout: float) -> bool:
        return self._stopped

    def exit_description(self) -> str:
        return f"the node that joined from {self.hostname} ({self.address}, pid {self.remote_pid}) is gone"

    def terminate(self, deadline: float) -> None:
        self._stopped = True  # its handle closes its channel: the node exits on its own


@dataclass
class Joined:
    """A node that joined slot ``index``: its channel, its group, and how it is seen."""

    index: int
    channel: Channel
    group: Any
    node: JoinedNode


def _local_address(channel: Channel) -> str:
    """The local address of ``channel``'s socket: the interface that reaches the peer (gloo binds it)."""
    sock = socket.socket(fileno=os.dup(channel.fileno()))
    try:
        return sock.getsockname()[0]
    finally:
        sock.close()


class JoinService:
    """The main process's side of joins: gives each authenticated joiner an empty slot.

    Args:
        rendezvous: the collector's store and command listener (kept open while this runs).
        backend: the process-group backend (a pair backend).
        num_slots: the slots, all empty at first.
        node_kwargs: what every node is told besides its rank (heartbeat interval, timeouts).
        timeout: seconds a joining node has to form its group and say hello.
        op_timeout: seconds a group operation may take.
    """

    def __init__(self, rendezvous: Rendezvous, backend: str, num_slots: int, node_kwargs: dict, *,
                 timeout: float, op_timeout: float) -> None:
        self.rendezvous, self.backend, self.node_kwargs = rendezvous, backend, dict(node_kwargs)
        self.timeout, self.op_timeout = timeout, op_timeout
        self._cond = threading.Condition()
        self._wanted: set[int] = set(range(num_slots))
        self._joined: dict[int, Joined] = {}
        self._generations: dict[int, int] = {}
        #: slots the collector waits for now (a replacement): a joining node takes one of them first
        self._awaited: set[int] = set()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rlharvest-joins", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the collector's side
    def want(self, index: int) -> None:
        """Slot ``index`` is empty again (its node left or died): the next node that joins takes it."""
        with self._cond:
            if index not in self._joined:  # else a node joined it already and waits to be taken
                self._wanted.add(index)

    def joined(self, indices) -> list[int]:
        """Which of ``indices`` have a node that joined and waits to be taken."""
        with self._cond:
            return [index for index in indices if index in self._joined]

    def take(self, indices: list[int], timeout: float, what: str) -> dict[int, Joined]:
        """The nodes that joined slots ``indices``, waiting up to ``timeout`` seconds for them.

        Raises:
            WorkerTimeoutError: naming the slots still empty then.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            self._awaited.update(indices)
            try:
                while True:
                    empty = [index for index in indices if index not in self._joined]
                    if not empty:
                        return {index: self._joined.pop(index) for index in indices}
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or self._closed.is_set():
                        break
                    self._cond.wait(min(remaining, 0.5))
            finally:
                self._awaited.difference_update(indices)
        raise WorkerTimeoutError(f"no node joined slot{'s' if len(empty) > 1 else ''} {empty} within {timeout:g} s "
                                 f"({what}): start one per empty slot with collector.join_command().",
                                 worker_idx=empty[0])

    def close(self) -> None:
        """Stop taking joins; nodes that joined but were not taken are sent away (their channel closes)."""
        self._closed.set()
        self._thread.join(2.0)  # a join in progress may wait longer (forming its group): it sees the close
        with self._cond:
            for joined in self._joined.values():
                with contextlib.suppress(OSError):
                    joined.channel.close()
            self._joined.clear()
            self._cond.notify_all()

    # ------------------------------------------------------------------ the acceptor thread
    def _loop(self) -> None:
        listener = self.rendezvous.listener
        while not self._closed.is_set():
            item = listener.next(0.2)
            if item is not None:
                self._admit(*item)

    def _admit(self, channel: Channel, hello: Any, peer) -> None:
        listener = self.rendezvous.listener
        if not (isinstance(hello, tuple) and len(hello) == 3 and hello[0] == "join"):
            channel.close()
            listener.drop(peer, f"not a join: {hello!r:.80}")
            return
        with self._cond:
            free = sorted(self._wanted & self._awaited) or sorted(self._wanted)
            if free:
                index = free[0]
                self._wanted.discard(index)
                generation = self._generations[index] = self._generations.get(index, -1) + 1
        if not free:
            with contextlib.suppress(OSError):
                channel.send(("refused", "every slot of the collector is taken"))
            channel.close()
            listener.drop(peer, f"node {hello[2]!r:.40} (pid {hello[1]!r:.12}) refused: every slot is taken")
            return
        try:
            group = self._form(channel, index, generation)
        except Exception as err:  # a node that fails to join is dropped; its slot stays empty
            channel.close()
            listener.drop(peer, f"node {hello[2]!r:.40} failed to join slot {index}: {err}")
            self.want(index)
            return
        node = JoinedNode(hello[1], str(hello[2]), peer[0] if peer else "?")
        with self._cond:
            if self._closed.is_set():  # the collector shut down meanwhile: send the node away
                channel.close()
                return
            self._joined[index] = Joined(index, channel, group, node)
            self._cond.notify_all()
        logger.info("rlharvest: a node joined slot %d from %s (%s)", index, node.hostname, node.address)

    def _form(self, channel: Channel, index: int, generation: int):
        """Tell the node its slot, form its group with it, and read its hello."""
        rank = index + 1
        channel.send(("slot", rank, generation, self.backend, self.node_kwargs))
        store, here = self.rendezvous.store, _local_address(channel)

        def build():
            return make_process_group(self.backend, group_store(store, rank, generation), 0, 2, self.op_timeout, here)

        group = _wait_in_thread(build, self.timeout, lambda: None, f"forming the group of slot {index}")
        if not channel.poll(self.timeout):
            raise TimeoutError(f"no hello within {self.timeout:g} s")
        hello = channel.recv()
        if not (isinstance(hello, tuple) and len(hello) == 4 and hello[0] == "hello" and hello[1] == rank):
            raise ValueError(f"unexpected hello {hello!r:.80}")
        return group


@dataclass
class Seat:
    """What a node that joined holds: its channel, its group, its slot, and its spec (pickled)."""

    conn: Channel
    group: Any
    index: int
    heartbeat_interval: float
    store: Any
    payload: bytes


def join_collector(host: str, port: int, authkey: bytes, *, timeout: float = 120.0,
                   handshake_timeout: float = 5.0, user_timeout: float = 10.0, op_timeout: float = 1800.0) -> Seat:
    """A joining node's side: find the command port, join, form the slot's group, receive the spec.

    ``timeout`` bounds everything up to the collector's answer (reaching its store, its command port,
    the handshake), as one deadline.

    Raises:
        CollectorUnreachable: no collector answered at ``host:port`` within ``timeout``.
        JoinRefused: when every slot is taken.
        AuthenticationFailed: when the collector did not prove it holds the key.
    """
    deadline = time.monotonic() + timeout
    store, control_port = _command_port(host, int(port), timeout, deadline)
    left = max(0.1, deadline - time.monotonic())
    try:
        conn = open_channel(host, control_port, authkey, left, user_timeout, handshake_timeout)
    except OSError as err:
        if isinstance(err, ConnectionError) and not isinstance(err, ConnectionRefusedError):
            raise  # AuthenticationFailed, a reset: the collector answered
        raise CollectorUnreachable(f"the collector at {host}:{port} did not open its command port "
                                   f"{control_port} within {timeout:g} s ({_why(err)}).") from None
    conn.send(("join", os.getpid(), socket.gethostname()))
    reply = conn.recv()
    if reply[0] == "refused":
        conn.close()
        raise JoinRefused(f"the collector at {host}:{port} refused this node: {reply[1]}.")
    _, rank, generation, backend, kwargs = reply
    group, _ = node_group(backend, store, rank, 2, generation, op_timeout, _local_address(conn))
    conn.send(("hello", rank, os.getpid(), socket.gethostname()))
    payload = conn.recv_bytes()
    return Seat(conn, group, rank - 1, float(kwargs.get("heartbeat_interval", 1.0)), store, payload)


def _why(err: BaseException) -> str:
    """One line: an OS error's reason, or the first line of torch's message (which may go on with C++
    stack frames)."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _command_port(host: str, port: int, timeout: float, deadline: float) -> tuple[Any, int]:
    """The collector's store at ``host:port`` and the command port it names, by ``deadline``.

    A plain connection is tried first, again every 0.2 s while nothing listens (the collector may
    start after its nodes): torch's store client would retry on its own, but overshoot the deadline
    and log each attempt with its C++ stack.

    Raises:
        CollectorUnreachable: naming the address, ``timeout`` and the last reason.
    """
    wait_for_listener(host, port, max(0.0, deadline - time.monotonic()))
    try:
        store = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=max(0.1, deadline - time.monotonic())))
    except RuntimeError as err:  # torch's DistError family
        raise CollectorUnreachable(f"what answers at {host}:{port} is not a collector's store (torch: "
                                   f"{_why(err)}).") from None
    try:
        store.set_timeout(datetime.timedelta(seconds=max(0.1, deadline - time.monotonic())))
        return store, int(store.get(CONTROL_KEY))
    except (RuntimeError, ValueError) as err:  # no such key in time; a key that is not a port
        raise CollectorUnreachable(f"the store at {host}:{port} named no collector's command port within "
                                   f"{timeout:g} s (torch: {_why(err)}).") from None
