"""The ``rlharvest`` command line (``rlharvest demo ...`` or ``python -m rlharvest demo ...``)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main", "build_parser"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from .demo.run import COLLECTORS, DEFAULT_FRAMES

    parser = argparse.ArgumentParser(prog="rlharvest", description="rlharvest: RL experience collectors.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
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
    node = commands.add_parser(
        "node", help="join a running DistributedCollector (launcher='external') as a node",
        description="Join the DistributedCollector at HOST:PORT (its launcher='external'; collector.join_command() "
                    "prints this command) and collect in the first empty slot until the collector shuts down, "
                    "this node is removed, or it receives SIGTERM (it then leaves). The collector's key is read from "
                    "--key-file (mode 0600); it is never given on the command line.",
    )
    node.add_argument("--join", required=True, metavar="HOST:PORT", help="the collector's address and tcp_port")
    node.add_argument("--key-file", required=True, metavar="PATH",
                      help="file holding the collector's key in hex, readable by its owner only")
    node.add_argument("--timeout", type=float, default=120.0, help="seconds to reach the collector and join")
    node.add_argument("--handshake-timeout", type=float, default=5.0,
                      help="seconds the collector has to prove it holds the key")
    return parser


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
    from .demo.run import TARGET_RETURN, CollectorUnavailable, DemoConfig, run_demo

    config = DemoConfig(
        collector=args.collector, workers=args.workers, frames=args.frames, seed=args.seed, out=args.out,
        target_return=None if args.no_early_stop else TARGET_RETURN, progress=not args.no_progress,
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


def _node(args: argparse.Namespace) -> int:
    from .collectors.distributed._joins import read_key_file
    from .transport.channel import parse_authkey
    from .transport.torchdist_join import JoinRefused
    from .worker.nodes import join_main

    host, _, port = args.join.rpartition(":")
    if not host or not port.isdigit():
        print(f"rlharvest node: error: --join must be HOST:PORT, got {args.join!r}", file=sys.stderr)
        return 2
    try:
        key = parse_authkey(read_key_file(args.key_file, "--key-file"), "--key-file")
    except (OSError, ValueError) as err:  # PermissionError (mode) is an OSError
        print(f"rlharvest node: error: {err}", file=sys.stderr)
        return 2
    try:
        join_main(host.strip("[]"), int(port), key, timeout=args.timeout, handshake_timeout=args.handshake_timeout)
    except JoinRefused as err:
        print(f"rlharvest node: {err}", file=sys.stderr)
        return 3
    except (EOFError, ConnectionError) as err:  # the collector shut down before it took this node
        print(f"rlharvest node: the collector closed the connection ({err or type(err).__name__}).", file=sys.stderr)
        return 1
    return 0


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
