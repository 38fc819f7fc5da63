"""This host on the network: free TCP ports (always found by asking the OS: bind to port 0), whether
an address is loopback, and which kernel this is (two processes with the same boot id share a
machine, hence its shared memory)."""

from __future__ import annotations

import socket

__all__ = ["free_port", "free_port_block", "port_is_free", "PortInUseError", "boot_id", "is_loopback"]


class PortInUseError(OSError):
    """A port a collector must listen on is taken."""


def port_is_free(port: int, host: str = "") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "") -> int:
    """A port the OS says is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_port_block(count: int = 3, host: str = "", attempts: int = 50) -> int:
    """A base port ``p`` such that ``p .. p+count-1`` are all free right now."""
    for _ in range(attempts):
        base = free_port(host)
        if base + count - 1 < 65536 and all(port_is_free(base + i, host) for i in range(1, count)):
            return base
    raise PortInUseError(f"Could not find {count} consecutive free ports after {attempts} attempts.")


def boot_id() -> str:
    """Identifies this kernel (same value = same machine)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def is_loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("localhost", "::1")
