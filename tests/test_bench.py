"""Smoke test of `rlharvest bench` (figures are not asserted: timings never are)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(240)
def test_bench_quick_one_workload(tmp_path):
    output = tmp_path / "bench.json"
    completed = subprocess.run(
        [sys.executable, "-m", "rlharvest", "bench", "--quick", "--no-torchrl", "--workload", "collector_counting",
         "--workload", "raw_gym_cartpole", "--workload", "weightsync_multisync_1m", "--output", str(output)],
        capture_output=True, text=True, timeout=220,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "collector_counting" in completed.stdout and "raw_gym_cartpole" in completed.stdout
    report = json.loads(output.read_text())
    row = report["rlharvest"]["collector_counting"]
    assert row["frames_per_s"] > 0 and row["leftover_children"] == 0 and "error" not in row
    assert report["torchrl"] is None and report["quick"] is True
    sync = report["rlharvest"]["weightsync_multisync_1m"]
    assert "error" not in sync and sync["leftover_children"] == 0
    for baseline in ("copy", "copy_in_loop"):  # both baselines measured, both ratios reported
        assert sync[f"{baseline}_s"] > 0
        assert sync[f"ratio_to_{baseline}"] == pytest.approx(sync["update_s"] / sync[f"{baseline}_s"])
    assert "/loop" in completed.stdout
