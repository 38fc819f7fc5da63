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
* ``update_1m_distributed_busy/quiet``: the busy figure against the quiet one.
* ``update_1m_collecting[_busy]/torchrl012``, ``update_1m_collecting_busy/quiet`` (issue 49): the same
  update to 2 nodes collecting while it happens (``sync=False``, 50-frame batches, 20 updates each
  followed by a batch; the bench workload ``weightsync_distributed_collecting_1m``) against TorchRL
  0.12's async ``DistributedDataCollector``, both sides run ``pairs`` times per condition (medians).
  Goals: ratio <= 0.25 quiet, busy <= 2x quiet.
* ``update_1m_collecting/work`` and ``/wake_to_swap`` (``benchmarks/update_breakdown.py``, 50-frame
  batches): the update against its work measured in the same updates (reading the weights, the copy
  into a generation, each node mapping and swapping it in), and a node's wake-to-swap time (its
  reader thread back in Python with the notice -> the weights swapped in) against the swap itself.
* ``relay_25m_4hosts/1host``: the 25M-parameter (100 MB) update to 4 remote hosts (network namespaces,
  unshaped veths, one node each) over the relay, against the same update to 1 remote host
  (``benchmarks/host_copies.py``). Goal: ratio <= 3, with 1.00 copies out of the learner. Needs root
  and iproute2; skipped (``figure`` None) otherwise.

"Busy" is two ``while True: pass`` loops at normal priority for the length of the measurement.
``pairs`` (``limit.py --pairs N``): rlharvest's side of the update rows is run N times, quiet and
busy alternated, and each figure is the median of the runs (one busy run's figure is where the
scheduler put the busy loops for its whole length); TorchRL's side is run once per condition (N times
for the collecting rows).
``quick``: the bench's quick budget (3 updates per figure), 6 updates in the breakdown, no relay row
(about 3 minutes with the collecting rows at load 5-8 on the 2 cores); the full run with ``--pairs 5``
takes about 15 minutes (the relay alone about 1).

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
#: the stage of ``update_breakdown.py`` (kept in step with its ``WAKE_TO_SWAP``)
WAKE_TO_SWAP = "node: wake-to-swap (reader has the notice -> swapped in)"


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


def _weightsync(python: str, script: str, workload: str, quick: bool) -> dict[str, Any]:
    command = [python, str(HERE / script), "--workload", workload, "--json"]
    return _json_line(command + (["--quick"] if quick else []), 180.0)


