"""Autoscaling (docs/autoscaling.md): does a collector started with one worker and
``autoscale=Autoscale(1, --max)`` settle near the best fixed worker count for the learner's pace, and
follow a change of pace?

    .venv/bin/python benchmarks/autoscale.py [--kind async|sync] [--step-s 0.005] [--frames 20]
        [--fast-s S] [--slow-s S] [--phase-batches N N N] [--max 8] [--sweep 1 2 ...]
        [--sweep-batches N] [--skip-sweep] [--plot PATH] [--json PATH]

The envs wait on I/O (a CountingEnv sleeping ``--step-s`` per step), so workers scale on 2 cores;
the learner "trains" by sleeping its time per batch (a learner on an accelerator leaves the CPUs to
the workers): ``--fast-s`` per batch, then ``--slow-s``, then fast again, for ``--phase-batches``
batches each. ``--kind async``: a ``MultiAsyncCollector`` whose batches are one worker's
``--frames`` frames; ``--kind sync``: a ``MultiSyncCollector`` whose ``--frames`` are re-split among
the workers whenever their number changes (the learner waits for the whole batch, so the paces
that make scaling matter are slower: defaults 0.2 s and 1.0 s against async's 0.02 s and 0.15 s).
The collector measures and decides by itself (its ``autoscale=``, defaults of ``Autoscale``); this
script only times each ``next()`` (the learner's wait) and reads ``active_workers``.

(a) The sweep: each fixed worker count for each pace, ``--sweep-batches`` batches after a warm-up of
as many batches as workers: the learner's wait (fraction of its time) and batches/s. The best fixed
count of a pace is the fewest workers that keep the learner's wait at or below ``grow_above`` (0.10),
the autoscaler's own target.
(b) The autoscaled run, per phase: batches from the change of pace to the last decision of the phase
(settled), the count it settled at, the learner's wait over the first 16 batches of the phase (the
previous count, the new pace) and from the last decision to the end of the phase.
(c) A plot of the workers and the learner's wait over time.

The load average is printed with every run: this machine is shared. Nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path

import torch

from rlharvest.collectors import Autoscale, MultiAsyncCollector, MultiSyncCollector
from rlharvest.envs import CountingEnv

ROOT = Path(__file__).resolve().parents[1]
#: batches the plotted learner wait is averaged over
SMOOTH = 16


class IOEnv(CountingEnv):
    """A CountingEnv whose step waits ``step_s`` seconds, as on a simulator or a remote service."""

    def __init__(self, step_s: float) -> None:
        super().__init__(max_steps=10**6)
        self.step_s = step_s

    def _step_arrays(self, actions):
        time.sleep(self.step_s)
        return super()._step_arrays(actions)


class EnvFactory:
    """A picklable env constructor."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s

    def __call__(self) -> IOEnv:
        return IOEnv(self.step_s)


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def make_collector(args, workers: int, autoscale: Autoscale | None = None):
    cls = MultiSyncCollector if args.kind == "sync" else MultiAsyncCollector
    return cls([EnvFactory(args.step_s)] * workers, frames_per_batch=args.frames, total_frames=-1,
               autoscale=autoscale)


def learner_wait(rows: list) -> float:
    wait = sum(r[2] for r in rows)
    total = sum(r[2] + r[3] for r in rows)
    return wait / total if total else 0.0


def fixed_run(args, workers: int, work_s: float) -> dict:
    """The learner's wait and batches/s with ``workers`` workers and no autoscaling."""
    collector = make_collector(args, workers)
    rows = []
    try:
        asked = yielded = None
        for index, batch in enumerate(collector):
            got = time.perf_counter()
            if index >= (workers if args.kind == "async" else 2) and asked is not None:  # warm-up: every worker delivered once
                rows.append((got, 0, got - asked, asked - yielded))
            if len(rows) == args.sweep_batches:
                break
            yielded = got
            time.sleep(work_s)  # the learner's training step
            asked = time.perf_counter()
    finally:
        collector.shutdown()
    seconds = rows[-1][0] - rows[0][0]
    return {"workers": workers, "learner_wait": learner_wait(rows[1:]),
            "batches_per_s": (len(rows) - 1) / seconds if seconds > 0 else 0.0}


