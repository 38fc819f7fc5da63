"""Run a node started by hand: what ``rlharvest node`` runs (docs/elastic.md, "The node command").

``rlharvest node --join HOST:PORT --key-file PATH`` joins a collector of ``launcher="external"``;
``rlharvest node --rank 1 --world-size 3 --host H --port P`` is node 1 of a collector of
``launcher="submitit_delayed"`` (it waits for nodes started elsewhere: by
:func:`submitit_delayed_launcher`, by this command on another machine, ...); ``P`` is the collector's
``tcp_port``: its command port (with mpi and ucc, its store).

A :class:`~rlharvest.collectors.distributed.DistributedCollector` node requires the main process to
prove it is the learner (a signature no node can make) before it proves anything itself or trusts
anything it receives (docs/security.md). Give it its key in a file only you can read or replace
(``--key-file``: the node key ``join_command()``'s file holds, or the collector's key in hex) or,
with ``--rank``, the collector's key in the ``RLHARVEST_AUTHKEY`` environment variable. There is
deliberately no option taking a key itself: a command line is visible to every user of the machine.

``python -m rlharvest.collectors.distributed.node --rank ...`` (with ``--authkey-file``) is the
deprecated spelling of ``rlharvest node --rank ...``; it still works, and says so.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from ..._node_cli import NodeArgs, add_node_arguments, parse_node_args
from ...transport.join_keys import read_key_file
from ...transport.keys import NodeCredential, parse_node_key
from ...transport.torchdist import node_credential
from ...worker.nodes import join_main, node_main


def read_authkey_file(path: str, flag: str = "--authkey-file") -> str:
    """The hex key in ``path`` (given as ``flag``), checked as
    :func:`~rlharvest.transport.join_keys.read_key_file` does.

    Raises:
        PermissionError: when other users may read or replace the file.
    """
    return read_key_file(path, flag)


def read_key(args: NodeArgs) -> NodeCredential | bytes | None:
    """What the node proves with: from ``--key-file`` (a node key, or the collector's key, returned
    as the collector's secret), else (``--rank`` form of a DistributedCollector) its slot's key
    derived from ``$RLHARVEST_AUTHKEY``; None for an RPC node (torch RPC has no key).

    Raises:
        OSError: the key file cannot be read; PermissionError: other users may read or replace it.
        ValueError: no key, a malformed one, or (``--rank``) the key of another rank.
    """
    if args.key_file:
        flag = "--authkey-file" if args.deprecated_flag else "--key-file"
        key = parse_node_key(read_authkey_file(args.key_file, flag), flag)
        if args.join is None and args.framework == "distributed":
            return node_credential(args.rank, key)
        return key
    if args.join is None and args.framework == "distributed":
        return node_credential(args.rank, None)
    return None


def start_node(args: NodeArgs, key: NodeCredential | bytes | None,
               report: Callable[[str], None] | None = None) -> None:
    """Run the node ``args`` describe, proving it holds ``key`` (:func:`read_key`), until the
    collector lets it go; ``report`` is told of each change of its state (``rlharvest node`` prints
    them on stderr).

    Raises:
        JoinRefused: every slot of the collector is taken.
        CollectorUnreachable: no collector answered at ``--join`` within ``args.timeout``.
        AuthenticationFailed: the collector did not prove it is the learner of that key.
        ConnectionError, EOFError: the collector closed the connection before it took the node.
    """
    if args.join is not None:
        host, port = args.join
        join_main(host, port, key, report, timeout=args.timeout, handshake_timeout=args.handshake_timeout)
        return
    kwargs = {}
    if args.framework == "distributed":
        kwargs.update(credential=key, handshake_timeout=args.handshake_timeout, timeout=args.timeout)
    node_main(args.rank, args.world_size, args.host, args.port, args.backend, args.framework, report, **kwargs)


def main(argv: list[str] | None = None) -> None:
    """The deprecated spelling of ``rlharvest node``: errors are raised, not turned into exit codes."""
    parser = argparse.ArgumentParser(prog="python -m rlharvest.collectors.distributed.node", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_node_arguments(parser)
    ns = parser.parse_args(argv)
    print("python -m rlharvest.collectors.distributed.node is deprecated: run `rlharvest node` (or "
          "`python -m rlharvest node`) with the same options; --authkey-file is now --key-file.", file=sys.stderr)
    try:
        args = parse_node_args(ns)
    except ValueError as err:
        parser.error(str(err))
    start_node(args, read_key(args))


if __name__ == "__main__":
    main()
