"""Each collector's throughput beside its limit, in one command (issue 35).

    python benchmarks/limit.py [--quick] [--out FILE.json] [--no-updates] [--rows collector|multi ...] [--pairs N]

Rows (a markdown table, with the date and the load average before and after):

* ``collector_cartpole``: ``Collector`` (CartPole-v1, 4-64-64-2 MLP) against the raw gymnasium + MLP
  loop (``common.raw_gym_loop_for``) in one process;
* ``multisync_cartpole`` / ``multiasync_cartpole``: 2 workers against two raw loops run concurrently in
  2 processes (their steps/s summed);
* ``batched_*`` (``benchmarks/limit_batched.py``): one env with a batch (``CountingEnv`` of 16 and 1024
  rows, gymnasium's ``SyncVectorEnv`` of 64 CartPoles) against its raw loop in the same process,
  alternated, and TorchRL 0.14.1's ``Collector`` on the same workload (``.venv-torchrl14``).

Beside each ratio of frames/s (wall time: what a user gets, meaningful on a quiet machine), the CPU
microseconds per frame of the collector's processes (all of them) and of the raw loop, and their
ratio: on a busy machine, where wall time mostly measures the scheduler, the steadier comparison
(though contention inflates both).

Each workload runs in a fresh process, as ``rlharvest bench`` runs it (``harness.run_in_subprocess`` on
``rlharvest_side.py``, the budgets of ``common.FULL`` / ``common.QUICK``); its limit is measured right
after it, for as many seconds as the workload collects, so both see about the same machine.

Rows are built by functions (:data:`ROWS`, each ``(quick) -> list[dict]``), every dict with the keys
``workload``, ``figure``, ``limit``, ``ratio`` and ``note``. Weight-update rows come from
``benchmarks/limit_updates.py`` when it exists (its ``rows(quick: bool) -> list[dict]``, same keys); a
missing module gives no rows. ``--no-updates`` leaves them out.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402
import harness  # noqa: E402

SIDE_SCRIPT = HERE / "rlharvest_side.py"
TIMEOUT_S = 300.0


# ------------------------------------------------------------------------------------------- limits
def raw_loops(processes: int, seconds: float) -> dict[str, Any]:
    """``processes`` raw loops at once, each in its own fresh process, started together (each reports
    ready after its imports; all are told to go at once) and run for ``seconds``: summed steps/s."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--raw-child", str(seconds)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    children = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                 start_new_session=True) for _ in range(processes)]
    try:
        for child in children:
            if child.stdout.readline().strip() != "ready":
                raise RuntimeError("a raw-loop process did not start")
        for child in children:
            child.stdin.write("go\n")
            child.stdin.flush()
        results = [json.loads(child.communicate(timeout=seconds + 120)[0].strip().splitlines()[-1])
                   for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    rates = [r["steps_per_s"] for r in results]
    return {"steps_per_s": sum(rates), "per_process": rates,
            "cpu_us_per_step": sum(r["cpu_us_per_step"] for r in results) / len(results)}


def _raw_child(seconds: float) -> None:
    import torch

    torch.set_num_threads(1)
    common.raw_gym_loop_for(0.05)  # warm-up: first calls, gymnasium's registry
    print("ready", flush=True)
    sys.stdin.readline()
    import time

    cpu = time.process_time()  # the loop's CPU time (gym.make and the policy's construction included: ms)
    steps_per_s = common.raw_gym_loop_for(seconds)
    cpu = time.process_time() - cpu
    print(json.dumps({"steps_per_s": steps_per_s, "cpu_us_per_step": cpu / (steps_per_s * seconds) * 1e6}),
          flush=True)


# ------------------------------------------------------------------------------------------- rows
def _workload(name: str, quick: bool) -> dict[str, Any]:
    result = harness.run_in_subprocess(SIDE_SCRIPT, name, quick, TIMEOUT_S)
    if "error" in result:
        raise RuntimeError(f"{name}: {result['error']} {result.get('stderr_tail', '')[-1000:]}")
    return result


def throughput_row(workload: str, processes: int, quick: bool, pairs: int = 1) -> dict[str, Any]:
    """``workload``'s frames/s beside ``processes`` concurrent raw loops, in ``pairs`` alternating pairs
    of fresh processes (the workload, then its limit): the medians of the figures and of the pairs'
    ratios. A fresh process's speed here moves by several percent with no change at all (where its
    memory lands), which one pair cannot tell from a difference (docs/archive/performance-history.md, "Distance to the limit")."""
    seconds = (common.QUICK if quick else common.FULL).seconds
    measured = []
    for _ in range(pairs):
        result = _workload(workload, quick)
        measured.append((result, raw_loops(processes, seconds)))
    results, limits = [r for r, _ in measured], [lim for _, lim in measured]
    figure = statistics.median(r["frames_per_s"] for r in results)
    # CPU time per frame of the collector's whole process tree (``ours_cpu``: cores used while timed)
    # beside the raw loop's per step: on a busy machine the steadier comparison (docs/performance.md)
    cpus = [r.get("ours_cpu", float("nan")) / r["frames_per_s"] * 1e6 for r in results]
    where = "1 process" if processes == 1 else f"{processes} processes at once"
    cores = statistics.median(r.get("ours_cpu", float("nan")) for r in results)
    others = statistics.median(r.get("background_cpu", float("nan")) for r in results)
    return {
        "workload": workload,
        "figure": figure,
        "limit": statistics.median(lim["steps_per_s"] for lim in limits),
        "ratio": statistics.median(r["frames_per_s"] / lim["steps_per_s"] for r, lim in measured),
        "note": f"frames/s; limit: raw gymnasium + MLP loop, {where}; collector used {cores:.2f} cores, "
                f"others {others:.2f}" + (f"; medians of {pairs} pairs" if pairs > 1 else ""),
        "pairs": [{"figure": r["frames_per_s"], "limit": lim["steps_per_s"]} for r, lim in measured],
        "raw_per_process": limits[-1]["per_process"],
        "cpu_us_per_frame": statistics.median(cpus),
        "limit_cpu_us_per_frame": statistics.median(lim["cpu_us_per_step"] for lim in limits),
        "cpu_ratio": statistics.median(lim["cpu_us_per_step"] / cpu for lim, cpu in zip(limits, cpus)),
    }


def collector_rows(quick: bool, pairs: int = 1) -> list[dict[str, Any]]:
    return [throughput_row("collector_cartpole", 1, quick, pairs)]


def multi_rows(quick: bool, pairs: int = 1) -> list[dict[str, Any]]:
    return [throughput_row(name, common.NUM_WORKERS, quick, pairs)
            for name in ("multisync_cartpole", "multiasync_cartpole")]


def batched_rows(quick: bool, pairs: int = 1) -> list[dict[str, Any]]:
    """One env with a batch against its raw loop, beside TorchRL 0.14.1 (``benchmarks/limit_batched.py``)."""
    import limit_batched

    return limit_batched.rows(quick, pairs)


def update_rows(quick: bool, pairs: int = 1) -> list[dict[str, Any]]:
    """The rows of ``benchmarks/limit_updates.py`` (weight updates), none when it does not exist;
    ``pairs``: alternated quiet/busy runs of rlharvest's side."""
    if importlib.util.find_spec("limit_updates") is None:
        return []
    return list(importlib.import_module("limit_updates").rows(quick, pairs))


#: The throughput rows, in order, by the name ``--rows`` takes (each ``(quick, pairs)``); :func:`update_rows`
#: follows unless ``--no-updates``.
ROWS: dict[str, Callable[[bool, int], list[dict[str, Any]]]] = {"collector": collector_rows, "multi": multi_rows,
                                                                 "batched": batched_rows}


# ------------------------------------------------------------------------------------------- table
def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:,.0f}"
    return str(value)


