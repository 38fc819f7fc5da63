"""Workload definitions shared by the TorchRL side and the rlharvest side.

This module is imported from two different virtual environments (the TorchRL
reference venv and the rlharvest venv), so it depends only on torch, numpy and
the standard library: no torchrl, no tensordict, no rlharvest.  Both sides build
their policies and baselines from here so that they measure the same thing.

Conventions:
    * All times are seconds from :func:`time.perf_counter` unless a name says
      otherwise; cross-process timestamps use :func:`time.monotonic`, which on
      Linux is one system-wide clock (CLOCK_MONOTONIC) shared by all processes.
    * Policies are plain ``nn.Module`` objects mapping tensors to tensors; each
      side wraps them in its own TensorDict plumbing.

Env families each side must provide (``measure.Side.env_fn``):
    * ``cartpole``: TorchRL-style wrapper of Gymnasium ``CartPole-v1``:
      ``observation`` float32 (4,), ``action`` one-hot (2,) of dtype
      :data:`ONE_HOT_ACTION_DTYPE`, policy :func:`make_cartpole_mlp` reading
      ``observation`` and writing ``action``.
    * ``counting``: counter env, ``observation`` int32 (*B, 1), ``action``
      binary (*B, 1) added to the counter, reward 0.0, ``done = terminated =
      counter > COUNTING_MAX_STEPS``; policy :class:`CountingPolicy` writing
      ``action = weight`` broadcast to (*B, 1).
    * ``timestamp``: ``cartpole`` plus a ``timestamp`` observation, float64
      (*B, 1) = ``time.monotonic()`` when the reset or step that produced the
      observation returned; policy :class:`MarkedCartpolePolicy` writing
      ``action`` and ``marker``.

Workloads (:func:`workload_names`: the collector suite, then the batched suite "Many envs, one
batched policy") and their sizes (:data:`FULL`, :data:`QUICK`) are defined here; ``measure.py``
runs them.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

#: Observation and action sizes of Gymnasium's ``CartPole-v1``.
CARTPOLE_OBS_DIM = 4
CARTPOLE_NUM_ACTIONS = 2

#: Dtype of TorchRL's one-hot action spec for ``GymEnv("CartPole-v1")``
#: (``OneHot(n=2, dtype=torch.int64)``), checked against TorchRL 0.12.0.
ONE_HOT_ACTION_DTYPE = torch.int64

#: ``max_steps`` of the counting env: done once the counter exceeds it, i.e.
#: every 6 steps with the constant action 1 (TorchRL's test-mock default).
COUNTING_MAX_STEPS = 5

#: Parameter counts used by the weight-sync workloads, by workload suffix.
BIG_POLICY_SIZES: dict[str, int] = {"1m": 1_000_000, "25m": 25_000_000}

#: Workers of every multi-process / distributed collector.
NUM_WORKERS = 2

#: ``total_frames`` given to every collector.  Runs are bounded by time (see
#: :class:`Budget`); a finite value is used because TorchRL's distributed
#: collectors yield nothing for ``total_frames=-1``.
TOTAL_FRAMES = 10**9


@dataclass(frozen=True)
class Budget:
    """Sizes of one benchmark run; :data:`FULL` and :data:`QUICK` are the presets."""

    frames_per_batch: int
    """Frames per yielded batch (total over workers) for throughput runs."""
    seconds: float
    """Collection time after the first batch for throughput runs."""
    weightsync_repeats: int
    """Timed ``update_policy_weights_()`` calls per weight-sync run."""
    weightsync_frames_per_batch: int
    """Frames per batch collected between two timed weight updates."""
    freshness_rounds: int
    """Weight updates per freshness run."""
    freshness_batches: int
    """Batches inspected after each update in a freshness run."""
    freshness_frames_per_batch: int
    """Frames per batch in a freshness run."""
    raw_gym_steps: int
    """Steps of the raw Gymnasium reference loop."""


FULL = Budget(1000, 6.0, 10, 20, 10, 4, 200, 30_000)
QUICK = Budget(200, 1.5, 3, 20, 3, 2, 200, 5_000)

#: Throughput workloads: name -> (collector kind, env family).  Kinds:
#: ``single`` (Collector), ``multisync``, ``multiasync``, ``distributed_sync``,
#: ``distributed_async``, ``rpc_sync``, ``rpc_async`` (2 workers each).
THROUGHPUT_WORKLOADS: dict[str, tuple[str, str]] = {
    "collector_cartpole": ("single", "cartpole"),
    "collector_counting": ("single", "counting"),
    "collector_cartpole_categorical": ("single", "cartpole_categorical"),
    "multisync_cartpole": ("multisync", "cartpole"),
    "multiasync_cartpole": ("multiasync", "cartpole"),
    "multisync_counting": ("multisync", "counting"),
    "multiasync_counting": ("multiasync", "counting"),
    "distributed_sync_cartpole": ("distributed_sync", "cartpole"),
    "distributed_async_cartpole": ("distributed_async", "cartpole"),
    "rpc_cartpole": ("rpc_async", "cartpole"),
    "ray_sync_cartpole": ("ray_sync", "cartpole"),
    "ray_async_cartpole": ("ray_async", "cartpole"),
}

#: Resources of the local Ray a Ray workload starts (before its collector, outside the timings).
RAY_INIT = {"num_cpus": NUM_WORKERS, "include_dashboard": False, "object_store_memory": 400 * 1024**2,
            "log_to_driver": False}


def init_ray(kind: str) -> None:
    """Start the local Ray of a ``ray_*`` workload (no-op for the others); usage stats off."""
    if not kind.startswith("ray_"):
        return
    import os

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray

    if not ray.is_initialized():
        ray.init(**RAY_INIT)

#: ``weightsync_<backend>_<size>``: backend -> collector kind.  The sync
#: variants, so every worker is idle between batches and only the weight
#: transfer is timed.
WEIGHTSYNC_KINDS = {"multisync": "multisync", "distributed": "distributed_sync", "rpc": "rpc_sync",
                    "ray": "ray_sync"}

#: ``weightsync_<backend>_1m`` of nodes collecting while the update happens: the async
#: ``DistributedCollector``, :data:`COLLECTING_FRAMES_PER_BATCH`-frame batches, each update followed by
#: a batch, :data:`COLLECTING_UPDATES` updates (full, quick): the update users of async nodes wait for.
COLLECTING_WEIGHTSYNC_KINDS = {"distributed_collecting": "distributed_async"}
COLLECTING_FRAMES_PER_BATCH = 50
COLLECTING_UPDATES = (20, 6)

#: ``freshness_<name>``: name -> collector kind.
FRESHNESS_KINDS = {
    "multiasync": "multiasync",
    "distributed_async": "distributed_async",
    "rpc": "rpc_async",
    "ray": "ray_async",
}


def workload_names() -> list[str]:
    """Every workload name, in the order ``--workload all`` runs them."""
    return collector_workload_names() + batched_workload_names()


def collector_workload_names() -> list[str]:
    """The workloads of the collector suite (one or two workers, the 4-64-64-2 MLP)."""
    names = ["raw_gym_cartpole", "raw_td_cartpole", *THROUGHPUT_WORKLOADS]
    names += [
        f"weightsync_{backend}_{size}" for backend in WEIGHTSYNC_KINDS for size in BIG_POLICY_SIZES
    ]
    names += [f"weightsync_{backend}_1m" for backend in COLLECTING_WEIGHTSYNC_KINDS]
    names += [f"freshness_{name}" for name in FRESHNESS_KINDS]
    return names


# --------------------------------------------------------------------------
# Many envs, one batched policy
# --------------------------------------------------------------------------

#: Hidden widths of the CartPole MLPs of the batched workloads: 4-64-64-2 and 4-512-512-512-2.
BATCHED_POLICY_HIDDEN: dict[str, tuple[int, ...]] = {"small": (64, 64), "big": (512, 512, 512)}

#: Env counts of the scaling table, and the count of the main table.
BATCHED_ENV_COUNTS = (1, 2, 4, 8, 16)
BATCHED_MAIN_ENVS = 8

#: ``batched_<kind>_<n>_<size>`` kinds: n CartPole-v1 envs stepped by ...
#:   * ``raw_vector``: ``gymnasium.vector.AsyncVectorEnv(n, shared_memory=True)`` and the MLP on the
#:     batch, no collector (the limit); * ``parallel``: ``Collector(ParallelEnv(n, GymEnv))``;
#:   * ``serial``: ``Collector(SerialEnv(n, GymEnv))`` (every env in the collector's process);
#:   * ``asyncbatched``: ``AsyncBatchedCollector([GymEnv] * n)``; ``asyncbatched_auto``: the same with
#:     TorchRL's ``transport="auto"`` and a ``policy_factory`` (TorchRL 0.14's fastest set-up);
#:   * ``asyncbatched_epw4``: the same with ``envs_per_worker=4`` (n / 4 workers of 4 envs each: on 2
#:     cores, one group steps while the policy serves the other);
#:   * ``multisync``: ``MultiSyncCollector`` with n workers of one env each (per-worker inference);
#:   * ``vectorenv``: rlharvest's ``Collector(GymEnv(AsyncVectorEnv(n)))``;
#:   * ``parallel_transformed``: ``Collector(ParallelEnv(n, TransformedEnv(GymEnv, StepCounter +
#:     RewardSum)))``, TorchRL env factories (the rlharvest side runs it in the TorchRL 0.14 venv).
BATCHED_KINDS = ("raw_vector", "parallel", "serial", "asyncbatched", "asyncbatched_auto", "asyncbatched_epw4",
                 "multisync", "vectorenv", "parallel_transformed")
#: kinds whose env factories are TorchRL's: rlharvest runs them with a Python that has torchrl
NEEDS_TORCHRL_ENVS = ("parallel_transformed",)


def batched_workload(name: str) -> tuple[str, int, str] | None:
    """``(kind, num_envs, size)`` of a ``batched_<kind>_<n>_<size>`` name, or None."""
    if not name.startswith("batched_"):
        return None
    head, _, size = name.removeprefix("batched_").rpartition("_")
    kind, _, count = head.rpartition("_")
    if kind not in BATCHED_KINDS or size not in BATCHED_POLICY_HIDDEN or not count.isdigit():
        return None
    return kind, int(count), size


def batched_workload_names() -> list[str]:
    """The main table (8 envs, both MLPs), then the scaling table (small MLP, n = 1 ... 16)."""
    names = [f"batched_{kind}_{BATCHED_MAIN_ENVS}_{size}" for size in BATCHED_POLICY_HIDDEN for kind in BATCHED_KINDS]
    names += [f"batched_{kind}_{n}_small" for n in BATCHED_ENV_COUNTS if n != BATCHED_MAIN_ENVS
              for kind in ("raw_vector", "parallel", "asyncbatched", "asyncbatched_auto")]
    return names


def batched_frames_per_batch(budget_frames: int, num_envs: int) -> int:
    """``budget_frames`` rounded to a multiple of ``num_envs`` (every side's Collector would round it)."""
    return num_envs * max(1, round(budget_frames / num_envs))


def make_sized_cartpole_mlp(size: str, seed: int = 0) -> nn.Sequential:
    """The CartPole MLP 4-h1-...-2 (Tanh between layers) with :class:`ArgmaxOneHot` at the end."""
    widths = (CARTPOLE_OBS_DIM, *BATCHED_POLICY_HIDDEN[size], CARTPOLE_NUM_ACTIONS)
    layers: list[nn.Module] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for index, (width_in, width_out) in enumerate(zip(widths, widths[1:])):
            if index:
                layers.append(nn.Tanh())
            layers.append(nn.Linear(width_in, width_out))
    return nn.Sequential(*layers, ArgmaxOneHot())


def raw_vector_loop(num_envs: int, size: str, seconds: float, seed: int = 0) -> dict[str, float]:
    """Frames per second of ``AsyncVectorEnv(num_envs, shared_memory=True)`` + the MLP on the batch.

    The limit a batched-env collector is compared to: each step runs the MLP once on the batch of
    observations (``torch.from_numpy``, no grad), takes the argmax as the actions and steps the vector
    env (gymnasium's own autoreset). Timed for ``seconds`` after 100 warm-up steps.
    """
    import gymnasium as gym

    env = gym.vector.AsyncVectorEnv([lambda: gym.make("CartPole-v1")] * num_envs, shared_memory=True)
    policy = make_sized_cartpole_mlp(size, seed)
    obs, _ = env.reset(seed=seed)
    steps = 0
    with torch.no_grad():
        for _ in range(100):
            obs, *_ = env.step(policy(torch.from_numpy(obs)).argmax(-1).numpy())
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            obs, *_ = env.step(policy(torch.from_numpy(obs)).argmax(-1).numpy())
            steps += 1
        elapsed = time.perf_counter() - start
    env.close()
    return {"frames_per_s": rate(steps * num_envs, elapsed), "timed_frames": steps * num_envs, "timed_s": elapsed}


class ArgmaxOneHot(nn.Module):
    """Turn logits into the one-hot encoding of their argmax over the last dim.

    The output dtype is :data:`ONE_HOT_ACTION_DTYPE`, the dtype of TorchRL's
    CartPole action spec, so the result can be written as ``"action"`` as is.

    Example:
        >>> ArgmaxOneHot()(torch.tensor([[0.1, 2.0]]))
        tensor([[0, 1]])
    """

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        index = logits.argmax(dim=-1)
        return nn.functional.one_hot(index, logits.shape[-1]).to(ONE_HOT_ACTION_DTYPE)


def make_cartpole_mlp(seed: int = 0) -> nn.Sequential:
    """Build the CartPole policy: observation (4 floats) -> one-hot action (2).

    Layers: Linear(4, 64), Tanh, Linear(64, 64), Tanh, Linear(64, 2),
    ArgmaxOneHot.  Weights are drawn from ``torch.manual_seed(seed)`` with a
    private generator state, so the global RNG is left untouched.

    Args:
        seed: Seed of the weight initialisation.

    Returns:
        The policy module (4,610 parameters).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Linear(CARTPOLE_OBS_DIM, 64),
            nn.Tanh(),
            nn.Linear(64, 64),
            nn.Tanh(),
            nn.Linear(64, CARTPOLE_NUM_ACTIONS),
            ArgmaxOneHot(),
        )


class ArgmaxIndex(nn.Module):
    """The argmax over the last dim as an int64 index (categorical actions: the raw loop's computation)."""

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)


def make_cartpole_categorical_mlp(seed: int = 0) -> nn.Sequential:
    """The CartPole MLP of :func:`make_cartpole_mlp` ending in :class:`ArgmaxIndex` (integer action)."""
    mlp = make_cartpole_mlp(seed)
    return nn.Sequential(*list(mlp)[:-1], ArgmaxIndex())


def big_policy_width(n_params: int) -> int:
    """Hidden width ``h`` of :func:`make_big_policy` for about ``n_params``.

    The network has ``h*h + 8*h + 2`` parameters (see :func:`make_big_policy`).
    """
    return max(1, round((-8 + math.sqrt(64 + 4 * (n_params - 2))) / 2))


def make_big_policy(n_params: int, seed: int = 0) -> nn.Sequential:
    """Build an MLP with roughly ``n_params`` parameters, input 4, output 2.

    Layers: Linear(4, h), Tanh, Linear(h, h), Tanh, Linear(h, 2) with ``h``
    from :func:`big_policy_width`, i.e. ``h*h + 8*h + 2`` parameters (within
    0.1 % of the request for 1M and 25M).  The output is logits; append
    :class:`ArgmaxOneHot` to turn it into a CartPole action.

    Args:
        n_params: Requested number of parameters.
        seed: Seed of the weight initialisation.
    """
    width = big_policy_width(n_params)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Linear(CARTPOLE_OBS_DIM, width),
            nn.Tanh(),
            nn.Linear(width, width),
            nn.Tanh(),
            nn.Linear(width, CARTPOLE_NUM_ACTIONS),
        )


