"""How the collectors scale with the number of workers (docs/performance-at-scale.md, "Scaling with workers").

For each N in ``--workers`` (default 2, 4, 8, 16, 32), each collector kind in ``--kinds`` and each
side (rlharvest, then TorchRL 0.12 when its venv exists; the order alternates from point to point),
runs ``scale_point.py`` in a fresh process group (one per side, kind and N: it measures, one collector
after the other, in one interpreter, so that torch is imported once per N):

* ``run``: constructor to first batch, frames/s, main-process CPU per batch, shutdown (counting env,
  one-parameter policy, 16 frames per worker per batch, ``--seconds`` of collection);
* ``w1m`` (every N) and ``w25m`` (N in ``--w25m-workers``, default 2 and 8: 32 processes holding
  25M parameters each, on 2 cores, take minutes to start): median ``update_policy_weights_()`` of
  ``--repeats`` updates with CartPole and ``common.make_big_policy``.

Limits: the point process gets ``--import-limit`` seconds to import torch and the side (and start
the local Ray); then each collector gets ``--start-limit`` seconds from its constructor to its first
batch, else it is reported as "did not start within X s" and the process group is killed (its later
points too); once started, ``--start-limit`` more seconds to finish. ``--busy`` keeps every core busy
with one spinning ``python -c`` loop per core for the whole run (started before, killed by pid
after). Each point records ``/proc/loadavg`` before it and the cores other processes used during its
timed part (``background_cpu``).

Usage::

    .venv/bin/python benchmarks/scale.py --output benchmarks/results/scale-quiet.json
    .venv/bin/python benchmarks/scale.py --busy --output benchmarks/results/scale-busy.json
    .venv/bin/python benchmarks/scale.py --plot-only benchmarks/results/scale-quiet.json
    .venv/bin/python benchmarks/scale.py --table-only benchmarks/results/scale-quiet.json

Prints a table, writes the JSON and an SVG plot (``--plot``, default ``docs/img/scale-<mode>.svg``).
Bound: ``--budget`` (default 1200 s) caps the whole grid; points not reached are reported as
skipped. The default grid (6 kinds x 5 N, rlharvest and TorchRL, 25M at N = 2 and 8) is 60 point
processes: on a quiet 2-core host it fits the budget only for rlharvest; on a shared host, narrow it
(``--workers 2,8,32 --torchrl-workers 2,32 --w25m-workers 2``: docs/performance-at-scale.md says what ran).
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
KINDS = ("multisync", "multiasync", "distributed_sync", "distributed_async", "rpc_async", "ray_sync")
WORKERS = (2, 4, 8, 16, 32)


def loadavg() -> str:
    with open("/proc/loadavg") as handle:
        return " ".join(handle.read().split()[:3])


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_child(python: str, side: str, kind: str, workers: int, whats: list[str],
              args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run ``scale_point.py`` for ``whats`` (one collector each, in one process) under the limits.

    Returns one result per entry of ``whats``: the point's JSON line, or an ``error`` ("did not start
    within X s", ...) for the points it did not finish (the process group is killed at the first).
    """
    cmd = [python, str(HERE / "scale_point.py"), "--side", side, "--kind", kind, "--workers", str(workers),
           "--what", ",".join(whats), "--seconds", str(args.seconds), "--repeats", str(args.repeats)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE)]), "RAY_USAGE_STATS_ENABLED": "0"}
    info = {"side": side, "kind": kind, "workers": workers, "loadavg_before": loadavg()}
    stderr = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True,
                            env=env, cwd=REPO)
    results: list[dict[str, Any]] = []
    state = "import"  # import -> ready -> started -> (result) ready ...
    deadline = time.monotonic() + args.import_limit
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    try:
        while time.monotonic() < deadline and len(results) < len(whats):
            if not selector.select(timeout=max(0.0, deadline - time.monotonic())):
                continue
            line = proc.stdout.readline()
            if not line:
                break
            if not line.startswith("{"):
                continue
            message = json.loads(line)
            event = message.get("event")
            if event in ("ready", "started"):
                state = event
                deadline = time.monotonic() + args.start_limit
            elif event is None:
                results.append({**message, **info})
                state = "result"
    finally:
        selector.close()
        _kill_group(proc.pid)
        proc.wait()
        stderr.seek(0)
        tail = stderr.read()[-1500:]
        stderr.close()
    errors = {"import": f"did not import (and start Ray) within {args.import_limit:.0f} s",
              "ready": f"did not start within {args.start_limit:.0f} s",
              "started": f"started, then did not finish within {args.start_limit:.0f} s more",
              "result": "the point process ended before this point"}
    for what in whats[len(results):]:
        results.append({**info, "what": what, "error": errors[state], "stderr_tail": tail})
        if state != "result":
            errors["result"] = f"not run: the point before it in its process failed ({errors[state]})"
            state = "result"
    return results


