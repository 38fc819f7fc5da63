"""The network side of a distributed collector's arguments, parsed and validated once.

Where the collector listens, what address and ports its nodes are told, the key they must prove
they hold and how long each wait may take (docs/security.md explains the choices).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ...config import positive_seconds
from ...transport.keys import AUTHKEY_ENV, new_authkey, parse_authkey, stretch_authkey
from ...transport.ports import check_local_address, free_port_block
from ...transport.launchers import TCP_PORT, main_host_ip

__all__ = ["NetworkConfig", "parse_tcp_port"]

#: ports a collector uses from its tcp_port on (store, commands, weights)
PORTS_USED = 3
LOOPBACK = "127.0.0.1"


def parse_tcp_port(value: Any, launcher: str) -> int:
    """``tcp_port`` (or ``$TCP_PORT``, or 10003) as an int; 0 means "pick free ports" (returned as 0).

    Raises:
        TypeError: for a non-integer, naming ``tcp_port``.
        ValueError: for a port outside 1..65533 (``tcp_port + 2`` must be a port too), or 0 with
            nodes started elsewhere (they must know the port in advance).
    """
    name = "tcp_port"
    if value is None:
        value, name = os.environ.get("TCP_PORT", str(TCP_PORT)), "tcp_port (from $TCP_PORT)"
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int port number, got {type(value).__name__} {value!r}")
    highest = 65535 - (PORTS_USED - 1)
    if value == 0:
        if launcher == "submitit_delayed":
            raise ValueError(f"{name}=0 (free ports) cannot work with launcher='submitit_delayed': nodes started "
                             "elsewhere must know the port in advance; pass the port they use.")
        return 0
    if not 1 <= value <= highest:
        raise ValueError(f"{name} must be in 1..{highest} (the collector also listens on tcp_port+1 and "
                         f"tcp_port+2), or 0 to pick free ports; got {value}")
    return value


def _authkey(value: Any, launcher: str) -> bytes:
    """The collector's secret: stretched from the key the user gave (the nodes holding that key compute
    the same), else a fresh random one."""
    if value is not None:
        return stretch_authkey(parse_authkey(value))
    if os.environ.get(AUTHKEY_ENV):
        return stretch_authkey(parse_authkey(os.environ[AUTHKEY_ENV], AUTHKEY_ENV))
    if launcher == "submitit_delayed":
        raise ValueError(f"launcher='submitit_delayed' needs the key the nodes were given: pass authkey=... or set "
                         f"{AUTHKEY_ENV} (hex) here and for every node (submitit_delayed_launcher does it for its "
                         "jobs); see docs/security.md.")
    return new_authkey()


@dataclass(frozen=True)
class NetworkConfig:
    """Addresses, ports, key and timeouts of one distributed collector."""

    launcher: str
    tcp_port: int
    """The base port ``p``: the command port (the store with mpi and ucc, whose command port is then
    ``p+1``); ``p+2`` (weights) follows it."""
    advertised_host: str
    """The address nodes connect to."""
    bind_host: str
    """The local address every listening socket binds to ("" = every interface)."""
    authkey: bytes | None = field(repr=False)
    """The collector's secret, every key of its channels derives from it (None for RPC: torch RPC
    has no such channel); stretched from the key the user gave, if any; never in the repr."""
    worker_timeout: float
    heartbeat_timeout: float
    handshake_timeout: float

    @classmethod
    def parse(cls, *, launcher: str, tcp_port: Any, bind_address: str | None, authkey: Any,
              worker_timeout: Any, heartbeat_timeout: Any, handshake_timeout: Any = 5.0,
              needs_key: bool = True) -> NetworkConfig:
        """Validate the arguments; ``tcp_port=0`` picks free ports on the bind address now.

        Raises:
            TypeError, ValueError: naming the offending argument.
        """
        worker_timeout = positive_seconds("worker_timeout", worker_timeout)
        heartbeat_timeout = positive_seconds("heartbeat_timeout", heartbeat_timeout)
        handshake_timeout = positive_seconds("handshake_timeout", handshake_timeout)
        port = parse_tcp_port(tcp_port, launcher)
        if bind_address is not None and not isinstance(bind_address, str):
            raise TypeError(f"bind_address must be a str (an IP address of this host), got {bind_address!r}")
        # Local nodes: loopback only. Others: the address nodes are told, never every interface by default.
        advertised = LOOPBACK if launcher == "mp" else main_host_ip()
        if launcher == "external" and bind_address not in (None, "0.0.0.0"):
            advertised = bind_address  # join_command() names the address the collector listens on
        bind_host = advertised if bind_address is None else ("" if bind_address == "0.0.0.0" else bind_address)
        if bind_address is not None:
            check_local_address(bind_host)  # else the first listening socket would say "port in use"
        if port == 0:
            port = free_port_block(PORTS_USED, bind_host)
        return cls(launcher=launcher, tcp_port=port, advertised_host=advertised, bind_host=bind_host,
                   authkey=_authkey(authkey, launcher) if needs_key else None, worker_timeout=worker_timeout,
                   heartbeat_timeout=heartbeat_timeout, handshake_timeout=handshake_timeout)

    @property
    def local(self) -> bool:
        return self.launcher == "mp"

    @property
    def user_timeout(self) -> float:
        """TCP user timeout of the channels: a vanished peer fails blocked sockets after this."""
        return max(3.0, self.heartbeat_timeout)

    @property
    def device_host(self) -> str | None:
        """gloo's local address: loopback for local nodes, else torch's choice (GLOO_SOCKET_IFNAME)."""
        return LOOPBACK if self.local else None

    def node_kwargs(self) -> dict:
        """What launched nodes get in their start arguments (never through the store)."""
        if self.authkey is None:
            return {"user_timeout": self.user_timeout}
        # Heartbeats well within heartbeat_timeout: at an equal period, jitter alone declares nodes dead.
        # No key here: each node gets its own slot's credential (TorchDistBackend._launch).
        return {"user_timeout": self.user_timeout,
                "handshake_timeout": self.handshake_timeout, "device_host": self.device_host,
                "heartbeat_interval": min(1.0, self.heartbeat_timeout / 4)}
