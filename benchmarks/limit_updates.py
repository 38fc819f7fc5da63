"""Weight-update rows of the one-command benchmark (``benchmarks/limit.py`` imports :func:`rows`).

Each row is ``{"workload", "figure", "limit", "ratio", "note"}``: a figure of this tree, the limit it
is compared with in the same run (``None`` when that could not be measured, the note says why) and
``figure / limit``. Seconds throughout.

* ``update_1m_distributed[_busy]/torchrl012``: ``update_policy_weights_()`` of the 1M-parameter
  (4 MB) benchmark policy to 2 ``DistributedCollector`` nodes (``launcher="mp"``, gloo; the bench
  workload ``weightsync_distributed_1m``) against TorchRL 0.12's ``DistributedDataCollector`` in the
  same run (when ``.venv-torchrl`` exists: ``benchmarks/setup_torchrl_venv.sh``). Goal: ratio <= 0.25
  quiet; with two busy loops, <= 1.0 (and ``_busy/quiet`` <= 2).
* ``update_1m_distributed[_busy]/copy``: the same figure against one in-process copy of the weights
  (the bench's ``copy_in_loop_s``: the one copy an update has to make, in the cache state it makes it in).
* ``update_1m_collecting/work``: the same update to nodes collecting while it happens (``sync=False``;
  ``benchmarks/update_breakdown.py``), against its work measured in the same updates: reading the
  weights, the copy into a generation, and each node mapping and swapping it in.
* ``update_1m_distributed_busy/quiet``: the busy figure against the quiet one.
* ``relay_25m_4hosts/1host``: the 25M-parameter (100 MB) update to 4 remote hosts (network namespaces,
  unshaped veths, one node each) over the relay, against the same update to 1 remote host
  (``benchmarks/host_copies.py``). Goal: ratio <= 3, with 1.00 copies out of the learner. Needs root
  and iproute2; skipped (``figure`` None) otherwise.

"Busy" is two ``while True: pass`` loops at normal priority for the length of the measurement.
``pairs`` (``limit.py --pairs N``): rlharvest's side of the two update rows is run N times, quiet and
busy alternated, and each figure is the median of the runs (one busy run's figure is where the
scheduler put the busy loops for its whole length); TorchRL's side is run once per condition.
``quick``: the bench's quick budget (3 updates per figure), 6 updates in the breakdown, no relay row
(69 s measured at load 9 on the 2 cores, where other test runs took most of them); the full run takes about 5
minutes (the relay alone about 1).

Usage: ``python benchmarks/limit_updates.py [--quick]`` prints the rows as JSON lines.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TREE = HERE.parent
__all__ = ["rows"]


def _env() -> dict[str, str]:
    """The children import rlharvest from this tree, whatever the Python's installed copy is."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TREE), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _json_line(command: list[str], timeout: float) -> dict[str, Any]:
    """The last JSON line ``command`` prints, or ``{"error": ...}``."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=_env(),
                              start_new_session=True)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": f"exit code {done.returncode}: {done.stderr[-500:]}"}


def _torchrl_python() -> str | None:
    python = os.environ.get("RLHARVEST_TORCHRL_PYTHON") or str(TREE / ".venv-torchrl/bin/python")
    if not Path(python).exists():
        return None
    probe = subprocess.run([python, "-c", "import torchrl"], capture_output=True, timeout=120)
    return python if probe.returncode == 0 else None


def _weightsync(python: str, script: str, quick: bool) -> dict[str, Any]:
    command = [python, str(HERE / script), "--workload", "weightsync_distributed_1m", "--json"]
    return _json_line(command + (["--quick"] if quick else []), 180.0)


def _breakdown(quick: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rlh-limit-") as directory:
        out = Path(directory) / "breakdown.json"
        command = [sys.executable, str(HERE / "update_breakdown.py"), "--repeats", "6" if quick else "20",
                   "--json", str(out)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=180.0, env=_env(),
                                  start_new_session=True)
        except subprocess.TimeoutExpired:
            return {"error": "timeout after 180 s"}
        if not out.exists():
            return {"error": f"exit code {done.returncode}: {done.stderr[-500:]}"}
        return json.loads(out.read_text())


class _Busy:
    """Two ``while True: pass`` loops at normal priority (the two cores of the reference machine)."""

    def __enter__(self) -> _Busy:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.nice(0))
                      for _ in range(2)]
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGKILL)
            proc.wait()


def _load() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def _row(workload: str, figure, limit, note: str) -> dict[str, Any]:
    ok = isinstance(figure, (int, float)) and isinstance(limit, (int, float)) and limit > 0
    return {"workload": workload, "figure": figure, "limit": limit, "ratio": figure / limit if ok else None,
            "note": note}


def _update_rows(quick: bool, pairs: int = 1) -> list[dict[str, Any]]:
    """The quiet and busy update rows. rlharvest's side is measured ``pairs`` times, quiet and busy
    alternated, each in fresh processes: one busy figure depends on where the scheduler puts the two
    busy loops for a whole run (1.1-6.9 ms in eight runs against ~1 ms quiet, docs/performance.md),
    so the figures are the medians of the runs. TorchRL's side, the reference of the <= 0.25 and
    <= 1.0 goals, is measured once per condition."""
    torchrl = _torchrl_python()
    ours: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    loads: dict[bool, list[str]] = {False: [], True: []}
    for _ in range(pairs):
        for busy in (False, True):
            with _Busy() if busy else _nothing():
                loads[busy].append(_load())
                ours[busy].append(_weightsync(sys.executable, "rlharvest_side.py", quick))
    rows, quiet = [], None
    for busy in (False, True):
        with _Busy() if busy else _nothing():
            theirs = _weightsync(torchrl, "torchrl_side.py", quick) if torchrl else {"error": "no .venv-torchrl"}
        runs = ours[busy]
        figures = [run["update_s"] for run in runs if isinstance(run.get("update_s"), (int, float))]
        figure = statistics.median(figures) if figures else None
        copies = [run["copy_in_loop_s"] for run in runs if isinstance(run.get("copy_in_loop_s"), (int, float))]
        name = "update_1m_distributed" + ("_busy" if busy else "")
        where = ("two busy loops, " if busy else "") + f"load {', '.join(loads[busy])}"
        goal = "goal <= 1.0 (no worse than TorchRL 0.12 there)" if busy else "goal <= 0.25"
        errors = "".join(_error(run) for run in runs)
        of = f"median of {runs[0].get('repeats')} updates" + (
            f", median of {len(figures)} runs ({', '.join(f'{f * 1e3:.2f}' for f in figures)} ms)" if pairs > 1 else "")
        rows.append(_row(f"{name}/torchrl012", figure, theirs.get("update_s"),
                         f"2 nodes, 4 MB, {of}; TorchRL 0.12 in the same run "
                         f"({theirs.get('error') or 'measured'}); {where}; {goal}" + errors))
        rows.append(_row(f"{name}/copy", figure, statistics.median(copies) if copies else None,
                         f"limit: one copy of the weights in the update loop; {where}" + errors))
        if busy:
            rows.append(_row(f"{name}/quiet", figure, quiet, "goal <= 2 (the quiet figure measured in the same run"
                             + (", medians of the alternated runs)" if pairs > 1 else ", just before)")))
        else:
            quiet = figure
    return rows


def _collecting_row(quick: bool) -> dict[str, Any]:
    load = _load()
    report = _breakdown(quick)
    ms = report.get("ms", {})
    total = ms.get("total (send called -> returned)")
    parts = ("read weights (prepare_weights)", "copy into a shared-memory generation (stage)")
    per_node = ("node: map generation (receive)", "node: swap tensors (apply_weights)")
    work = None
    if all(k in ms for k in parts + per_node):
        work = sum(ms[k] for k in parts) + 2 * sum(ms[k] for k in per_node)
    return _row("update_1m_collecting/work", None if total is None else total / 1e3, None if work is None else work / 1e3,
                "2 nodes collecting (sync=False), medians of the updates; limit: read + copy into a generation "
                f"+ 2 x (map + swap), measured in the same updates; load {load}" + _error(report))


def _relay_row(quick: bool) -> dict[str, Any]:
    name = "relay_25m_4hosts/1host"
    if quick:
        return _row(name, None, None, "skipped with quick (network namespaces and 5 nodes: ~40 s more); run without it")
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return _row(name, None, None, "skipped: network namespaces need root and iproute2")
    with tempfile.TemporaryDirectory(prefix="rlh-limit-") as directory:
        out = Path(directory) / "relay.json"
        command = [sys.executable, str(HERE / "host_copies.py"), "--code", str(TREE), "--layouts", "1", "4x1",
                   "--modes", "relay", "--params", "25000000", "--updates", "6",
                   "--heartbeat-timeout", "10", "--output", str(out)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=600.0, env=_env())
        except subprocess.TimeoutExpired:
            return _row(name, None, None, "timeout after 600 s")
        if not out.exists():
            return _row(name, None, None, f"host_copies.py failed ({done.returncode}): {done.stderr[-300:]}")
        rows = json.loads(out.read_text())
    rows = rows["rows"]
    by = {(r["layout"], r["mode"]): r for r in rows}
    one, four = by.get(("1", "direct")), by.get(("4x1", "relay"))
    if one is None or four is None:
        return _row(name, None, None, f"missing rows in host_copies.py's output: {rows!r:.300}")
    return _row(name, four["seconds_median"], one["seconds_median"],
                f"100 MB, unshaped veths, one node per host, medians of {four['updates']} updates (the first left "
                f"out); {four['copies']:.2f} copies out of the learner (goal 1.0); load {four['load_before']:.1f}; goal <= 3")


def _error(report: dict[str, Any]) -> str:
    return f"; error: {report['error']}" if "error" in report else ""


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def rows(quick: bool, pairs: int = 1) -> list[dict[str, Any]]:
    """The weight-update rows (see the module docstring); ``pairs``: quiet/busy runs of rlharvest's side."""
    return [*_update_rows(quick, pairs), _collecting_row(quick), _relay_row(quick)]


if __name__ == "__main__":
    for row in rows("--quick" in sys.argv[1:]):
        print(json.dumps(row), flush=True)
