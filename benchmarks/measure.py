"""The measurements, written once against the collector API both sides share.

Nothing here imports torchrl, tensordict or rlharvest: a *side* (see
:class:`Side`) supplies collectors, envs and TensorDict-wrapped policies, and
these functions drive them through the TorchRL collector API (``iter``,
``next``, ``update_policy_weights_()``, ``shutdown()``).  ``torchrl_side.py``
is the TorchRL side; an rlharvest side only needs its own :class:`Side`.

Metric definitions (all times from ``time.perf_counter`` unless noted):

* ``first_batch_s``: from just before the collector constructor is called to
  the first batch in hand (includes worker start-up and env construction).
* ``frames_per_s``: frames of the batches after the first, divided by the
  time from the first batch in hand to the last batch in hand.  Collection
  runs for ``Budget.seconds`` after the first batch.
* ``shutdown_s``: duration of ``collector.shutdown()``.
* ``leftover_children`` / ``children_gone_s``: see ``harness.children_report``.
* ``update_s``: median duration of ``update_policy_weights_()`` (no
  argument) after every parameter was bumped in place, one batch collected
  between updates; ``copy_s``: ``common.inprocess_copy_seconds``;
  ``ratio_to_copy = update_s / copy_s``.
* ``fresh_fraction`` / ``batch_fresh_fraction``: see :func:`measure_freshness`.
* ``ours_cpu`` / ``background_cpu``: cores used by the benchmark's process
  tree / by everything else during the timed part (``harness.CpuMonitor``);
  ``run_ours_cpu`` / ``run_background_cpu``: the same over the whole
  workload (construction and shutdown included).
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

import common
import harness


class Side(Protocol):
    """What a benchmark side provides (TorchRL or rlharvest)."""

    name: str

    def versions(self) -> dict[str, str]:
        """Versions of the packages under test."""

    def build_collector(
        self, kind: str, env_fn: Callable[[], Any], policy: nn.Module, frames_per_batch: int
    ) -> Any:
        """A collector of ``kind`` (see ``common.THROUGHPUT_WORKLOADS``) with
        ``common.NUM_WORKERS`` workers and ``total_frames=common.TOTAL_FRAMES``."""

    def env_fn(self, family: str) -> Callable[[], Any]:
        """Picklable env constructor: ``cartpole``, ``counting`` or ``timestamp``."""

    def policy(self, family: str) -> nn.Module:
        """TensorDict policy for ``cartpole`` or ``counting`` envs."""

    def big_policy(self, n_params: int) -> nn.Module:
        """``make_big_policy(n_params)`` + ArgmaxOneHot, observation -> action."""

    def marked_policy(self) -> tuple[common.MarkedCartpolePolicy, nn.Module]:
        """The marked module and its wrapper writing ``action`` and ``marker``."""

    def build_batched_collector(self, kind: str, num_envs: int, size: str, frames_per_batch: int) -> Any:
        """A collector of ``kind`` (see ``common.BATCHED_KINDS``) over ``num_envs`` CartPole envs with
        ``common.make_sized_cartpole_mlp(size)``; raises NotImplementedError where the side has no such
        collector."""


def _collect_or_shutdown(collector: Any, body: Callable[[], Any]) -> Any:
    """Run ``body``; on any exception shut ``collector`` down and re-raise."""
    try:
        return body()
    except BaseException:
        collector.shutdown()
        raise


def shutdown_and_check(collector: Any) -> dict[str, Any]:
    """Shut ``collector`` down; ``shutdown_s`` plus the children report."""
    shutdown_s = common.time_call(collector.shutdown)
    report = {"shutdown_s": shutdown_s, **harness.children_report()}
    harness.reap_descendants()
    return report


def measure_throughput(side: Side, kind: str, family: str, budget: common.Budget) -> dict[str, Any]:
    """``first_batch_s``, ``frames_per_s`` and ``shutdown_s`` of one collector."""
    env_fn, policy = side.env_fn(family), side.policy(family)
    common.init_ray(kind)
    start = time.perf_counter()
    collector = side.build_collector(kind, env_fn, policy, budget.frames_per_batch)
    return {"collector_kind": kind, **_time_collector(collector, start, budget)}


def measure_batched(side: Side, kind: str, num_envs: int, size: str, budget: common.Budget) -> dict[str, Any]:
    """Frames/s of ``num_envs`` CartPole envs and the ``size`` MLP (docs/performance.md, "Many envs, one batched policy")."""
    info = {"collector_kind": kind, "num_envs": num_envs, "policy": size}
    if kind == "raw_vector":
        monitor = harness.CpuMonitor().start()
        return {**info, **common.raw_vector_loop(num_envs, size, budget.seconds), **monitor.stop()}
    start = time.perf_counter()
    frames = common.batched_frames_per_batch(budget.frames_per_batch, num_envs)
    collector = side.build_batched_collector(kind, num_envs, size, frames)
    return {**info, **_time_collector(collector, start, budget)}


def _time_collector(collector: Any, start: float, budget: common.Budget) -> dict[str, Any]:
    """Iterate ``collector`` for ``budget.seconds`` after its first batch, then shut it down."""

    def collect() -> dict[str, Any]:
        batches = iter(collector)
        first = next(batches)
        first_at = time.perf_counter()
        monitor = harness.CpuMonitor().start()
        frames, count = 0, 0
        while time.perf_counter() - first_at < budget.seconds:
            frames += next(batches).numel()
            count += 1
        last_at = time.perf_counter()
        return {
            "frames_per_s": common.rate(frames, last_at - first_at),
            "first_batch_s": first_at - start,
            "frames_per_batch": int(first.numel()),
            "timed_batches": count,
            "timed_frames": frames,
            "timed_s": last_at - first_at,
            **monitor.stop(),
        }

    result = _collect_or_shutdown(collector, collect)
    return {**result, **shutdown_and_check(collector)}


def measure_weightsync(side: Side, kind: str, n_params: int, budget: common.Budget) -> dict[str, Any]:
    """Median latency of ``update_policy_weights_()`` with a big policy.

    After the first batch, ``budget.weightsync_repeats`` times: add 1e-3 to
    every parameter in place, time ``update_policy_weights_()`` (no argument:
    the collector re-reads its policy), then collect one batch.

    Two baselines of one in-process ``copy_`` of the same bytes: ``copy_s``,
    repeated between two cache-hot buffers after the run
    (:func:`common.inprocess_copy_seconds`), and ``copy_in_loop_s``, timed in
    the same loop just before each update, from a source written just before
    (as the policy is) into a destination last written one batch earlier (as
    a weight buffer is): the copy an update has to make, in the cache state
    it makes it in.
    """
    policy = side.big_policy(n_params)
    common.init_ray(kind)
    collector = side.build_collector(
        kind, side.env_fn("cartpole"), policy, budget.weightsync_frames_per_batch
    )
    source, destination = common.copy_buffers(n_params)

    def updates() -> tuple[list[float], list[float], dict[str, float]]:
        batches = iter(collector)
        next(batches)
        monitor = harness.CpuMonitor().start()
        latencies, copies = [], []
        for _ in range(budget.weightsync_repeats):
            copies.append(common.timed_copy(source, destination))
            common.bump_parameters(policy)
            latencies.append(common.time_call(collector.update_policy_weights_))
            next(batches)
        return latencies, copies, monitor.stop()

    latencies, copies, cpu = _collect_or_shutdown(collector, updates)
    report = shutdown_and_check(collector)
    copy_s = common.inprocess_copy_seconds(n_params)
    copy_in_loop_s = common.summarize(copies)["median"]
    stats = common.summarize(latencies)
    return {
        "collector_kind": kind,
        "n_params": common.count_params(policy),
        "update_s": stats["median"],
        "update_min_s": stats["min"],
        "update_max_s": stats["max"],
        "repeats": len(latencies),
        "copy_s": copy_s,
        "ratio_to_copy": stats["median"] / copy_s,
        "copy_in_loop_s": copy_in_loop_s,
        "ratio_to_copy_in_loop": stats["median"] / copy_in_loop_s,
        **cpu,
        **report,
    }


def _freshness_rounds(
    collector: Any, module: common.MarkedCartpolePolicy, budget: common.Budget
) -> list[common.FreshnessCounts]:
    """The update/inspect rounds of :func:`measure_freshness`."""
    batches = iter(collector)
    next(batches)
    rounds = []
    for k in range(1, budget.freshness_rounds + 1):
        with torch.no_grad():
            module.marker.fill_(float(k))
        collector.update_policy_weights_()
        t_return = time.monotonic()
        counts = common.FreshnessCounts()
        for _ in range(budget.freshness_batches):
            batch = next(batches)
            counts.add_frames(batch.get("timestamp"), batch.get("marker"), float(k), t_return)
        rounds.append(counts)
    return rounds


def measure_freshness(side: Side, kind: str, budget: common.Budget) -> dict[str, Any]:
    """How many frames collected after a weight update used the new weights.

    After one warm-up batch, each round ``k = 1..rounds`` sets the policy's
    ``marker`` parameter to ``k``, calls ``update_policy_weights_()``, takes
    ``t_return = time.monotonic()`` and inspects the next
    ``budget.freshness_batches`` batches.  ``fresh_fraction``: among frames
    whose ``timestamp`` (the monotonic time at which their observation was
    produced, hence shortly before the policy acted on it) is later than
    ``t_return``, the share with ``marker == k``.  ``batch_fresh_fraction``:
    the same share over *all* frames of those batches, including frames
    already in flight when the update was made.
    """
    module, policy = side.marked_policy()
    common.init_ray(kind)
    collector = side.build_collector(
        kind, side.env_fn("timestamp"), policy, budget.freshness_frames_per_batch
    )

    def rounds_with_cpu() -> tuple[list[common.FreshnessCounts], dict[str, float]]:
        monitor = harness.CpuMonitor().start()
        return _freshness_rounds(collector, module, budget), monitor.stop()

    rounds, cpu = _collect_or_shutdown(collector, rounds_with_cpu)
    totals = common.FreshnessCounts()
    for counts in rounds:
        totals.add(counts)
    return {
        "collector_kind": kind,
        "fresh_fraction": common.rate(totals.after_fresh, totals.after),
        "batch_fresh_fraction": common.rate(totals.total_fresh, totals.total),
        "considered_frames": totals.after,
        "fresh_frames": totals.after_fresh,
        "inspected_frames": totals.total,
        "rounds": len(rounds),
        "per_round_fresh_fraction": [round(common.rate(c.after_fresh, c.after), 4) for c in rounds],
        "per_round_batch_fresh_fraction": [
            round(common.rate(c.total_fresh, c.total), 4) for c in rounds
        ],
        **cpu,
        **shutdown_and_check(collector),
    }


def measure_raw_gym(budget: common.Budget) -> dict[str, Any]:
    """``steps_per_s`` of ``common.raw_gym_loop`` (no collector involved)."""
    monitor = harness.CpuMonitor().start()
    steps_per_s = common.raw_gym_loop(budget.raw_gym_steps)
    return {"steps_per_s": steps_per_s, "steps": budget.raw_gym_steps, **monitor.stop()}


def measure_raw_td(side: Side, budget: common.Budget) -> dict[str, Any]:
    """``steps_per_s`` of a bare TensorDict loop: the side's CartPole env and policy, no collector.

    Each step: ``policy(td)``, ``env.step_and_maybe_reset(td)`` (the env protocol both sides share),
    carrying the returned root to the next step.
    """
    env = side.env_fn("cartpole")()
    policy = side.policy("cartpole")
    steps = budget.raw_gym_steps
    monitor = harness.CpuMonitor().start()
    with torch.no_grad():
        td = env.reset()
        start = time.perf_counter()
        for _ in range(steps):
            td = policy(td)
            _, td = env.step_and_maybe_reset(td)
        elapsed = time.perf_counter() - start
    env.close()
    return {"steps_per_s": steps / elapsed, "steps": steps, **monitor.stop()}


def run_workload(side: Side, name: str, budget: common.Budget) -> dict[str, Any]:
    """Run the workload called ``name`` in this process."""
    if name == "raw_gym_cartpole":
        return measure_raw_gym(budget)
    if name == "raw_td_cartpole":
        return measure_raw_td(side, budget)
    batched = common.batched_workload(name)
    if batched is not None:
        return measure_batched(side, *batched, budget)
    if name in common.THROUGHPUT_WORKLOADS:
        kind, family = common.THROUGHPUT_WORKLOADS[name]
        return measure_throughput(side, kind, family, budget)
    backend, _, size = name.removeprefix("weightsync_").rpartition("_")
    if name.startswith("weightsync_") and backend in common.WEIGHTSYNC_KINDS:
        if size in common.BIG_POLICY_SIZES:
            kind = common.WEIGHTSYNC_KINDS[backend]
            return measure_weightsync(side, kind, common.BIG_POLICY_SIZES[size], budget)
    if name.startswith("weightsync_") and backend in common.COLLECTING_WEIGHTSYNC_KINDS and size == "1m":
        updates = common.COLLECTING_UPDATES[budget == common.QUICK]
        collecting = dataclasses.replace(budget, weightsync_frames_per_batch=common.COLLECTING_FRAMES_PER_BATCH,
                                         weightsync_repeats=updates)
        return measure_weightsync(side, common.COLLECTING_WEIGHTSYNC_KINDS[backend], common.BIG_POLICY_SIZES[size],
                                  collecting)
    freshness = name.removeprefix("freshness_")
    if name.startswith("freshness_") and freshness in common.FRESHNESS_KINDS:
        return measure_freshness(side, common.FRESHNESS_KINDS[freshness], budget)
    valid = ", ".join(common.workload_names())
    raise ValueError(f"unknown workload {name!r}; valid: {valid}")


def run_one(side: Side, name: str, quick: bool) -> dict[str, Any]:
    """Run one workload; an exception becomes an ``error`` entry."""
    result: dict[str, Any] = {"workload": name, "side": side.name, **side.versions()}
    start = time.perf_counter()
    monitor = harness.CpuMonitor().start()
    try:
        result.update(run_workload(side, name, common.QUICK if quick else common.FULL))
    except Exception as exc:  # noqa: BLE001 - reported in the result, not hidden
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
        harness.reap_descendants()
    run_cpu = monitor.stop()
    result["run_ours_cpu"] = run_cpu["ours_cpu"]
    result["run_background_cpu"] = run_cpu["background_cpu"]
    result["wall_s"] = time.perf_counter() - start
    return result
