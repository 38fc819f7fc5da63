"""``rlharvest demo``: PPO learns CartPole-v1 from experience collected by an rlharvest collector.

The loop is the usual on-policy one::

    for batch in collector:                  # workers collect with the current weights
        ppo.update(batch, frames)            # the learner mutates the policy module in place ...
        collector.update_policy_weights_()   # ... and the collector pushes it to every worker

A progress bar shows frames, frames/s, the mean return of the last 20 episodes, the policy version
(number of weight updates) and the duration of the last weight sync; ``--monitor`` serves the
collector's live page (``rlharvest.monitor``) meanwhile. At the end a summary table is
printed and ``<out>/learning_curve.png`` and ``<out>/summary.json`` are written.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .choices import COLLECTORS, DEFAULT_FRAMES, TARGET_RETURN
from .ppo import PPO, PPOConfig, make_policy, make_value

if TYPE_CHECKING:  # the collectors are imported when the demo runs (``make_collector``)
    from ..collectors.base import BaseCollector

__all__ = ["DemoConfig", "run_demo", "make_env", "build_collector", "EpisodeTracker", "CollectorUnavailable",
           "COLLECTORS", "DEFAULT_FRAMES"]

ENV_ID = "CartPole-v1"
WINDOW = 20


@dataclass
class DemoConfig:
    collector: str = "distributed"
    workers: int = 2
    frames: int = DEFAULT_FRAMES
    seed: int = 0
    out: str = "demo_out"
    target_return: float | None = TARGET_RETURN  # stop early once the last-20 mean reaches it (None: never)
    progress: bool = True
    monitor_port: int | None = None  # serve rlharvest.monitor's page on 127.0.0.1 (0: a port from the OS)
    ppo: PPOConfig = field(default_factory=PPOConfig)


def make_env():
    """One CartPole-v1 (integer actions). Module-level so that it pickles for any launcher."""
    from rlharvest.envs import GymEnv

    return GymEnv(ENV_ID, categorical_action_encoding=True)


# ---------------------------------------------------------------------------------------------- collectors
class CollectorUnavailable(RuntimeError):
    """The requested collector cannot be imported in this install."""


def build_collector(name: str, policy, workers: int, frames_per_batch: int, total_frames: int):
    """The rlharvest collector called ``name``, all of them with the TorchRL-compatible constructor."""
    kwargs = dict(policy=policy, frames_per_batch=frames_per_batch, total_frames=total_frames)
    if name == "single":
        from rlharvest.collectors import Collector

        return Collector(make_env, **kwargs)
    if name == "multisync":
        from rlharvest.collectors import MultiSyncCollector

        return MultiSyncCollector([make_env] * workers, **kwargs)
    if name == "multiasync":
        from rlharvest.collectors import MultiAsyncCollector

        return MultiAsyncCollector([make_env] * workers, **kwargs)
    if name in ("distributed", "rpc"):
        from rlharvest.transport.ports import free_port_block

        multi_node = dict(create_env_fn=[make_env] * workers, launcher="mp", sync=True,
                          tcp_port=free_port_block(3), **kwargs)  # a master port and the two after it
        try:
            if name == "distributed":
                from rlharvest.collectors.distributed import DistributedCollector

                return DistributedCollector(backend="gloo", **multi_node)
            from rlharvest.collectors.distributed import RPCCollector

            return RPCCollector(**multi_node)
        except ImportError as err:
            raise CollectorUnavailable(f"--collector {name} is not available in this install ({err}); "
                               "try --collector multisync.") from err
    raise ValueError(f"unknown collector {name!r}; choose one of {COLLECTORS}")


def seed_collector(collector: BaseCollector, seed: int) -> None:
    """Seed the envs (and, for worker collectors, the workers' torch RNG); tolerate collectors without it."""
    try:
        collector.set_seed(seed)
    except NotImplementedError:
        print(f"note: {type(collector).__name__}.set_seed is not implemented; envs are not seeded.", file=sys.stderr)


# ---------------------------------------------------------------------------------------------- episodes
class EpisodeTracker:
    """Episode returns from batches of any layout, episodes spanning batches included.

    Partial returns are kept per (batch row, trajectory id); an episode is complete at its ``done`` step.
    After :meth:`add`, ``last_finished`` lists ``(frames into the batch, return)`` of the episodes that
    ended in that batch, in the order they ended.
    """

    def __init__(self, window: int = WINDOW):
        self.returns: list[float] = []
        self.recent: deque[float] = deque(maxlen=window)
        self.last_finished: list[tuple[int, float]] = []
        self._partial: dict[tuple[int, int], float] = {}

    def add(self, batch) -> None:
        steps = batch.shape[-1]
        rows = batch.shape[:-1].numel()
        reward = batch.get(("next", "reward")).reshape(rows, steps).tolist()
        done = batch.get(("next", "done")).reshape(rows, steps).tolist()
        traj = batch.get(("collector", "traj_ids")).reshape(rows, steps).tolist()
        partial, finished = self._partial, []
        for row in range(rows):
            for t in range(steps):
                tid = traj[row][t]
                if tid < 0:  # a step an interrupted rollout did not collect
                    continue
                key = (row, tid)
                partial[key] = partial.get(key, 0.0) + reward[row][t]
                if done[row][t]:
                    finished.append((t, partial.pop(key)))
        finished.sort(key=lambda item: item[0])
        # every row advances one frame per time step
        self.last_finished = [((t + 1) * rows, value) for t, value in finished]
        for _, value in finished:
            self.returns.append(value)
            self.recent.append(value)

    @property
    def mean_recent(self) -> float:
        return sum(self.recent) / len(self.recent) if self.recent else float("nan")


# ---------------------------------------------------------------------------------------------- output
def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="frame", unit_scale=True, dynamic_ncols=True, disable=not enabled,
                desc="PPO CartPole-v1", file=sys.stderr, smoothing=0.3)


