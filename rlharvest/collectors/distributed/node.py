"""Start a node by hand: ``python -m rlharvest.collectors.distributed.node --rank 1 --world-size 3 --host H --port P``.

The main process must use ``launcher="submitit_delayed"`` (it then waits for nodes started
elsewhere: by :func:`submitit_delayed_launcher`, by this command on another machine, ...). ``P`` is
the collector's ``tcp_port``: its command port (with mpi and ucc, its store).

A :class:`~rlharvest.collectors.distributed.DistributedCollector` node proves to the main process
that it holds the collector's key, and requires the same proof back, before it trusts anything it
receives (docs/security.md). Give it the key (hex) in the ``RLHARVEST_AUTHKEY`` environment
variable, or in a file only you can read or replace (``--authkey-file``). There is deliberately no option
taking the key itself: a command line is visible to every user of the machine.
"""

from __future__ import annotations

import argparse

from ...transport.channel import AUTHKEY_ENV
from ...worker.nodes import node_main
from ._joins import read_key_file


def read_authkey_file(path: str) -> str:
    """The hex key in ``path`` (``--authkey-file``), checked as :func:`._joins.read_key_file` does.

    Raises:
        PermissionError: when other users may read or replace the file.
    """
    return read_key_file(path, "--authkey-file")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, required=True, help="this node's rank (1 .. world_size-1)")
    parser.add_argument("--world-size", type=int, required=True, help="number of nodes + 1")
    parser.add_argument("--host", required=True, help="address of the main process")
    parser.add_argument("--port", type=int, required=True, help="the collector's tcp_port")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--framework", default="distributed", choices=["distributed", "rpc"])
    parser.add_argument("--authkey-file", help=f"file holding the collector's key in hex (default: ${AUTHKEY_ENV})")
    parser.add_argument("--handshake-timeout", type=float, default=5.0,
                        help="seconds the main process has to prove it holds the key")
    args = parser.parse_args(argv)
    kwargs = {}
    if args.framework == "distributed":
        kwargs["handshake_timeout"] = args.handshake_timeout
        if args.authkey_file:
            kwargs["authkey"] = read_authkey_file(args.authkey_file)
    node_main(args.rank, args.world_size, args.host, args.port, args.backend, args.framework, **kwargs)


if __name__ == "__main__":
    main()
