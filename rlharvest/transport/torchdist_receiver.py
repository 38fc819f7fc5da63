"""Node end of the weights to nodes (the receiver of DistributedWeightSyncScheme): a thread reads
the node's weight channel, the worker loop maps or receives each announced payload and swaps it in
between two env steps; as its host's carrier it receives the update into a slot the host's other
nodes map (docs/weights.md, "One copy per host"). The sender is :mod:`.torchdist_weights`.

A generation to map (nothing to wait for) can be taken by the reader thread itself, when the scheme
asked for it (:meth:`DistWeightReceiver.take_early`): it maps the generation, the scheme swaps it in
under the policy's lock and acknowledges, so the update does not wait for the collection loop to
reach its next step boundary. Updates the loop takes and updates the thread takes are taken in the
order they arrived, one at a time (:attr:`DistWeightReceiver.taking`).
"""

from __future__ import annotations

import datetime
import functools
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from tensordict import TensorDictBase

from ..data.flat import FlatLayout
from ..errors import RemoteFailure
from .base import WeightReceiver
from .channel import open_channel, shutdown_connection
from .ports import boot_id, is_loopback
from .rendezvous import WEIGHTS_TAG
from .torchdist_hosts import shm_identity, valid_segment_name
from .torchdist_relay import Forwarder, Links, RelayPort, Stream, local_address, receive, relay_port_key, unwrap_key, \
    weight_key
from .weight_pool import attach_named, create_named, unlink_named

__all__ = ["NodeGroupLinks", "DistWeightReceiver", "is_receiver_message"]


@dataclass
class NodeGroupLinks:
    """What a node's weight receiver needs from its transport: the node's group with the main
    process (and the main process's rank in it), and the node's slot key (its weight channel's key
    derives from it) and rank."""

    group: Any
    parent_rank: int = 0
    key: bytes | None = field(default=None, repr=False)
    rank: int | None = None


