"""Benchmark harness shared by both sides: processes, CPU accounting, CLI.

Standard library only (Linux ``/proc``), so it runs in either venv.

* Process hygiene: which descendants outlive a collector's ``shutdown()``.
* CPU accounting: how many cores this process tree and everything else used
  during a measurement, so that a run disturbed by another workload on the
  (2-core) machine can be recognised and retried.
* The command line: ``--workload NAME|all [--quick] [--json] [--output F]``;
  ``all`` runs each workload in a fresh subprocess with a timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORKLOAD_TIMEOUT_S = 180.0
#: Cores used by other processes above which a run counts as disturbed.
NOISY_BACKGROUND_CPU = 0.3
#: Cores used by other processes below which the machine counts as quiet.
QUIET_BACKGROUND_CPU = 0.2


# --------------------------------------------------------------------------
# /proc
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcInfo:
    """What ``/proc/<pid>/stat`` tells about one process."""

    ppid: int
    state: str
    """State letter: R, S, D, Z (zombie), ..."""
    ticks: int
    """utime + stime + cutime + cstime, in clock ticks."""


def process_table() -> dict[int, ProcInfo]:
    """Every process of the machine, by pid."""
    table: dict[int, ProcInfo] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat_file:
                stat = stat_file.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        ticks = sum(int(x) for x in fields[11:15])
        table[int(entry)] = ProcInfo(int(fields[1]), fields[0], ticks)
    return table


def descendants(table: dict[int, ProcInfo], root: int) -> list[int]:
    """Pids below ``root`` in ``table`` (zombies included)."""
    children: dict[int, list[int]] = {}
    for pid, info in table.items():
        children.setdefault(info.ppid, []).append(pid)
    found, stack = [], list(children.get(root, []))
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return sorted(found)


def cmdline(pid: int) -> str:
    """Command line of ``pid`` (empty while the process is exiting)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmd_file:
            return cmd_file.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "<gone>"


def is_mp_helper(pid: int) -> bool:
    """True for multiprocessing's resource tracker / forkserver.

    They live as long as the main process by design (and killing the
    resource tracker makes it lose track of shared memory), so they are
    counted apart from workers and never reaped.
    """
    cmd = cmdline(pid)
    return "resource_tracker" in cmd or "forkserver" in cmd or is_ray_service(cmd)


def is_ray_service(cmd: str) -> bool:
    """The local Ray of a Ray workload (daemons, agents, idle pooled workers, gone with
    ``ray.shutdown``), as opposed to an actor left alive (``ray::<ActorClass>``)."""
    if cmd.startswith("ray::"):
        name = cmd.split()[0]
        return name.startswith("ray::IDLE") or name.endswith("Agent")
    return "/site-packages/ray/" in cmd


def live_descendants() -> list[int]:
    """Live (non-zombie) descendants of this process."""
    table = process_table()
    return [pid for pid in descendants(table, os.getpid()) if table[pid].state != "Z"]


def leftover_workers() -> list[int]:
    """Live descendants that are not multiprocessing helpers."""
    return [pid for pid in live_descendants() if not is_mp_helper(pid)]


def children_report(grace_s: float = 5.0) -> dict[str, Any]:
    """Descendants left right after a ``shutdown()``, and how long they linger.

    Returns:
        ``leftover_children``: live non-helper descendants when called;
        ``helper_children``: multiprocessing helpers alive;
        ``leftover_cmdlines``: ``"<state> <cmdline>"`` of the leftovers (an
        empty cmdline means the process is exiting);
        ``children_gone_s``: seconds until no leftover remained (10 ms
        polls), or None if some survived ``grace_s``.
    """
    start = time.perf_counter()
    live = live_descendants()
    leftovers = [pid for pid in live if not is_mp_helper(pid)]
    report: dict[str, Any] = {
        "leftover_children": len(leftovers),
        "helper_children": len(live) - len(leftovers),
    }
    if leftovers:
        table = process_table()
        report["leftover_cmdlines"] = [
            f"{table[pid].state if pid in table else '?'} {cmdline(pid)[:160]}"
            for pid in leftovers
        ]
    while leftovers and time.perf_counter() - start < grace_s:
        time.sleep(0.01)
        leftovers = leftover_workers()
    report["children_gone_s"] = None if leftovers else time.perf_counter() - start
    return report


def reap_descendants(grace_s: float = 2.0) -> None:
    """SIGTERM, then SIGKILL, the leftover workers of this process (by pid)."""
    for pid in leftover_workers():
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and leftover_workers():
        time.sleep(0.05)
    for pid in leftover_workers():
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


