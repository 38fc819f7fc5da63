"""Nodes that join a running collector from anywhere (``launcher="external"``, docs/elastic.md).

The collector starts no node: its slots (one per env constructor) are filled by nodes that join.
Its command port (``tcp_port``) stays open for its whole life; nothing else of it is reachable
before a node joined. A joining node (``python -m rlharvest node --join HOST:PORT --key-file PATH``)
opens the authenticated command channel there (:mod:`rlharvest.transport.channel`: the collector
proves first that it is the learner, then the node that it holds the join key, before anything is
decoded) and says ``("join", pid, hostname, wire format)`` (plain values, never unpickled; the format
of the messages it sends, :data:`~.wire.WIRE_FORMAT`). On that same channel the main process answers

* ``("refused", reason)`` when no slot is empty, nor empties within :attr:`JoinService.SLOT_GRACE`
  seconds, or the node sends messages in another format (an older rlharvest's say no format: they are
  pickles), logged at WARNING, the channel closed; or
* ``("slot", rank, generation, backend, kwargs, wrapped)``: ``wrapped`` is the slot's key,
  encrypted under a secret of this channel alone; both sides then form the slot's group over the
  channel and prove it is theirs (:mod:`rlharvest.transport.pairing`), then the node receives its
  spec (env constructor, policy, weight channel) once the collector takes the slot.

Whatever a joining node sends that fails (a store key that does not decode, a group that does not
form, a wrong proof) drops that node and gives its slot back to the next one.

Groups are formed on at most :attr:`JoinService.MAX_FORMING` threads at once, each within the
rendezvous timeout, so a node joins while the collector collects; the collector takes the joined
node when it starts that slot (``TorchDistBackend``: ``start_all`` for the first nodes,
``start_one`` for a replacement), always on its own thread. While the collector waits for empty
slots it says so, with the command that joins a node: once at WARNING after
:attr:`JoinService.WARN_AFTER` seconds (a user who configured no logging sees it on stderr), then at
INFO every :attr:`JoinService.LOG_EVERY` seconds. Whoever opens the service may be told of each node
that joins a slot and each that is refused (:class:`JoinWatcher`): the collector publishes them as
fleet events, without this module knowing of collectors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from ..errors import CollectorUnreachable, JoinRefused, WorkerTimeoutError
from .channel import Channel, open_channel
from .keys import NodeCredential, as_credential, slot_key, unwrap_key, wrap_key
from .launchers import LaunchedNode
from .pairing import form_pair
from .rendezvous import Rendezvous
from .wire import WIRE_FORMAT

__all__ = ["JoinRefused", "JoinService", "JoinWatcher", "JoinedNode", "Seat", "join_collector"]

logger = logging.getLogger("rlharvest")


class JoinedNode(LaunchedNode):
    """A node that joined from elsewhere, as the collector sees it: only through its channel.

    Args:
        remote_pid, hostname, address: what the node said of itself, and where it connected from.
        channel: its command channel, whose end on the node closes when the node's process exits.
    """

    pid = None  # not a process of this machine (even when it runs here)

    def __init__(self, remote_pid: int, hostname: str, address: str, channel: Channel | None = None) -> None:
        self.remote_pid, self.hostname, self.address = remote_pid, hostname, address
        self._channel = channel
        self._stopped = False

    def is_alive(self) -> bool:
        return not self._stopped  # its handle sees the rest: its channel closing, its heartbeats

    def _ended(self, timeout: float) -> bool:
        return self._stopped

    def exit_description(self) -> str:
        return f"the node that joined from {self.hostname} ({self.address}, pid {self.remote_pid}) is gone"

    def terminate(self, deadline: float) -> None:
        """The node exits on its own once told to close, or once its handle closes the channel: wait
        until ``deadline`` for its end of the channel to close (the collector's ``shutdown()`` then
        returns once the nodes it told to close have exited). What it still sends is skipped unread."""
        self._stopped = True
        channel, self._channel = self._channel, None
        try:
            while channel is not None and time.monotonic() < deadline:
                if channel.poll(min(0.1, max(0.0, deadline - time.monotonic()))):
                    channel.recv_bytes()
        except (EOFError, OSError):  # its end closed: the node's process has ended
            pass


@dataclass
class Joined:
    """A node that joined slot ``index``: its channel, its group (and its store), and how it is seen."""

    index: int
    channel: Channel
    group: Any
    node: JoinedNode
    store: Any = None


class JoinWatcher(NamedTuple):
    """What the service tells whoever opened it, on the service's own threads (keep them short)."""

    joined: Callable[[int, str, str], None]
    """``(slot, hostname, address)``: a node joined ``slot`` (its group formed), waiting to be taken."""
    refused: Callable[[str, str], None]
    """``(who, reason)``: a node that came to join was refused."""


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
        rendezvous: the collector's command listener (kept open while this runs).
        backend: the process-group backend (a pair backend).
        num_slots: the slots, all empty at first.
        node_kwargs: what every node is told besides its rank (heartbeat interval, timeouts).
        timeout: seconds a joining node has to form its group and prove it.
        op_timeout: seconds a group operation may take.
        command: the command that joins a node, for the log while slots wait.
        watcher: told of each node that joins a slot and each that is refused.
    """

    #: groups formed at once (each takes a thread for up to ``timeout``)
    MAX_FORMING = 4
    #: seconds the collector waits for nodes before it says so at WARNING (once; INFO afterwards)
    WARN_AFTER = 3.0
    #: seconds between two INFO lines naming the slots the collector waits for
    LOG_EVERY = 10.0
    #: seconds a node that finds every slot taken waits for one to empty before it is refused: the
    #: collector says it replaces a node (a WARNING) a moment before it empties the slot
    SLOT_GRACE = 5.0

    def __init__(self, rendezvous: Rendezvous, backend: str, num_slots: int, node_kwargs: dict, *,
                 timeout: float, op_timeout: float, command: str | None = None,
                 watcher: JoinWatcher | None = None) -> None:
        self.rendezvous, self.backend, self.node_kwargs = rendezvous, backend, dict(node_kwargs)
        self.node_kwargs.setdefault("slots", num_slots)  # a node says "joined as node i of n"
        self.watcher = watcher
        self._warned = False
        self.timeout, self.op_timeout, self.command = timeout, op_timeout, command
        self._cond = threading.Condition()
        self._wanted: set[int] = set(range(num_slots))
        self._joined: dict[int, Joined] = {}
        self._generations: dict[int, int] = {}
        #: slots the collector waits for now (a replacement): a joining node takes one of them first
        self._awaited: set[int] = set()
        self._forming = threading.BoundedSemaphore(self.MAX_FORMING)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rlharvest-joins", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the collector's side
    def want(self, index: int) -> None:
        """Slot ``index`` is empty again (its node left or died): the next node that joins takes it."""
        with self._cond:
            if index not in self._joined:  # else a node joined it already and waits to be taken
                self._wanted.add(index)
                self._cond.notify_all()  # a node waiting for a slot (``SLOT_GRACE``) takes it

    def joined(self, indices) -> list[int]:
        """Which of ``indices`` have a node that joined and waits to be taken."""
        with self._cond:
            return [index for index in indices if index in self._joined]

    def take(self, indices: list[int], timeout: float, what: str) -> dict[int, Joined]:
        """The nodes that joined slots ``indices``, waiting up to ``timeout`` seconds for them (and
        saying which slots are empty every :attr:`LOG_EVERY` seconds meanwhile).

        Raises:
            WorkerTimeoutError: naming the slots still empty then.
        """
        deadline = time.monotonic() + timeout
        next_log = time.monotonic() + (self.LOG_EVERY if self._warned else min(self.WARN_AFTER, self.LOG_EVERY))
        with self._cond:
            self._awaited.update(indices)
            try:
                while True:
                    empty = [index for index in indices if index not in self._joined]
                    if not empty:
                        return {index: self._joined.pop(index) for index in indices}
                    now = time.monotonic()
                    if deadline - now <= 0 or self._closed.is_set():
                        break
                    if now >= next_log:
                        next_log = now + self.LOG_EVERY
                        level, self._warned = logging.INFO if self._warned else logging.WARNING, True
                        logger.log(level, "rlharvest: waiting for nodes to join slot%s %s (%s, %.0f s left); start "
                                   "one per empty slot with: %s", "s" if len(empty) > 1 else "", empty, what,
                                   deadline - now, self.command or "collector.join_command()")
                    self._cond.wait(min(deadline - now, next_log - now, 0.5))
            finally:
                self._awaited.difference_update(indices)
        raise WorkerTimeoutError(f"no node joined slot{'s' if len(empty) > 1 else ''} {empty} within {timeout:g} s "
                                 f"({what}): start one per empty slot with collector.join_command().",
                                 worker_idx=empty[0])

    def close(self) -> None:
        """Stop taking joins; nodes that joined but were not taken are sent away (their channel closes)."""
        self._closed.set()
        self._thread.join(2.0)
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
        if not (isinstance(hello, tuple) and len(hello) in (3, 4) and hello[0] == "join" and type(hello[1]) is int
                and isinstance(hello[2], str) and channel.key_id == 0):
            channel.close()
            listener.drop(peer, f"not a join: {hello!r:.80}")
            return
        who = f"node {hello[2]!r:.40} (pid {hello[1]})"
        if hello[3:] != (WIRE_FORMAT,):  # it could join, but the collector would refuse its first reply
            said = f"wire format {hello[3]!r:.20}" if hello[3:] else "pickles (wire format 1)"
            self._refuse(channel, peer, who, f"it sends its messages as {said}, this collector reads wire format "
                         f"{WIRE_FORMAT}: install the collector's rlharvest version on the node")
            return
        if not self._forming.acquire(blocking=False):
            self._refuse(channel, peer, who, f"{self.MAX_FORMING} nodes are joining already, try again")
            return
        node = JoinedNode(hello[1], hello[2], peer[0] if peer else "?", channel)
        threading.Thread(target=self._join, args=(channel, peer, who, node),
                         name="rlharvest-join", daemon=True).start()

    def _slot(self, who: str) -> tuple[int, int] | None:
        """An empty slot for a joining node, within ``SLOT_GRACE`` seconds, and its generation."""
        deadline, said = time.monotonic() + self.SLOT_GRACE, False
        with self._cond:
            while True:
                free = sorted(self._wanted & self._awaited) or sorted(self._wanted)
                if free:
                    index = free[0]
                    self._wanted.discard(index)
                    self._generations[index] = self._generations.get(index, -1) + 1
                    return index, self._generations[index]
                left = deadline - time.monotonic()
                if left <= 0 or self._closed.is_set():
                    return None
                if not said:
                    said = True
                    logger.info("rlharvest: %s waits up to %g s for a slot to empty: every slot is taken", who,
                                self.SLOT_GRACE)
                self._cond.wait(left)

    def _refuse(self, channel: Channel, peer, who: str, reason: str) -> None:
        with contextlib.suppress(OSError):
            channel.send(("refused", reason))
        channel.close()
        self.rendezvous.listener.drop(peer, f"{who} refused: {reason}")
        if self.watcher is not None:
            self.watcher.refused(who, reason)

    def _join(self, channel: Channel, peer, who: str, node: JoinedNode) -> None:
        """Give the node a slot and form its group with it (on a thread of its own)."""
        try:
            slot = self._slot(who)
            if slot is None:
                self._refuse(channel, peer, who, "every slot is taken")
                return
            index, generation = slot
            try:
                group, store = self._seat(channel, index, generation)
            except Exception as err:  # whatever the node sent or did, a decode error too: dropped, its slot given back
                channel.close()
                self.rendezvous.listener.drop(peer, f"{who} failed to join slot {index}: {type(err).__name__}: {err}")
                self.want(index)
                return
        finally:
            self._forming.release()
        with self._cond:
            if self._closed.is_set():  # the collector shut down meanwhile: send the node away
                channel.close()
                return
            self._joined[index] = Joined(index, channel, group, node, store)
            self._cond.notify_all()
        logger.info("rlharvest: a node joined slot %d from %s (%s)", index, node.hostname, node.address)
        if self.watcher is not None:
            self.watcher.joined(index, node.hostname, node.address)

    def _seat(self, channel: Channel, index: int, generation: int) -> tuple[Any, Any]:
        """Tell the node its slot (and the slot's key, wrapped under this channel's own secret), form
        their group; returns it and its store."""
        rank = index + 1
        key = slot_key(self.rendezvous.authkey, rank)
        channel.send(("slot", rank, generation, self.backend, self.node_kwargs, wrap_key(key, channel.exporter)))
        return form_pair(channel, key, 0, self.backend, timeout=self.timeout, op_timeout=self.op_timeout,
                         device_host=_local_address(channel))


@dataclass
class Seat:
    """What a node that joined holds: its channel, its group (and store), its slot, its slot's key
    and its spec (pickled)."""

    conn: Channel
    group: Any
    index: int
    heartbeat_interval: float
    store: Any
    payload: bytes
    key: bytes = field(repr=False)
    slots: int | None = None
    """The collector's slots (None from a collector that does not say)."""


