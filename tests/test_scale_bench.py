"""benchmarks/scale.py, scale_plot.py and update_breakdown.py: their plumbing (figures are never asserted)."""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture()
def bench_modules(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import scale
    import scale_plot
    import update_breakdown

    return scale, scale_plot, update_breakdown


def _report(results: list[dict]) -> dict:
    return {"mode": "quiet", "date": "2026-12-03 19:00 UTC", "cpus": 2, "loadavg_start": "1.0 1.0 1.0",
            "results": results}


def test_plot_and_table_from_a_report(bench_modules):
    scale, scale_plot, _ = bench_modules
    results = []
    for side in ("rlharvest", "torchrl"):
        for workers in (2, 8):
            results.append({"side": side, "kind": "multisync", "workers": workers, "what": "run",
                            "first_batch_s": 0.5 * workers, "shutdown_s": 0.1, "frames_per_s": 1000.0 * workers,
                            "main_cpu_ms_per_batch": 1.5, "main_cpu_us_per_frame": 20.0, "background_cpu": 0.1})
            results.append({"side": side, "kind": "multisync", "workers": workers, "what": "w1m", "update_s": 0.002})
    results.append({"side": "torchrl", "kind": "ray_sync", "workers": 32, "what": "run",
                    "error": "did not start within 60 s"})
    svg = scale_plot.render(_report(results))
    root = ET.fromstring(svg)  # well-formed
    assert root.tag.endswith("svg") and svg.count("<polyline") == 10  # 4 run panels and the 1M panel, 2 sides each
    table = scale.table(results)
    assert "did not start within 60 s" in table and "multisync" in table
    row = next(line for line in table.splitlines() if line.startswith("multisync") and " 8 rlharvest" in line)
    assert "8000" in row and "2.0" in row  # frames/s and the 1M update in ms


def test_the_table_of_a_stored_report(bench_modules, tmp_path, capsys):
    scale, _, _ = bench_modules
    results = [{"side": "rlharvest", "kind": "multisync", "workers": 2, "what": "run", "first_batch_s": 0.5,
                "shutdown_s": 0.1, "frames_per_s": 5514.0, "main_cpu_ms_per_batch": 0.9,
                "main_cpu_us_per_frame": 29.0, "background_cpu": 1.0}]
    report = tmp_path / "scale.json"
    report.write_text(json.dumps(_report(results)))
    assert scale.main(["--table-only", str(report)]) == 0
    assert capsys.readouterr().out.strip() == scale.table(results).strip()


def test_plan_alternates_sides_and_limits_the_25m_points(bench_modules):
    scale, _, _ = bench_modules
    args = argparse.Namespace(workers=(2, 32), kinds=("multisync", "ray_sync"), w25m_workers=(2,),
                              torchrl_workers=(2,))
    points = scale.plan(args, {"rlharvest": "py", "torchrl": "py2"})
    assert [p[0] for p in points[:4]] == ["rlharvest", "torchrl", "torchrl", "rlharvest"]
    assert all(p[0] == "rlharvest" for p in points if p[2] == 32)
    assert all(("w25m" in p[3]) == (p[2] == 2) for p in points)


def test_breakdown_analysis_of_one_update(bench_modules):
    _, _, breakdown = bench_modules

    def event(t, e, v=None, w=None, **extra):
        return {"t": t, "e": e, "v": v, "w": w, **extra}

    main = [event(0.000, "send_start", 1, run_ns=0, wait_ns=0), event(0.001, "prepared"),
            event(0.001, "deliver_start", 1), event(0.002, "stage_start"), event(0.003, "stage_end"),
            event(0.004, "notice_write", 1), event(0.005, "deliver_end", 1), event(0.005, "wait_start", 1),
            event(0.009, "ack_read", 1, 0), event(0.010, "wait_end", 1),
            event(0.010, "send_end", 1, run_ns=2_000_000, wait_ns=3_000_000)]
    node = [event(0.006, "notice_read", 1), event(0.007, "receive_start", None, 0),
            event(0.0072, "receive_end", 1, 0), event(0.0073, "apply_start"), event(0.0075, "apply_end"),
            event(0.008, "ack_write", 1, 0)]
    medians = breakdown.analyse({1: main, 2: node}, 1)
    assert medians["total (send called -> returned)"] == pytest.approx(10.0)
    assert medians["main thread runnable, waiting for a core, during send"] == pytest.approx(3.0)
    assert medians["node: reader has it -> taken (a step boundary, or at once by the reader)"] == pytest.approx(1.0)
    assert medians["ack on the wire (node writes -> main reads)"] == pytest.approx(1.0)
    offsets = breakdown.timeline({1: main, 2: node}, 1)
    assert offsets["node A: ack_write"] == pytest.approx(8.0) and offsets["main: ack_read #1"] == pytest.approx(9.0)


@pytest.mark.timeout(300)
def test_a_point_that_does_not_start_in_time_is_reported_and_killed(bench_modules):
    scale, _, _ = bench_modules
    args = argparse.Namespace(seconds=0.5, repeats=1, import_limit=200.0, start_limit=0.001)
    results = scale.run_child(sys.executable, "rlharvest", "multisync", 2, ["run", "w1m"], args)
    assert [r["what"] for r in results] == ["run", "w1m"]
    assert results[0]["error"] == "did not start within 0 s"  # its process group was killed with it
    assert results[1]["error"] == "not run: the point before it in its process failed (did not start within 0 s)"
    assert "loadavg_before" in results[0]


@pytest.mark.timeout(300)
def test_a_point_measures_and_leaves_no_worker(bench_modules):
    scale, _, _ = bench_modules
    args = argparse.Namespace(seconds=0.5, repeats=1, import_limit=200.0, start_limit=120.0)
    (run,) = scale.run_child(sys.executable, "rlharvest", "multisync", 2, ["run"], args)
    assert "error" not in run, run
    assert run["frames_per_s"] > 0 and run["main_cpu_ms_per_batch"] > 0 and run["frames_per_batch"] == 32
    assert run["leftover_children"] == 0 and run["shutdown_s"] >= 0
