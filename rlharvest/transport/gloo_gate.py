"""The gate on gloo's port while a pair group forms (docs/security.md, "Groups").

gloo accepts every connection made to the listening socket of a group's device and keeps each one,
even one its peer closed, for the group's whole life (torch 2.13); a failed ``accept`` (no
descriptor left) aborts the process. A stranger who reached that port while a pair formed could so
exhaust the learner's descriptors, and under a low descriptor limit kill it. So:

* **The kernel completes no stranger's connection.** As soon as gloo's device exists, a classic
  BPF socket filter on its listening socket (:class:`Gate`) admits only SYN packets: a handshake
  may start, and waits in the kernel's SYN queue (no descriptor), but its last ACK is dropped, so
  it never reaches gloo's ``accept``.
* **The pair's own connection is let in by name.** The rank whose gloo connects reports, on the
  authenticated channel, the address and port its connection leaves from (:meth:`Gate.outgoing`);
  the other rank's filter then admits that address alone (:meth:`Gate.admit`), and the
  connection, retransmitted by its kernel, completes within ~0.2 s.
* **Once the pair proved itself the port closes** (:meth:`Gate.close`): the listening socket is
  swapped for one nobody reaches, IPv4 or IPv6, and any connection accepted in the milliseconds
  before the filter was on is closed too.

Linux only (``/proc/self/fd``), as the rest of the pair groups.
"""

from __future__ import annotations

import ctypes
import os
import socket
import stat
import struct
import threading
from dataclasses import dataclass
from typing import Iterator

__all__ = ["Gate", "GateUnavailable", "Endpoint", "packed"]

_SO_ATTACH_FILTER, _SO_DETACH_FILTER = 26, 27
_SKF_NET_OFF = -0x100000
_LD_ABS_W, _LD_ABS_H, _LD_ABS_B = 0x20, 0x28, 0x30
_AND_K, _JEQ_K, _RET_K = 0x54, 0x15, 0x06
_ACCEPT, _DROP = 0xFFFFFFFF, 0
#: only pure SYNs pass: ``flags & (SYN|ACK) == SYN`` (byte 13 of the TCP header)
_SYN_ONLY = [(_LD_ABS_B, 0, 0, 13), (_AND_K, 0, 0, 0x12), (_JEQ_K, 0, 1, 0x02), (_RET_K, 0, 0, _ACCEPT),
             (_RET_K, 0, 0, _DROP)]
#: creating a device and finding its listening socket: one at a time in this process
_CREATING = threading.Lock()


class GateUnavailable(RuntimeError):
    """gloo's listening socket could not be found (its port would stay open for the group's life)."""


@dataclass(frozen=True)
class Endpoint:
    """A TCP address: ``family`` (``socket.AF_INET`` or ``AF_INET6``), ``host`` and ``port``."""

    family: int
    host: str
    port: int

    def encode(self) -> bytes:
        raw = socket.inet_pton(self.family, self.host)
        return bytes([len(raw)]) + struct.pack("!H", self.port) + raw

    @classmethod
    def decode(cls, data: bytes) -> Endpoint:
        """Raises:
            ValueError: for anything but an encoded IPv4 or IPv6 endpoint."""
        if len(data) not in (7, 19) or data[0] != len(data) - 3:
            raise ValueError("not an encoded endpoint")
        family = socket.AF_INET if data[0] == 4 else socket.AF_INET6
        return cls(family, socket.inet_ntop(family, data[3:]), struct.unpack("!H", data[1:3])[0])


def packed(family: int, address: tuple) -> bytes:
    """How ``address`` starts in a ``sockaddr`` (what gloo writes into the pair's store)."""
    host, port = address[0], address[1]
    if family == socket.AF_INET:
        return struct.pack("=H", family) + struct.pack("!H", port) + socket.inet_aton(host)
    flowinfo = address[2] if len(address) > 2 else 0
    return struct.pack("=H", family) + struct.pack("!HI", port, flowinfo) + socket.inet_pton(family, host.split("%")[0])


def _links() -> dict[int, str]:
    """``fd -> what it is`` (e.g. ``socket:[123]``) for this process's descriptors."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            found[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
    return found


def _tcp_sockets(fds) -> Iterator[tuple[int, socket.socket]]:
    """``(fd, a duplicate of it)`` for the TCP sockets among ``fds`` (the caller closes nothing)."""
    for fd in fds:
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:  # closed meanwhile
            continue
        with sock:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                yield fd, sock


def _attach(fd: int, program: list[tuple[int, int, int, int]]) -> None:
    code = (ctypes.c_ubyte * (8 * len(program)))()
    for index, instruction in enumerate(program):
        struct.pack_into("=HBBI", code, 8 * index, *instruction)
    with socket.socket(fileno=os.dup(fd)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, struct.pack("@HP", len(program), ctypes.addressof(code)))


def _only(peer: Endpoint) -> list[tuple[int, int, int, int]]:
    """A filter admitting the packets of ``peer`` alone."""
    raw = socket.inet_pton(peer.family, peer.host)
    start = 12 if peer.family == socket.AF_INET else 8  # the source address in the IP header
    words = [struct.unpack("!I", raw[i:i + 4])[0] for i in range(0, len(raw), 4)]
    program, checks = [], len(words) + 1
    for index, word in enumerate(words):
        program += [(_LD_ABS_W, 0, 0, (_SKF_NET_OFF + start + 4 * index) & 0xFFFFFFFF),
                    (_JEQ_K, 0, 2 * (checks - index) - 1, word)]
    program += [(_LD_ABS_H, 0, 0, 0), (_JEQ_K, 0, 1, peer.port), (_RET_K, 0, 0, _ACCEPT), (_RET_K, 0, 0, _DROP)]
    return program


def _retire(fd: int) -> None:
    """Make ``fd`` a listening Unix socket with an empty backlog that gloo no longer polls: the port
    refuses connections and gloo, which closes the descriptor with the group, finds nothing there."""
    dummy = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        dummy.bind("")  # an abstract name of the kernel's choosing
        dummy.listen(0)
        dummy.setblocking(False)  # as gloo's own: accept() says EAGAIN instead of waiting
        os.dup2(dummy.fileno(), fd, inheritable=False)
    finally:
        dummy.close()


def _close_in_place(fd: int) -> None:
    """Close the connection at ``fd`` while the descriptor stays gloo's (it closes it itself later)."""
    with open(os.devnull, "rb") as null:
        os.dup2(null.fileno(), fd, inheritable=False)