class DistWeightReceiver(WeightReceiver):
    """Node end: a reader thread on the weight channel; payloads mapped or received, then swapped in."""

    zero_copy = True

    def __init__(self, info: dict, worker_idx: int, links: NodeGroupLinks | None = None,
                 user_timeout: float = 10.0) -> None:
        self.info = info
        self.worker_idx = worker_idx
        self.links = links
        self.user_timeout = user_timeout
        self.conn = None
        self._inbox: queue.Queue = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        self._wake_box = [self._wake_w]  # what the reader thread writes to (-1 once closed)
        self._segments: dict[Any, tuple] = {}  # generation or slot id -> (mapping, view)
        self._owned: dict[Any, tuple] = {}  # slot id -> (name, flat) of the slots this node created as carrier
        self._gen_id: Any = None
        self._layout: FlatLayout | None = None
        self._buffers: list | None = None  # two (flat, view) pairs received over the process group
        self._in_use = 1
        self._thread: threading.Thread | None = None
        self._relay: RelayPort | None = None  # where the carrier upstream connects (docs/weights.md, "A relay")
        self._downstream: Links | None = None  # the link to the next carrier, kept between updates
        self._forwarder: Forwarder | None = None  # the last update's forwarding, which reads its slot
        self._key: bytes | None = None  # this node's weight key (derived: docs/security.md, "The key")
        #: held while an update is taken (by the worker loop or the reader thread), one at a time
        self.taking = threading.Lock()
        self._early: Callable[[int, Callable[[], TensorDictBase]], bool] | None = None
        self._early_box: list = [None]  # what the reader thread calls (a weak reference to this receiver)

    def fileno(self) -> int:
        return self._wake_r

    def wait_handle(self):
        return self

    def connect(self, timeout: float) -> TensorDictBase | None:
        """Open the weight channel (with this node's weight key, derived from its slot key and the
        sender's salt) and take the initial weights.

        Raises:
            RuntimeError: without the node's slot key (a receiver outside a torchdist node).
        """
        info, links = self.info, self.links
        if links is None or links.key is None or "salt" not in info:
            raise RuntimeError("a DistributedWeightSyncScheme receiver runs in a node of a DistributedCollector: its "
                               "weight channel's key derives from the node's key.")
        self._key = weight_key(links.key, bytes.fromhex(info["salt"]))
        handshake = info.get("handshake_timeout", 5.0)
        self.conn = open_channel(info["host"], info["port"], self._key, timeout, self.user_timeout, handshake,
                                 key_id=self.worker_idx + 1)
        hello = ("hello", self.worker_idx, is_loopback(info["host"]), boot_id(), shm_identity())
        if info.get("relay") and not hello[2]:  # another host's carrier may forward to it
            self._relay = RelayPort(local_address(self.conn), relay_port_key(self._key), handshake, self.user_timeout)
            self._downstream = Links(self.worker_idx, handshake, self.user_timeout)
            hello += (self._relay.port,)
        self.conn.send_hello(hello)
        kind, version, body = self.conn.recv()  # a replacement gets the current weights and their version
        if kind != "init":
            raise RuntimeError(f"unexpected weight-channel message {kind!r} during connect")
        # The thread holds the channel and the inbox, not the receiver: when it ends it must not drop
        # the last reference to the weight buffers (deallocating tensors in a daemon thread while the
        # interpreter finalizes can abort the process).
        self._thread = threading.Thread(target=_read_loop, args=(self.conn, self._inbox, self._wake_box,
                                                                 self._early_box),
                                        name="rlharvest-weights-reader", daemon=True)
        self._thread.start()
        return None if body is None else self._payload(version, body, timeout)

    def _payload(self, version: int, body, timeout: float) -> TensorDictBase:
        if body[0] == "shm":
            _, gen_id, handle = body
            if handle is not None:
                self._segments[gen_id] = attach_named(handle)
            self._gen_id = gen_id
            return self._segments[gen_id][1]
        if body[0] == "pg-host":
            return self._carry(version, *body[1:], timeout=timeout)
        _, layout = body
        if layout is not None:
            self._layout = layout
        if self._buffers is None:
            self._buffers = [self._layout.allocate(), self._layout.allocate()]
        self._in_use = 1 - self._in_use  # receive into the buffer the model does not run on
        flat, view = self._buffers[self._in_use]
        self._recv_flat(flat, timeout)
        self._gen_id = None
        return view

    def _carry(self, version: int, slot_id, name: str, layout: FlatLayout | None, unlink: list[str],
               relay: tuple | None = None, *, timeout: float) -> TensorDictBase:
        """As its host's carrier: receive the update into slot ``slot_id`` (created as ``name`` the
        first time), tell the main process it is there (the host's other nodes then map it), and run
        on it.

        The slot is one no node of this host runs on or waits for (the main process chose it), so
        nobody maps a partial update; the names in ``unlink`` are slots of a carrier that is gone.
        ``relay``: ``(upstream, downstream, silence, nonce, chunk, digests)``: the update comes on the relay
        between hosts, from ``upstream`` (a carrier's index, or the main process), to be forwarded to the
        carrier at ``downstream`` (or None); see :meth:`_relay_update`.
        """
        if layout is not None:
            self._layout = layout
        for old in unlink:
            if valid_segment_name(old):
                unlink_named(old)
        if slot_id not in self._owned:
            if not valid_segment_name(name):
                raise ValueError(f"not a weight slot name: {name!r:.80}")
            mapping, flat, view, handle = create_named(name, self._layout)
            self._segments[slot_id] = (mapping, view)
            self._owned[slot_id] = (handle, flat)
        _, flat = self._owned[slot_id]
        if relay is None:
            self._recv_flat(flat, timeout)
        else:
            self._relay_update(version, slot_id, flat, *relay, timeout=timeout)
        self.conn.send(("staged", version, slot_id))
        self._gen_id = slot_id
        return self._segments[slot_id][1]

    def _relay_update(self, version: int, slot_id, flat: torch.Tensor, upstream: int, downstream, silence: float,
                      nonce: bytes, chunk: int, digests: bytes, timeout: float) -> None:
        """Take the update into ``flat`` on the relay between hosts (docs/weights.md): over the link
        from ``upstream`` (the carrier before this one, or the main process), checking each chunk
        against ``digests`` (from the main process) and forwarding it at once to the carrier at
        ``downstream`` (``(address, port, its relay key wrapped under this node's weight key)``, or
        None). A relay that breaks, stays silent ``silence`` seconds, misses ``timeout`` or sends a
        bad chunk: the main process sends the whole update instead, and the carrier after this one
        does the same (its link is closed)."""
        if self._forwarder is not None:  # the previous update's forwarding reads the slot it came in
            self._forwarder.wait()
        deadline = time.monotonic() + timeout
        data = memoryview(flat.numpy())
        stream = Stream(version, nonce, flat.numel(), chunk)
        out = None
        if downstream is not None and self._downstream is not None:
            address, key = (downstream[0], int(downstream[1])), unwrap_key(downstream[2], self._key)
            out = Forwarder(lambda: self._downstream.get(address, key), lambda: self._downstream.drop(address), data,
                            stream, silence, deadline)
        link = self._relay.upstream(upstream, silence) if self._relay is not None else None
        whole = link is not None and receive(link, data, stream, digests, silence, out, deadline)
        if link is not None and not whole:
            self._relay.drop(upstream)  # out of step with its sender: the next update opens a new one
        if out is not None:
            out.finish(whole)
            self._forwarder = out
        if not whole:
            self.conn.send(("unrelayed", version, slot_id))
            self._recv_flat(flat, timeout)

    def _recv_flat(self, flat: torch.Tensor, timeout: float) -> None:
        if self.links is None:
            raise RuntimeError("weights over a process group need the node's group: this receiver has none.")
        self.links.group.recv([flat], self.links.parent_rank, WEIGHTS_TAG).wait(datetime.timedelta(seconds=timeout))

    def take_early(self, apply: Callable[[int, Callable[[], TensorDictBase]], bool] | None) -> bool:
        """Let the reader thread take updates that need no waiting (a generation to map): it calls
        ``apply(version, load)`` holding :attr:`taking`, when no earlier update waits for the worker
        loop; ``apply`` calls ``load()`` for the weights (the generation mapped), swaps them in and
        acknowledges, and returns True, or returns False (before ``load``) to leave the update to the
        loop. An exception in ``apply`` leaves the update to the loop too, which takes it again and
        raises. None stops it. Returns True (this receiver supports it)."""
        self._early = apply
        self._early_box[0] = None if apply is None else functools.partial(_take_early, weakref.ref(self))
        return True

    def _take_early(self, message) -> bool:
        """The reader thread: take ``message`` now (True), or leave it to the worker loop (False)."""
        apply = self._early
        if apply is None or not (isinstance(message, tuple) and len(message) == 3):
            return False
        kind, version, body = message
        if kind != "update" or not (isinstance(body, tuple) and body and body[0] == "shm"):
            return False
        if not self.taking.acquire(blocking=False):  # the loop is taking an update: this one comes after it
            return False
        try:
            if not self._inbox.empty():  # an earlier update waits for the loop: keep the order
                return False
            return bool(apply(version, lambda: self._payload(version, body, 0.0)))
        except Exception:  # noqa: BLE001 - the loop takes it again and reports the failure
            return False
        finally:
            self.taking.release()

    def pending(self) -> bool:
        return not self._inbox.empty()

    def receive(self, timeout: float):
        try:
            message = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return None
        os.read(self._wake_r, 1)
        kind, version, body = message
        if kind != "update":
            return None
        return version, self._payload(version, body, 120.0)

    def ack(self, version: int) -> None:
        self.conn.send(("ack", version, self._gen_id))

    def nack(self, failure) -> None:
        self.conn.send(("error", failure))

    def close(self) -> None:
        self._early, self._early_box[0] = None, None
        if self.conn is not None:
            # close() alone does not wake a recv() blocked in the reader thread; shutdown() does. The
            # reader ends first: a connection closed under its recv() raised TypeError in the thread.
            shutdown_connection(self.conn)
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self.conn is not None:
            try:
                self.conn.close()
            except OSError:
                pass
        if self._forwarder is not None:
            self._forwarder.wait(2.0)
        if self._downstream is not None:
            self._downstream.close()
        if self._relay is not None:
            self._relay.close()
        for (name, _), _ in self._owned.values():
            unlink_named(name)  # nodes still mapping a slot keep it; nobody maps it anew after its carrier left
        for segment, _ in self._segments.values():
            try:
                segment.close()
            except (BufferError, OSError):
                pass  # views of the segment may still be alive in the model: the OS frees it at exit
        # Once: a second close would close whatever reused the descriptor numbers (the reader thread
        # stops writing to -1).
        fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        self._wake_box[0] = -1
        for fd in fds:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass


