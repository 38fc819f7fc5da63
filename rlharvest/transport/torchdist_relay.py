"""Hosts forward weight updates to each other (docs/weights.md, "A relay between hosts").

With two or more remote hosts, the weight sender of nodes (``torchdist_weights``) streams an update to
the carrier of the first host only; each carrier streams it on to the carrier of the next host (a
chain). A carrier receives each chunk straight into its slot and a forwarding thread sends it on from
there, so the hosts of the chain receive the update nearly together; it reports the slot ``staged``
only once it holds all of it, and the host's other nodes map a slot only after that, as in "One copy
per host".

**Links.** Every hop is a *link*: a TCP connection to the downstream carrier's relay port,
authenticated once with the handshake of :mod:`.channel` under that carrier's *relay key* (derived
from its weight channel's key: :func:`relay_port_key`), then kept open from one update to the next.
Only the main process can derive a carrier's relay key; it gives it to the carrier upstream inside
that carrier's announcement, wrapped under the upstream carrier's own weight key
(:func:`wrap_key`): no key crosses the network in clear. A link is always either between two
updates or closed: whoever gives up on an update part-way closes it, and the next update opens a
new one. A link's hello (who opened it) is decoded as plain values, never unpickled.

**Chunk digests.** On a link, an update is a header (version, a per-update nonce, sizes) and then its
chunks. The main process computes the BLAKE3 hash of every chunk once (32 bytes; the ``blake3``
package) and sends the list to *each* carrier over that carrier's own authenticated weight channel,
with the nonce and the sizes. The hashes need no key: the channel that carries the list is what
makes them trustworthy, and BLAKE3, like SHA-256, is collision resistant, so no one can make other
bytes match them. It hashes about twice as fast as SHA-256 (with SHA-NI) on one core. A
carrier checks each chunk it receives against its list before it forwards it: a chunk that a
stranger on the path or a carrier upstream altered, moved or replayed fails, and the relay breaks.
So a carrier, even one that holds keys, cannot forge an update for the hosts after it.

Why TCP and not the process groups: a node's group is a pair (the node and the main process), formed
when the node starts; a group among carriers would be a collective over every rank of the world
(``new_group``), which a replacement, a node of another generation that joined alone, cannot take
part in.

A carrier whose upstream dies, stalls (``silence`` seconds without a byte, or the update's whole
deadline), never connects or sends a chunk that fails its digest reports ``unrelayed``: the main
process then sends it the update directly over its group; it closes its own downstream link, so the
hosts after it do the same.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import blake3

from .._utils import cpu_count
from .channel import AuthenticationFailed, derive_key, listen, open_channel
from .keys import unwrap_key, wrap_key
from .listener import ChannelListener

__all__ = ["MIN_CHUNK_BYTES", "MAX_CHUNK_BYTES", "Stream", "chunk_bytes", "chunk_digests", "relay_port_key",
           "weight_key", "wrap_key", "unwrap_key", "Links", "RelayPort", "Forwarder", "receive", "local_address"]

#: the largest chunk: small enough that hops overlap, large enough that a chunk's tag costs nothing
MAX_CHUNK_BYTES = 1 << 20
#: the smallest chunk: a small update is still cut in ~8 so the hops overlap, not into tiny writes
MIN_CHUNK_BYTES = 256 << 10
_CHUNKS = 8
_DIGEST = 32
_HEADER = struct.Struct("!Q16sQQ")  # version, nonce, total bytes, chunk bytes
#: who opened a link: a carrier says its worker index, the main process this
FROM_MAIN = -1


def chunk_bytes(total: int) -> int:
    """The chunk size of a ``total``-byte update: ~8 chunks, within [256 KiB, 4 MiB]."""
    return min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, -(-total // _CHUNKS)))


def weight_key(slot: bytes, salt: bytes) -> bytes:
    """The key of a node's weight channel: derived from its slot key and the sender's salt (which
    travels in the node's spec; the key itself never does)."""
    return derive_key(slot, "weights", salt)


def relay_port_key(weights: bytes) -> bytes:
    """The key of a carrier's relay port, derived from its weight channel's key."""
    return derive_key(weights, "relay-port")


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


def chunk_digests(data: memoryview, stream: Stream) -> bytes:
    """The BLAKE3 hash of every chunk of ``stream`` in ``data``, concatenated (32 bytes per chunk).

    The learner computes them before it announces an update, while the carriers wait for it: the
    chunks are hashed on up to 4 threads (BLAKE3 releases the GIL), which roughly halves that wait on
    2 cores. The threads are made for the call and end with it, so a process forked later inherits
    no pool it could not run."""
    pieces = [stream.piece(data, index) for index in range(stream.count)]
    threads = min(4, cpu_count(), len(pieces))
    if threads < 2:
        return b"".join(map(_digest, pieces))
    with ThreadPoolExecutor(threads, thread_name_prefix="rlharvest-relay-digests") as pool:
        return b"".join(pool.map(_digest, pieces))


def _digest(piece: memoryview) -> bytes:
    """A chunk's BLAKE3 hash, on this thread alone (the relay is short of CPU, not of threads)."""
    return blake3.blake3(piece).digest()


def local_address(conn) -> str:
    """The address of this end of ``conn``: where other hosts reach this host."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        return sock.getsockname()[0]


def _raw(channel) -> socket.socket:
    """The socket under an authenticated channel, for chunks sent and received without copies (the
    channel itself is closed: from now on, the chunk digests authenticate what crosses the link)."""
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
        me: how this process names itself to the listener (a worker index, or :data:`FROM_MAIN`).
        handshake_timeout, user_timeout: of the handshake and the TCP connection.
    """

    def __init__(self, me: int, handshake_timeout: float, user_timeout: float) -> None:
        self.me = me
        self.handshake_timeout, self.user_timeout = handshake_timeout, user_timeout
        self._open: dict[tuple[str, int], socket.socket] = {}
        self._lock = threading.Lock()

    def get(self, address: tuple[str, int], key: bytes) -> socket.socket | None:
        """The link to ``address``: the one kept if its peer did not close it, else a new one opened
        with ``key`` (the relay key of the carrier there); None if it cannot be opened (the carrier
        there then asks the main process for the update)."""
        address = (address[0], int(address[1]))
        with self._lock:
            sock = self._open.get(address)
        if sock is not None and not _peer_closed(sock):
            return sock
        self.drop(address)
        try:
            channel = open_channel(address[0], address[1], key, self.handshake_timeout, self.user_timeout,
                                   self.handshake_timeout)
            channel.send_hello(("relay-link", self.me))
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
    the links upstream carriers (or the main process) opened to it.

    Args:
        key: this carrier's relay key (:func:`relay_port_key`).
    """

    def __init__(self, address: str, key: bytes, handshake_timeout: float, user_timeout: float) -> None:
        self.key = key
        self.listener = ChannelListener(listen(address, 0, attempts=1), key, "relay", handshake_timeout,
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
            if not (len(hello) == 2 and hello[0] == "relay-link" and type(hello[1]) is int):
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
    (:meth:`put`; the main process gives them all at once), within ``deadline`` (monotonic seconds).

    The forwarder reads ``data`` until its thread ends: :meth:`wait` returns only then (aborting the
    link if the thread outlives its timeout), so nobody writes the buffer while it is being sent. A
    link that fails (or a stream given up with ``finish(False)``) is dropped through ``broken``: the
    carrier downstream then misses chunks and asks the main process for the update.
    """

    def __init__(self, connect: Callable[[], socket.socket | None], broken: Callable[[], None], data: memoryview,
                 stream: Stream, silence: float, deadline: float | None = None) -> None:
        self._connect, self._broken = connect, broken
        self.data, self.stream, self.silence = data, stream, silence
        self.deadline = deadline if deadline is not None else time.monotonic() + 3600.0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._sock: socket.socket | None = None
        self.failed = False
        self._thread = threading.Thread(target=self._run, name="rlharvest-relay-forward", daemon=True)
        self._thread.start()

    def put(self, index: int) -> None:
        """Chunk ``index`` is in ``data``."""
        self._queue.put(index)

    def put_all(self) -> None:
        for index in range(self.stream.count):
            self.put(index)
        self.finish(True)

    def finish(self, whole: bool) -> None:
        """No more chunks: the stream is complete (``whole``) or was given up (the link is closed)."""
        self._queue.put(whole)

    def wait(self, timeout: datetime.timedelta | float | None = None) -> None:
        """Until the thread is done with ``data`` (a failed link does not raise: its carrier falls
        back). After ``timeout`` seconds the link is aborted, which ends the thread at once (once
        :meth:`finish` was called)."""
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.failed = True
            sock = self._sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked send; the link is dropped below
                except OSError:
                    pass
            self._thread.join()

    def _send(self, sock: socket.socket, data) -> None:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the update's deadline passed")
        sock.settimeout(min(self.silence, remaining))  # bounds the whole sendall (Python >= 3.5)
        sock.sendall(data)

    def _run(self) -> None:
        item = None
        try:
            sock = self._sock = self._connect()
            if sock is None:
                raise ConnectionError("no link")
            self._send(sock, self.stream.header())
            while True:
                item = self._queue.get()
                if item is True:
                    return
                if item is False:
                    raise ConnectionError("the stream was given up")
                self._send(sock, self.stream.piece(self.data, item))
        except (OSError, ConnectionError):
            self.failed = True
            self._broken()
            while item not in (True, False):  # until the producer is done with ``data``
                item = self._queue.get()


def _recv_into(sock: socket.socket, view: memoryview, silence: float, deadline: float) -> None:
    while len(view):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the update's deadline passed")
        sock.settimeout(min(silence, remaining))
        got = sock.recv_into(view)
        if got == 0:
            raise EOFError("the link closed")
        view = view[got:]


def receive(sock: socket.socket, data: memoryview, stream: Stream, digests: bytes, silence: float,
            forwarder: Forwarder | None = None, deadline: float | None = None) -> bool:
    """Receive ``stream`` from the link ``sock`` straight into ``data``, checking every chunk against
    its BLAKE3 hash in ``digests`` (from the main process) and handing it to ``forwarder`` once checked.
    Whether ``data`` now holds all of it: False when the link closed, stayed silent ``silence``
    seconds, did not deliver by ``deadline`` (monotonic seconds), or sent another update or a chunk
    that fails its digest (the caller then drops the link)."""
    deadline = deadline if deadline is not None else time.monotonic() + 3600.0
    if len(digests) != _DIGEST * stream.count:
        return False
    try:
        header = bytearray(_HEADER.size)
        _recv_into(sock, memoryview(header), silence, deadline)
        if bytes(header) != stream.header():
            return False
        for index in range(stream.count):
            piece = stream.piece(data, index)
            _recv_into(sock, piece, silence, deadline)
            if not hmac.compare_digest(_digest(piece), digests[index * _DIGEST:(index + 1) * _DIGEST]):
                return False
            if forwarder is not None:
                forwarder.put(index)
        return True
    except (OSError, EOFError):
        return False
