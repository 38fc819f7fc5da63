"""Hosts forward weight updates to each other (docs/weights.md, "A relay between hosts").

With two or more remote hosts, the weight sender of nodes (``torchdist_weights``) streams an update to
the carrier of the first host only; each carrier streams it on to the carrier of the next host (a
chain). A carrier receives each chunk straight into its slot and a forwarding thread sends it on from
there, so the hosts of the chain receive the update nearly together; it reports the slot ``staged``
only once it holds all of it, and the host's other nodes map a slot only after that, as in "One copy
per host".

**Links.** Every hop is a *link*: a TCP connection authenticated once with the handshake of
:mod:`.channel`, under a key derived from the weight channel's key (every node holds that one; the
derived key opens no port of the main process), then kept open from one update to the next. A link
is always either between two updates or closed: whoever gives up on an update part-way closes it,
and the next update opens a new one.

**Chunk tags.** On a link, an update is a header (version, a per-update nonce, sizes) and then, per
chunk, a 32-byte tag and the chunk's bytes. The main process computes each tag once, HMAC-SHA256 under
the relay key of (nonce, version, chunk index, bytes), and carriers check it and forward the tag
unchanged. The nonce and the sizes reach each carrier from the main process over its authenticated
weight channel, so a chunk is accepted only for the update, and the place in it, it was made for: a
chunk injected, altered, replayed from another update or moved fails its tag and the relay breaks.

Why TCP and not the process groups: a node's group is a pair (the node and the main process), formed
through the store when the node starts; a group among carriers would be a collective over every rank
of the world (``new_group``), which a replacement, a node of another generation that joined alone,
cannot take part in.

A carrier whose upstream dies, stalls (``silence`` seconds without a byte), never connects or sends a
chunk that fails its tag reports ``unrelayed``: the main process then sends it the update directly
over its group; it closes its own downstream link, so the hosts after it do the same.
"""

from __future__ import annotations

import datetime
import hmac
import os
import queue
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable

from .channel import AuthenticationFailed, ChannelListener, listen, open_channel

__all__ = ["MIN_CHUNK_BYTES", "MAX_CHUNK_BYTES", "Stream", "chunk_bytes", "chunk_tag", "relay_key", "Links",
           "RelayPort", "Forwarder", "receive", "local_address"]

#: the largest chunk: small enough that hops overlap, large enough that a chunk's tag costs nothing
MAX_CHUNK_BYTES = 1 << 20
#: the smallest chunk: a small update is still cut in ~8 so the hops overlap, not into tiny writes
MIN_CHUNK_BYTES = 256 << 10
_CHUNKS = 8
_TAG = 32
_HEADER = struct.Struct("!Q16sQQ")  # version, nonce, total bytes, chunk bytes
#: who opened a link: a carrier says its worker index, the main process this
FROM_MAIN = -1


