"""The listening side of authenticated channels (:mod:`.channel`): a port that authenticates each
peer on its own thread and hands out the authenticated ones; strangers are dropped and logged,
never fatal, and a flood of them costs a bounded number of descriptors and threads, and cannot keep
a real peer out (see docs/security.md).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import math
import os
import queue
import select
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .channel import AuthenticationFailed, Channel, Keys, _connection, _Watchdog, authenticate
from .keys import LearnerIdentity

__all__ = ["ChannelListener", "network_of"]

logger = logging.getLogger("rlharvest")


class _DropLog:
    """Warnings about dropped connections, at most ``burst`` per ``window`` seconds; the rest are
    counted and reported in one line when the next window opens (a stranger reconnecting in a loop
    must not flood the log)."""

    def __init__(self, burst: int = 5, window: float = 10.0) -> None:
        self.burst, self.window = burst, window
        self._start, self._logged, self._held = -math.inf, 0, 0
        self._lock = threading.Lock()

    def __call__(self, message: str, *args: Any) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._start >= self.window:
                if self._held:
                    logger.warning("rlharvest: %d more dropped connections were not logged in the last %g s",
                                   self._held, self.window)
                self._start, self._logged, self._held = now, 0, 0
            if self._logged >= self.burst:
                self._held += 1
                return
            self._logged += 1
        logger.warning(message, *args)


def network_of(address: str) -> str:
    """The network a peer's handshakes are counted in: 127.0.0.0/8 for loopback, the /24 of another
    IPv4 address, the /64 of an IPv6 one (an IPv4-mapped one counts as IPv4)."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    prefix = (8 if ip.is_loopback else 24) if ip.version == 4 else 64
    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))


@dataclass(eq=False)
class _Pending:
    """One handshake in progress: its network and peer, when it must be proven by, and (once the peer
    sent its first message and a thread of its own carries on) the watchdog that can cut it short."""

    network: str
    conn: Any
    peer: Any
    deadline: float
    started: float = field(default_factory=time.monotonic)
    watchdog: _Watchdog | None = None

    @property
    def proving(self) -> bool:
        return self.watchdog is not None