def sweep(args) -> dict[str, list[dict]]:
    print(f"\n(a) fixed worker counts, {args.sweep_batches} batches each")
    print(f"{'pace':>6s} {'learner s':>9s} {'workers':>7s} {'learner wait':>12s} {'batches/s':>9s}  load before")
    results: dict[str, list[dict]] = {}
    for pace, work_s in (("fast", args.fast_s), ("slow", args.slow_s)):
        results[pace] = []
        for workers in args.sweep:
            before = load()
            run = fixed_run(args, workers, work_s)
            results[pace].append({**run, "load": before})
            print(f"{pace:>6s} {work_s:9.3f} {workers:7d} {run['learner_wait']:12.3f} {run['batches_per_s']:9.1f}  "
                  f"{before}", flush=True)
    return results


def best_fixed(runs: list[dict], target: float) -> dict:
    """The fewest workers that keep the learner's wait at or below ``target`` (else the least wait)."""
    fed = [r for r in runs if r["learner_wait"] <= target]
    return min(fed, key=lambda r: r["workers"]) if fed else min(runs, key=lambda r: r["learner_wait"])


def autoscaled_run(args) -> tuple[list, list[dict], list[tuple[str, float, int]]]:
    """The phases under ``autoscale=``: per batch ``(seconds, workers, wait_s, work_s)``, the decisions,
    and ``(pace, learner s, batches)``."""
    phases = [("fast", args.fast_s), ("slow", args.slow_s), ("fast", args.fast_s)]
    phases = [(pace, work_s, count) for (pace, work_s), count in zip(phases, args.phase_batches)]
    collector = make_collector(args, 1, Autoscale(1, args.max))
    schedule = [work_s for _, work_s, count in phases for _ in range(count)]
    history, start, asked, worked = [], None, time.perf_counter(), 0.0
    try:
        for index, batch in enumerate(collector):
            got = time.perf_counter()
            start = got if start is None else start
            history.append((got - start, len(collector.active_workers), got - asked, worked))
            if index + 1 == len(schedule):
                break
            time.sleep(schedule[index])  # the learner's training step
            asked = time.perf_counter()
            worked = asked - got
        decisions = collector.stats()["autoscale/decisions"]
    finally:
        collector.shutdown()
    return history, decisions, phases


def phase_report(history: list, decisions: list[dict], phases: list, sweep_results: dict | None,
                 target: float) -> list[dict]:
    print("\n(b) autoscaled, Autoscale(1, max) with its defaults, per phase")
    print(f"{'phase':>8s} {'settled after':>13s} {'at':>3s} {'wait before':>11s} {'wait after':>10s} "
          f"{'batches/s':>9s} {'best fixed':>10s} {'its wait':>8s} {'batches/s':>9s}")
    report, start = [], 0
    for number, (pace, work_s, count) in enumerate(phases):
        end = min(start + count, len(history))
        rows = history[start:end]
        inside = [d for d in decisions if start < d["batch"] <= end]
        settled = inside[-1]["batch"] - start if inside else 0
        after = history[start + settled:end]
        entry = {"phase": f"{number + 1}:{pace}", "learner_s": work_s, "batches": len(rows),
                 "settled_after_batches": settled, "workers": rows[-1][1] if rows else None,
                 "decisions": len(inside), "wait_before": learner_wait(rows[:SMOOTH]),
                 "wait_after": learner_wait(after), "batches_per_s_after": _rate(after)}
        if sweep_results is not None:
            best = best_fixed(sweep_results[pace], target)
            entry.update(best_fixed=best["workers"], best_fixed_wait=best["learner_wait"],
                         best_fixed_batches_per_s=best["batches_per_s"])
        report.append(entry)
        print(f"{entry['phase']:>8s} {settled:13d} {entry['workers']:3d} {entry['wait_before']:11.3f} "
              f"{entry['wait_after']:10.3f} {entry['batches_per_s_after']:9.1f} {entry.get('best_fixed', '-'):>10} "
              f"{entry.get('best_fixed_wait', float('nan')):8.3f} "
              f"{entry.get('best_fixed_batches_per_s', float('nan')):9.1f}")
        start = end
    return report


def _rate(rows: list) -> float:
    seconds = rows[-1][0] - rows[0][0] if len(rows) > 1 else 0.0
    return (len(rows) - 1) / seconds if seconds > 0 else 0.0


