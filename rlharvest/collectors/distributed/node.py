"""Start a node by hand: ``python -m rlharvest.collectors.distributed.node --rank 1 --world-size 3 --host H --port P``.

The main process must use ``launcher="submitit_delayed"`` (it then waits for nodes started
elsewhere: by :func:`submitit_delayed_launcher`, by this command on another machine, ...).
"""

from __future__ import annotations

import argparse

from .launchers import node_main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True, help="this node's rank (1 .. world_size-1)")
    parser.add_argument("--world-size", type=int, required=True, help="number of nodes + 1")
    parser.add_argument("--host", required=True, help="address of the main process")
    parser.add_argument("--port", type=int, required=True, help="the collector's tcp_port")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--framework", default="distributed", choices=["distributed", "rpc"])
    args = parser.parse_args(argv)
    node_main(args.rank, args.world_size, args.host, args.port, args.backend, args.framework)


if __name__ == "__main__":
    main()
