"""Where each microsecond of a batched step goes: the raw loop's parts and the ``Collector``'s, for the
batched rows of ``benchmarks/limit.py`` (``limit_batched.ROWS``).

Each part is timed on its own in this process, many times over, as CPU time (``time.process_time``),
and the smallest of ``--repeats`` measurements is kept: on a busy machine the minimum is the figure
least disturbed by the other processes (the parts are microseconds long). The parts of the
``Collector``'s step are those of ``rlharvest/rollout.py``'s loop, called as the loop calls them:

* the policy: the rollout's ``PolicyStep`` under the policy's lock (the raw loop: the module);
* the env step: the env adapter's ``step`` (the raw loop: the env's own step);
* ``any()`` of the done rows (both);
* an end of episode, per step (the env resets every 6th step for the counting rows; for the gymnasium
  row, the vector env resets rows itself): the reset of the rows that ended, and their new trajectory
  ids (the collector only: handed out once a chunk of 64 steps, divided by 64);
* writing the steps into the batch (per step: one chunk of 64 steps, divided by 64), and the batch
  itself (the collector's iteration, the copy it hands out...), from the whole step's CPU time minus
  the parts above: what is left is the loop's own bookkeeping.

The whole step is timed too, as ``limit_batched.py`` times it (whole batches), and the remainder
(whole step - parts) is printed as "loop, storage and batch".

Usage: ``python benchmarks/batched_step.py [--repeats 5] [--row NAME ...]``; instruction counts instead of
CPU time (the same on a busy machine as on a quiet one)::

    CALLGRIND_OUT=/tmp/cg.out valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=/tmp/cg.out \
        .venv/bin/python benchmarks/batched_step.py --instructions
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import limit_batched  # noqa: E402


def cpu_us(call: Callable[[], object], count: int, repeats: int) -> float:
    """The smallest CPU microseconds per call of ``call`` over ``repeats`` runs of ``count`` calls."""
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(count):
            call()
        best = min(best, (time.process_time() - start) / count * 1e6)
    return best


def _callgrind(*args: str) -> None:
    """Ask the callgrind running this process (``callgrind_control``), waiting for its answer in short
    sleeps: valgrind reads the request while this process runs, not while it is blocked in a wait."""
    command = subprocess.Popen(["callgrind_control", *args, str(os.getpid())], stdout=subprocess.DEVNULL)
    while command.poll() is None:
        time.sleep(0.002)


def instructions(call: Callable[[], object], count: int, repeats: int) -> float:
    """Instructions per call of ``call`` (``count`` calls), counted by callgrind: this process runs under
    ``valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=FILE`` with ``FILE`` in the
    environment as ``CALLGRIND_OUT``. Each measurement is dumped and read back."""
    call()
    _callgrind("--zero")
    _callgrind("-i", "on")
    for _ in range(count):
        call()
    _callgrind("-i", "off")
    _callgrind("--dump")
    dumps = sorted(Path(os.environ["CALLGRIND_OUT"]).parent.glob(Path(os.environ["CALLGRIND_OUT"]).name + "*"),
                   key=lambda path: path.stat().st_mtime)
    for line in dumps[-1].read_text().splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1]) / count
    raise RuntimeError(f"no totals in {dumps[-1]}")


def anatomy(row: str, repeats: int, cpu_us: Callable = cpu_us) -> dict[str, float]:
    """CPU microseconds (or, with ``cpu_us=instructions``, instructions) per step of each part (see the
    module docstring)."""
    import torch

    from rlharvest.episodes import EpisodeEnds, trajectory_ids

    torch.set_num_threads(1)
    kind, batch = limit_batched.ROWS[row]
    collector = limit_batched._rlharvest_collector(kind, batch)
    try:
        batches = limit_batched._collector_steps(collector)
        for _ in range(3):
            batches()
        rollout = collector._engine.rollout  # noqa: SLF001 - its parts, called as the loop calls them
        raw = limit_batched._raw_counting(batch) if kind == "counting" else limit_batched._raw_vector(batch)
        steps = limit_batched.STEPS
        parts: dict[str, float] = {}
        count = max(20, 20000 // batch)
        parts["raw loop: whole step"] = cpu_us(raw, count, repeats)
        parts["collector: whole step"] = cpu_us(batches, max(3, count // steps), repeats) / steps
        root = dict(rollout.root)
        with torch.no_grad():
            actions = rollout.policy_step(root)
            module = rollout.policy_step.stages[0][0]
            observation = root["observation"]
            parts["policy: the module (both)"] = cpu_us(lambda: module(observation), count, repeats)

            def policy_step():
                with rollout.policy_lock:
                    return rollout.policy_step(root)

            parts["policy: the rollout's call and lock (collector)"] = cpu_us(policy_step, count, repeats) - \
                parts["policy: the module (both)"]
            if kind == "counting":
                env = rollout.env
                env_step = lambda: env._step_arrays(actions)  # noqa: E731
            else:
                vector = rollout.env.env
                gym_actions = rollout.env._gym_action(actions["action"])  # noqa: SLF001
                env_step = lambda: vector.step(gym_actions)  # noqa: E731
            parts["env: its own step (both)"] = cpu_us(env_step, count, repeats)
            parts["env: the adapter around it (collector)"] = cpu_us(lambda: rollout.adapter.step(root, actions),
                                                                     count, repeats) - parts["env: its own step (both)"]
            nxt, done, _ = rollout.adapter.step(root, actions)
            parts["any() of the done rows (both)"] = cpu_us(lambda: bool(done.any()), count, repeats)
            if kind == "counting":
                ended = torch.ones_like(done)
                every = limit_batched.COUNTING_MAX_STEPS + 1
                parts["reset of the ended rows, per step (both)"] = cpu_us(
                    lambda: rollout.adapter.reset_rows(root, ended), count, repeats) / every
                traj, rows = rollout.traj_ids, rollout.adapter.done_rows(ended)
                ends = [(step, rows) for step in range(every - 1, steps, every)]
                parts["new trajectory ids, per step (collector)"] = cpu_us(
                    lambda: trajectory_ids(traj, ends, steps, rollout.traj_counter.take), max(5, count // steps),
                    repeats) / steps
            columns_of = [(root, actions, nxt, rollout.traj_ids, 0, 0)] * steps

            no_ends = EpisodeEnds(rollout.batch_size)

            def write_chunk():  # the ids' column included, as in a chunk where no row ended
                rollout.batches.write(rollout._columns(list(columns_of), no_ends, rollout.traj_ids)[0], 0)  # noqa: SLF001

            parts["writing the steps into the batch, per step (collector)"] = cpu_us(write_chunk, max(5, count // steps),
                                                                                     repeats) / steps
        batches()  # the buffer written above is the next batch's: overwritten
    finally:
        collector.shutdown()
    shared = sum(v for k, v in parts.items() if k.endswith("(both)"))  # the raw loop's parts
    parts["raw loop: the loop itself (whole - parts)"] = parts["raw loop: whole step"] - shared
    ours = shared + sum(v for k, v in parts.items() if k.endswith("(collector)"))
    parts["collector: loop, batch and the rest (whole - parts)"] = parts["collector: whole step"] - ours
    return parts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--row", action="append", choices=list(limit_batched.ROWS))
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions instead (run under callgrind, see instructions())")
    args = parser.parse_args(argv)
    for row in args.row or list(limit_batched.ROWS):
        load = os.getloadavg()[0]
        parts = anatomy(row, args.repeats, instructions if args.instructions else cpu_us)
        kind, batch = limit_batched.ROWS[row]
        unit = "instructions" if args.instructions else f"CPU us, smallest of {args.repeats}"
        print(f"{row} (batch {batch}; {unit} per step; load {load:.1f}):")
        for name, value in parts.items():
            print(f"  {value:9.2f}  {name}")
        print(f"  ratio raw/collector (whole steps): {parts['raw loop: whole step'] / parts['collector: whole step']:.3f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