def plot(history: list, phases: list, report: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = [r[0] for r in history]
    most = max(r[1] for r in history)
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 5))
    top.step(times, [r[1] for r in history], where="post", label="workers (autoscaled)")
    smooth = [learner_wait(history[max(0, i - SMOOTH + 1): i + 1]) for i in range(len(history))]
    bottom.plot(times, smooth, color="tab:red", label=f"learner wait (last {SMOOTH} batches)")
    bottom.axhline(0.10, color="grey", linestyle=":", label="grow_above")
    start = 0
    for entry, (pace, work_s, count) in zip(report, phases):
        end = min(start + count, len(history)) - 1
        if end <= start:
            break
        for axis in (top, bottom):
            axis.axvspan(times[start], times[end], alpha=0.08 if pace == "fast" else 0.2, color="tab:blue")
        top.text(times[start], most + 0.3, f"learner {work_s * 1000:.0f} ms/batch", fontsize=8)
        if "best_fixed" in entry:
            top.hlines(entry["best_fixed"], times[start], times[end], colors="black", linestyles="--",
                       label="best fixed count" if start == 0 else None)
        start = end + 1
    top.set_ylabel("workers")
    top.set_ylim(0, most + 1.5)
    top.legend(loc="center right", fontsize=8)
    bottom.set_ylabel("learner wait")
    bottom.set_xlabel("seconds")
    bottom.set_ylim(0, 1)
    bottom.legend(loc="center right", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"\n(c) plot: {path}")


def json_with_history(figures: dict, history: list) -> str:
    """``figures`` indented, then ``"history"``: one line per batch, ``[seconds, workers, wait_s,
    work_s]`` rounded to 0.1 ms."""
    rows = ",\n  ".join(json.dumps([round(value, 4) for value in row]) for row in history)
    return json.dumps(figures, indent=1)[:-2] + ',\n "history": [\n  ' + rows + "\n ]\n}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=("async", "sync"), default="async")
    parser.add_argument("--step-s", type=float, default=0.005, help="seconds each env step waits")
    parser.add_argument("--frames", type=int, default=20, help="frames per batch")
    parser.add_argument("--fast-s", type=float, default=None, help="the fast learner's seconds per batch")
    parser.add_argument("--slow-s", type=float, default=None, help="the slow learner's seconds per batch")
    parser.add_argument("--phase-batches", type=int, nargs=3, default=None)
    parser.add_argument("--max", type=int, default=8, help="max_collectors")
    parser.add_argument("--sweep", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8])
    parser.add_argument("--sweep-batches", type=int, default=None)
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--plot", type=Path, default=None, help="default docs/autoscale-<kind>.png")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    defaults = {"async": (0.02, 0.15, [200, 100, 200], 60), "sync": (0.2, 1.0, [80, 40, 80], 20)}[args.kind]
    for name, value in zip(("fast_s", "slow_s", "phase_batches", "sweep_batches"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.plot is None:
        args.plot = ROOT / "docs" / f"autoscale-{args.kind}.png"
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="frames_per_batch=.* is not divisible")  # sync sweep: rounded up
    logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)8.0f ms %(message)s", stream=sys.stdout)
    logging.getLogger("rlharvest.autoscale").setLevel(logging.INFO)
    kind = "MultiSyncCollector" if args.kind == "sync" else "MultiAsyncCollector"
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, {kind}, env step "
          f"{args.step_s * 1000:g} ms, {args.frames} frames per batch, learner {args.fast_s * 1000:g} / "
          f"{args.slow_s * 1000:g} ms per batch")
    sweep_results = None if args.skip_sweep else sweep(args)
    before = load()
    print(f"\nautoscaled run, load before {before}")
    history, decisions, phases = autoscaled_run(args)
    report = phase_report(history, decisions, phases, sweep_results, Autoscale(1, 2).grow_above)
    title = (f"{kind}(autoscale=Autoscale(1, {args.max})); env step {args.step_s * 1000:g} ms x {args.frames} "
             f"frames per batch; load {before}")
    plot(history, phases, report, args.plot, title)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        figures = {"args": {k: str(v) for k, v in vars(args).items()}, "sweep": sweep_results, "phases": report,
                   "decisions": decisions, "load_before": before}
        args.json.write_text(json_with_history(figures, history))
        print(f"figures: {args.json}")


if __name__ == "__main__":
    main()
