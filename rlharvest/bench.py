"""``rlharvest bench``: run the benchmarks of ``benchmarks/`` for rlharvest and, in the same run, for
TorchRL when its side environments exist, and print tables of the results and their ratios.

Every side runs the same measurement code (``benchmarks/measure.py``), each in its own interpreter:
rlharvest's with this process's Python, TorchRL 0.12's with the Python of the side environment made
by ``benchmarks/setup_torchrl_venv.sh`` (``.venv-torchrl`` at the repository root, or
``--torchrl-python``), TorchRL 0.14's with ``.venv-torchrl14`` (the venv of the TorchRL compatibility
suite, made by ``make setup-torchrl``; or ``--torchrl14-python``). Workloads run one at a time, each
side right after the other (so sides are compared under the same load), each in a fresh process;
each figure is the median of ``--repeats`` runs. Results are also written as JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ._bench_tables import batched_tables

__all__ = ["run_bench", "compile_sources", "find_benchmarks", "find_torchrl_python", "find_torchrl14_python",
           "format_table"]

QUICK_WORKLOADS = ["raw_gym_cartpole", "collector_cartpole", "multisync_cartpole", "weightsync_multisync_1m"]
_SPREAD_KEYS = ("steps_per_s", "frames_per_s", "update_s")
_MEDIAN_KEYS = ("steps_per_s", "frames_per_s", "first_batch_s", "shutdown_s", "update_s", "copy_s",
                "ratio_to_copy", "fresh_fraction", "batch_fresh_fraction")


def compile_sources(*folders: Path) -> None:
    """Write the bytecode of the Python sources under ``folders``, as installing a package does.

    A source checkout run with ``PYTHONDONTWRITEBYTECODE`` (or from a read-only tree) has none: every
    process of a run (each worker, each Ray actor) would compile rlharvest again, about 0.6 s of CPU
    each, while the TorchRL side imports installed packages that come compiled.
    """
    import compileall

    for folder in folders:
        compileall.compile_dir(str(folder), quiet=2)


def find_benchmarks(path: str | None = None) -> Path:
    """The ``benchmarks/`` folder (next to the package in a source checkout)."""
    candidates = [Path(path)] if path else []
    candidates.append(Path(__file__).resolve().parents[1] / "benchmarks")
    candidates.append(Path.cwd() / "benchmarks")
    for candidate in candidates:
        if (candidate / "rlharvest_side.py").exists():
            return candidate
    raise FileNotFoundError("benchmarks/ not found: run from an rlharvest source checkout or pass --benchmarks DIR.")


def find_torchrl_python(explicit: str | None, benchmarks: Path) -> str | None:
    """A Python that can import TorchRL 0.12 (its side environment), or None."""
    candidates = [explicit] if explicit else []
    candidates += [os.environ.get("RLHARVEST_TORCHRL_PYTHON"), str(benchmarks.parent / ".venv-torchrl/bin/python")]
    return _first_python(candidates, "import torchrl")


def find_torchrl14_python(explicit: str | None, benchmarks: Path) -> str | None:
    """A Python that can import TorchRL 0.14 (the side with AsyncBatchedCollector), or None."""
    candidates = [explicit] if explicit else []
    candidates += [os.environ.get("RLHARVEST_TORCHRL14_PYTHON"), str(benchmarks.parent / ".venv-torchrl14/bin/python")]
    probe = "import torchrl, sys; sys.exit(0 if torchrl.__version__.startswith('0.14') else 1)"
    return _first_python(candidates, probe)


def _first_python(candidates: list, probe: str) -> str | None:
    for python in filter(None, candidates):
        if Path(python).exists():
            completed = subprocess.run([python, "-c", probe], capture_output=True, timeout=120)
            if completed.returncode == 0:
                return python
    return None


def _run_side(python: str, script: Path, workloads: list[str], quick: bool, timeout: float,
              quiet_wait: float | None = None, noisy_retries: int | None = None) -> list[dict]:
    """One pass of a side: every workload in a fresh process, JSON lines parsed."""
    quiet_wait = (0 if quick else 30) if quiet_wait is None else quiet_wait
    noisy_retries = (0 if quick else 2) if noisy_retries is None else noisy_retries
    command = [python, str(script), "--workload", ",".join(workloads), "--json", "--isolated",
               "--timeout", str(timeout), "--noisy-retries", str(noisy_retries), "--quiet-wait", str(quiet_wait)]
    if quick:
        command.append("--quick")
    completed = subprocess.run(command, capture_output=True, text=True,
                               timeout=(timeout + quiet_wait) * (noisy_retries + 1) * max(1, len(workloads)) + 60)
    results = []
    for line in completed.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            results.append(json.loads(line))
    if not results and completed.returncode:
        raise RuntimeError(f"{script.name} failed:\n{completed.stderr[-2000:]}")
    return results


def _median_results(passes: list[list[dict]]) -> dict[str, dict]:
    """Per workload, the median of every figure over the passes (errors kept when all passes failed)."""
    by_name: dict[str, list[dict]] = {}
    for results in passes:
        for result in results:
            by_name.setdefault(result["workload"], []).append(result)
    merged = {}
    for name, runs in by_name.items():
        good = [r for r in runs if "error" not in r]
        if not good:
            merged[name] = runs[-1]
            continue
        row = dict(good[-1])
        for key in _MEDIAN_KEYS:
            values = [r[key] for r in good if isinstance(r.get(key), (int, float))]
            if values:
                row[key] = statistics.median(values)
                if key in _SPREAD_KEYS:
                    row[f"{key}_runs"] = values  # how much the figure moved between runs (the noise)
        row["runs"] = len(good)
        row["background_cpu_runs"] = [r.get("background_cpu") for r in good]
        merged[name] = row
    return merged


SIDES = ("rlharvest", "torchrl", "torchrl14")


def _workload_names(folder: Path, suite: str) -> list[str]:
    listing = subprocess.run([sys.executable, str(folder / "rlharvest_side.py"), "--list"],
                             capture_output=True, text=True, check=True)
    names = listing.stdout.split()
    if suite == "batched":
        return [n for n in names if n.startswith("batched_")]
    if suite == "collectors":
        return [n for n in names if not n.startswith("batched_")]
    return names


def _needs_torchrl_envs(name: str) -> bool:
    """Workloads whose env factories are TorchRL's: rlharvest then runs them in the TorchRL 0.14 venv."""
    return name.startswith("batched_parallel_transformed_")


