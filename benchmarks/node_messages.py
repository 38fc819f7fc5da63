"""What reading a node's messages costs the main process, this checkout against another commit.

    .venv/bin/python benchmarks/node_messages.py [--against 5b09725] [--rounds 3]

Messages from nodes are in wire format 2 since issue 51 (docs/security.md, "What a node's messages can
do"), pickles read through an allow-list before (which refused tensordict's own pickles: a batch
that fits no flat buffer did not reach the learner). For each kind of message a node sends (a heartbeat,
a BATCH reply of a dense batch, the first one with its layout, a batch that fits no flat buffer, a
state dict): microseconds to write it (on the node) and to read it (in the main process), and the
batches per second of a ``DistributedCollector`` (2 nodes on this host, CountingEnv, 16 frames a
batch: the reply per batch weighs most there). Both sides run in fresh processes, one after the
other in each round (the commit's tree is unpacked with ``git archive``); the ratios this side /
that side of the same round are the figures to read. Nothing here is a test: timings depend on the
machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _codec():
    """``(encode, decode)`` of the rlharvest imported: wire format 2, or pickles and the allow-list."""
    from rlharvest.transport import wire

    if hasattr(wire, "decode_from_node"):
        return wire.encode_from_node, wire.decode_from_node
    import pickle

    return (lambda value: pickle.dumps(value, pickle.HIGHEST_PROTOCOL)), wire.loads_from_node


def _messages() -> dict:
    import torch
    from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict

    from rlharvest.collectors import Collector
    from rlharvest.data.flat import FlatLayout
    from rlharvest.envs import CountingEnv
    from rlharvest.protocol import Reply

    collector = Collector(CountingEnv(batch_size=(4,)), frames_per_batch=64, total_frames=64)
    batch = next(iter(collector))
    collector.shutdown()
    frames = 100
    structured = TensorDict({"obs": torch.randn(frames, 8), "note": NonTensorStack(*[NonTensorData(f"step {i}")
                                                                                     for i in range(frames)]),
                             "parts": LazyStackedTensorDict(*[TensorDict({"x": torch.zeros(frames, i + 1)}, [frames])
                                                              for i in range(2)], stack_dim=1)}, [frames])
    policy = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 4))
    return {
        "heartbeat": ("hb", 12345),
        "batch reply": Reply(12, 1, value=None, frames=64, times=(0.0123, 0.0045), host=None),
        "first batch reply": Reply(1, 1, value=FlatLayout.of(batch), frames=64, times=(0.0123, 0.0045), host="h"),
        "structured batch (100 frames)": Reply(12, 1, value=structured, frames=frames, times=(0.01, 0.01)),
        "state dict (1.3M params)": Reply(3, 1, value={"policy_state_dict": policy.state_dict(), "frames": 640}),
    }


def _per_message_us(function, budget: float = 0.3) -> float:
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget or calls < 3:
        function()
        calls += 1
    return (time.perf_counter() - start) / calls * 1e6


def _collector_batches_per_s(batches: int = 300) -> float:
    from rlharvest.collectors.distributed import DistributedCollector
    from rlharvest.envs import CountingEnv
    from rlharvest.transport.ports import free_port_block

    collector = DistributedCollector([CountingEnv] * 2, None, launcher="mp", tcp_port=free_port_block(3),
                                     frames_per_batch=16, total_frames=-1, sync=False)
    try:
        iterator = iter(collector)
        for _ in range(20):
            next(iterator)
        start = time.perf_counter()
        for _ in range(batches):
            next(iterator)
        return batches / (time.perf_counter() - start)
    finally:
        collector.shutdown()


def measure() -> dict:
    """This interpreter's rlharvest: write and read microseconds per message kind, batches per second."""
    import torch

    torch.set_num_threads(1)
    encode, decode = _codec()
    figures = {}
    for name, message in _messages().items():
        data = encode(message)
        figures[f"{name}: write us"] = _per_message_us(lambda: encode(message))
        try:
            decode(data)
        except Exception:  # noqa: BLE001 (before issue 51, the allow-list refused tensordict's pickles)
            figures[f"{name}: read us"] = None
        else:
            figures[f"{name}: read us"] = _per_message_us(lambda: decode(data))
        figures[f"{name}: bytes"] = len(data)
    figures["DistributedCollector batches/s"] = _collector_batches_per_s()
    return figures


def _side(tree: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, __file__, "--measure"], env=env, cwd=tree, capture_output=True, text=True,
                         check=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="5b09725", help="the commit to compare with (default: before issue 51)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure()))
        return
    with tempfile.TemporaryDirectory(prefix="rlh-bench-") as other:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.against], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", other], input=archive.stdout, check=True)
        rounds = [(_side(ROOT), _side(Path(other))) for _ in range(args.rounds)]
    print(f"{'':44} {'this':>10} {args.against:>10} {'ratio':>7}   (medians of {args.rounds} rounds, load "
          f"{os.getloadavg()[0]:.1f})")
    for key in rounds[0][0]:
        if any(mine[key] is None or theirs[key] is None for mine, theirs in rounds):
            print(f"{key:44} {'refused' if rounds[0][0][key] is None else '':>10} "
                  f"{'refused' if rounds[0][1][key] is None else '':>10}")
            continue
        this = statistics.median(mine[key] for mine, _ in rounds)
        that = statistics.median(theirs[key] for _, theirs in rounds)
        ratio = statistics.median(mine[key] / theirs[key] for mine, theirs in rounds)
        print(f"{key:44} {this:10.1f} {that:10.1f} {ratio:7.2f}")


if __name__ == "__main__":
    main()
