"""Run by test_nothing_left_open.py in a network namespace of its own: two ``RPCCollector`` in a row in
this process, on the default port (10003). Prints ``listening`` once a collector listens on 10003 and
``released`` once, after its ``shutdown()``, nothing it opened is left (tests/held.py); exits 1 otherwise.
"""

from __future__ import annotations

import functools

import torch
from held import Held, held, held_since, start_process_state
from mocks import weight_policy

from rlharvest.collectors.distributed import RPCCollector
from rlharvest.envs import CountingEnv
from rlharvest.transport.launchers import TCP_PORT


def main() -> int:
    torch.set_num_threads(1)
    start_process_state()
    before = held()
    for _ in range(2):
        collector = RPCCollector([functools.partial(CountingEnv, max_steps=5)] * 2, weight_policy(), launcher="mp",
                                 frames_per_batch=4, total_frames=8)
        if TCP_PORT not in {port for _, port in held_since(before).ports}:
            return 1
        print("listening", flush=True)
        assert sum(batch.numel() for batch in collector) == 8
        collector.shutdown()
        left = held_since(before)
        if left != Held({}, set()):
            print(left, flush=True)
            return 1
        print("released", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