def _ratio(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, (int, float)) else "n/a"  # a row whose side failed: its note says why


def format_table(report: dict[str, Any]) -> str:
    lines = [f"limits, {report['date']}, load average {report['load_before']} before, {report['load_after']} after"
             + (" (quick)" if report["quick"] else ""), "",
             "| workload | figure | limit | ratio | CPU us/frame (limit) | CPU ratio | note |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for row in report["rows"]:
        cpu = (f"{row['cpu_us_per_frame']:.1f} ({row['limit_cpu_us_per_frame']:.1f})"
               if "cpu_us_per_frame" in row else "")
        cpu_ratio = f"{row['cpu_ratio']:.2f}" if "cpu_ratio" in row else ""
        lines.append(f"| {row['workload']} | {_number(row['figure'])} | {_number(row['limit'])} | "
                     f"{_ratio(row['ratio'])} | {cpu} | {cpu_ratio} | {row['note']} |")
    return "\n".join(lines)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run(quick: bool, updates: bool = True, rows: list[str] | None = None, pairs: int = 1) -> dict[str, Any]:
    """The report of the throughput rows named in ``rows`` (all of :data:`ROWS` by default, each over
    ``pairs`` pairs of processes), then the update rows unless ``updates`` is false."""
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_before": _load(), "quick": quick, "rows": [],
    }
    for name in list(ROWS) if rows is None else rows:
        report["rows"].extend(ROWS[name](quick, pairs))
    if updates:
        report["rows"].extend(update_rows(quick, pairs))
    report["load_after"] = _load()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="each collector's throughput beside its limit")
    parser.add_argument("--quick", action="store_true", help="small runs (common.QUICK budgets)")
    parser.add_argument("--out", type=Path, help="also write the report as JSON")
    parser.add_argument("--no-updates", action="store_true", help="leave out limit_updates.py's rows")
    parser.add_argument("--rows", action="append", choices=list(ROWS),
                        help="only these throughput rows (repeatable; default: all)")
    parser.add_argument("--pairs", type=int, default=1,
                        help="alternating pairs of fresh processes per throughput row, and quiet/busy runs of the "
                        "update rows (medians; default 1)")
    parser.add_argument("--raw-child", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error(f"--pairs must be at least 1, got {args.pairs}")
    if args.raw_child is not None:
        _raw_child(args.raw_child)
        return 0
    report = run(args.quick, updates=not args.no_updates, rows=args.rows, pairs=args.pairs)
    if args.out:  # first: a run of minutes is kept whatever the printing does
        args.out.write_text(json.dumps(report, indent=1))
    print(format_table(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