def count_params(module: nn.Module) -> int:
    """Number of parameter elements of ``module``."""
    return sum(p.numel() for p in module.parameters())


class CountingPolicy(nn.Module):
    """Constant policy for counting envs: its action is its one parameter.

    ``forward()`` takes no observation and returns the 0-d ``weight`` (init
    1.0).  The caller broadcasts it to the action shape of the batch, e.g. to
    ``(*batch_shape, 1)`` for a counting env whose action is the count
    increment.  Raising ``weight`` to 2.0 and syncing weights therefore shows
    up as actions equal to 2 in later batches.
    """

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self) -> torch.Tensor:
        return self.weight


class MarkedCartpolePolicy(nn.Module):
    """CartPole MLP that also reports which weights produced each action.

    ``forward(observation)`` returns ``(action, marker)``: the one-hot action
    of :func:`make_cartpole_mlp` and the value of the scalar parameter
    ``marker`` broadcast to ``(*batch_shape, 1)`` (float32).  The freshness
    workloads set ``marker`` to a new value, sync weights, and look for that
    value in the frames collected afterwards.
    """

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.mlp = make_cartpole_mlp(seed)
        self.marker = nn.Parameter(torch.zeros(()), requires_grad=False)

    def forward(self, observation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        action = self.mlp(observation)
        marker = self.marker.expand(*observation.shape[:-1], 1).clone()
        return action, marker


def bump_parameters(module: nn.Module, delta: float = 1e-3) -> None:
    """Add ``delta`` in place to every parameter of ``module``."""
    with torch.no_grad():
        for param in module.parameters():
            param.add_(delta)


@dataclass
class FreshnessCounts:
    """Frame counts of one freshness round (or of several, once added up)."""

    after: int = 0
    """Frames whose observation timestamp is later than ``t_return``."""
    after_fresh: int = 0
    """... of which were produced with the new weights (``marker == k``)."""
    total: int = 0
    """All frames of the inspected batches."""
    total_fresh: int = 0
    """... of which were produced with the new weights."""

    def add_frames(
        self, timestamps: torch.Tensor, markers: torch.Tensor, marker: float, t_return: float
    ) -> None:
        """Count the frames of one batch (``batch["timestamp"]``, ``batch["marker"]``)."""
        stamps = timestamps.reshape(-1)
        is_fresh = markers.reshape(-1) == marker
        after = stamps > t_return
        self.after += int(after.sum())
        self.after_fresh += int((is_fresh & after).sum())
        self.total += stamps.numel()
        self.total_fresh += int(is_fresh.sum())

    def add(self, other: FreshnessCounts) -> None:
        for name in ("after", "after_fresh", "total", "total_fresh"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


# --------------------------------------------------------------------------
# Timing helpers
# --------------------------------------------------------------------------


def time_call(fn: Callable[[], object]) -> float:
    """Wall-clock seconds taken by one call of ``fn``."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_of(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall-clock seconds of ``repeats`` calls of ``fn``.

    Args:
        fn: Zero-argument callable to time.
        repeats: Number of timed calls (>= 1).
        warmup: Untimed calls made first.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    return statistics.median(time_call(fn) for _ in range(repeats))


def rate(count: float, per: float) -> float:
    """``count / per`` (a rate or a fraction), or NaN when ``per`` is not positive."""
    return count / per if per > 0 else float("nan")


def find_free_port_block(size: int = 3, attempts: int = 50) -> int:
    """A TCP port ``p`` such that ``p .. p+size-1`` are all free right now.

    Each candidate comes from binding port 0 (the OS picks a free port); the
    following ports are then checked by binding them too.  TorchRL's
    distributed collectors use ``p`` (process group), ``p+1`` (command store)
    and ``p+2`` (weight-sync store).

    Raises:
        RuntimeError: If no block is found in ``attempts`` tries.
    """
    import socket

    for _ in range(attempts):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("", 0))
            base = probe.getsockname()[1]
        if base + size - 1 > 65535:
            continue
        try:
            for port in range(base, base + size):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind(("", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no block of {size} free TCP ports found")


# --------------------------------------------------------------------------
# Baselines
# --------------------------------------------------------------------------


def raw_gym_loop(steps: int, seed: int = 0) -> float:
    """Steps per second of a bare Gymnasium CartPole loop with the MLP policy.

    The reference loop: ``gym.make("CartPole-v1")``; each step converts the
    numpy observation with ``torch.from_numpy``, runs :func:`make_cartpole_mlp`
    under ``torch.no_grad()``, takes the argmax as an int action, calls
    ``env.step`` and resets on ``terminated or truncated``.  The timer covers
    the ``steps`` steps only (not ``gym.make`` nor the first reset).

    Args:
        steps: Number of env steps to time.
        seed: Seed of the first reset and of the policy weights.
    """
    import gymnasium as gym

    env = gym.make("CartPole-v1")
    policy = make_cartpole_mlp(seed)
    obs, _ = env.reset(seed=seed)
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(steps):
            one_hot = policy(torch.from_numpy(obs))
            action = int(one_hot.argmax())
            obs, _, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                obs, _ = env.reset()
    elapsed = time.perf_counter() - start
    env.close()
    return rate(steps, elapsed)


def raw_gym_loop_for(seconds: float, seed: int = 0) -> float:
    """Steps per second of :func:`raw_gym_loop`'s loop run for ``seconds`` (checked every 100 steps)
    rather than a step count: the limit that ``benchmarks/limit.py`` runs in several processes at once,
    each for as long as the collector it is compared with collects."""
    import gymnasium as gym

    env = gym.make("CartPole-v1")
    policy = make_cartpole_mlp(seed)
    obs, _ = env.reset(seed=seed)
    steps = 0
    start = time.perf_counter()
    deadline = start + seconds
    with torch.no_grad():
        while time.perf_counter() < deadline:
            for _ in range(100):
                one_hot = policy(torch.from_numpy(obs))
                action = int(one_hot.argmax())
                obs, _, terminated, truncated, _ = env.step(action)
                if terminated or truncated:
                    obs, _ = env.reset()
            steps += 100
    elapsed = time.perf_counter() - start
    env.close()
    return rate(steps, elapsed)


def inprocess_copy_seconds(n_params: int, repeats: int = 20) -> float:
    """Median seconds of one in-process ``dst.copy_(src)`` of ``n_params`` floats.

    Both tensors are flat, contiguous float32 and allocated (and touched) up
    front; the copy runs with one intra-op thread (collectors may have changed
    the thread count: TorchRL's multi-process shutdown raises it again).  This
    is the lower bound a weight sync of that size is compared to.
    """
    src = torch.randn(n_params, dtype=torch.float32)
    dst = torch.zeros(n_params, dtype=torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return median_of(lambda: dst.copy_(src), repeats, warmup=2)
    finally:
        torch.set_num_threads(threads)


def copy_buffers(n_params: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A source and a destination of ``n_params`` float32, allocated and touched up front."""
    return torch.randn(n_params, dtype=torch.float32), torch.zeros(n_params, dtype=torch.float32)


def timed_copy(source: torch.Tensor, destination: torch.Tensor) -> float:
    """Seconds of one ``destination.copy_(source)`` with one intra-op thread, the source just written."""
    threads = torch.get_num_threads()
    if threads != 1:
        torch.set_num_threads(1)
    try:
        source.add_(1e-3)
        return time_call(lambda: destination.copy_(source))
    finally:
        if threads != 1:
            torch.set_num_threads(threads)


def summarize(values: list[float]) -> dict[str, float]:
    """Median, min and max of ``values`` (NaN for an empty list)."""
    if not values:
        nan = float("nan")
        return {"median": nan, "min": nan, "max": nan}
    array = np.asarray(values, dtype=np.float64)
    return {
        "median": float(np.median(array)),
        "min": float(array.min()),
        "max": float(array.max()),
    }