def join_collector(host: str, port: int, authkey: NodeCredential | bytes, *, timeout: float = 120.0,
                   handshake_timeout: float = 5.0, user_timeout: float = 10.0, op_timeout: float = 1800.0,
                   on_retry: Callable[[BaseException], None] | None = None) -> Seat:
    """A joining node's side: join at the command port, form the slot's group, receive the spec.

    ``authkey``: the node's credential (what ``join_command()``'s key file holds, or that hex
    decoded), or the collector's secret (:func:`~.keys.parse_node_key` of the collector's key),
    whose join key it then proves.
    ``timeout`` bounds everything up to the collector's answer (reaching its command port, the
    handshake), as one deadline; ``on_retry(error)`` is called each time nothing answered yet.

    Raises:
        CollectorUnreachable: no collector answered at ``host:port`` within ``timeout``.
        JoinRefused: when every slot is taken.
        AuthenticationFailed: when the collector did not prove it is the learner of that key.
        PairingFailed: when the slot's group did not form, or its peer is not the collector.
    """
    credential = as_credential(authkey) or NodeCredential.for_joining(authkey)
    deadline = time.monotonic() + timeout
    try:
        # open_channel retries while nothing listens (a collector may start after its nodes); no bare
        # probe first: the collector would log each as a dropped connection, and its log of drops is
        # rate-limited, so probes could hide a real refusal or stranger
        conn = open_channel(host, int(port), credential, max(0.1, deadline - time.monotonic()), user_timeout,
                            handshake_timeout, on_retry=on_retry)
    except OSError as err:
        if isinstance(err, ConnectionError) and not isinstance(err, ConnectionRefusedError):
            raise  # AuthenticationFailed, a reset: the collector answered
        raise CollectorUnreachable(f"no collector answered at {host}:{port} within {timeout:g} s "
                                   f"({_why(err)}).") from None
    conn.send_hello(("join", os.getpid(), socket.gethostname(), WIRE_FORMAT))
    try:
        reply = conn.recv()  # the collector proved it is the learner: its messages are trusted
    except EOFError:  # a collector that does not know this hello (an older rlharvest) closes at once
        raise EOFError(f"without answering the join at {host}:{port}: it may run another rlharvest version, this "
                       f"node sends wire format {WIRE_FORMAT}") from None
    if isinstance(reply, tuple) and reply[:1] == ("refused",):
        conn.close()
        raise JoinRefused(f"the collector at {host}:{port} refused this node: {reply[1]}.")
    try:
        _, rank, generation, backend, kwargs, wrapped = reply
        key = unwrap_key(wrapped, conn.exporter)
    except (TypeError, ValueError) as err:
        conn.close()
        raise ConnectionError(f"the collector at {host}:{port} answered in a way this node does not understand "
                              f"(another rlharvest version?): {reply!r:.80}") from err
    group, store = form_pair(conn, key, 1, backend, timeout=timeout, op_timeout=op_timeout,
                             device_host=_local_address(conn))
    payload = conn.recv_bytes()
    slots = kwargs.get("slots")
    return Seat(conn, group, rank - 1, float(kwargs.get("heartbeat_interval", 1.0)), store, payload, key,
                slots if type(slots) is int else None)


def _why(err: BaseException) -> str:
    """One line: an OS error's reason, or the first line of a message (torch's may go on with C++
    stack frames)."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