def _is_id(value: Any) -> bool:
    """A generation's id (an int) or a slot's (two ints)."""
    return type(value) is int or (type(value) is tuple and len(value) == 2 and all(type(v) is int for v in value))


def is_receiver_message(message: Any) -> bool:
    """What a receiver sends its sender (the main process takes nothing else on a weight channel):
    ``("ack", version, generation or slot or None)``, ``("error", failure)``, ``("staged" or
    "unrelayed", version, slot)``."""
    if type(message) is not tuple or not message:
        return False
    if message[0] == "error":
        return len(message) == 2 and type(message[1]) is RemoteFailure
    if len(message) != 3 or type(message[1]) is not int:
        return False
    return (message[0] == "ack" and (message[2] is None or _is_id(message[2]))) or \
        (message[0] in ("staged", "unrelayed") and _is_id(message[2]))


def _take_early(receiver_ref: weakref.ref, message) -> bool:
    receiver = receiver_ref()
    return receiver is not None and receiver._take_early(message)


def _read_loop(conn, inbox: queue.Queue, wake_box: list[int], early_box: list) -> None:
    """Move weight-channel messages to ``inbox`` and wake the worker loop (through the descriptor in
    ``wake_box``, -1 once the receiver closed it), until the channel closes; a message the function
    in ``early_box`` takes at once (:meth:`DistWeightReceiver.take_early`) goes nowhere else."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        early = early_box[0]
        if early is not None and early(message):
            continue
        inbox.put(message)
        try:
            if wake_box[0] < 0:
                return
            os.write(wake_box[0], b"x")
        except OSError:  # the receiver closed meanwhile
            return
