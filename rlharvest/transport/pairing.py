"""A node's process group with the main process, formed over their authenticated channel (docs/security.md).

With gloo and nccl every node has a group of its own with the main process (two ranks: the main
process is 0, the node 1). torch forms a group through a *store* where each rank writes its address
and reads the other's. torch's ``TCPStore`` is unauthenticated: a stranger who reaches it can write
the next node's address first and become the main process's peer. So no group is formed through it:

1. **The store is the channel.** :class:`ChannelStore` is the group's store, private to the pair:
   what one rank writes travels to the other over their authenticated channel (``("set", key,
   value)`` frames), and nothing else is ever read. A stranger writes to no store of ours.
2. **The pair proves itself.** gloo's own sockets are not authenticated either: a stranger who
   connects to a rank's gloo port while the pair forms could take the place of the other rank. So
   once the group formed, each side sends 32 random bytes *over the group*, and the other returns
   their HMAC under the channel's key *on the channel*. Only a peer that both holds the key and is
   on the other end of the group can: a hijacked group fails the proof and is dropped before any
   batch or weight crosses it (:func:`form_pair` raises; the caller drops the node).

3. **The group's port closes.** gloo keeps its listening socket for the group's whole life and
   keeps every connection made to it, even one its peer closed (torch 2.13): any local user could
   exhaust the process's descriptors through it. A pair needs it only until it is connected, so
   once the pair proved itself its listening socket is swapped for one nobody reaches
   (:func:`retire_listener`); the group keeps working over its connected sockets.

Forming a group has a deadline (``timeout``, the rendezvous timeout) separate from the group's
operation timeout (``op_timeout``), set once the pair has proved itself. gloo waits up to five times
its timeout for a pair's first connection (a peer that accepted the connection but never answers,
e.g. a stranger's group holding the other rank's listener): a gloo group is built with a fifth of the
deadline (:data:`GLOO_CONNECT_FACTOR`), and its store answers gloo's own waits by the deadline itself.
gloo keeps that fifth as the default of waits given no timeout (``_set_default_timeout`` does not
reach it in torch 2.13): every wait on a pair's group passes its own.
"""

from __future__ import annotations

import datetime
import hmac
import os
import socket
import stat
import struct
import time
from typing import Any

import torch
import torch.distributed as dist

from .channel import Channel

__all__ = ["ChannelStore", "GLOO_CONNECT_FACTOR", "PairingFailed", "PAIR_TAG", "distributed_state_exists", "form_pair",
           "make_process_group", "mark_distributed_state", "retire_listener"]

#: the tag of the proof's random bytes on the group (batches and weights use 11 and 12)
PAIR_TAG = 13
_NONCE = 32
_SET, _FORMED, _PROOF = b"S", b"F", b"P"
_KEY = struct.Struct("!H")
#: what one rank may write into the pair's store (gloo writes one address of ~100 bytes)
_MAX_VALUE, _MAX_KEYS = 64 << 10, 64


#: how many times its timeout gloo waits for a pair's first connection (gloo's ``tcp/pair.cc``)
GLOO_CONNECT_FACTOR = 5

_STATE = {"created": False}


def distributed_state_exists() -> bool:
    """Whether this process created torch.distributed state (whose threads make fork unsafe)."""
    return _STATE["created"] or (dist.is_available() and dist.is_initialized())


def mark_distributed_state() -> None:
    """Record that torch.distributed (a store, a group, RPC) now runs threads in this process."""
    _STATE["created"] = True


class PairingFailed(ConnectionError):
    """The pair's group did not form, or its peer failed the proof (it is not the node on the channel)."""