def start_spinners() -> list[subprocess.Popen]:
    """One busy ``python -c`` loop per core (``--busy``)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(os.cpu_count() or 1)]


def stop_spinners(spinners: list[subprocess.Popen]) -> None:
    for spinner in spinners:
        spinner.kill()
        spinner.wait()


def plan(args: argparse.Namespace, sides: dict[str, str]) -> list[tuple[str, str, int, list[str]]]:
    """(side, kind, workers, whats) in run order: by N then kind (``--order workers``) or by kind then
    N (``--order kind``: under ``--budget``, whole curves of the first kinds), the sides alternating."""
    points = []
    flip = False
    order = getattr(args, "order", "workers")
    pairs = ([(w, k) for w in args.workers for k in args.kinds] if order == "workers"
             else [(w, k) for k in args.kinds for w in args.workers])
    for workers, kind in pairs:
        whats = ["run", "w1m"] + (["w25m"] if workers in args.w25m_workers else [])
        names = list(sides)
        for side in (reversed(names) if flip else names):
            if side == "torchrl" and (workers not in args.torchrl_workers
                                      or kind not in (getattr(args, "torchrl_kinds", None) or args.kinds)):
                continue
            points.append((side, kind, workers, whats))
        flip = not flip
    return points


def fmt(value: Any, scale: float = 1.0, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    return f"{value * scale:.{digits}f}"


def row_load(row: dict[str, dict[str, Any]]) -> str:
    """The 1-minute load average before the row's point process (``-`` for a skipped point)."""
    for result in row.values():
        if result.get("loadavg_before"):
            return result["loadavg_before"].split()[0]
    return "-"