class Gate:
    """The gate on the listening socket of one pair group's gloo device (see the module docstring).

    Made before the devices (:meth:`devices`); :meth:`published` checks it holds the socket whose
    address gloo wrote; :meth:`outgoing` finds this rank's own connection to the peer;
    :meth:`admit` lets the peer's connection in; :meth:`close` closes the port.
    """

    def __init__(self) -> None:
        self._before = _links()
        self._lock = threading.Lock()
        self.listening: dict[int, bytes] = {}  # fd -> packed address
        #: the peer's connection, once its rank reported it (this rank's gloo then accepts it)
        self.admitted: Endpoint | None = None

    def devices(self, host: str | None) -> list:
        """gloo's devices on ``host``, their listening sockets filtered. Without ``host``, torch's own
        choice: one per interface of ``$GLOO_SOCKET_IFNAME`` (comma-separated) if set, else the
        address of this host's name."""
        import torch.distributed as dist

        with _CREATING:
            before = _links()
            if host is not None:
                devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            elif len(os.environ.get("GLOO_SOCKET_IFNAME", "")) > 1:
                devices = [dist.ProcessGroupGloo.create_device(interface=name)
                           for name in os.environ["GLOO_SOCKET_IFNAME"].split(",")]
            else:
                devices = [dist.ProcessGroupGloo.create_default_device()]
            fresh = [fd for fd, link in _links().items() if before.get(fd) != link]
            for fd, sock in _tcp_sockets(fresh):
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    _attach(fd, _SYN_ONLY)
                    self.listening[fd] = packed(sock.family, sock.getsockname())
        return devices

    def published(self, written: bytes) -> None:
        """gloo wrote ``written`` (its addresses) into the pair's store: keep the filter on the
        listening sockets named there only, and put it on any that is named but was not found.

        Raises:
            GateUnavailable: no listening socket of this process is named there.
        """
        for fd in [fd for fd, address in self.listening.items() if address not in written]:
            with socket.socket(fileno=os.dup(fd)) as sock:  # another listener created meanwhile: not gloo's
                sock.setsockopt(socket.SOL_SOCKET, _SO_DETACH_FILTER, 0)
            del self.listening[fd]
        if not self.listening:
            for fd, sock in _tcp_sockets(_links()):
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) \
                        and (address := packed(sock.family, sock.getsockname())) in written:
                    _attach(fd, _SYN_ONLY)
                    self.listening[fd] = address
        if not self.listening:
            raise GateUnavailable("gloo's listening socket was not found: its port would stay open")

    def outgoing(self, published: list[bytes]) -> Endpoint | None:
        """This rank's connection to an address the peer ``published`` (this rank's gloo connects to
        the peer's): where it leaves from, or None while there is none."""
        fresh = [fd for fd, link in _links().items() if self._before.get(fd) != link]
        for _, sock in _tcp_sockets(fresh):
            try:
                peer, local = sock.getpeername(), sock.getsockname()
            except OSError:  # not connected (yet)
                continue
            if any(packed(sock.family, peer) in value for value in published):
                return Endpoint(sock.family, local[0].split("%")[0], local[1])
        return None

    def admit(self, peer: Endpoint) -> None:
        """Let ``peer``'s connection in (its rank reported it), and no other."""
        with self._lock:
            self.admitted = peer
            for fd in self.listening:
                with socket.socket(fileno=os.dup(fd)) as sock:
                    if sock.family == peer.family:
                        _attach(fd, _only(peer))

    def close(self) -> int:
        """The pair proved itself: close the port (its listening sockets) and any connection accepted
        on it but the peer's. Returns how many listening sockets were closed.

        Raises:
            GateUnavailable: when none was.
        """
        with self._lock:
            addresses = set(self.listening.values())
            for fd in self.listening:
                _retire(fd)
            retired, self.listening = len(self.listening), {}
        if not retired:
            raise GateUnavailable("gloo's listening socket was not found: its port would stay open")
        fresh = [fd for fd, link in _links().items() if self._before.get(fd) != link]
        for fd, sock in _tcp_sockets(fresh):
            try:
                local, peer = sock.getsockname(), sock.getpeername()
            except OSError:
                continue
            if packed(sock.family, local) in addresses \
                    and Endpoint(sock.family, peer[0].split("%")[0], peer[1]) != self.admitted:
                _close_in_place(fd)
        return retired
