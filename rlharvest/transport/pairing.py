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

3. **gloo's port takes the pair's connection only, then closes.** gloo keeps its listening socket
   for the group's whole life and keeps every connection made to it, even one its peer closed
   (torch 2.13): any local user could exhaust the process's descriptors through it. So the kernel
   completes no connection to it but the one whose address the peer's rank reports on the channel,
   and once the pair proved itself the socket is swapped for one nobody reaches (:mod:`.gloo_gate`);
   the group keeps working over its connected sockets.

Whatever the peer sends that the pairing does not take (a key that is not UTF-8, too much, an
unknown frame) fails the pair with :class:`PairingFailed`, as does anything gloo makes of it: the
caller drops that node, never more.

Forming a group has a deadline (``timeout``, the rendezvous timeout) separate from the group's
operation timeout (``op_timeout``), set once the pair has proved itself. gloo waits up to five times
its timeout for a pair's first connection (a peer that accepted the connection but never answers,
e.g. a stranger's group holding the other rank's listener): a gloo group is built with a fifth of the
deadline (:data:`GLOO_CONNECT_FACTOR`), and its store answers gloo's own waits by the deadline itself.
gloo keeps that fifth as the default of waits given no timeout (``_set_default_timeout`` does not
reach it in torch 2.13): every wait on a pair's group passes its own.
"""

from __future__ import annotations

import contextlib
import datetime
import hmac
import os
import struct
import threading
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

from .channel import Channel
from .gloo_gate import Endpoint, Gate

__all__ = ["ChannelStore", "GLOO_CONNECT_FACTOR", "PairingFailed", "PAIR_TAG", "distributed_state_exists", "form_pair",
           "make_process_group", "mark_distributed_state"]

#: the tag of the proof's random bytes on the group (batches and weights use 11 and 12)
PAIR_TAG = 13
_NONCE = 32
_SET, _FORMED, _PROOF, _PORT = b"S", b"F", b"P", b"A"
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

    Only the two ranks' own writes are ever read; the store refuses more than ``_MAX_KEYS`` keys,
    values above 64 KiB, a key that is not UTF-8 or a frame it does not know from the peer
    (:class:`PairingFailed`), and any wait ends at ``deadline`` (monotonic seconds). Frames are read
    by whichever thread waits (gloo's, or :meth:`reading`'s while gloo connects), one at a time.
    ``gate``: the gate on gloo's port (:mod:`.gloo_gate`), with gloo.
    """

    def __init__(self, channel: Channel, deadline: float, gate: Gate | None = None) -> None:
        super().__init__()
        self.channel, self.deadline, self.gate = channel, deadline, gate
        self._data: dict[str, bytes] = {}
        #: what this rank wrote (gloo's own addresses: where its listening socket is), and the peer
        self.written = self.peer_written = b""
        self._peer_formed = False
        self._proof: bytes | None = None
        self._closed = False
        self._reading = threading.Lock()
        #: what went wrong reading the peer's frames (raised by every later wait)
        self.failure: PairingFailed | None = None

    # ------------------------------------------------------------------ what torch calls
    def set(self, key: str, value) -> None:
        self._check_open()
        value = value.encode() if isinstance(value, str) else bytes(value)
        self._data[key] = value
        self.written += value
        if self.gate is not None:
            self.gate.published(self.written)  # before the peer can know the address
        raw = key.encode()
        self.channel.send_bytes(_SET + _KEY.pack(len(raw)) + raw + value)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._data[key]

    def wait(self, keys, timeout: datetime.timedelta | None = None) -> None:
        """Until every key of ``keys`` arrived, by the pairing's deadline (gloo's ``timeout`` is a fifth
        of it, for its connect: see the module's docstring)."""
        self._check_open()
        self._pump(lambda: all(key in self._data for key in keys))

    def check(self, keys) -> bool:
        self._check_open()
        while self._read_one(0):
            pass
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

    def _pump(self, ready) -> None:
        """Read the peer's frames until ``ready()``, by the deadline."""
        while not ready():
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the other rank of the pair did not answer in time")
            self._read_one(min(remaining, 0.05))

    def _read_one(self, timeout: float) -> bool:
        """Apply the peer's next frame if one comes within ``timeout`` seconds; whether one did.

        While another thread reads (:meth:`reading`'s, which takes the lock again microseconds after
        letting it go), this one does not queue for the lock: it returns after ``timeout``, and its
        caller looks again at what that thread applied. Queued, it could wait for the lock for as
        long as gloo's connect lasted (seconds: a node's group waited 11 s for a key already read).
        """
        if not self._reading.acquire(timeout=timeout):
            return False
        try:
            if self.failure is not None:
                raise self.failure
            if not self.channel.poll(timeout):
                return False
            try:
                self._apply(self.channel.recv_bytes())
            except PairingFailed as err:
                self.failure = err
                raise
            return True
        finally:
            self._reading.release()

    def _apply(self, frame: bytes) -> None:
        kind = frame[:1]
        if kind == _SET and len(frame) >= 1 + _KEY.size:
            (size,), raw = _KEY.unpack_from(frame, 1), frame[1 + _KEY.size:]
            try:
                key = raw[:size].decode()
            except UnicodeDecodeError:
                raise PairingFailed("the other rank wrote a store key that is not UTF-8") from None
            value = raw[size:]
            if len(value) > _MAX_VALUE or (key not in self._data and len(self._data) >= _MAX_KEYS):
                raise PairingFailed("the other rank wrote more than a pair's store holds")
            self._data[key] = value
            self.peer_written += value
        elif kind == _FORMED and len(frame) == 1:
            self._peer_formed = True
        elif kind == _PROOF and len(frame) == 1 + _NONCE and self._proof is None:
            self._proof = frame[1:]
        elif kind == _PORT and self.gate is not None and self.gate.admitted is None:
            try:
                self.gate.admit(Endpoint.decode(frame[1:]))
            except ValueError:
                raise PairingFailed("the other rank reported a malformed address") from None
        else:
            raise PairingFailed(f"the other rank sent a frame the pairing does not take ({bytes(frame[:1])!r})")

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Read the peer's frames on a thread of its own meanwhile (while gloo waits in its connect, the
        peer's report of its connection must be read for the gate to let it in)."""
        stop = threading.Event()

        def run() -> None:
            while not stop.is_set():
                try:
                    self._read_one(0.01)
                except (PairingFailed, OSError, EOFError):
                    return  # a failure is kept and raised to the next wait

        thread = threading.Thread(target=run, name="rlharvest-pair-reader", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(5.0)

    def report(self) -> None:
        """If this rank's gloo connected to the peer's, say where the connection leaves from."""
        if self.gate is not None:
            mine = self.gate.outgoing([self.peer_written])
            if mine is not None:
                self.channel.send_bytes(_PORT + mine.encode())

    def settle(self) -> None:
        """Say this rank's group formed and read the peer's writes up to its own such word: after
        that, the channel holds nothing of the pairing, and the store takes no more writes."""
        self.channel.send_bytes(_FORMED)
        self._pump(lambda: self._peer_formed)
        self._closed = True

    def proof(self) -> bytes:
        """The peer's proof of its group (the frame after :meth:`settle`)."""
        self._pump(lambda: self._proof is not None)
        return self._proof


def make_process_group(backend: str, store, rank: int, world_size: int, timeout: float,
                       device_host: str | None = None):
    """An explicit process group (no global default group involved).

    ``device_host`` pins gloo's sockets to one local address (``"127.0.0.1"`` for local nodes);
    without it gloo uses ``GLOO_SOCKET_IFNAME`` or the address this host's name resolves to. A store
    with a ``gate`` (a pair's, :class:`ChannelStore`) gets gloo's device filtered by it.
    """
    delta = datetime.timedelta(seconds=timeout)
    mark_distributed_state()
    if backend == "gloo":
        gate = getattr(store, "gate", None)
        if gate is None and device_host is None:
            return dist.ProcessGroupGloo(store, rank, world_size, delta)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = delta
        options._devices = (gate.devices(device_host) if gate is not None
                            else [dist.ProcessGroupGloo.create_device(hostname=device_host)])
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


def form_pair(channel: Channel, key: bytes, rank: int, backend: str, *, timeout: float, op_timeout: float,
              device_host: str | None = None, make=make_process_group) -> tuple[Any, ChannelStore]:
    """Rank ``rank``'s side (0: the main process, 1: the node) of the pair group over ``channel``.

    ``key``: the key the channel was opened with (both sides hold it). Returns the group and its
    store (keep the store as long as the group: torch holds the store by reference).

    Raises:
        PairingFailed: the peer failed the proof, wrote too much or anything the pairing does not
            take, or the group did not form within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    store = ChannelStore(channel, deadline, Gate() if backend == "gloo" else None)
    # gloo waits GLOO_CONNECT_FACTOR times its timeout for the first connection: the whole deadline
    within = max(0.1, timeout) / GLOO_CONNECT_FACTOR if backend == "gloo" else max(0.1, timeout)
    try:
        with store.reading():
            group = make(backend, store, rank, 2, within, device_host)
        store.report()
        store.settle()
        _prove(group, store, key, rank, backend, deadline)
        if store.gate is not None:
            store.gate.close()
    except Exception as err:  # whatever the peer sent, or what gloo made of it: this pair fails, nothing else
        cause = store.failure or err
        if isinstance(cause, PairingFailed):
            raise cause from err if cause is not err else None
        raise PairingFailed(f"the pair's group did not form: {type(err).__name__}: {err}") from err
    set_timeout = getattr(group, "_set_default_timeout", None)
    if set_timeout is not None:
        set_timeout(datetime.timedelta(seconds=op_timeout))
    return group, store