class ChannelStore(dist.Store):
    """The store of one pair group: writes travel to the other rank over ``channel``.

    Only the two ranks' own writes are ever read; the store refuses more than ``_MAX_KEYS`` keys or
    values above 64 KiB from the peer, and any wait ends at ``deadline`` (monotonic seconds).
    """

    def __init__(self, channel: Channel, deadline: float) -> None:
        super().__init__()
        self.channel, self.deadline = channel, deadline
        self._data: dict[str, bytes] = {}
        #: what this rank wrote (gloo's own addresses: where its listening socket is)
        self.written = b""
        self._peer_formed = False
        self._closed = False

    # ------------------------------------------------------------------ what torch calls
    def set(self, key: str, value) -> None:
        self._check_open()
        value = value.encode() if isinstance(value, str) else bytes(value)
        self._data[key] = value
        self.written += value
        raw = key.encode()
        self.channel.send_bytes(_SET + _KEY.pack(len(raw)) + raw + value)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._data[key]

    def wait(self, keys, timeout: datetime.timedelta | None = None) -> None:
        """Until every key of ``keys`` arrived, by the pairing's deadline (gloo's ``timeout`` is a fifth
        of it, for its connect: see the module's docstring)."""
        self._check_open()
        while not all(key in self._data for key in keys):
            self._read(self.deadline)

    def check(self, keys) -> bool:
        self._check_open()
        while self.channel.poll(0):
            self._read(self.deadline)
        return all(key in self._data for key in keys)

    def add(self, key: str, value: int) -> int:  # a counter of one rank only: gloo's pairs do not use it
        total = int(self._data.get(key, b"0")) + value
        self._data[key] = str(total).encode()
        return total

    def num_keys(self) -> int:
        return len(self._data)

    def delete_key(self, key: str) -> bool:
        return self._data.pop(key, None) is not None

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        pass  # the deadline of the pairing holds

    # ------------------------------------------------------------------ the pairing's own frames
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this pair's store closed once the pair formed")

    def _read(self, deadline: float) -> bytes:
        """One frame from the peer: a write is applied here; anything else is returned."""
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not self.channel.poll(remaining):
            raise TimeoutError("the other rank of the pair did not answer in time")
        frame = self.channel.recv_bytes()
        if frame[:1] == _SET and len(frame) >= 1 + _KEY.size:
            (size,), raw = _KEY.unpack_from(frame, 1), frame[1 + _KEY.size:]
            key, value = raw[:size].decode(), raw[size:]
            if len(value) > _MAX_VALUE or (key not in self._data and len(self._data) >= _MAX_KEYS):
                raise PairingFailed("the other rank wrote more than a pair's store holds")
            self._data[key] = value
        elif frame[:1] == _FORMED:
            self._peer_formed = True
        return frame

    def settle(self) -> None:
        """Say this rank's group formed and read the peer's writes up to its own such word: after
        that, the channel holds nothing of the pairing, and the store takes no more writes."""
        self.channel.send_bytes(_FORMED)
        while not self._peer_formed:
            self._read(self.deadline)
        self._closed = True

    def proof(self) -> bytes:
        """The peer's proof frame (the next frame after :meth:`settle`)."""
        frame = self._read(self.deadline)
        if frame[:1] != _PROOF or len(frame) != 1 + _NONCE:
            raise PairingFailed("the other rank sent no proof of its group")
        return frame[1:]


def make_process_group(backend: str, store, rank: int, world_size: int, timeout: float,
                       device_host: str | None = None):
    """An explicit process group (no global default group involved).

    ``device_host`` pins gloo's sockets to one local address (``"127.0.0.1"`` for local nodes);
    without it gloo uses ``GLOO_SOCKET_IFNAME`` or the address this host's name resolves to.
    """
    delta = datetime.timedelta(seconds=timeout)
    mark_distributed_state()
    if backend == "gloo":
        if device_host is None:
            return dist.ProcessGroupGloo(store, rank, world_size, delta)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = delta
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=device_host)]
        return dist.ProcessGroupGloo(store, rank, world_size, options)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = delta
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=delta)
    return dist.group.WORLD


