"""A weight channel to the Ray actors on the driver's node that bypasses Ray's calls.

A Ray actor call costs a few hundred microseconds each way, and an update through actor calls
takes two per actor (the notice, and its reply once applied). Actors on the driver's node reach
the driver directly instead:

* the sender listens on a Unix socket in a private directory of its own (mode 0700) and hands
  each actor, with its initial weights, an *invitation*: the socket's path, a one-time token and a
  slot of a small named shared-memory *board* (one int64 per actor: the last version announced);
* the actor's receiver connects while it is built (before the worker loop serves), presents the
  token, and maps the board;
* an update writes the actor's slot of the board (what the receiver reads between env steps, a
  memory read) and then sends the notice on the socket (what an idle worker loop wakes on); the
  receiver acknowledges on the same socket. A dead actor closes its socket: the sender's wait
  ends at once.

The socket carries pickles only after the token was checked (the token itself is read as raw
bytes), so a stranger connecting to the path never gets anything unpickled.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import secrets
import select
import shutil
import socket
import tempfile
import time
import weakref
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from typing import Any, Callable

import numpy as np

from ..errors import WorkerError, WorkerTimeoutError
from .weight_pool import map_named

__all__ = ["ChannelServer", "ChannelClient", "Wakeup", "channel_supported"]

#: seconds an accepted connection may take to present its token
_HELLO_SECONDS = 2.0
#: longest single wait, between two liveness checks
_SLICE_SECONDS = 0.2


def channel_supported() -> bool:
    """Whether this host offers what the channel's receiving end waits with (epoll: Linux). Actors
    that use the channel run on the driver's host, so the driver's answer is theirs."""
    return hasattr(select, "epoll")


class ChannelServer:
    """The driver's end: the listening socket, the board, one connection per actor.

    Args:
        num_workers: how many actors (board slots).
    """

    def __init__(self, num_workers: int) -> None:
        self._listener, self._dir = _listen(backlog=max(128, num_workers + 16))
        self.path = os.path.join(self._dir, "s")
        # the directory goes even if the collector is never shut down (at interpreter exit)
        self._remove_dir = weakref.finalize(self, shutil.rmtree, self._dir, True)
        # the board comes in chunks, so that actors added later get slots without moving anybody's
        self._chunk_slots = max(1, num_workers)
        self._chunks: list[tuple[shared_memory.SharedMemory, np.ndarray]] = []
        self.conns: dict[int, Connection] = {}
        self._tokens: dict[bytes, int] = {}

    def invite(self, worker: int, node_id: str | None) -> dict:
        """What actor ``worker`` needs to connect (``node_id``: the driver's node, where it must run)."""
        for token in [t for t, w in self._tokens.items() if w == worker]:
            del self._tokens[token]
        token = secrets.token_hex(16).encode()
        self._tokens[token] = worker
        segment, _, slot = self._slot(worker)
        return {"path": self.path, "token": token, "board": segment.name, "slots": self._chunk_slots,
                "slot": slot, "node": node_id}

    def _slot(self, worker: int) -> tuple[shared_memory.SharedMemory, np.ndarray, int]:
        """The chunk holding actor ``worker``'s slot (created when first needed), and the slot in it."""
        chunk, slot = divmod(worker, self._chunk_slots)
        while len(self._chunks) <= chunk:
            segment = shared_memory.SharedMemory(create=True, size=8 * self._chunk_slots)
            values = np.ndarray((self._chunk_slots,), dtype=np.int64, buffer=segment.buf)
            values[:] = 0
            self._chunks.append((segment, values))
        segment, values = self._chunks[chunk]
        return segment, values, slot

    @property
    def board(self) -> np.ndarray:
        """The version last announced to each actor, by index (a copy)."""
        if not self._chunks:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([values for _, values in self._chunks])

    def connection(self, worker: int, deadline: float, alive: Callable[[], tuple[bool, str]]) -> Connection:
        """The connection of actor ``worker``, accepting connections until it arrived.

        Raises:
            WorkerError: when the actor died before it connected.
            WorkerTimeoutError: when it did not connect by ``deadline``.
        """
        while worker not in self.conns:
            if multiprocessing.connection.wait([self._listener], _SLICE_SECONDS):
                self._accept()
                continue
            ok, description = alive()
            if not ok:
                raise WorkerError(f"the actor died before it opened its weight channel: {description}.",
                                  worker_idx=worker)
            if time.monotonic() > deadline:
                raise WorkerTimeoutError("the actor did not open its weight channel in time.", worker_idx=worker)
        return self.conns[worker]

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(True)
        conn = Connection(sock.detach())
        try:
            token = conn.recv_bytes(64) if conn.poll(_HELLO_SECONDS) else b""
        except (EOFError, OSError):
            token = b""
        worker = self._tokens.pop(token, None)
        if worker is None:  # a stale invitation (a replaced actor) or a stranger
            conn.close()
            return
        self.drop(worker)
        self.conns[worker] = conn

    def announce(self, worker: int, version: int, body: Any) -> None:
        """Write the version on the board, then the notice on the socket (the receiver reads them in
        that order: a notice never arrives before its version)."""
        _, values, slot = self._slot(worker)
        values[slot] = version
        self.conns[worker].send(("update", version, body))

    def drop(self, worker: int) -> None:
        """Forget actor ``worker``'s connection (it is gone, or replaced)."""
        conn = self.conns.pop(worker, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        for worker in list(self.conns):
            self.drop(worker)
        with contextlib.suppress(OSError):
            self._listener.close()
        self._remove_dir()
        chunks, self._chunks = self._chunks, []
        for segment, _ in chunks:
            with contextlib.suppress(OSError, BufferError):  # a descriptor already closed: still unlink the name
                segment.close()
            with contextlib.suppress(FileNotFoundError):
                segment.unlink()


def _listen(backlog: int) -> tuple[socket.socket, str]:
    """A listening socket at ``<dir>/s`` in a new private directory (mode 0700: only this user can
    connect to it), in the temporary directory or in /tmp.

    Actors connect while they are built and are accepted at the first update: the backlog holds
    every actor's connection until then, so none waits in ``connect``.
    """
    try:
        return _listen_in(tempfile.gettempdir(), backlog)
    except OSError:  # e.g. a TMPDIR too long for a socket's path (108 bytes at most)
        return _listen_in("/tmp", backlog)


def _listen_in(parent: str, backlog: int) -> tuple[socket.socket, str]:
    directory = tempfile.mkdtemp(prefix="rlharvest-weights-", dir=parent)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(os.path.join(directory, "s"))
    except OSError:
        listener.close()
        shutil.rmtree(directory, ignore_errors=True)
        raise
    listener.listen(backlog)
    listener.setblocking(False)
    return listener, directory


class ChannelClient:
    """An actor's end: the connection to the driver and its slot of the board.

    Raises:
        ConnectionError: when the driver's socket cannot be reached (the actor does not share this
            host's file system: pass ``RayWeightSyncScheme(use_shared_memory=False)``).
    """

    def __init__(self, invite: dict, timeout: float) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(invite["path"])
        except OSError as err:
            sock.close()
            raise ConnectionError(f"cannot reach the driver's weight channel at {invite['path']} ({err}); "
                                  f"RayWeightSyncScheme(use_shared_memory=False) avoids it.") from err
        sock.setblocking(True)
        self.conn = Connection(sock.detach())
        self.conn.send_bytes(invite["token"])
        self._mapping, board = map_named(invite["board"], 8 * invite["slots"], writable=False)
        self._board = np.frombuffer(board, dtype=np.int64)
        self._slot = invite["slot"]

    def announced(self) -> int:
        """The last version the driver announced to this actor (a read of shared memory)."""
        return int(self._board[self._slot])

    def close(self) -> None:
        self._board = None
        with contextlib.suppress(OSError):
            self.conn.close()
        with contextlib.suppress(BufferError, OSError):
            self._mapping.close()


class Wakeup:
    """One file descriptor ``multiprocessing.connection.wait`` can wait on, ready whenever one of its
    members is (an epoll set): a receiver's wait handle fixed before every source of updates is."""

    def __init__(self, *members) -> None:
        self._epoll = select.epoll()
        for member in members:
            self.add(member)

    def add(self, member) -> None:
        self._epoll.register(member.fileno(), select.EPOLLIN)

    def fileno(self) -> int:
        return self._epoll.fileno()

    def close(self) -> None:
        self._epoll.close()