def write_learning_curve(path: Path, curve: list[tuple[int, float]], returns_at: list[tuple[int, float]],
                         title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    if returns_at:
        xs, ys = zip(*returns_at)
        ax.scatter(xs, ys, s=4, alpha=0.25, color="tab:gray", label="episode return")
    points = [(f, r) for f, r in curve if not math.isnan(r)]
    if points:
        xs, ys = zip(*points)
        ax.plot(xs, ys, color="tab:blue", lw=2, label=f"mean of last {WINDOW} episodes")
    ax.axhline(TARGET_RETURN, color="tab:green", ls="--", lw=1, label=f"target {TARGET_RETURN:g}")
    ax.set_xlabel("frames")
    ax.set_ylabel("episode return")
    ax.set_ylim(0, 520)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(rows: list[tuple[str, Any]]) -> str:
    width = max(len(k) for k, _ in rows)
    cells = [(k, f"{v:,.1f}" if isinstance(v, float) else str(v)) for k, v in rows]
    value_width = max(len(v) for _, v in cells)
    rule = f"+{'-' * (width + 2)}+{'-' * (value_width + 2)}+"
    lines = [rule] + [f"| {k:<{width}} | {v:>{value_width}} |" for k, v in cells] + [rule]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- the demo
@dataclass
class _Progress:
    """What the training loop records as it goes."""

    tracker: EpisodeTracker = field(default_factory=lambda: EpisodeTracker())
    curve: list = field(default_factory=list)        # (frames, mean of the last 20 episodes) after each batch
    returns_at: list = field(default_factory=list)   # (frames, return) of each finished episode
    sync_ms: list = field(default_factory=list)
    timings: dict = field(default_factory=lambda: {"collect": 0.0, "train": 0.0, "sync": 0.0})
    frames: int = 0
    version: int = 0
    reached_at: int | None = None
    interrupted: bool = False


def run_demo(config: DemoConfig) -> dict:
    """Train PPO on CartPole-v1 through the chosen collector; returns (and writes) the summary."""
    start = time.perf_counter()
    torch.set_num_threads(1)
    torch.manual_seed(config.seed)
    cfg = config.ppo
    workers = 1 if config.collector == "single" else max(1, int(config.workers))
    frames_per_batch = math.ceil(cfg.frames_per_batch / workers) * workers
    total_frames = max(1, math.ceil(config.frames / frames_per_batch)) * frames_per_batch
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)

    probe = make_env()
    obs_dim = probe.observation_spec["observation"].shape[-1]
    n_actions = probe.full_action_spec["action"].n
    probe.close()
    policy = make_policy(obs_dim, n_actions, cfg.hidden)
    ppo = PPO(policy, make_value(obs_dim, cfg.hidden), cfg, total_frames)

    progress = _Progress()
    collector = build_collector(config.collector, policy, workers, frames_per_batch, total_frames)
    monitor = _start_monitor(collector, config.monitor_port)
    setup_seconds = time.perf_counter() - start
    bar = _progress_bar(total_frames, config.progress)
    try:
        seed_collector(collector, config.seed)
        _train(collector, ppo, config, progress, bar)
    except KeyboardInterrupt:  # still write what we have
        progress.interrupted = True
    finally:
        bar.close()
        collector.shutdown()
        if monitor is not None:
            monitor.close()
    wall = time.perf_counter() - start
    summary = _summary(config, progress, workers=workers, total_frames=total_frames,
                       frames_per_batch=frames_per_batch, wall=wall, setup_seconds=setup_seconds)
    write_learning_curve(out / "learning_curve.png", progress.curve, progress.returns_at,
                         f"PPO on {ENV_ID} via {config.collector} collector (seed {config.seed})")
    with open(out / "summary.json", "w") as fh:
        json.dump(summary, fh, indent=2)
    _print_summary(summary, out)
    return summary