def chunk_bytes(total: int) -> int:
    """The chunk size of a ``total``-byte update: ~8 chunks, within [256 KiB, 4 MiB]."""
    return min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, -(-total // _CHUNKS)))


def relay_key(authkey: bytes) -> bytes:
    """The key carriers authenticate links and chunks with, derived from the weight channel's key."""
    return hmac.new(authkey, b"rlharvest-relay", "sha256").digest()


@dataclass(frozen=True)
class Stream:
    """One update on the relay: its version, its nonce (16 random bytes from the main process), its
    size and its chunk size."""

    version: int
    nonce: bytes
    total: int
    chunk: int

    @classmethod
    def new(cls, version: int, total: int) -> "Stream":
        return cls(version, os.urandom(16), total, chunk_bytes(total))

    @property
    def count(self) -> int:
        return -(-self.total // self.chunk)

    def header(self) -> bytes:
        return _HEADER.pack(self.version, self.nonce, self.total, self.chunk)

    def piece(self, data: memoryview, index: int) -> memoryview:
        return data[index * self.chunk:min(self.total, (index + 1) * self.chunk)]


def chunk_tag(key: bytes, stream: Stream, index: int, payload) -> bytes:
    """HMAC-SHA256 of chunk ``index`` of ``stream``: binds its bytes to the update and their place."""
    tag = hmac.new(key, stream.nonce + stream.version.to_bytes(8, "big") + index.to_bytes(8, "big"), "sha256")
    tag.update(payload)
    return tag.digest()


def local_address(conn) -> str:
    """The address of this end of ``conn``: where other hosts reach this host."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        return sock.getsockname()[0]


def _raw(channel) -> socket.socket:
    """The socket under an authenticated channel, for chunks sent and received without copies (the
    channel itself is closed: from now on, the chunk tags authenticate what crosses the link)."""
    sock = socket.socket(fileno=os.dup(channel.fileno()))
    channel.close()
    return sock


def _close(sock: socket.socket | None) -> None:
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


class Links:
    """Links this process opened to carriers downstream, by address, kept from one update to the next.

    Args:
        key: the relay key (:func:`relay_key`).
        me: how this process names itself to the listener (a worker index, or :data:`FROM_MAIN`).
        handshake_timeout, user_timeout: of the handshake and the TCP connection.
    """

    def __init__(self, key: bytes, me: int, handshake_timeout: float, user_timeout: float) -> None:
        self.key, self.me = key, me
        self.handshake_timeout, self.user_timeout = handshake_timeout, user_timeout
        self._open: dict[tuple[str, int], socket.socket] = {}
        self._lock = threading.Lock()

    def get(self, address: tuple[str, int]) -> socket.socket | None:
        """The link to ``address``: the one kept if its peer did not close it, else a new one; None if
        it cannot be opened (the carrier there then asks the main process for the update)."""
        address = (address[0], int(address[1]))
        with self._lock:
            sock = self._open.get(address)
        if sock is not None and not _peer_closed(sock):
            return sock
        self.drop(address)
        try:
            channel = open_channel(address[0], address[1], self.key, self.handshake_timeout, self.user_timeout,
                                   self.handshake_timeout)
            channel.send(("relay-link", self.me))
        except (OSError, EOFError, AuthenticationFailed):
            return None
        sock = _raw(channel)
        with self._lock:
            self._open[address] = sock
        return sock

    def drop(self, address: tuple[str, int] | None) -> None:
        """Close the link to ``address`` (it broke, or its update was given up part-way)."""
        if address is None:
            return
        with self._lock:
            sock = self._open.pop((address[0], int(address[1])), None)
        _close(sock)

    def close(self) -> None:
        with self._lock:
            socks, self._open = list(self._open.values()), {}
        for sock in socks:
            _close(sock)


def _peer_closed(sock: socket.socket) -> bool:
    """Whether the far end closed a link we only ever write to (it then reads as ready: EOF or reset)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def _at_end(sock: socket.socket) -> bool:
    """Whether a link we read from was closed by its far end (nothing but its end is left to read)."""
    timeout = sock.gettimeout()
    sock.settimeout(0.0)  # a peek that never waits (with a timeout set, recv would wait for data)
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (BlockingIOError, InterruptedError):
        return False  # open, nothing waiting yet
    except OSError:
        return True  # reset
    finally:
        sock.settimeout(timeout)


class RelayPort:
    """A node's relay listener, on the address its weight channel leaves from (port from the OS), and
    the links upstream carriers (or the main process) opened to it."""

    def __init__(self, address: str, authkey: bytes, handshake_timeout: float, user_timeout: float) -> None:
        self.key = relay_key(authkey)
        self.listener = ChannelListener(listen(address, 0, attempts=1), self.key, "relay", handshake_timeout,
                                        user_timeout)
        self.port = self.listener.port
        self._links: dict[int, socket.socket] = {}

    def upstream(self, sender: int, timeout: float) -> socket.socket | None:
        """The link from ``sender`` (a worker index or :data:`FROM_MAIN`), waiting up to ``timeout``
        seconds for it to connect; None if it did not."""
        deadline = time.monotonic() + timeout
        while True:
            self._take(0.0 if sender in self._links else max(0.0, min(0.2, deadline - time.monotonic())))
            if sender in self._links and _at_end(self._links[sender]):  # e.g. its sender died and was replaced
                self.drop(sender)
            if sender in self._links:
                return self._links[sender]
            if time.monotonic() >= deadline:
                return None

    def _take(self, timeout: float) -> None:
        """Links that connected meanwhile; a newer link from the same sender replaces the older."""
        while True:
            item = self.listener.next(timeout)
            if item is None:
                return
            timeout = 0.0
            channel, hello, peer = item
            if not (isinstance(hello, tuple) and len(hello) == 2 and hello[0] == "relay-link"
                    and type(hello[1]) is int):
                channel.close()
                self.listener.drop(peer, f"unexpected hello {hello!r:.80}")
                continue
            _close(self._links.pop(hello[1], None))
            self._links[hello[1]] = _raw(channel)

    def drop(self, sender: int) -> None:
        """Close the link from ``sender`` (its update broke part-way: the stream is no longer in step)."""
        _close(self._links.pop(sender, None))

    def close(self) -> None:
        self.listener.close()
        for sock in self._links.values():
            _close(sock)
        self._links.clear()


class Forwarder:
    """Sends ``stream`` from ``data`` over a link, in a thread, chunk by chunk as they are given
    (:meth:`put`); the main process gives them all at once and has the tags computed here.

    A link that fails (or a stream given up with ``finish(False)``) is dropped through ``broken``:
    the carrier downstream then misses chunks and asks the main process for the update.
    """

    def __init__(self, connect: Callable[[], socket.socket | None], broken: Callable[[], None], data: memoryview,
                 stream: Stream, silence: float, key: bytes | None = None) -> None:
        self._connect, self._broken = connect, broken
        self.data, self.stream, self.silence, self.key = data, stream, silence, key
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.failed = False
        self._thread = threading.Thread(target=self._run, name="rlharvest-relay-forward", daemon=True)
        self._thread.start()

    def put(self, index: int, tag: bytes | None = None) -> None:
        """Chunk ``index`` is in ``data`` (with its ``tag``, or None to compute it here)."""
        self._queue.put((index, tag))

    def put_all(self) -> None:
        for index in range(self.stream.count):
            self.put(index)
        self.finish(True)

    def finish(self, whole: bool) -> None:
        """No more chunks: the stream is complete (``whole``) or was given up (the link is closed)."""
        self._queue.put(whole)

    def wait(self, timeout: datetime.timedelta | float | None = None) -> None:
        """Until the thread is done with ``data`` (a failed link does not raise: its carrier falls back)."""
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        self._thread.join(timeout)

    def _run(self) -> None:
        item = None
        try:
            sock = self._connect()
            if sock is None:
                raise ConnectionError("no link")
            sock.settimeout(self.silence)
            sock.sendall(self.stream.header())
            while True:
                item = self._queue.get()
                if item is True:
                    return
                if item is False:
                    raise ConnectionError("the stream was given up")
                index, tag = item
                piece = self.stream.piece(self.data, index)
                sock.sendall(tag if tag is not None else chunk_tag(self.key, self.stream, index, piece))
                sock.sendall(piece)
        except (OSError, ConnectionError):
            self.failed = True
            self._broken()
            while item not in (True, False):  # until the producer is done with ``data``
                item = self._queue.get()


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    while len(view):
        got = sock.recv_into(view)
        if got == 0:
            raise EOFError("the link closed")
        view = view[got:]


def receive(sock: socket.socket, data: memoryview, stream: Stream, key: bytes, silence: float,
            forwarder: Forwarder | None = None) -> bool:
    """Receive ``stream`` from the link ``sock`` straight into ``data``, checking every chunk's tag and
    handing it to ``forwarder`` once checked. Whether ``data`` now holds all of it: False when the link
    closed, stayed silent ``silence`` seconds, or sent another update or a chunk that fails its tag
    (the caller then drops the link)."""
    tag = memoryview(bytearray(_TAG))
    try:
        sock.settimeout(silence)
        header = bytearray(_HEADER.size)
        _recv_into(sock, memoryview(header))
        if bytes(header) != stream.header():
            return False
        for index in range(stream.count):
            piece = stream.piece(data, index)
            _recv_into(sock, tag)
            _recv_into(sock, piece)
            if not hmac.compare_digest(tag, chunk_tag(key, stream, index, piece)):
                return False
            if forwarder is not None:
                forwarder.put(index, bytes(tag))
        return True
    except (OSError, EOFError):
        return False
