"""This host on the network: free TCP ports (always found by asking the OS: bind to port 0), whether
an address is loopback, and which kernel this is (two processes with the same boot id share a
machine, hence its shared memory)."""

from __future__ import annotations

import errno
import socket

from ..errors import AddressNotAvailableError, PortInUseError

__all__ = ["free_port", "free_port_block", "port_is_free", "PortInUseError", "AddressNotAvailableError", "boot_id",
           "is_loopback", "not_this_host", "check_local_address"]


def not_this_host(err: OSError, host: str, argument: str = "bind_address") -> AddressNotAvailableError | None:
    """The error to raise when binding to ``host`` failed with ``err`` because ``host`` is not an address
    of this host (rather than because the port is taken), naming ``argument``; else None."""
    if isinstance(err, socket.gaierror):
        why = f"it does not resolve ({err.strerror})"
    elif err.errno == errno.EADDRNOTAVAIL:
        why = "no interface of this host has it"
    else:
        return None
    not_here = AddressNotAvailableError(
        f"{argument}={host!r} is not an address of this host: {why}. Give the address of one of its interfaces "
        "(`ip addr` lists them), '127.0.0.1' for nodes on this host, or '0.0.0.0' for every interface.")
    not_here.errno = errno.EADDRNOTAVAIL
    return not_here


def check_local_address(host: str, argument: str = "bind_address") -> None:
    """Raise :class:`AddressNotAvailableError` naming ``argument`` unless this host can listen on ``host``
    ("" is every interface)."""
    if not host:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, 0))
        except OSError as err:
            not_here = not_this_host(err, host, argument)
            if not_here is not None:
                raise not_here from None
            raise


def port_is_free(port: int, host: str = "") -> bool:
    """Whether ``host:port`` can be listened on now.

    Raises:
        AddressNotAvailableError: ``host`` is not an address of this host (no port of it is free).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            not_here = not_this_host(err, host)
            if not_here is not None:
                raise not_here from None
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
