"""One point of the scaling benchmark (``scale.py``): one side, one collector kind, N workers.

Run by ``scale.py`` in a fresh process group, with the side's Python (the project's venv for
rlharvest, ``.venv-torchrl`` for TorchRL 0.12)::

    python benchmarks/scale_point.py --side rlharvest --kind multisync --workers 8 --what run,w1m

For each ``--what`` (one collector each, one after the other, in this process) it prints
``{"event": "ready"}`` before the constructor and ``{"event": "started"}`` once the first batch is in
hand (so that the parent can tell "did not start within X s" from a later failure), then one JSON
result line.

``--what run``: the counting env and its one-parameter policy (the cheapest env and policy both
sides share), ``frames_per_batch = 16 * N``: ``first_batch_s`` (constructor called -> first batch in
hand), ``frames_per_s`` over ``--seconds`` after the first batch, ``main_cpu_ms_per_batch`` and
``main_cpu_us_per_frame`` (``time.process_time`` of this process, every thread, over those batches:
the learner-side cost), ``shutdown_s``.

``--what w1m`` / ``w25m``: CartPole and ``common.make_big_policy`` of 1M / 25M parameters,
``frames_per_batch = 4 * N``; ``update_s`` is the median of ``--repeats`` calls of
``update_policy_weights_()`` after bumping every parameter in place, one batch between calls (for
the async kinds the workers collect while the update happens).

Nothing here imports torchrl or rlharvest at module level: TorchRL's spawned workers re-import the
main module.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import harness  # noqa: E402

WHATS = {"run": None, "w1m": 1_000_000, "w25m": 25_000_000}


def _side(name: str) -> Any:
    if name == "rlharvest":
        import rlharvest_side

        return rlharvest_side.RLHarvestSide()
    if name == "torchrl":
        import torchrl_side

        return torchrl_side.TorchRLSide()
    raise ValueError(f"side must be 'rlharvest' or 'torchrl', got {name!r}")


def _emit(payload: dict[str, Any]) -> None:
    print(json.dumps(payload), flush=True)


def _run(side: Any, kind: str, workers: int, seconds: float) -> dict[str, Any]:
    policy = side.policy("counting")
    start = time.perf_counter()
    collector = side.build_collector(kind, side.env_fn("counting"), policy, 16 * workers)
    try:
        batches = iter(collector)
        first = next(batches)
        first_at = time.perf_counter()
        _emit({"event": "started", "first_batch_s": first_at - start})
        monitor = harness.CpuMonitor().start()
        cpu0 = time.process_time()
        frames = count = 0
        while time.perf_counter() - first_at < seconds:
            frames += next(batches).numel()
            count += 1
        cpu = time.process_time() - cpu0
        last_at = time.perf_counter()
        result = {
            "first_batch_s": first_at - start,
            "frames_per_batch": int(first.numel()),
            "frames_per_s": common.rate(frames, last_at - first_at),
            "timed_batches": count,
            "main_cpu_ms_per_batch": 1e3 * common.rate(cpu, count),
            "main_cpu_us_per_frame": 1e6 * common.rate(cpu, frames),
            "main_cpu_cores": common.rate(cpu, last_at - first_at),
            **monitor.stop(),
        }
    except BaseException:
        collector.shutdown()
        raise
    import measure

    return {**result, **measure.shutdown_and_check(collector)}


def _updates(side: Any, kind: str, workers: int, n_params: int, repeats: int) -> dict[str, Any]:
    policy = side.big_policy(n_params)
    start = time.perf_counter()
    collector = side.build_collector(kind, side.env_fn("cartpole"), policy, 4 * workers)
    try:
        batches = iter(collector)
        next(batches)
        _emit({"event": "started", "first_batch_s": time.perf_counter() - start})
        monitor = harness.CpuMonitor().start()
        latencies = []
        for _ in range(repeats):
            common.bump_parameters(policy)
            latencies.append(common.time_call(collector.update_policy_weights_))
            next(batches)
        cpu = monitor.stop()
    except BaseException:
        collector.shutdown()
        raise
    import measure

    stats = common.summarize(latencies)
    return {"n_params": common.count_params(policy), "update_s": stats["median"], "update_min_s": stats["min"],
            "update_max_s": stats["max"], "repeats": repeats, **cpu, **measure.shutdown_and_check(collector)}


def run_point(side: Any, kind: str, workers: int, what: str, seconds: float, repeats: int) -> dict[str, Any]:
    """Measure one point in this process; an exception becomes an ``error`` entry."""
    result: dict[str, Any] = {"side": side.name, "kind": kind, "workers": workers, "what": what, **side.versions()}
    began = time.perf_counter()
    _emit({"event": "ready", "what": what})  # imports and the local Ray are up: the start limit counts from here
    try:
        if WHATS[what] is None:
            result.update(_run(side, kind, workers, seconds))
        else:
            result.update(_updates(side, kind, workers, WHATS[what], repeats))
    except Exception as exc:  # noqa: BLE001 - reported in the result
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-3000:]
        harness.reap_descendants()
    result["wall_s"] = time.perf_counter() - began
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one point of benchmarks/scale.py")
    parser.add_argument("--side", required=True, choices=("rlharvest", "torchrl"))
    parser.add_argument("--kind", required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--what", required=True, help=f"comma-separated, run in this order: {sorted(WHATS)}")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    side = _side(args.side)
    common.NUM_WORKERS = args.workers  # read by the sides' build_collector at call time
    common.RAY_INIT["num_cpus"] = args.workers  # one CPU per actor (the default remote config)
    common.init_ray(args.kind)
    failed = None
    for what in args.what.split(","):
        if what not in WHATS:
            raise SystemExit(f"--what must name some of {sorted(WHATS)}, got {what!r}")
        if failed is not None:  # the clean-up after a failure may have taken the local Ray with it
            _emit({"side": args.side, "kind": args.kind, "workers": args.workers, "what": what,
                   "error": f"not run: the point before it in its process failed ({failed:.120})"})
            continue
        result = run_point(side, args.kind, args.workers, what, args.seconds, args.repeats)
        _emit(result)
        failed = result.get("error")
    if args.kind.startswith("ray_"):
        import ray

        ray.shutdown()
    return 1 if failed is not None else 0


if __name__ == "__main__":
    sys.exit(main())
