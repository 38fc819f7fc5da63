"""The batched rows of ``benchmarks/limit.py`` (issue 49): one env with a batch, its raw loop, rlharvest's
``Collector`` and TorchRL 0.14.1's ``Collector``, in one run.

Rows (:data:`ROWS`):

* ``batched_counting_16`` / ``batched_counting_1024``: ``CountingEnv(max_steps=5, batch_size=(B,))``
  and a 1-64-1 MLP (ReLU) whose output's sign is the action (1 on every count it meets, so every
  row's episode ends every 6 steps, and every 6th step resets all rows);
* ``batched_vector_cartpole_64``: gymnasium's ``SyncVectorEnv`` of 64 ``CartPole-v1`` with
  ``autoreset_mode=SAME_STEP`` and the 4-64-64-2 MLP (``common.make_sized_cartpole_mlp("small")``).

The raw loop is the env's own step and the policy in a Python loop, no collector: for the counting
env, rlharvest's ``CountingEnv._step_arrays`` and ``_reset_arrays(done)`` of the rows that ended; for
gymnasium, ``SyncVectorEnv.step`` (which resets the rows that ended itself). Every collector yields
batches of :data:`STEPS` steps (``frames_per_batch = STEPS * B``), with every documented key
(trajectory ids, the ``"time"`` dim).

One child process per side and pair (``--child rlharvest`` in this venv, ``--child torchrl14`` in
``.venv-torchrl14``): the rlharvest child alternates rounds of the raw loop and of the collector in
the same process, ``rounds`` times; the TorchRL child runs its collector as many rounds. Each round
times ``seconds`` of work after a warm-up, with the wall clock (frames/s: what a user gets on a
quiet machine) and the process's CPU time (``time.process_time``: CPU microseconds per frame, the
steadier comparison on a busy machine). One intra-op thread everywhere.

Usage: ``python benchmarks/limit_batched.py [--quick]`` prints the rows as JSON lines (``limit.py``
calls :func:`rows`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
TREE = HERE.parent
sys.path.insert(0, str(HERE))

#: row name -> (env kind, batch size)
ROWS: dict[str, tuple[str, int]] = {
    "batched_counting_16": ("counting", 16),
    "batched_counting_1024": ("counting", 1024),
    "batched_vector_cartpole_64": ("vector_cartpole", 64),
}
#: steps per batch of every collector
STEPS = 64
COUNTING_MAX_STEPS = 5
__all__ = ["rows", "ROWS", "STEPS"]


# ------------------------------------------------------------------------------------- workloads
def counting_mlp():
    """The 1-64-1 MLP (ReLU) of the counting rows: observation (int32, (*B, 1)) -> action (int8, 1)."""
    import torch
    from torch import nn

    class CountingMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                self.mlp = nn.Sequential(nn.Linear(1, 64), nn.ReLU(), nn.Linear(64, 1))
            with torch.no_grad():
                self.mlp[2].bias.fill_(10.0)  # the action is 1 on every count the env reaches (0..6)

        def forward(self, observation: torch.Tensor) -> torch.Tensor:
            return (self.mlp(observation.float()) > 0).to(torch.int8)

    return CountingMLP()


def vector_cartpole(num_envs: int):
    """gymnasium's ``SyncVectorEnv`` of ``num_envs`` CartPole-v1, resetting ended rows in the same step."""
    import functools

    import gymnasium as gym

    return gym.vector.SyncVectorEnv([functools.partial(gym.make, "CartPole-v1")] * num_envs,
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)


def _raw_counting(batch: int) -> Callable[[], int]:
    """One raw step of the counting row per call (returns the frames it made)."""
    import torch

    from rlharvest.envs import CountingEnv

    env = CountingEnv(max_steps=COUNTING_MAX_STEPS, batch_size=(batch,))
    policy = counting_mlp()
    state = {"observation": env._reset_arrays(None)["observation"]}

    @torch.no_grad()
    def step() -> int:
        observations, _, terminated, _ = env._step_arrays({"action": policy(state["observation"])})
        observation = observations["observation"]
        if terminated.any():
            observation = env._reset_arrays(terminated)["observation"]
        state["observation"] = observation
        return batch

    return step


