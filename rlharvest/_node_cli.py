"""The arguments of ``rlharvest node``, the one command that starts a node by hand, parsed once.

Two forms (docs/elastic.md, "The node command"):

* ``rlharvest node --join HOST:PORT --key-file PATH``: join a running ``DistributedCollector`` of
  ``launcher="external"`` (what ``join_command()`` prints);
* ``rlharvest node --rank R --world-size N --host HOST --port PORT [--key-file PATH]``: be node ``R``
  of a collector of ``launcher="submitit_delayed"``, which waits for nodes started elsewhere.

This module imports no torch: the command's ``--help`` and argument errors come at once, before
the node pays for importing it. What runs the node is
``rlharvest.collectors.distributed.node.start_node``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

__all__ = ["EXIT_CODES", "NodeArgs", "add_node_arguments", "parse_node_args", "EXIT_OK", "EXIT_FAILED",
           "EXIT_USAGE", "EXIT_REFUSED", "EXIT_UNREACHABLE", "EXIT_HANDSHAKE"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_REFUSED = 3
EXIT_UNREACHABLE = 4
EXIT_HANDSHAKE = 5

#: every status the node command exits with, and what it means (docs/elastic.md lists the same)
EXIT_CODES = {
    EXIT_OK: "the collector shut down or removed this node, or the node left on SIGTERM",
    EXIT_FAILED: "the collector closed the connection before it took this node, or the node failed (the error "
                 "is printed)",
    EXIT_USAGE: "a bad argument or key file",
    EXIT_REFUSED: "the collector refused this node: every slot is taken, or the node runs another rlharvest version",
    EXIT_UNREACHABLE: "no collector answered at the address within --timeout",
    EXIT_HANDSHAKE: "the collector did not prove it is the learner of the key of --key-file within --handshake-timeout",
}

FRAMEWORKS = ("distributed", "rpc")


@dataclass(frozen=True)
class NodeArgs:
    """The node command's arguments, validated.

    ``join`` is set for the ``--join`` form; ``rank``, ``world_size``, ``host`` and ``port`` for the
    ``--rank`` form.
    """

    key_file: str | None
    handshake_timeout: float
    timeout: float
    join: tuple[str, int] | None = None
    rank: int | None = None
    world_size: int | None = None
    host: str | None = None
    port: int | None = None
    backend: str = "gloo"
    framework: str = "distributed"
    #: the key file was given with the deprecated spelling --authkey-file
    deprecated_flag: bool = False


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """The node command's options, on ``parser``."""
    join = parser.add_argument_group("joining a collector of launcher='external' (what join_command() prints)")
    join.add_argument("--join", metavar="HOST:PORT", help="the collector's address and tcp_port")
    hand = parser.add_argument_group("a node of a collector of launcher='submitit_delayed'")
    hand.add_argument("--rank", type=int, help="this node's rank (1 .. world-size - 1)")
    hand.add_argument("--world-size", type=int, help="number of nodes + 1")
    hand.add_argument("--host", help="address of the collector's process")
    hand.add_argument("--port", type=int, help="the collector's tcp_port")
    hand.add_argument("--backend", default="gloo", help="the process-group backend")
    hand.add_argument("--framework", default="distributed", choices=FRAMEWORKS,
                      help="distributed (DistributedCollector) or rpc (RPCCollector)")
    both = parser.add_argument_group("both")
    both.add_argument("--key-file", metavar="PATH",
                      help="file holding the node key join_command() wrote, or the collector's key in hex, readable "
                           "by its owner only (required with --join; with --rank, $RLHARVEST_AUTHKEY may hold the "
                           "collector's key instead)")
    both.add_argument("--authkey-file", metavar="PATH", help="deprecated spelling of --key-file")
    both.add_argument("--timeout", type=float, default=120.0,
                      help="seconds to wait for the collector to answer at its address (retried while nothing "
                           "listens there), then for each step of joining it; counted once the node has imported "
                           "torch")
    both.add_argument("--handshake-timeout", type=float, default=5.0,
                      help="seconds the collector has to prove it is the learner of that key")
    parser.epilog = "exit status: " + "; ".join(f"{code} {meaning}" for code, meaning in EXIT_CODES.items()) + "."


def _seconds(name: str, value: float) -> float:
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name} must be a positive number of seconds, got {value:g}")
    return value


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--join must be HOST:PORT (PORT in 1..65535), got {text!r}")
    return host.strip("[]"), int(port)


def parse_node_args(ns: argparse.Namespace) -> NodeArgs:
    """The validated arguments of a parsed node command line.

    Raises:
        ValueError: naming the option, the value given and what is allowed.
    """
    if ns.key_file and ns.authkey_file:
        raise ValueError("give the key file once: --key-file (--authkey-file is its deprecated spelling)")
    key_file = ns.key_file or ns.authkey_file
    common = dict(key_file=key_file, deprecated_flag=bool(ns.authkey_file),
                  timeout=_seconds("--timeout", ns.timeout),
                  handshake_timeout=_seconds("--handshake-timeout", ns.handshake_timeout))
    by_hand = {"--rank": ns.rank, "--world-size": ns.world_size, "--host": ns.host, "--port": ns.port}
    given = [name for name, value in by_hand.items() if value is not None]
    if ns.join is not None:
        if given:
            raise ValueError(f"--join and {', '.join(given)} are two ways to start a node: give --join HOST:PORT "
                             "(a collector of launcher='external') or --rank/--world-size/--host/--port "
                             "(launcher='submitit_delayed'), not both")
        if key_file is None:
            raise ValueError("--join needs --key-file PATH (the file join_command() names, copied to this host)")
        return NodeArgs(join=_address(ns.join), **common)
    if not given:
        raise ValueError("say which collector to serve: --join HOST:PORT (launcher='external'), or --rank, "
                         "--world-size, --host and --port (launcher='submitit_delayed')")
    missing = [name for name, value in by_hand.items() if value is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} missing: a node of launcher='submitit_delayed' needs --rank, "
                         "--world-size, --host and --port")
    if not 1 <= ns.rank < ns.world_size:
        raise ValueError(f"--rank must be in 1..{ns.world_size - 1} (--world-size {ns.world_size} counts the "
                         f"collector's process as rank 0), got {ns.rank}")
    if not 0 < ns.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {ns.port}")
    return NodeArgs(rank=ns.rank, world_size=ns.world_size, host=ns.host, port=ns.port, backend=ns.backend,
                    framework=ns.framework, **common)