def _start_monitor(collector: BaseCollector, port: int | None):
    """``--monitor``: the collector's live page (docs/monitoring.md), its address on stderr."""
    if port is None:
        return None
    from rlharvest.monitor import Monitor

    try:
        monitor = Monitor(collector, port=port)
    except BaseException:
        collector.shutdown()
        raise
    print(f"monitor: open {monitor.url} in a browser to watch the collector", file=sys.stderr, flush=True)
    return monitor


def _train(collector: BaseCollector, ppo: PPO, config: DemoConfig, progress: _Progress, bar) -> None:
    """Train on every batch, pushing the weights after each update, until solved or the budget is spent."""
    tracker, timings, sync_ms = progress.tracker, progress.timings, progress.sync_ms
    tick = time.perf_counter()
    for batch in collector:
        timings["collect"] += time.perf_counter() - tick
        tracker.add(batch)
        progress.returns_at += [(progress.frames + offset, r) for offset, r in tracker.last_finished]
        progress.frames += batch.numel()
        mean_recent = tracker.mean_recent
        progress.curve.append((progress.frames, mean_recent))
        solved = (config.target_return is not None and len(tracker.recent) == tracker.recent.maxlen
                  and mean_recent >= config.target_return)
        if not solved:
            tick = time.perf_counter()
            ppo.update(batch, progress.frames)
            timings["train"] += time.perf_counter() - tick

            tick = time.perf_counter()
            collector.update_policy_weights_()  # re-reads the policy module we passed, pushes it
            sync_ms.append((time.perf_counter() - tick) * 1e3)
            timings["sync"] += sync_ms[-1] / 1e3
            progress.version += 1

        bar.set_postfix(_progress_fields(collector.stats(), mean_recent, progress.version), refresh=False)
        bar.update(batch.numel())
        if solved:
            progress.reached_at = progress.frames
            bar.total = progress.frames  # the budget was an upper bound: show the bar complete
            return  # no need for another update
        tick = time.perf_counter()