def _raw_vector(num_envs: int) -> Callable[[], int]:
    import torch

    import common

    env = vector_cartpole(num_envs)
    policy = common.make_sized_cartpole_mlp("small")
    state = {"observation": env.reset(seed=0)[0]}

    @torch.no_grad()
    def step() -> int:
        actions = policy(torch.from_numpy(state["observation"])).argmax(-1).numpy()
        state["observation"] = env.step(actions)[0]
        return num_envs

    return step


def _rlharvest_collector(kind: str, batch: int):
    from tensordict.nn import TensorDictModule

    import common
    from rlharvest.collectors import Collector
    from rlharvest.envs import CountingEnv, GymEnv

    if kind == "counting":
        env = CountingEnv(max_steps=COUNTING_MAX_STEPS, batch_size=(batch,))
        policy = TensorDictModule(counting_mlp(), in_keys=["observation"], out_keys=["action"])
    else:
        env = GymEnv(vector_cartpole(batch))
        policy = TensorDictModule(common.make_sized_cartpole_mlp("small"), in_keys=["observation"], out_keys=["action"])
    return Collector(env, policy, frames_per_batch=STEPS * batch, total_frames=-1)


def _torchrl_collector(kind: str, batch: int):
    from tensordict.nn import TensorDictModule
    from torchrl.collectors import Collector

    import common

    if kind == "counting":
        from torchrl.testing.mocking_classes import CountingEnv

        env = CountingEnv(max_steps=COUNTING_MAX_STEPS, batch_size=(batch,))
        policy = TensorDictModule(counting_mlp(), in_keys=["observation"], out_keys=["action"])
    else:
        from torchrl.envs import GymWrapper

        env = GymWrapper(vector_cartpole(batch))
        policy = TensorDictModule(common.make_sized_cartpole_mlp("small"), in_keys=["observation"], out_keys=["action"])
    return Collector(env, policy, frames_per_batch=STEPS * batch, total_frames=-1)


def _collector_steps(collector) -> Callable[[], int]:
    """One batch of ``collector`` per call (returns its frames); the batch's keys are checked once."""
    batches = iter(collector)
    first = next(batches)
    keys = set(first.keys(True, True))
    if ("collector", "traj_ids") not in keys:
        raise RuntimeError(f"the collector's batch lacks ('collector', 'traj_ids'): {sorted(map(str, keys))}")

    def step() -> int:
        return next(batches).numel()

    return step


# ------------------------------------------------------------------------------------- timing
def _timed(step: Callable[[], int], seconds: float) -> dict[str, float]:
    """Run ``step`` for ``seconds`` (after a warm-up of a tenth of that): frames/s and CPU us a frame."""
    warm_until = time.perf_counter() + seconds / 10
    while time.perf_counter() < warm_until:
        step()
    frames = 0
    cpu, start = time.process_time(), time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        frames += step()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"frames_per_s": frames / wall, "cpu_us_per_frame": cpu / frames * 1e6, "frames": frames}


def child(side: str, row: str, rounds: int, seconds: float) -> dict[str, Any]:
    """The rounds of one side's child process for ``row``."""
    import torch

    torch.set_num_threads(1)
    kind, batch = ROWS[row]
    if side == "rlharvest":
        raw = _raw_counting(batch) if kind == "counting" else _raw_vector(batch)
        collector = _rlharvest_collector(kind, batch)
        ours = _collector_steps(collector)
        measured = {"raw": [], "collector": []}
        try:
            for _ in range(rounds):  # alternated: the raw loop, then the collector
                measured["raw"].append(_timed(raw, seconds))
                measured["collector"].append(_timed(ours, seconds))
        finally:
            collector.shutdown()
        return measured
    collector = _torchrl_collector(kind, batch)
    try:
        theirs = _collector_steps(collector)
        return {"collector": [_timed(theirs, seconds) for _ in range(rounds)]}
    finally:
        collector.shutdown()


# ------------------------------------------------------------------------------------- rows
def _torchrl14_python() -> str | None:
    python = os.environ.get("RLHARVEST_TORCHRL14_PYTHON") or str(TREE / ".venv-torchrl14/bin/python")
    return python if Path(python).exists() else None


