"""The ``rlharvest`` command line (``rlharvest demo ...`` or ``python -m rlharvest demo ...``).

Building the parser imports no torch (``rlharvest --help`` and ``--version`` answer at once, and
argument errors come before any heavy import); each command imports what it runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from . import __version__
from ._node_cli import EXIT_FAILED, EXIT_HANDSHAKE, EXIT_REFUSED, EXIT_UNREACHABLE, EXIT_USAGE
from ._node_cli import add_node_arguments, parse_node_args
from .demo.choices import COLLECTORS, DEFAULT_FRAMES

__all__ = ["main", "build_parser"]

#: what ``rlharvest demo`` imports beyond rlharvest's own dependencies (the ``demo`` extra)
DEMO_NEEDS = ("gymnasium", "matplotlib", "tqdm")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlharvest", description="rlharvest: RL experience collectors.")
    parser.add_argument("--version", action="version", version=f"rlharvest {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_demo(commands)
    _add_bench(commands)
    node = commands.add_parser(
        "node", help="start a node by hand: join a DistributedCollector (launcher='external'), or serve one of "
                     "launcher='submitit_delayed'",
        description="Start a node by hand. With --join HOST:PORT: join the DistributedCollector listening there "
                    "(launcher='external'; collector.join_command() prints this command) and collect in the first "
                    "empty slot until the collector shuts down, this node is removed, or it receives SIGTERM (it "
                    "then leaves). With --rank/--world-size/--host/--port: be that node of a collector of "
                    "launcher='submitit_delayed'. The collector's key is read from --key-file (mode 0600); it is "
                    "never given on the command line.",
    )
    add_node_arguments(node)
    return parser


def _add_demo(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser(
        "demo", help="train PPO on CartPole-v1 through an rlharvest collector",
        description="Train a small PPO on gymnasium's CartPole-v1 with experience collected by an rlharvest "
                    "collector; weights are pushed to the collector after every update. Stops as soon as the "
                    "mean return of the last 20 episodes reaches 475 (or when the frame budget is spent), then "
                    "writes OUT/learning_curve.png and OUT/summary.json.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    demo.add_argument("--collector", choices=COLLECTORS, default="distributed",
                      help="which collector gathers the experience")
    demo.add_argument("--workers", type=_positive_int, default=2,
                      help="worker processes / nodes (ignored by 'single')")
    demo.add_argument("--frames", type=_positive_int, default=DEFAULT_FRAMES,
                      help="frame budget (an upper bound: training stops once solved)")
    demo.add_argument("--seed", type=int, default=0, help="random seed")
    demo.add_argument("--out", default="demo_out", help="output directory")
    demo.add_argument("--no-early-stop", action="store_true",
                      help="spend the whole frame budget even once the target return is reached")
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    demo.add_argument("--monitor", nargs="?", const=0, type=_port, metavar="PORT",
                      help="serve the live page of the collector (rlharvest.monitor) on 127.0.0.1:PORT while PPO "
                           "trains (PORT omitted: one the OS chooses; the address is printed)")


def _add_bench(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser(
        "bench", help="measure rlharvest's collectors (and TorchRL's, side by side) and print one table",
        description="Run benchmarks/ for rlharvest and, when their side environments exist (see "
                    "benchmarks/README.md), for TorchRL 0.12 and 0.14 in the same run, one side after the other "
                    "per workload; print frames/s with ratios to the raw gymnasium loops, weight-sync latency "
                    "with ratios to one in-process copy_, and write JSON.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    bench.add_argument("--quick", action="store_true", help="a few small workloads, one run each (< 2 minutes)")
    bench.add_argument("--workload", action="append", help="run only this workload (repeatable)")
    bench.add_argument("--repeats", type=_positive_int, help="runs per figure (median); default 3, 1 with --quick")
    bench.add_argument("--output", default="benchmarks/results/local-latest.json", help="JSON report path")
    bench.add_argument("--torchrl-python", help="Python of the TorchRL 0.12 side environment")
    bench.add_argument("--no-torchrl", action="store_true", help="do not run the TorchRL 0.12 side")
    bench.add_argument("--torchrl14-python", help="Python of the TorchRL 0.14 side environment")
    bench.add_argument("--no-torchrl14", action="store_true", help="do not run the TorchRL 0.14 side")
    bench.add_argument("--suite", choices=("all", "collectors", "batched"), default="all",
                       help="which workloads (collectors: one or two workers; batched: many envs, one policy)")
    bench.add_argument("--quiet-wait", type=float, help="seconds to wait for a quiet machine before each workload "
                                                        "(default 30, 0 with --quick)")
    bench.add_argument("--noisy-retries", type=int, help="re-runs of a workload disturbed by other processes "
                                                         "(default 2, 0 with --quick)")
    bench.add_argument("--benchmarks", help="the benchmarks/ folder (default: the source checkout's)")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        return _bench(args)
    if args.command == "node":
        return _node(args)
    if args.command != "demo":
        parser.print_help()
        return 2
    missing = [name for name in DEMO_NEEDS if importlib.util.find_spec(name) is None]
    if args.monitor is not None and importlib.util.find_spec("prometheus_client") is None:
        print("rlharvest demo: error: --monitor needs prometheus-client: pip install 'rlharvest[monitor]'.",
              file=sys.stderr)
        return 2
    if missing:
        print(f"rlharvest demo: error: the demo needs {', '.join(missing)}: pip install 'rlharvest[demo]' "
              f"(or {' '.join(missing)}).", file=sys.stderr)
        return 2
    from .demo.run import TARGET_RETURN, CollectorUnavailable, DemoConfig, run_demo

    config = DemoConfig(
        collector=args.collector, workers=args.workers, frames=args.frames, seed=args.seed, out=args.out,
        target_return=None if args.no_early_stop else TARGET_RETURN, progress=not args.no_progress,
        monitor_port=args.monitor,
    )
    try:
        summary = run_demo(config)
    except CollectorUnavailable as err:
        print(f"rlharvest demo: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 130 if summary.get("interrupted") else 0


def _node(ns: argparse.Namespace) -> int:
    """Run a node; a failure is one line on stderr and a documented exit status (``_node_cli``)."""
    try:
        args = parse_node_args(ns)
    except ValueError as err:
        return _node_failed(f"error: {err}", EXIT_USAGE)
    if args.deprecated_flag:
        print("rlharvest node: --authkey-file is deprecated: use --key-file.", file=sys.stderr)
    # torch's C++ log would add its own lines, with stack frames, to a failure this command reports in one
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    from .collectors.distributed.node import read_key, start_node
    from .errors import CollectorUnreachable, JoinRefused
    from .transport.channel import AuthenticationFailed

    try:
        key = read_key(args)
    except (OSError, ValueError) as err:  # missing, readable or replaceable by others, malformed
        return _node_failed(f"error: {err}", EXIT_USAGE)
    try:
        start_node(args, key, _node_says)
    except JoinRefused as err:
        return _node_failed(str(err), EXIT_REFUSED)
    except CollectorUnreachable as err:
        return _node_failed(str(err), EXIT_UNREACHABLE)
    except AuthenticationFailed as err:
        return _node_failed(f"the handshake with the collector failed: {err}. Does the key file hold this "
                            "collector's key?", EXIT_HANDSHAKE)
    except (EOFError, ConnectionError) as err:  # the collector shut down before it took this node
        return _node_failed(f"the collector closed the connection ({err or type(err).__name__}).", EXIT_FAILED)
    return 0


def _node_says(line: str) -> None:
    """One line on stderr per change of the node's state, prefixed so that it can be grepped."""
    print(f"rlharvest node: {line}", file=sys.stderr, flush=True)


def _node_failed(message: str, status: int) -> int:
    _node_says(message)
    return status


def _bench(args: argparse.Namespace) -> int:
    from .bench import format_table, run_bench

    try:
        report = run_bench(quick=args.quick, workloads=args.workload, repeats=args.repeats, output=args.output,
                           torchrl_python=args.torchrl_python, benchmarks=args.benchmarks,
                           with_torchrl=not args.no_torchrl, torchrl14_python=args.torchrl14_python,
                           with_torchrl14=not args.no_torchrl14, suite=args.suite, quiet_wait=args.quiet_wait,
                           noisy_retries=args.noisy_retries)
    except FileNotFoundError as err:
        print(f"rlharvest bench: error: {err}", file=sys.stderr)
        return 2
    print(format_table(report))
    print(f"\n{report['wall_s']} s; JSON report: {args.output}")
    failed = [n for n, r in report["rlharvest"].items() if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