def _progress_fields(stats: dict, mean_recent: float, version: int) -> dict:
    """What the progress bar shows besides frames: the return, then what the collector's ``stats()``
    says (cheap, read after every batch) about throughput, weight updates, time and restarts."""
    sync = stats.get("weight_sync_s_last")
    fields = {"return(20)": f"{mean_recent:.1f}", "version": stats.get("policy_version", version),
              "sync": f"{sync * 1e3:.2f}ms" if sync is not None else "-",
              "fps": f"{stats.get('frames_per_s_recent', 0.0):.0f}",
              "env/policy": f"{stats['time_env_s']:.1f}s/{stats['time_policy_s']:.1f}s"}
    if stats.get("restarts"):
        fields["restarts"] = stats["restarts"]
    return fields


def _summary(config: DemoConfig, progress: _Progress, *, workers: int, total_frames: int, frames_per_batch: int,
             wall: float, setup_seconds: float) -> dict:
    tracker, timings, sync_ms, frames = progress.tracker, progress.timings, progress.sync_ms, progress.frames
    mean_recent = tracker.mean_recent
    return {
        "env": ENV_ID,
        "collector": config.collector,
        "workers": workers,
        "seed": config.seed,
        "frames": frames,
        "frame_budget": total_frames,
        "frames_per_batch": frames_per_batch,
        "wall_seconds": round(wall, 3),
        "setup_seconds": round(setup_seconds, 3),
        "collect_seconds": round(timings["collect"], 3),
        "train_seconds": round(timings["train"], 3),
        "sync_seconds": round(timings["sync"], 3),
        "frames_per_second": round(frames / wall, 1) if wall > 0 else 0.0,
        "collect_frames_per_second": round(frames / timings["collect"], 1) if timings["collect"] > 0 else 0.0,
        "episodes": len(tracker.returns),
        "mean_return_last_20": None if math.isnan(mean_recent) else round(mean_recent, 2),
        "target_return": config.target_return,
        "solved": progress.reached_at is not None,
        "solved_at_frames": progress.reached_at,
        "interrupted": progress.interrupted,
        "weight_updates": progress.version,
        "mean_weight_sync_ms": round(sum(sync_ms) / len(sync_ms), 3) if sync_ms else None,
        "ppo": config.ppo.as_dict(),
        "learning_curve": [[f, None if math.isnan(r) else round(r, 2)] for f, r in progress.curve],
    }


def _print_summary(summary: dict, out: Path) -> None:
    mean = summary["mean_return_last_20"]
    if summary["solved"]:
        status = f"solved (>= {summary['target_return']:g}) at {summary['solved_at_frames']:,} frames"
    elif summary["interrupted"]:
        status = "interrupted"
    else:
        status = "budget spent" + ("" if summary["target_return"] is None else ", target not reached")
    rows = [
        ("collector", f"{summary['collector']} ({summary['workers']} worker{'s' * (summary['workers'] > 1)})"),
        ("seed", summary["seed"]),
        ("frames", f"{summary['frames']:,}"),
        ("episodes", summary["episodes"]),
        ("mean return (last 20)", "n/a" if mean is None else f"{mean:.1f}"),
        ("status", status),
        ("weight updates", summary["weight_updates"]),
        ("mean weight sync", "n/a" if summary["mean_weight_sync_ms"] is None
         else f"{summary['mean_weight_sync_ms']:.2f} ms"),
        ("wall time", f"{summary['wall_seconds']:.1f} s"),
        ("  of which collecting", f"{summary['collect_seconds']:.1f} s"),
        ("  of which training", f"{summary['train_seconds']:.1f} s"),
        ("frames / s (overall)", f"{summary['frames_per_second']:,.0f}"),
        ("frames / s (collecting)", f"{summary['collect_frames_per_second']:,.0f}"),
    ]
    print(format_table(rows))
    print(f"wrote {out / 'learning_curve.png'} and {out / 'summary.json'}", flush=True)
