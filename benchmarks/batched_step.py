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
  ids (the collector only);
* writing the steps into the batch (per step: one chunk of 64 steps, divided by 64), and the batch
  itself (the collector's iteration, the copy it hands out...), from the whole step's CPU time minus
  the parts above: what is left is the loop's own bookkeeping.

The whole step is timed too, as ``limit_batched.py`` times it (whole batches), and the remainder
(whole step - parts) is printed as "loop, storage and batch".

Usage: ``python benchmarks/batched_step.py [--repeats 5] [--row NAME ...]``
"""

from __future__ import annotations

import argparse
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


def anatomy(row: str, repeats: int) -> dict[str, float]:
    """Microseconds of CPU per step of each part (see the module docstring)."""
    import torch

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
                traj = rollout.traj_ids
                parts["new trajectory ids, per step (collector)"] = cpu_us(
                    lambda: rollout._renumber(traj, ended), count, repeats) / every  # noqa: SLF001
            columns_of = [(root, actions, nxt, rollout.traj_ids, 0, 0)] * steps

            def write_chunk():
                rollout.batches.write(rollout._columns(list(columns_of)), 0)  # noqa: SLF001

            parts["writing the steps into the batch, per step (collector)"] = cpu_us(write_chunk, max(5, count // steps),
                                                                                     repeats) / steps
        batches()  # the buffer written above is the next batch's: overwritten
    finally:
        collector.shutdown()
    shared = sum(v for k, v in parts.items() if k.endswith("(both)"))
    raw_parts = shared - parts["policy: the module (both)"] * 0  # the raw loop's parts are the shared ones
    parts["raw loop: the loop itself (whole - parts)"] = parts["raw loop: whole step"] - raw_parts
    ours = shared + sum(v for k, v in parts.items() if k.endswith("(collector)"))
    parts["collector: loop, batch and the rest (whole - parts)"] = parts["collector: whole step"] - ours
    return parts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--row", action="append", choices=list(limit_batched.ROWS))
    args = parser.parse_args(argv)
    import os

    for row in args.row or list(limit_batched.ROWS):
        load = os.getloadavg()[0]
        parts = anatomy(row, args.repeats)
        kind, batch = limit_batched.ROWS[row]
        print(f"{row} (batch {batch}; CPU us per step, smallest of {args.repeats}; load {load:.1f}):")
        for name, value in parts.items():
            print(f"  {value:9.2f}  {name}")
        print(f"  ratio raw/collector (whole steps): {parts['raw loop: whole step'] / parts['collector: whole step']:.3f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
