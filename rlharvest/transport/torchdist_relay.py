"""Hosts forward weight updates to each other (docs/weights.md, "A relay between hosts").

With two or more remote hosts, the weight sender of nodes (``torchdist_weights``) sends an update over
the process group to the carrier of the first host only; each carrier streams it on to the carrier of
the next host (a chain), over an authenticated TCP channel (:mod:`.channel`) that the downstream
carrier listens on. A carrier writes each chunk into its slot and forwards it at once, so the hosts
of the chain receive the update nearly together; it reports the slot ``staged`` only once it holds
all of it, and the host's other nodes map a slot only after that, as in "One copy per host".

Why TCP channels and not the process groups: a node's group is a pair (the node and the main
process), formed through the store when the node starts; a group among carriers would be a
collective over every rank of the world (``new_group``), which a replacement, a node of another
generation that joined alone, cannot take part in. A channel needs only the key every node already
holds (a key derived from it: the relay is no way into the main process's weight port).

A carrier whose upstream dies, stalls (``user_timeout`` seconds without a byte) or never connects
reports ``unrelayed``: the main process then sends it the update directly over its group; it closes
its own downstream connection, so the hosts after it do the same.
"""

from __future__ import annotations

import hmac
import os
import socket
import threading
import time
from typing import Any

import numpy
import torch

from .channel import ChannelListener, listen, open_channel, shutdown_connection

__all__ = ["CHUNK_BYTES", "relay_key", "RelayPort", "relay_in", "forward", "open_downstream"]

#: bytes per relayed message: small enough that hops overlap, large enough that tags cost nothing
CHUNK_BYTES = 4 << 20


def relay_key(authkey: bytes) -> bytes:
    """The key carriers authenticate each other with, derived from the weight channel's key."""
    return hmac.new(authkey, b"rlharvest-relay", "sha256").digest()


def local_address(conn) -> str:
    """The address of this end of ``conn``: where other hosts reach this host."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        return sock.getsockname()[0]


class RelayPort:
    """A node's relay listener, on the address its weight channel leaves from (port from the OS)."""

    def __init__(self, address: str, authkey: bytes, handshake_timeout: float, user_timeout: float) -> None:
        self.key = relay_key(authkey)
        self.user_timeout = user_timeout
        self.listener = ChannelListener(listen(address, 0, attempts=1), self.key, "relay", handshake_timeout,
                                        user_timeout)
        self.port = self.listener.port

    def accept(self, version: int, timeout: float):
        """The upstream channel that announces ``version`` (stale ones are closed), or None."""
        deadline = time.monotonic() + timeout
        while True:
            item = self.listener.next(max(0.0, min(0.2, deadline - time.monotonic())))
            if item is not None:
                channel, hello, _ = item
                if isinstance(hello, tuple) and hello[:2] == ("relay", version):
                    return channel
                channel.close()  # a late upstream of an earlier update
            elif time.monotonic() >= deadline:
                return None

    def close(self) -> None:
        self.listener.close()


def open_downstream(address: tuple[str, int] | None, authkey: bytes, version: int, handshake_timeout: float,
                    user_timeout: float):
    """The channel to the next carrier, announcing ``version``; None if there is none or it failed
    (the next carrier then asks the main process for the update)."""
    if address is None:
        return None
    try:
        channel = open_channel(address[0], int(address[1]), relay_key(authkey), handshake_timeout, user_timeout,
                               handshake_timeout)
        channel.send(("relay", version))
        return channel
    except (OSError, EOFError, ConnectionError):
        return None


class _Silence:
    """Shuts ``channel`` down when no chunk arrived for ``seconds`` (a stalled upstream keeps its
    socket open and its kernel acknowledges keepalives: only the missing bytes tell)."""

    def __init__(self, channel, seconds: float) -> None:
        self.channel, self.seconds = channel, seconds
        self.last = time.monotonic()
        self.expired = False
        self._done = threading.Event()
        threading.Thread(target=self._watch, name="rlharvest-relay-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self._done.wait(min(0.5, self.seconds / 4)):
            if time.monotonic() - self.last > self.seconds:
                self.expired = True
                shutdown_connection(self.channel)
                return

    def stop(self) -> None:
        self._done.set()


def relay_in(upstream, flat: torch.Tensor, downstream, silence: float) -> tuple[bool, Any]:
    """Receive the update from ``upstream`` into ``flat`` chunk by chunk, forwarding each chunk to
    ``downstream``. Returns ``(whole, downstream)``: whether ``flat`` holds all of it, and the
    downstream channel if it still works (a downstream that fails is dropped: its carrier falls back)."""
    watch = _Silence(upstream, silence)
    offset, total = 0, flat.numel()
    try:
        while offset < total:
            chunk = upstream.recv_bytes()
            watch.last = time.monotonic()
            size = len(chunk)
            if size == 0 or offset + size > total:
                return False, downstream
            flat[offset:offset + size].numpy()[:] = numpy.frombuffer(chunk, dtype=numpy.uint8)
            offset += size
            downstream = forward(downstream, chunk)
        return True, downstream
    except (OSError, EOFError, ConnectionError):
        return False, downstream
    finally:
        watch.stop()
        upstream.close()


def forward(downstream, chunk):
    """``chunk`` to ``downstream``; returns the channel, or None once it failed (then closed)."""
    if downstream is None:
        return None
    try:
        downstream.send_bytes(chunk)
        return downstream
    except (OSError, ConnectionError):
        close(downstream)
        return None


def close(channel) -> None:
    if channel is not None:
        try:
            channel.close()
        except OSError:
            pass