# --------------------------------------------------------------------------
# CPU accounting
# --------------------------------------------------------------------------


def system_busy_ticks() -> int:
    """Non-idle CPU ticks of the whole machine (all cores) since boot."""
    with open("/proc/stat") as stat_file:
        fields = [int(x) for x in stat_file.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return user + nice + system + irq + softirq + steal


def process_tree_ticks(root: int) -> int:
    """CPU ticks of ``root`` and its descendants, waited-for children included."""
    table = process_table()
    return sum(table[pid].ticks for pid in [root, *descendants(table, root)] if pid in table)


class CpuMonitor:
    """Cores used by this process tree and by everything else over a window.

    Example:
        >>> monitor = CpuMonitor().start()
        >>> ...  # the measured work
        >>> monitor.stop()  # {"ours_cpu": 1.9, "background_cpu": 0.05}

    Both figures are averaged over the window, in cores (0..n_cpus).  A
    ``background_cpu`` well above 0 means another workload competed for the
    CPU, so the measurement is pessimistic.
    """

    def __init__(self) -> None:
        self._root = os.getpid()
        self._start: tuple[float, int, int] | None = None

    def start(self) -> CpuMonitor:
        self._start = (time.monotonic(), system_busy_ticks(), process_tree_ticks(self._root))
        return self

    def stop(self) -> dict[str, float]:
        if self._start is None:
            raise RuntimeError("CpuMonitor.stop() called before start()")
        began, busy0, ours0 = self._start
        window = (time.monotonic() - began) * os.sysconf("SC_CLK_TCK")
        busy = system_busy_ticks() - busy0
        ours = process_tree_ticks(self._root) - ours0
        if window <= 0:
            return {"ours_cpu": float("nan"), "background_cpu": float("nan")}
        return {
            "ours_cpu": round(ours / window, 3),
            "background_cpu": round(max(busy - ours, 0) / window, 3),
        }


def wait_for_quiet(
    max_background: float = QUIET_BACKGROUND_CPU, window_s: float = 2.0, max_wait_s: float = 60.0
) -> dict[str, float]:
    """Wait until other processes use at most ``max_background`` cores.

    Samples ``window_s`` windows until one is quiet or ``max_wait_s`` passed.

    Returns:
        ``quiet_wait_s`` (seconds waited) and ``background_before`` (the last
        window's background cores).
    """
    start = time.monotonic()
    while True:
        monitor = CpuMonitor().start()
        time.sleep(window_s)
        background = monitor.stop()["background_cpu"]
        waited = time.monotonic() - start
        if background <= max_background or waited >= max_wait_s:
            return {"quiet_wait_s": round(waited, 1), "background_before": background}


# --------------------------------------------------------------------------
# Running workloads
# --------------------------------------------------------------------------


def run_in_subprocess(script: Path, name: str, quick: bool, timeout_s: float) -> dict[str, Any]:
    """Run ``script --workload name --json`` in a fresh process group.

    A timeout or a crash yields ``{"workload": name, "error": ...}``.  The
    process group (the workload and all its workers) is killed afterwards,
    so nothing outlives the workload.
    """
    cmd = [sys.executable, str(script), "--workload", name, "--json"]
    if quick:
        cmd.append("--quick")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
        error = f"exit code {proc.returncode} without a JSON line"
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        out, err = proc.communicate()
        error = f"timeout after {timeout_s:.0f} s"
    finally:
        _kill_group(proc.pid)
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"workload": name, "error": error, "stderr_tail": err[-3000:]}


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_isolated(
    script: Path, name: str, quick: bool, timeout_s: float, retries: int, quiet_wait_s: float = 60.0
) -> dict[str, Any]:
    """:func:`run_in_subprocess` on a quiet machine, retried while disturbed.

    Before each attempt, waits (up to 60 s) for the machine to be quiet.  An
    attempt during which other processes used more than
    ``NOISY_BACKGROUND_CPU`` cores (see :func:`background_of`) is retried, up
    to ``retries`` times; the least disturbed attempt is kept, with
    ``attempts`` set.
    """
    attempts: list[dict[str, Any]] = []
    for _ in range(retries + 1):
        quiet = wait_for_quiet(max_wait_s=quiet_wait_s) if quiet_wait_s > 0 else {}
        attempts.append({**run_in_subprocess(script, name, quick, timeout_s), **quiet})
        if is_clean(attempts[-1]):
            break
    best = min(attempts, key=lambda r: ("error" in r, background_of(r)))
    best["attempts"] = len(attempts)
    return best


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    """The benchmark command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--workload", help="workload name, comma-separated names, or 'all'"
    )
    parser.add_argument(
        "--isolated",
        action="store_true",
        help="run each workload in a fresh subprocess on a quiet machine, with "
        "retries (implied by 'all' and by several names)",
    )
    parser.add_argument("--quick", action="store_true", help="small runs, ~1-2 s each")
    parser.add_argument("--json", action="store_true", help="one compact JSON line per workload")
    parser.add_argument(
        "--output",
        type=Path,
        help="also store the results in this JSON list (entries of other workloads are kept)",
    )
    parser.add_argument("--list", action="store_true", help="print the workload names and exit")
    parser.add_argument(
        "--timeout", type=float, default=WORKLOAD_TIMEOUT_S, help="seconds per workload (all)"
    )
    parser.add_argument(
        "--keep-clean",
        action="store_true",
        help="with --output: reuse the undisturbed, error-free results "
        "already in the output file, re-run the others and keep, per workload, "
        "the less disturbed of the stored and the new result",
    )
    parser.add_argument(
        "--noisy-retries",
        type=int,
        default=2,
        help="with 'all': re-run a workload up to N times while other processes used "
        f"more than {NOISY_BACKGROUND_CPU} cores during it; the quietest run is kept",
    )
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=60.0,
        help="with 'all': seconds to wait for a quiet machine before each workload (0: do not wait)",
    )
    args = parser.parse_args(argv)
    if not args.list and not args.workload:
        parser.error("--workload is required")
    return args


def background_of(result: dict[str, Any]) -> float:
    """Cores other processes used during a run: the worse of the timed part
    (``background_cpu``) and the whole workload (``run_background_cpu``)."""
    timed = result.get("background_cpu", 0.0)
    return max(timed, result.get("run_background_cpu", timed))


def is_clean(result: dict[str, Any]) -> bool:
    """No error, and other processes used at most ``NOISY_BACKGROUND_CPU`` cores."""
    return "error" not in result and background_of(result) <= NOISY_BACKGROUND_CPU


def _stored_results(path: Path | None, quick: bool) -> dict[str, dict[str, Any]]:
    """Results of the same mode (quick or full) stored at ``path``, by workload."""
    if path is None or not path.exists():
        return {}
    stored = json.loads(path.read_text())
    return {r["workload"]: r for r in stored if r.get("quick") == quick}


def _less_disturbed(first: dict[str, Any], second: dict[str, Any]) -> bool:
    """Whether ``first`` is a better measurement than ``second``."""
    return ("error" in first, background_of(first)) < ("error" in second, background_of(second))


def write_results(path: Path, results: list[dict[str, Any]], names: list[str]) -> None:
    """Store ``results`` in the JSON list at ``path``, replacing entries of the
    same workloads and keeping the others, in the order of ``names``."""
    merged = {r["workload"]: r for r in json.loads(path.read_text())} if path.exists() else {}
    merged.update({r["workload"]: r for r in results})
    order = {name: index for index, name in enumerate(names)}
    rows = sorted(merged.values(), key=lambda r: order.get(r["workload"], len(order)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=2) + "\n")


def cli(
    argv: list[str] | None,
    script: Path,
    names: list[str],
    run_one: Callable[[str, bool], dict[str, Any]],
    description: str = "collector benchmarks",
) -> int:
    """Entry point of a side's script.

    Args:
        argv: Command-line arguments (None: ``sys.argv[1:]``).
        script: The side's script, re-run per workload for ``--workload all``.
        names: Every workload name, in the order ``all`` runs them.
        run_one: ``(name, quick) -> result``, run in this process.
        description: ``--help`` text.

    Returns:
        0 if every workload succeeded, else 1.
    """
    args = parse_args(argv, description)
    if args.list:
        print("\n".join(names))
        return 0
    selected = names if args.workload == "all" else args.workload.split(",")
    isolated = args.isolated or len(selected) > 1 or args.workload == "all"
    stored = _stored_results(args.output, args.quick) if args.keep_clean else {}
    results = []
    for name in selected:
        previous = stored.get(name)
        if previous is not None and is_clean(previous):
            result = previous
        elif isolated:
            result = run_isolated(script, name, args.quick, args.timeout, args.noisy_retries, args.quiet_wait)
        else:
            result = run_one(name, args.quick)
        if previous is not None and _less_disturbed(previous, result):
            result = previous
        result["quick"] = args.quick
        results.append(result)
        print(json.dumps(result) if args.json else json.dumps(result, indent=2), flush=True)
    if args.output:
        write_results(args.output, results, names)
    return 0 if all("error" not in r for r in results) else 1