def _proof_mac(key: bytes, nonce: bytes, rank: int) -> bytes:
    return hmac.digest(key, b"rlharvest-pair\0" + bytes([rank]) + nonce, "sha256")


def _prove(group, store: ChannelStore, key: bytes, rank: int, backend: str, deadline: float) -> None:
    """Both ranks send random bytes over the group; each returns the other's HMAC on the channel."""
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    mine = torch.frombuffer(bytearray(os.urandom(_NONCE)), dtype=torch.uint8).to(device)
    theirs = torch.zeros(_NONCE, dtype=torch.uint8, device=device)
    peer = 1 - rank
    works = [group.send([mine], peer, PAIR_TAG), group.recv([theirs], peer, PAIR_TAG)]
    remaining = datetime.timedelta(seconds=max(0.1, deadline - time.monotonic()))
    for work in works:
        work.wait(remaining)
    store.channel.send_bytes(_PROOF + _proof_mac(key, bytes(theirs.cpu().numpy()), peer))
    if not hmac.compare_digest(store.proof(), _proof_mac(key, bytes(mine.cpu().numpy()), rank)):
        raise PairingFailed("the peer of this group is not the node on the channel (a stranger took its place)")


def _listening_sockets() -> dict[int, tuple[str, int]]:
    """``fd -> (address, port)`` of this process's listening IPv4 sockets."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            with socket.socket(fileno=os.dup(fd)) as sock:
                if sock.family == socket.AF_INET and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    found[fd] = sock.getsockname()
        except OSError:  # closed meanwhile, or not a socket we can look at
            continue
    return found


def retire_listener(written: bytes) -> int:
    """Close the listening socket of the gloo group whose addresses this rank ``written`` into its
    store: its descriptor is made to point at a listening Unix socket with an empty backlog that
    gloo no longer polls (a later ``accept`` finds nothing), so the port refuses connections and the
    group, already connected, keeps working; gloo closes the descriptor with the group. Returns
    how many sockets were retired (0 when none matched: the group then keeps its port)."""
    retired = 0
    for fd, (host, port) in _listening_sockets().items():
        sockaddr = struct.pack("=H", socket.AF_INET) + struct.pack("!H", port) + socket.inet_aton(host)
        if sockaddr not in written:
            continue
        dummy = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            dummy.bind("")  # an abstract name of the kernel's choosing
            dummy.listen(0)
            dummy.setblocking(False)  # as gloo's own: accept() says EAGAIN instead of waiting
            os.dup2(dummy.fileno(), fd, inheritable=False)
            retired += 1
        finally:
            dummy.close()
    return retired


def form_pair(channel: Channel, key: bytes, rank: int, backend: str, *, timeout: float, op_timeout: float,
              device_host: str | None = None, make=make_process_group) -> tuple[Any, ChannelStore]:
    """Rank ``rank``'s side (0: the main process, 1: the node) of the pair group over ``channel``.

    ``key``: the key the channel was opened with (both sides hold it). Returns the group and its
    store (keep the store as long as the group: torch holds the store by reference).

    Raises:
        PairingFailed: the peer failed the proof, wrote too much, or the group did not form within
            ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    store = ChannelStore(channel, deadline)
    # gloo waits GLOO_CONNECT_FACTOR times its timeout for the first connection: the whole deadline
    within = max(0.1, timeout) / GLOO_CONNECT_FACTOR if backend == "gloo" else max(0.1, timeout)
    try:
        group = make(backend, store, rank, 2, within, device_host)
        store.settle()
        _prove(group, store, key, rank, backend, deadline)
    except PairingFailed:
        raise
    except (RuntimeError, TimeoutError, OSError, EOFError) as err:
        raise PairingFailed(f"the pair's group did not form: {err}") from err
    set_timeout = getattr(group, "_set_default_timeout", None)
    if set_timeout is not None:
        set_timeout(datetime.timedelta(seconds=op_timeout))
    if backend == "gloo":
        retire_listener(store.written)
    return group, store