def _interleaved_passes(pythons: dict[str, str | None], scripts: dict[str, Path], names: list[str], repeats: int,
                        quick: bool, timeout: float, quiet_wait: float | None,
                        noisy_retries: int | None) -> dict[str, list[list[dict]]]:
    """Each workload on every side, one side after the other, before the next workload starts."""
    passes: dict[str, list[list[dict]]] = {side: [] for side in SIDES}
    for _ in range(repeats):
        for name in names:
            for side in SIDES:
                python = pythons[side]
                if side == "rlharvest" and _needs_torchrl_envs(name):
                    python = pythons["torchrl14"]
                    if python is None:
                        passes[side].append([{"workload": name, "error": "needs TorchRL env factories: give "
                                              "--torchrl14-python (a Python with TorchRL 0.14 and gymnasium)"}])
                        continue
                if python is not None:
                    passes[side].append(_run_side(python, scripts[side], [name], quick, timeout, quiet_wait,
                                                  noisy_retries))
    return passes


def _only_rlharvest(pythons: dict[str, str | None], names: list[str]) -> bool:
    """Whether rlharvest's side is the only one to run, all of it with this Python."""
    return all(pythons[side] is None for side in SIDES if side != "rlharvest") and \
        not any(_needs_torchrl_envs(name) for name in names)


def run_bench(quick: bool = False, workloads: list[str] | None = None, repeats: int | None = None,
              output: str | None = None, torchrl_python: str | None = None, benchmarks: str | None = None,
              with_torchrl: bool = True, torchrl14_python: str | None = None, with_torchrl14: bool = True,
              suite: str = "all", quiet_wait: float | None = None, noisy_retries: int | None = None) -> dict[str, Any]:
    """Run every side and return ``{"rlharvest": {...}, "torchrl": {...}|None, "torchrl14": {...}|None, ...}``.

    Each workload runs on every side, one side after the other, before the next workload starts.
    """
    folder = find_benchmarks(benchmarks)
    compile_sources(Path(__file__).resolve().parent, folder)
    names = workloads or (QUICK_WORKLOADS if quick else _workload_names(folder, suite))
    repeats = repeats or (1 if quick else 3)
    timeout = 60.0 if quick else 180.0
    started = time.time()
    pythons = {
        "rlharvest": sys.executable,
        "torchrl": find_torchrl_python(torchrl_python, folder) if with_torchrl else None,
        "torchrl14": find_torchrl14_python(torchrl14_python, folder) if with_torchrl14 else None,
    }
    scripts = {"rlharvest": folder / "rlharvest_side.py", "torchrl": folder / "torchrl_side.py",
               "torchrl14": folder / "torchrl_side.py"}
    if _only_rlharvest(pythons, names):
        # no other side to alternate with: every workload in one pass of the script (each still in a
        # fresh process), which saves the script's own start, importing torch, per workload
        passes: dict[str, list[list[dict]]] = {side: [] for side in SIDES}
        passes["rlharvest"] = [_run_side(sys.executable, scripts["rlharvest"], names, quick, timeout, quiet_wait,
                                         noisy_retries) for _ in range(repeats)]
    else:
        passes = _interleaved_passes(pythons, scripts, names, repeats, quick, timeout, quiet_wait, noisy_retries)
    report: dict[str, Any] = {"quick": quick, "repeats": repeats, "workloads": names, "started": started}
    for side in SIDES:
        report[f"{side}_python"] = pythons[side]
        report[side] = _median_results(passes[side]) if pythons[side] is not None or side == "rlharvest" else None
    report["wall_s"] = round(time.time() - started, 1)
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _fmt(value: Any, digits: int = 0, suffix: str = "") -> str:
    if not isinstance(value, (int, float)):
        return "-"
    return f"{value:,.{digits}f}{suffix}"