def _run_child(python: str, side: str, row: str, rounds: int, seconds: float) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TREE), os.environ.get("PYTHONPATH")]))}
    command = [python, str(Path(__file__).resolve()), "--child", side, "--row", row, "--rounds", str(rounds),
               "--seconds", str(seconds)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120 + 4 * rounds * seconds,
                              start_new_session=True)
    except subprocess.TimeoutExpired:
        return {"error": "timeout"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": f"exit code {done.returncode}: {done.stderr[-600:]}"}


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs) if runs else float("nan")


def row_of(row: str, quick: bool, pairs: int = 1) -> list[dict[str, Any]]:
    """``row``'s two table rows (rlharvest against the raw loop, TorchRL 0.14.1 against the same raw loop),
    over ``pairs`` pairs of child processes (rlharvest's, then TorchRL's)."""
    rounds, seconds = (2, 1.0) if quick else (5, 3.0)
    torchrl = _torchrl14_python()
    ours: dict[str, list] = {"raw": [], "collector": []}
    theirs: list[dict] = []
    errors = []
    load = os.getloadavg()[0]
    if torchrl is None:
        errors.append("torchrl14: no .venv-torchrl14 (make setup-torchrl, or RLHARVEST_TORCHRL14_PYTHON)")
    for _ in range(pairs):
        result = _run_child(sys.executable, "rlharvest", row, rounds, seconds)
        if "error" in result:
            errors.append(f"rlharvest: {result['error']}")
        else:
            for key in ours:
                ours[key] += result[key]
        if torchrl is not None:
            result = _run_child(torchrl, "torchrl14", row, rounds, seconds)
            if "error" in result:
                errors.append(f"torchrl14: {result['error']}")
            else:
                theirs += result["collector"]
    raw_fps, raw_cpu = _median(ours["raw"], "frames_per_s"), _median(ours["raw"], "cpu_us_per_frame")
    # each round's collector against the raw round just before it (same process, same minute)
    pair_ratios = [c["frames_per_s"] / r["frames_per_s"] for r, c in zip(ours["raw"], ours["collector"])]
    cpu_ratios = [r["cpu_us_per_frame"] / c["cpu_us_per_frame"] for r, c in zip(ours["raw"], ours["collector"])]
    kind, batch = ROWS[row]
    what = (f"CountingEnv(batch_size=({batch},)) + 1-64-1 MLP" if kind == "counting"
            else f"SyncVectorEnv({batch} CartPole, SAME_STEP) + 4-64-64-2 MLP")
    note = (f"{what}, {STEPS}-step batches; {len(ours['raw'])} alternated rounds of {seconds:g} s; "
            f"load {load:.1f}; goal >= 0.85" + "".join(f"; error: {e}" for e in errors))
    ratio = statistics.median(pair_ratios) if pair_ratios else None
    rows = [{"workload": f"{row}/raw", "figure": _median(ours["collector"], "frames_per_s"), "limit": raw_fps,
             "ratio": ratio, "note": note, "rounds": ours,
             "cpu_us_per_frame": _median(ours["collector"], "cpu_us_per_frame"), "limit_cpu_us_per_frame": raw_cpu,
             "cpu_ratio": statistics.median(cpu_ratios) if cpu_ratios else float("nan")}]
    if theirs:
        fps, cpu = _median(theirs, "frames_per_s"), _median(theirs, "cpu_us_per_frame")
        rows.append({"workload": f"{row}/torchrl14", "figure": fps, "limit": raw_fps, "ratio": fps / raw_fps,
                     "note": f"TorchRL 0.14.1 Collector against rlharvest's raw loop of the same pairs; "
                             f"{len(theirs)} rounds", "rounds": theirs,
                     "cpu_us_per_frame": cpu, "limit_cpu_us_per_frame": raw_cpu, "cpu_ratio": raw_cpu / cpu})
    return rows


def rows(quick: bool, pairs: int = 1) -> list[dict[str, Any]]:
    """Every batched row (see the module docstring)."""
    return [line for row in ROWS for line in row_of(row, quick, pairs)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="batched envs against their raw loop")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--pairs", type=int, default=1)
    parser.add_argument("--row", choices=list(ROWS), action="append")
    parser.add_argument("--child", choices=("rlharvest", "torchrl14"), help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=2.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.row[0], args.rounds, args.seconds)), flush=True)
        return 0
    for row in args.row or list(ROWS):
        for line in row_of(row, args.quick, args.pairs):
            print(json.dumps({k: v for k, v in line.items() if k != "rounds"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