def _breakdown(quick: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rlh-limit-") as directory:
        out = Path(directory) / "breakdown.json"
        command = [sys.executable, str(HERE / "update_breakdown.py"), "--repeats", "6" if quick else "20",
                   "--frames-per-batch", "50", "--json", str(out)]
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


def _update_rows(quick: bool, pairs: int = 1, workload: str = "weightsync_distributed_1m",
                 name: str = "update_1m_distributed", collecting: bool = False) -> list[dict[str, Any]]:
    """The quiet and busy rows of ``workload``. rlharvest's side is measured ``pairs`` times, quiet and
    busy alternated, each in fresh processes: one busy figure depends on where the scheduler puts the two
    busy loops for a whole run (1.1-6.9 ms in eight runs against ~1 ms quiet, docs/performance.md),
    so the figures are the medians of the runs. TorchRL's side, the reference of the <= 0.25 goal, is
    measured once per condition, or ``pairs`` times too for nodes ``collecting`` (issue 49: medians of
    at least 5 runs each)."""
    torchrl = _torchrl_python()
    ours: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    theirs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    loads: dict[bool, list[str]] = {False: [], True: []}
    for _ in range(pairs):
        for busy in (False, True):
            with _Busy() if busy else _nothing():
                loads[busy].append(_load())
                ours[busy].append(_weightsync(sys.executable, "rlharvest_side.py", workload, quick))
                if collecting and torchrl:
                    theirs[busy].append(_weightsync(torchrl, "torchrl_side.py", workload, quick))
    if not collecting:
        for busy in (False, True):
            with _Busy() if busy else _nothing():
                theirs[busy].append(_weightsync(torchrl, "torchrl_side.py", workload, quick) if torchrl
                                    else {"error": "no .venv-torchrl"})
    rows, quiet = [], None
    for busy in (False, True):
        runs = ours[busy]
        figure, figures = _median_of(runs, "update_s")
        reference, references = _median_of(theirs[busy], "update_s")
        copy, _ = _median_of(runs, "copy_in_loop_s")
        label = name + ("_busy" if busy else "")
        where = ("two busy loops, " if busy else "") + f"load {', '.join(loads[busy])}"
        if collecting:
            goal = "" if busy else "; goal <= 0.25"
        else:
            goal = "; goal <= 1.0 (no worse than TorchRL 0.12 there)" if busy else "; goal <= 0.25"
        errors = "".join(_error(run) for run in runs)
        their_errors = "".join(_error(run) for run in theirs[busy]) or ("" if theirs[busy] else "; no .venv-torchrl")
        nodes = "2 nodes collecting (sync=False), 50-frame batches" if collecting else "2 nodes"
        of = f"median of {runs[0].get('repeats')} updates" + (
            f", median of {len(figures)} runs ({_ms(figures)})" if pairs > 1 else "")
        them = f"TorchRL 0.12 in the same run ({_ms(references)})" if references else "TorchRL 0.12"
        rows.append(_row(f"{label}/torchrl012", figure, reference,
                         f"{nodes}, 4 MB, {of}; {them}{their_errors}; {where}{goal}" + errors))
        if not collecting:
            rows.append(_row(f"{label}/copy", figure, copy,
                             f"limit: one copy of the weights in the update loop; {where}" + errors))
        if busy:
            rows.append(_row(f"{label}/quiet", figure, quiet, "goal <= 2 (the quiet figure measured in the same run"
                             + (", medians of the alternated runs)" if pairs > 1 else ", just before)")))
        else:
            quiet = figure
    return rows


def _median_of(runs: list[dict[str, Any]], key: str) -> tuple[float | None, list[float]]:
    values = [run[key] for run in runs if isinstance(run.get(key), (int, float))]
    return (statistics.median(values) if values else None), values


def _ms(seconds: list[float]) -> str:
    return ", ".join(f"{value * 1e3:.2f}" for value in seconds) + " ms"


def _collecting_rows(quick: bool) -> list[dict[str, Any]]:
    """From ``update_breakdown.py`` (2 nodes collecting, 50-frame batches): the update against its
    work, and the nodes' wake-to-swap time (the reader thread back in Python with the notice -> the
    weights swapped in, by it or by the collection loop between two steps) against the swap itself."""
    load = _load()
    report = _breakdown(quick)
    ms = report.get("ms", {})
    total = ms.get("total (send called -> returned)")
    parts = ("read weights (prepare_weights)", "copy into a shared-memory generation (stage)")
    per_node = ("node: map generation (receive)", "node: swap tensors (apply_weights)")
    work = None
    if all(k in ms for k in parts + per_node):
        work = sum(ms[k] for k in parts) + 2 * sum(ms[k] for k in per_node)
    wake = ms.get(WAKE_TO_SWAP)
    swap = ms.get("node: swap tensors (apply_weights)")
    tail = ", ".join(f"{label} {ms[WAKE_TO_SWAP + suffix]:.2f} ms" for label, suffix in
                     (("90th percentile", ", 90th percentile"), ("largest", ", largest")) if WAKE_TO_SWAP + suffix in ms)
    return [
        _row("update_1m_collecting/work", None if total is None else total / 1e3, None if work is None else work / 1e3,
             "update_breakdown.py: 2 nodes collecting (sync=False), medians of the updates; limit: read + copy into a "
             f"generation + 2 x (map + swap), measured in the same updates; load {load}" + _error(report)),
        _row("update_1m_collecting/wake_to_swap", None if wake is None else wake / 1e3, None if swap is None else swap / 1e3,
             f"a node's reader has the notice -> new weights swapped in, median over nodes and updates ({tail}); "
             "limit: the swap itself" + _error(report)),
    ]


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
    collecting = _update_rows(quick, pairs, "weightsync_distributed_collecting_1m", "update_1m_collecting", True)
    return [*_update_rows(quick, pairs), *collecting, *_collecting_rows(quick), _relay_row(quick)]


if __name__ == "__main__":
    for row in rows("--quick" in sys.argv[1:]):
        print(json.dumps(row), flush=True)