def _ratio(a: Any, b: Any, digits: int = 2) -> str:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or not b:
        return "-"
    return f"{a / b:.{digits}f}x"


def format_table(report: dict[str, Any]) -> str:
    """The results as plain-text tables (the batched suite's after the collectors')."""
    ours, theirs = report["rlharvest"], report.get("torchrl") or {}
    raw_ours = ours.get("raw_gym_cartpole", {}).get("steps_per_s")
    raw_theirs = theirs.get("raw_gym_cartpole", {}).get("steps_per_s")
    lines = [f"{'workload':34s} {'rlharvest':>12s} {'/raw':>6s} {'torchrl':>10s} {'/raw':>6s} {'rlh/trl':>8s}"
             f" {'1st batch s':>12s} {'shutdown s':>11s}"]
    for name in report["workloads"]:
        a, b = ours.get(name, {}), theirs.get(name, {})
        if "error" in a:
            lines.append(f"{name:34s} error: {a['error'][:70]}")
            continue
        if name.startswith(("weightsync_", "freshness_", "batched_")):
            continue
        rate_a = a.get("frames_per_s", a.get("steps_per_s"))
        rate_b = b.get("frames_per_s", b.get("steps_per_s"))
        lines.append(
            f"{name:34s} {_fmt(rate_a):>12s} {_ratio(rate_a, raw_ours):>6s} {_fmt(rate_b):>10s} "
            f"{_ratio(rate_b, raw_theirs):>6s} {_ratio(rate_a, rate_b):>8s} "
            f"{_fmt(a.get('first_batch_s'), 2) + ' / ' + _fmt(b.get('first_batch_s'), 2):>12s} "
            f"{_fmt(a.get('shutdown_s'), 2) + ' / ' + _fmt(b.get('shutdown_s'), 2):>11s}")
    sync = [n for n in report["workloads"] if n.startswith("weightsync_")]
    if sync:
        lines += ["", f"{'weight sync (2 workers)':34s} {'rlharvest ms':>12s} {'/copy':>7s} {'/loop':>7s}"
                      f" {'torchrl ms':>11s} {'/copy':>7s} {'/loop':>7s} {'trl/rlh':>8s}",
                  "(/copy: over a copy_ of the same bytes between cache-hot buffers; /loop: over one timed in "
                  "the same loop, in the cache state an update copies in)"]
        for name in sync:
            a, b = ours.get(name, {}), theirs.get(name, {})
            ms_a = a.get("update_s", 0) * 1e3 if "update_s" in a else None
            ms_b = b.get("update_s", 0) * 1e3 if "update_s" in b else None
            lines.append(f"{name:34s} {_fmt(ms_a, 2):>12s} {_fmt(a.get('ratio_to_copy'), 1, 'x'):>7s} "
                         f"{_fmt(a.get('ratio_to_copy_in_loop'), 1, 'x'):>7s} "
                         f"{_fmt(ms_b, 2):>11s} {_fmt(b.get('ratio_to_copy'), 1, 'x'):>7s} "
                         f"{_fmt(b.get('ratio_to_copy_in_loop'), 1, 'x'):>7s} {_ratio(ms_b, ms_a):>8s}")
    fresh = [n for n in report["workloads"] if n.startswith("freshness_")]
    if fresh:
        lines += ["", f"{'fresh frames after update':34s} {'rlharvest':>12s} {'(batch)':>8s} {'torchrl':>10s} {'(batch)':>8s}"]
        for name in fresh:
            a, b = ours.get(name, {}), theirs.get(name, {})
            lines.append(f"{name:34s} {_fmt(a.get('fresh_fraction'), 3):>12s} "
                         f"{_fmt(a.get('batch_fresh_fraction'), 3):>8s} {_fmt(b.get('fresh_fraction'), 3):>10s} "
                         f"{_fmt(b.get('batch_fresh_fraction'), 3):>8s}")
    lines += batched_tables(report)
    if not theirs:
        lines += ["", "TorchRL side not run (create it with benchmarks/setup_torchrl_venv.sh)."]
    if not report.get("torchrl14") and any(n.startswith("batched_") for n in report["workloads"]):
        lines += ["TorchRL 0.14 side not run (create it with make setup-torchrl)."]
    return "\n".join(lines)
