"""Authenticated TCP channels: ``multiprocessing`` Connections (pickled messages) over sockets.

The command channel of a node and the weight channel of the distributed weight-sync scheme are both
made here. Sockets are tuned so that a peer that vanished (host unreachable) makes a blocked send or
receive fail within ``user_timeout`` seconds instead of the kernel's ~15 minutes.
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import os
import socket
import time

from .ports import PortInUseError

__all__ = ["listen", "accept_channel", "open_channel", "shutdown_connection"]


def _tune_socket(sock: socket.socket, user_timeout: float) -> None:
    """Fail blocked sends/receives after ``user_timeout`` s of silence instead of ~15 minutes."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, int(user_timeout / 3)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(user_timeout * 1000))


def listen(host: str, port: int, attempts: int = 10) -> socket.socket:
    """A listening socket on ``port``, or on one of the next ``attempts`` ports if it is taken."""
    for candidate in range(port, port + attempts):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, candidate))
        except OSError:
            sock.close()
            continue
        sock.listen(64)
        return sock
    raise PortInUseError(f"ports {port}..{port + attempts - 1} are all in use.")


def accept_channel(server: socket.socket, authkey: bytes, timeout: float, user_timeout: float):
    """Accept one authenticated connection (``multiprocessing`` Connection over TCP), or None."""
    server.settimeout(timeout)
    try:
        sock, _ = server.accept()
    except socket.timeout:
        return None
    _tune_socket(sock, user_timeout)
    sock.settimeout(None)
    conn = mpc.Connection(sock.detach())
    mpc.deliver_challenge(conn, authkey)
    mpc.answer_challenge(conn, authkey)
    return conn


def open_channel(host: str, port: int, authkey: bytes, timeout: float, user_timeout: float):
    """Connect to a listener made by :func:`listen` and authenticate."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    _tune_socket(sock, user_timeout)
    sock.settimeout(None)
    conn = mpc.Connection(sock.detach())
    mpc.answer_challenge(conn, authkey)
    mpc.deliver_challenge(conn, authkey)
    return conn


def shutdown_connection(conn) -> None:
    """Shut a channel's socket down both ways, which wakes a recv() blocked in another thread."""
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed or never connected
        pass
