"""What the alignment of a generation's tensors does to the one copy an update makes.

    .venv/bin/python benchmarks/copy_alignment.py [--params 1e6] [--idle 0.02]

The benchmark's MLP (``common.make_big_policy``) is copied into two flat buffers used in turn, as a
weight pool's generations are, with each tensor starting at a multiple of 16 bytes or of 64 bytes
(a cache line, what ``FlatLayout`` does). Before each copy the process sleeps ``--idle`` seconds
(the time between two updates, during which the buffers drop out of the cache) and then changes
the parameters, as a learner does. Prints the median copy time of each alignment and their ratio,
measured in this run, and the same with no sleep (buffers in cache). Nothing here is a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


def buffers(parameters: list[torch.Tensor], align: int) -> list[torch.Tensor]:
    """Views of one flat buffer, one per parameter, each starting at a multiple of ``align`` bytes."""
    sizes = [p.numel() * p.element_size() for p in parameters]
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // align) * align
    flat = torch.empty(end + 4096, dtype=torch.uint8)
    base = -flat.data_ptr() % 4096  # the buffer itself on a page, as shared memory is
    return [flat[base + offset: base + offset + size].view(p.dtype).view(p.shape)
            for offset, size, p in zip(offsets, sizes, parameters)]


def median_copy_s(policy: torch.nn.Module, align: int, idle: float, repeats: int) -> float:
    parameters = [p.data for p in policy.parameters()]
    generations = [buffers(parameters, align) for _ in range(2)]
    times = []
    for i in range(repeats + 3):
        if idle:
            time.sleep(idle)
        common.bump_parameters(policy)
        start = time.perf_counter()
        torch._foreach_copy_(generations[i % 2], parameters)
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=1e6)
    parser.add_argument("--idle", type=float, default=0.02, help="seconds between two updates")
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    policy = common.make_big_policy(int(args.params))
    for idle in (args.idle, 0.0):
        by_align = {}
        for align in (16, 64, 16, 64):  # alternating: drift in the machine hits both
            by_align.setdefault(align, []).append(median_copy_s(policy, align, idle, args.repeats))
        t16, t64 = (statistics.median(by_align[a]) for a in (16, 64))
        print(f"idle {idle:g} s: 16-byte {t16 * 1e3:.3f} ms, 64-byte {t64 * 1e3:.3f} ms, "
              f"16/64 = {t16 / t64:.2f}x")


if __name__ == "__main__":
    main()