def table(results: list[dict[str, Any]]) -> str:
    """One row per (side, kind, N): the run figures and the update latencies."""
    rows: dict[tuple, dict[str, Any]] = {}
    for result in results:
        key = (result["kind"], result["workers"], result["side"])
        row = rows.setdefault(key, {})
        row[result["what"]] = result
    header = (f"{'kind':18} {'N':>3} {'side':9} {'first s':>8} {'shut s':>7} {'frames/s':>9} {'cpu ms/b':>8} "
              f"{'us/frame':>8} {'1M ms':>7} {'25M ms':>7} {'bg':>5} {'load1':>5}  notes")
    out = [header, "-" * len(header)]
    for (kind, workers, side), row in sorted(rows.items()):
        run, w1, w25 = row.get("run", {}), row.get("w1m", {}), row.get("w25m", {})
        notes = "; ".join(f"{what}: {r['error']}" for what, r in row.items() if "error" in r)
        out.append(f"{kind:18} {workers:>3} {side:9} {fmt(run.get('first_batch_s')):>8} "
                   f"{fmt(run.get('shutdown_s')):>7} {fmt(run.get('frames_per_s'), digits=0):>9} "
                   f"{fmt(run.get('main_cpu_ms_per_batch')):>8} {fmt(run.get('main_cpu_us_per_frame'), digits=0):>8} "
                   f"{fmt(w1.get('update_s'), 1e3, 1):>7} {fmt(w25.get('update_s'), 1e3, 1):>7} "
                   f"{fmt(run.get('background_cpu')):>5} {(row_load(row)):>5}  {notes}")
    return "\n".join(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ints = lambda text: tuple(int(x) for x in text.split(",") if x)  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=ints, default=WORKERS, help="N values, comma-separated")
    parser.add_argument("--kinds", type=lambda t: tuple(t.split(",")), default=KINDS)
    parser.add_argument("--w25m-workers", type=ints, default=(2, 8), help="N values with a 25M update")
    parser.add_argument("--torchrl-workers", type=ints, default=WORKERS, help="N values run on TorchRL's side")
    parser.add_argument("--torchrl-kinds", type=lambda t: tuple(t.split(",")), help="kinds run on TorchRL's side")
    parser.add_argument("--torchrl-python", default=str(REPO / ".venv-torchrl" / "bin" / "python"))
    parser.add_argument("--no-torchrl", action="store_true")
    parser.add_argument("--seconds", type=float, default=3.0, help="collection after the first batch (run)")
    parser.add_argument("--repeats", type=int, default=5, help="timed updates per w1m/w25m point")
    parser.add_argument("--start-limit", type=float, default=90.0, help="seconds to the first batch")
    parser.add_argument("--import-limit", type=float, default=180.0,
                        help="seconds for the point's imports (and local Ray) before the start limit counts")
    parser.add_argument("--budget", type=float, default=1200.0, help="seconds for the whole grid")
    parser.add_argument("--order", choices=("workers", "kind"), default="workers",
                        help="run the grid N by N, or kind by kind (whole curves first under --budget)")
    parser.add_argument("--busy", action="store_true", help="keep every core busy during the run")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--plot-only", type=Path, help="only redraw the plot of this JSON")
    parser.add_argument("--table-only", type=Path, help="only print the table of this JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import scale_plot

    args = parse_args(argv)
    if args.plot_only:
        report = json.loads(args.plot_only.read_text())
        scale_plot.write_svg(report, args.plot or REPO / "docs" / "img" / f"scale-{report['mode']}.svg")
        return 0
    if args.table_only:
        print(table(json.loads(args.table_only.read_text())["results"]))
        return 0
    sides = {"rlharvest": sys.executable}
    if not args.no_torchrl and Path(args.torchrl_python).exists():
        sides["torchrl"] = args.torchrl_python
    mode = "busy" if args.busy else "quiet"
    report: dict[str, Any] = {"mode": mode, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "cpus": os.cpu_count(), "loadavg_start": loadavg(), "sides": list(sides),
                              "start_limit_s": args.start_limit, "seconds": args.seconds, "results": []}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks (kill the point's group)
    spinners = start_spinners() if args.busy else []
    began = time.monotonic()
    try:
        for side, kind, workers, whats in plan(args, sides):
            if time.monotonic() - began > args.budget:
                report["results"] += [{"side": side, "kind": kind, "workers": workers, "what": what,
                                       "error": f"skipped: the grid's {args.budget:.0f} s budget was spent"}
                                      for what in whats]
                continue
            for result in run_child(sides[side], side, kind, workers, whats, args):
                report["results"].append(result)
                brief = {k: result.get(k) for k in ("first_batch_s", "frames_per_s", "main_cpu_ms_per_batch",
                                                    "update_s", "background_cpu", "error") if k in result}
                print(f"{side} {kind} N={workers} {result['what']}: {brief}", flush=True)
    finally:
        stop_spinners(spinners)
    report["loadavg_end"] = loadavg()
    report["wall_s"] = time.monotonic() - began
    print(table(report["results"]))
    output = args.output or REPO / "benchmarks" / "results" / f"local-scale-{mode}.json"
    output.write_text(json.dumps(report, indent=1))
    scale_plot.write_svg(report, args.plot or REPO / "docs" / "img" / f"scale-{mode}.svg")
    return 0


if __name__ == "__main__":
    sys.exit(main())
