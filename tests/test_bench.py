"""Smoke test of `rlharvest bench` (figures are not asserted: timings never are)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(240)
def test_bench_quick_end_to_end(tmp_path):
    """`rlharvest bench --quick` on one workload of each kind: a collector, a weight sync and two
    batched-env collectors (the raw loops are the limit test's: tests/test_limit.py)."""
    output = tmp_path / "bench.json"
    batched = ["batched_parallel_8_small", "batched_asyncbatched_8_small"]
    command = [sys.executable, "-m", "rlharvest", "bench", "--quick", "--no-torchrl", "--no-torchrl14",
               "--output", str(output)]
    for name in ["collector_counting", "weightsync_multisync_1m", *batched]:
        command += ["--workload", name]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=220)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "collector_counting" in completed.stdout
    report = json.loads(output.read_text())
    row = report["rlharvest"]["collector_counting"]
    assert row["frames_per_s"] > 0 and row["leftover_children"] == 0 and "error" not in row
    assert report["torchrl"] is None and report["torchrl14"] is None and report["quick"] is True
    sync = report["rlharvest"]["weightsync_multisync_1m"]
    assert "error" not in sync and sync["leftover_children"] == 0
    for baseline in ("copy", "copy_in_loop"):  # both baselines measured, both ratios reported
        assert sync[f"{baseline}_s"] > 0
        assert sync[f"ratio_to_{baseline}"] == pytest.approx(sync["update_s"] / sync[f"{baseline}_s"])
    assert "/loop" in completed.stdout
    for name in batched:
        row = report["rlharvest"][name]
        assert "error" not in row and row["frames_per_s"] > 0 and row.get("leftover_children", 0) == 0
    table = completed.stdout.split("many envs, one batched policy: 8 CartPole-v1, 4-64-64-2 MLP")[1]
    assert "Collector(ParallelEnv)" in table and "AsyncBatchedCollector" in table


def test_batched_tables_from_a_report():
    from rlharvest.bench import format_table

    def rows(rate: float) -> dict:
        return {f"batched_{kind}_{n}_small": {"frames_per_s": rate * n} for kind in ("raw_vector", "parallel")
                for n in (1, 8)} | {"batched_multisync_8_small": {"frames_per_s": rate}}

    names = sorted(rows(1.0))
    report = {"workloads": names, "rlharvest": rows(100.0), "torchrl": rows(10.0), "torchrl14": None}
    table = format_table(report)
    assert "many envs, one batched policy: 8 CartPole-v1, 4-64-64-2 MLP" in table
    parallel = next(line for line in table.splitlines() if line.startswith("Collector(ParallelEnv)"))
    assert "800" in parallel and "80" in parallel and "10.00x" in parallel  # rlharvest over TorchRL 0.12
    assert "scaling, 4-64-64-2 MLP" in table and "Collector(ParallelEnv) 8.00x" in table


def test_compile_sources_writes_bytecode_also_when_python_would_not(tmp_path, monkeypatch):
    from rlharvest.bench import compile_sources

    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # as with PYTHONDONTWRITEBYTECODE=1
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("VALUE = 1\n")
    compile_sources(tmp_path / "pkg")
    assert [p.name.split(".")[0] for p in (tmp_path / "pkg" / "__pycache__").glob("*.pyc")] == ["mod"]
