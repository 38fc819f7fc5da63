"""The listening side of authenticated channels (:mod:`.channel`): a port that authenticates each
peer on its own thread and hands out the authenticated ones; strangers are dropped and logged,
never fatal, and a flood of them costs a bounded number of descriptors and threads (see
docs/security.md).
"""

from __future__ import annotations

import logging
import math
import queue
import socket
import threading
import time
from typing import Any

from .channel import AuthenticationFailed, Channel, Keys, _connection, authenticate

__all__ = ["ChannelListener"]

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


class ChannelListener:
    """Accepts authenticated channels on ``sock`` until closed; strangers are dropped, never fatal.

    Every accepted connection is authenticated in its own thread (so a silent peer delays nobody),
    must complete the handshake and send its hello within ``handshake_timeout`` seconds, and is
    otherwise closed and logged at WARNING on the ``rlharvest`` logger (at most 5 such lines per
    10 s, then a count). At most :attr:`MAX_PENDING` handshakes run at once, and at most
    :attr:`MAX_PER_SOURCE` from one address: a connection beyond either is closed at once, so a
    flood costs this process a bounded number of descriptors and threads. :meth:`next` hands out
    ``(channel, hello, peer)`` for authenticated peers; the caller checks who they claim to be.

    Args:
        sock: a listening socket (see :func:`listen`); the listener owns it from now on.
        authkey: the keys peers may prove they hold (see :func:`authenticate`).
        what: how warnings name this port (``"command"``, ``"weight"``).
        handshake_timeout: seconds a peer has for the handshake and its hello.
        user_timeout: TCP user timeout of accepted channels.
    """

    #: handshakes in progress at once; beyond that, new connections are closed at once
    MAX_PENDING = 32
    #: handshakes in progress at once from one address (a stranger elsewhere cannot hold them all)
    MAX_PER_SOURCE = 8

    def __init__(self, sock: socket.socket, authkey: Keys, what: str, handshake_timeout: float,
                 user_timeout: float) -> None:
        self.sock, self.authkey, self.what = sock, authkey, what
        self.handshake_timeout, self.user_timeout = handshake_timeout, user_timeout
        self.port = sock.getsockname()[1]
        self._ready: queue.Queue = queue.Queue()
        self._pending: dict[str, int] = {}
        self._lock = threading.Lock()
        self._log = _DropLog()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name=f"rlharvest-{what}-listener", daemon=True)
        self._thread.start()

    def drop(self, peer, reason: str) -> None:
        """Log that a peer was dropped (also used by callers rejecting an authenticated hello)."""
        where = f"{peer[0]}:{peer[1]}" if peer else "a peer"
        self._log("rlharvest: dropped a connection from %s to the %s port %d: %s", where, self.what, self.port, reason)

    def _admit(self, source: str) -> str | None:
        """Take a handshake slot for ``source``; why not, when both caps leave none."""
        with self._lock:
            if sum(self._pending.values()) >= self.MAX_PENDING:
                return f"{self.MAX_PENDING} handshakes already in progress"
            if self._pending.get(source, 0) >= self.MAX_PER_SOURCE:
                return f"{self.MAX_PER_SOURCE} handshakes from {source} already in progress"
            self._pending[source] = self._pending.get(source, 0) + 1
        return None

    def _release(self, source: str) -> None:
        with self._lock:
            left = self._pending.pop(source) - 1
            if left:
                self._pending[source] = left

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self.sock.accept()
            except OSError:  # closed (shutdown wakes accept) or a transient error (EMFILE: try again)
                if self._closed.is_set():
                    return
                time.sleep(0.05)
                continue
            refused = self._admit(peer[0])
            if refused is not None:
                sock.close()
                self.drop(peer, refused)
                continue
            threading.Thread(target=self._handshake, args=(sock, peer), name="rlharvest-handshake",
                             daemon=True).start()

    def _handshake(self, sock: socket.socket, peer) -> None:
        try:
            channel, hello = authenticate(_connection(sock, self.user_timeout), self.authkey,
                                          self.handshake_timeout, listener=True, hello=True)
        except AuthenticationFailed as err:
            if not self._closed.is_set():
                self.drop(peer, str(err))
            return
        except OSError as err:  # tuning a socket the peer already reset
            sock.close()
            self.drop(peer, str(err))
            return
        finally:
            self._release(peer[0])
        if self._closed.is_set():
            channel.close()
            return
        self._ready.put((channel, hello, peer))

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