class ChannelListener:
    """Accepts authenticated channels on ``sock`` until closed; strangers are dropped, never fatal.

    One thread accepts connections; a peer that sent nothing yet costs a descriptor and no thread.
    Once it sent its first message (a real peer does as soon as it is connected), its handshake goes
    on in a thread of its own (so a slow peer delays nobody). The peer must prove it holds its key within :attr:`PROOF_TIMEOUT`
    seconds of connecting (or ``handshake_timeout`` if shorter), then send its hello within
    ``handshake_timeout``; it is otherwise closed and logged at WARNING on the ``rlharvest`` logger
    (at most 5 such lines per 10 s, then a count). At most :attr:`MAX_PENDING` handshakes run at
    once, and at most :attr:`MAX_PER_NETWORK` from one network (:func:`network_of`); a newcomer
    beyond either cap evicts the oldest handshake of its network (of the busiest network, for the
    first cap), one whose peer has not even sent its first message first: a flood costs this process
    a bounded number of descriptors and threads, and cannot keep out a real peer. :meth:`next` hands out ``(channel, hello, peer)`` for
    authenticated peers; the caller checks who they claim to be.

    Args:
        sock: a listening socket (see :func:`listen`); the listener owns it from now on.
        authkey: the keys peers may prove they hold (see :func:`authenticate`).
        what: how warnings name this port (``"command"``, ``"weight"``).
        handshake_timeout: seconds a peer has for the handshake and its hello.
        user_timeout: TCP user timeout of accepted channels.
        identity: the learner's signing key, which proves this listener first (else an HMAC under
            the peer's key does).
    """

    #: handshakes in progress at once; beyond that, a newcomer evicts one of the busiest network
    MAX_PENDING = 32
    #: handshakes in progress at once from one network; beyond that, a newcomer evicts one of them
    MAX_PER_NETWORK = 8
    #: seconds a peer has to prove it holds its key (a real one needs two round trips)
    PROOF_TIMEOUT = 2.0

    def __init__(self, sock: socket.socket, authkey: Keys, what: str, handshake_timeout: float,
                 user_timeout: float, identity: LearnerIdentity | None = None) -> None:
        self.sock, self.authkey, self.what, self.identity = sock, authkey, what, identity
        self.handshake_timeout, self.user_timeout = handshake_timeout, user_timeout
        self.proof_timeout = min(self.PROOF_TIMEOUT, handshake_timeout)
        self.port = sock.getsockname()[1]
        self._ready: queue.Queue = queue.Queue()
        self._pending: list[_Pending] = []  # oldest first
        self._lock = threading.Lock()
        self._log = _DropLog()
        self._closed = threading.Event()
        self._selector = selectors.DefaultSelector()  # the listening socket and the peers silent so far
        self._thread = threading.Thread(target=self._accept_loop, name=f"rlharvest-{what}-listener", daemon=True)
        self._thread.start()

    def drop(self, peer, reason: str) -> None:
        """Log that a peer was dropped (also used by callers rejecting an authenticated hello)."""
        where = f"{peer[0]}:{peer[1]}" if peer else "a peer"
        self._log("rlharvest: dropped a connection from %s to the %s port %d: %s", where, self.what, self.port, reason)

    # ------------------------------------------------------------------ the accepting thread
    def _accept_loop(self) -> None:
        self.sock.setblocking(False)
        self._selector.register(self.sock, selectors.EVENT_READ)
        try:
            while not self._closed.is_set():
                with self._lock:
                    silent = [entry.deadline for entry in self._pending if not entry.proving]
                wait = min(silent, default=time.monotonic() + 0.5) - time.monotonic()
                events = self._selector.select(max(0.0, min(wait, 0.5)))
                for key, _ in sorted(events, key=lambda event: event[0].data is None):  # peers who spoke first
                    try:
                        if key.data is None:
                            self._accept_some()
                        else:
                            self._first_message(key.data)
                    except OSError as err:  # one peer's trouble is never the listener's end
                        self.drop(getattr(key.data, "peer", None), str(err))
                self._expire()
        finally:
            with self._lock:
                silent = [entry for entry in self._pending if not entry.proving]
            for entry in silent:
                self._forget(entry)
                entry.conn.close()
            self._selector.close()

    def _accept_some(self) -> None:
        """Accept the connections waiting (a bounded batch, then the others are served)."""
        for _ in range(64):
            try:
                sock, peer = self.sock.accept()
            except BlockingIOError:
                return
            except OSError:  # closed (shutdown wakes the loop), or a transient error (EMFILE)
                time.sleep(0 if self._closed.is_set() else 0.05)
                return
            sock.setblocking(True)
            try:
                conn = _connection(sock, self.user_timeout)
            except OSError as err:  # the peer already reset
                sock.close()
                self.drop(peer, str(err))
                continue
            entry = _Pending(network_of(peer[0]), conn, peer, time.monotonic() + self.proof_timeout)
            self._promote_speakers()  # a peer whose first message arrived meanwhile is not evicted as silent
            evicted = self._admit(entry)
            if evicted is not None:
                self._evict(*evicted)
            self._selector.register(conn.fileno(), selectors.EVENT_READ, entry)

    def _admit(self, entry: _Pending) -> tuple[_Pending, str] | None:
        """Take a handshake slot for ``entry``; the handshake it evicts (and why), if any."""
        with self._lock:
            victim = None
            mine = [pending for pending in self._pending if pending.network == entry.network]
            if len(mine) >= self.MAX_PER_NETWORK:
                victim, why = _oldest(mine), f"{len(mine)} handshakes from {entry.network} in progress"
            elif len(self._pending) >= self.MAX_PENDING:
                networks = [pending.network for pending in self._pending]
                busiest = max(networks, key=networks.count)
                victim = _oldest([pending for pending in self._pending if pending.network == busiest])
                why = f"{len(self._pending)} handshakes in progress"
            if victim is not None:
                self._pending.remove(victim)
            self._pending.append(entry)
        return None if victim is None else (victim, f"evicted for a newer connection ({why})")

    def _evict(self, entry: _Pending, reason: str) -> None:
        if entry.proving:
            entry.watchdog.fire(reason)  # its thread drops and logs it
            return
        self._close_silent(entry, reason)

    def _close_silent(self, entry: _Pending, reason: str) -> None:
        """Drop a peer that has not spoken (or only closed): no thread of its own to wake."""
        self._forget(entry)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(entry.conn.fileno())
        entry.conn.close()
        self.drop(entry.peer, reason)

    def _promote_speakers(self) -> None:
        """Hand on the silent peers whose first message arrived since the last look."""
        with self._lock:
            if len(self._pending) < self.MAX_PER_NETWORK:
                return  # no eviction is near
            silent = {entry.conn.fileno(): entry for entry in self._pending if not entry.proving}
        poller = select.poll()
        for fd in silent:
            poller.register(fd, select.POLLIN)
        for fd, _ in poller.poll(0):
            self._first_message(silent[fd])

    def _first_message(self, entry: _Pending) -> None:
        """The peer sent something: its handshake goes on in a thread of its own, by the same deadline
        (a peer that only closed the connection is dropped here)."""
        try:
            with socket.socket(fileno=os.dup(entry.conn.fileno())) as sock:
                ended = not sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:  # reset meanwhile
            ended = True
        if ended:
            self._close_silent(entry, "the peer closed the connection during the handshake")
            return
        self._selector.unregister(entry.conn.fileno())
        with self._lock:
            entry.watchdog = _Watchdog(entry.conn, max(0.0, entry.deadline - time.monotonic()))
        threading.Thread(target=self._handshake, args=(entry,), name="rlharvest-handshake", daemon=True).start()

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [entry for entry in self._pending if not entry.proving and entry.deadline <= now]
        for entry in expired:
            self._close_silent(entry, f"nothing sent within {self.proof_timeout:g} s")

    def _forget(self, entry: _Pending) -> None:
        with self._lock:
            if entry in self._pending:
                self._pending.remove(entry)

    # ------------------------------------------------------------------ one handshake's thread
    def _handshake(self, entry: _Pending) -> None:
        try:
            channel, hello = authenticate(entry.conn, self.authkey, entry.watchdog.seconds, listener=True, hello=True,
                                          identity=self.identity,
                                          hello_timeout=self.handshake_timeout, watchdog=entry.watchdog)
        except AuthenticationFailed as err:
            if not self._closed.is_set():
                self.drop(entry.peer, str(err))
            return
        finally:
            self._forget(entry)
        if self._closed.is_set():
            channel.close()
            return
        self._ready.put((channel, hello, entry.peer))

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (the port no longer accepts)."""
        return self._closed.is_set()

    def next(self, timeout: float) -> tuple[Channel, Any, Any] | None:
        """The next authenticated ``(channel, hello, peer)``, or None after ``timeout`` seconds."""
        try:
            return self._ready.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        """Stop accepting (the port closes) and close channels nobody took. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._thread.join(2.0)
        self.sock.close()
        while True:
            try:
                channel, _, _ = self._ready.get_nowait()
            except queue.Empty:
                return
            channel.close()


def _oldest(entries: list[_Pending]) -> _Pending:
    """The handshake to evict among ``entries``: the oldest of those whose peer sent nothing yet, else
    the oldest (a real peer sends its first message as soon as it is connected)."""
    return min(entries, key=lambda entry: (entry.proving, entry.started))
