"""Where the time of a weight update to collecting DistributedCollector nodes goes.

Two nodes (launcher "mp", gloo, this host: the nodes get shared-memory generations), CartPole and
``common.make_big_policy`` (1M parameters by default), collecting while the update happens
(``sync=False``; ``--sync`` for the synchronous collector). The script wraps, from outside the
library (no library change), the methods an update passes through, in this process and in the nodes
(forked from it, so they inherit the wrappers), and logs ``time.monotonic()`` (one clock for every
process on Linux) at each step:

main process: ``send`` called -> weights read (``prepare_weights``) -> ``deliver`` (waits for an
unfinished previous update, copies into a shared-memory generation: ``stage``, writes the notice
on each node's weight channel) -> ``wait_acks`` -> each node's ack read -> ``send`` returns.

node: notice read by the channel's reader thread -> the collection loop takes it between two env
steps (``receive``) -> generation mapped -> weights swapped in (``apply_weights``) -> ack written.

Prints the median of each stage over ``--repeats`` updates (one batch collected between two
updates, as ``rlharvest bench``'s weight-sync workloads), and the load. Usage::

    .venv/bin/python benchmarks/update_breakdown.py [--params 1000000] [--repeats 30] [--sync]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_LOG: dict[str, object] = {}


def schedstat() -> tuple[int, int]:
    """This thread's nanoseconds on a core and waiting in the run queue (``/proc/thread-self/schedstat``)."""
    with open("/proc/thread-self/schedstat") as handle:
        run_ns, wait_ns, _ = handle.read().split()
    return int(run_ns), int(wait_ns)


def log(event: str, version: int | None = None, worker: int | None = None) -> None:
    """Append one event of this process to its own file (one line, flushed); send_start / send_end
    also record the calling thread's schedstat."""
    handle = _LOG.get(os.getpid())
    if handle is None:
        handle = open(Path(os.environ["RLH_BREAKDOWN_DIR"]) / f"{os.getpid()}.jsonl", "a", buffering=1)
        _LOG[os.getpid()] = handle
    record = {"t": time.monotonic(), "e": event, "v": version, "w": worker}
    if event in ("send_start", "send_end"):
        record["run_ns"], record["wait_ns"] = schedstat()
    handle.write(json.dumps(record) + "\n")


def _wrap(owner: type, name: str, before=None, after=None) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        if before is not None:
            before(self, *args, **kwargs)
        result = original(self, *args, **kwargs)
        if after is not None:
            after(self, result, *args, **kwargs)
        return result

    setattr(owner, name, wrapper)


def install() -> None:
    """Timestamps around the update path (main process and nodes)."""
    from rlharvest.transport import channel as channel_mod
    from rlharvest.transport import torchdist_receiver as receiver_mod
    from rlharvest.transport import torchdist_weights as sender_mod
    from rlharvest.weight_update.schemes import WeightSyncScheme

    def version_of(scheme) -> int:
        return scheme._version + 1  # noqa: SLF001 - the version this send will carry

    _wrap(WeightSyncScheme, "send", lambda s, *a, **k: log("send_start", version_of(s)),
          lambda s, r, *a, **k: log("send_end", s._version))  # noqa: SLF001
    _wrap(WeightSyncScheme, "prepare_weights", None, lambda s, r, *a, **k: log("prepared"))
    _wrap(WeightSyncScheme, "apply_weights", lambda s, *a, **k: log("apply_start"),
          lambda s, r, *a, **k: log("apply_end"))
    sender = sender_mod.DistWeightSender
    _wrap(sender, "deliver", lambda s, p, v, w: log("deliver_start", v), lambda s, r, p, v, w: log("deliver_end", v))
    if hasattr(sender, "_stage_shared"):  # trees before the generation book
        _wrap(sender, "_stage_shared", lambda s, *a: log("stage_start"), lambda s, r, *a: log("stage_end"))
    else:
        from rlharvest.transport.weight_pool import GenerationBook

        _wrap(GenerationBook, "stage", lambda s, *a, **k: log("stage_start"), lambda s, r, *a, **k: log("stage_end"))
    _wrap(sender, "wait_acks", lambda s, v, *a: log("wait_start", v), lambda s, r, v, *a: log("wait_end", v))

    def took(self, worker, message):
        if message[0] == "ack":
            log("ack_read", message[1], worker)

    _wrap(sender, "_take", took)

    def sent(self, message):
        if isinstance(message, tuple) and message and message[0] == "update":
            log("notice_write", message[1])

    _wrap(channel_mod.Channel, "send", sent)
    receiver = receiver_mod.DistWeightReceiver
    _wrap(receiver, "receive", lambda s, *a: log("receive_start", None, s.worker_idx),
          lambda s, r, *a: log("receive_end", None if r is None else r[0], s.worker_idx))
    _wrap(receiver, "ack", lambda s, v: log("ack_write", v, s.worker_idx))
    original_loop = receiver_mod._read_loop  # noqa: SLF001 - looked up when the receiver connects

    class TimedConn:
        def __init__(self, conn) -> None:
            self.conn = conn

        def recv(self):
            message = self.conn.recv()
            if isinstance(message, tuple) and message and message[0] == "update":
                log("notice_read", message[1])
            return message

    receiver_mod._read_loop = lambda conn, *rest: original_loop(TimedConn(conn), *rest)  # noqa: SLF001

    # An update the reader thread takes itself (trees with WeightSyncScheme._take_early): "receive"
    # is the mapping (load), "apply" from the mapping's end to the version moved (_cascade).
    early = getattr(WeightSyncScheme, "_take_early", None)
    if early is not None:
        def take_early(self, version, load):
            worker = getattr(self._receiver, "worker_idx", None)  # noqa: SLF001

            def timed_load():
                log("receive_start", None, worker)
                weights = load()
                log("receive_end", version, worker)
                log("apply_start", version, worker)
                return weights

            return early(self, version, timed_load)

        WeightSyncScheme._take_early = take_early  # noqa: SLF001
        _wrap(WeightSyncScheme, "_cascade", lambda s, *a: log("apply_end"))


def collect(args: argparse.Namespace) -> None:
    import torch

    import common
    import harness
    import rlharvest_envs
    from rlharvest.collectors.distributed import DistributedCollector

    torch.set_num_threads(1)
    policy = rlharvest_envs.big_policy(args.params)
    collector = DistributedCollector([rlharvest_envs.make_cartpole_env] * 2, policy, launcher="mp", backend="gloo",
                                     tcp_port=common.find_free_port_block(3), sync=args.sync,
                                     frames_per_batch=args.frames_per_batch, total_frames=common.TOTAL_FRAMES)
    try:
        batches = iter(collector)
        for _ in range(3):
            next(batches)
        monitor = harness.CpuMonitor().start()
        for _ in range(args.repeats):
            common.bump_parameters(policy)
            collector.update_policy_weights_()
            next(batches)
        print(f"cpu during the updates: {monitor.stop()}", flush=True)
    finally:
        collector.shutdown()


def _events(directory: Path) -> dict[int, list[dict]]:
    return {int(p.stem): [json.loads(line) for line in p.read_text().splitlines()] for p in directory.glob("*.jsonl")}


#: the node's reader thread back in Python with the notice -> the new weights swapped in (by the reader
#: itself or by the collection loop between two steps): what the GIL and the policy's lock cost
WAKE_TO_SWAP = "node: wake-to-swap (reader has the notice -> swapped in)"


def analyse(by_pid: dict[int, list[dict]], main_pid: int) -> dict[str, float]:
    """Median milliseconds of each stage (see the module docstring)."""
    main = by_pid[main_pid]
    stages: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        stages.setdefault(name, []).append(1e3 * value)

    nodes = [events for pid, events in by_pid.items() if pid != main_pid]
    starts = [i for i, e in enumerate(main) if e["e"] == "send_start"]
    for index in starts:
        version = main[index]["v"]
        window = main[index:]
        first = {}
        for event in window:
            first.setdefault(event["e"], event["t"])
            if event["e"] == "send_end":
                break
        t0 = first["send_start"]
        add("total (send called -> returned)", first["send_end"] - t0)
        end = next(e for e in window if e["e"] == "send_end")
        add("main thread on a core during send", 1e-9 * (end["run_ns"] - main[index]["run_ns"]))
        add("main thread runnable, waiting for a core, during send", 1e-9 * (end["wait_ns"] - main[index]["wait_ns"]))
        add("read weights (prepare_weights)", first["prepared"] - t0)
        add("previous update's acks (in deliver, before staging)", first["stage_start"] - first["deliver_start"])
        add("copy into a shared-memory generation (stage)", first["stage_end"] - first["stage_start"])
        add("notices written (stage end -> deliver returns)", first["deliver_end"] - first["stage_end"])
        first.setdefault("notice_write", first["deliver_end"])
        acks = [e["t"] for e in window if e["e"] == "ack_read" and e["v"] == version and e["t"] <= first["send_end"]]
        for events in nodes:
            node = _node_times(events, version)
            if node is None:
                continue
            add("node: first notice written -> its reader thread has one", node["notice_read"] - first["notice_write"])
            add("node: reader has it -> taken (a step boundary, or at once by the reader)", node["receive_start"] - node["notice_read"])
            add("node: map generation (receive)", node["receive_end"] - node["receive_start"])
            add("node: swap tensors (apply_weights)", node["apply_end"] - node["apply_start"])
            add("node: apply end -> ack written (cascade)", node["ack_write"] - node["apply_end"])
            add(WAKE_TO_SWAP, node["apply_end"] - node["notice_read"])
            later = [t for t in acks if t >= node["ack_write"]]
            if later:
                add("ack on the wire (node writes -> main reads)", min(later) - node["ack_write"])
        if acks:
            add("last ack read -> send returns", first["send_end"] - max(acks))
    medians = {name: statistics.median(values) for name, values in stages.items()}
    medians[WAKE_TO_SWAP + ", 90th percentile"] = _percentile(stages.get(WAKE_TO_SWAP, []), 0.9)
    medians[WAKE_TO_SWAP + ", largest"] = max(stages.get(WAKE_TO_SWAP, [float("nan")]))
    return medians


def _percentile(values: list[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def timeline(by_pid: dict[int, list[dict]], main_pid: int) -> dict[str, float]:
    """Median milliseconds from ``send`` called to each event of an update, nodes in the order they
    acknowledged (node A first)."""
    main = by_pid[main_pid]
    nodes = [events for pid, events in by_pid.items() if pid != main_pid]
    offsets: dict[str, list[float]] = {}
    for index in (i for i, e in enumerate(main) if e["e"] == "send_start"):
        version, t0 = main[index]["v"], main[index]["t"]
        seen: dict[str, int] = {}
        for event in main[index:]:
            name = event["e"]
            seen[name] = seen.get(name, 0) + 1
            label = f"main: {name}" + (f" #{seen[name]}" if name in ("notice_write", "ack_read") else "")
            offsets.setdefault(label, []).append(1e3 * (event["t"] - t0))
            if name == "send_end":
                break
        per_node = sorted((times for times in (_node_times(events, version) for events in nodes) if times),
                          key=lambda times: times["ack_write"])
        for letter, times in zip("AB", per_node):
            for name, value in times.items():
                offsets.setdefault(f"node {letter}: {name}", []).append(1e3 * (value - t0))
    ordered = sorted(offsets.items(), key=lambda item: statistics.median(item[1]))
    return {name: statistics.median(values) for name, values in ordered}


def _node_times(events: list[dict], version: int) -> dict[str, float] | None:
    """A node's timestamps for ``version`` (None if it did not log them all)."""
    times: dict[str, float] = {}
    for index, event in enumerate(events):
        if event["e"] == "notice_read" and event["v"] == version:
            times["notice_read"] = event["t"]
        if event["e"] == "receive_end" and event["v"] == version:
            start = next(e for e in reversed(events[:index]) if e["e"] == "receive_start")
            times["receive_start"], times["receive_end"] = start["t"], event["t"]
            after = events[index:]
            apply = [e for e in after if e["e"] in ("apply_start", "apply_end")]
            ack = [e for e in after if e["e"] == "ack_write" and e["v"] == version]
            if len(apply) >= 2 and ack:
                times["apply_start"], times["apply_end"], times["ack_write"] = apply[0]["t"], apply[1]["t"], ack[0]["t"]
    needed = ("notice_read", "receive_start", "receive_end", "apply_start", "apply_end", "ack_write")
    return times if all(k in times for k in needed) else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--frames-per-batch", type=int, default=20)
    parser.add_argument("--sync", action="store_true", help="DistributedCollector(sync=True)")
    parser.add_argument("--json", type=Path, help="also write the medians here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rlh-breakdown-") as directory:
        os.environ["RLH_BREAKDOWN_DIR"] = directory
        install()
        load = open("/proc/loadavg").read().split()[:3]
        collect(args)
        events = _events(Path(directory))
        medians = analyse(events, os.getpid())
        offsets = timeline(events, os.getpid())
    mode = "sync" if args.sync else "async"
    print(f"{args.params} parameters, 2 nodes collecting ({mode}), {args.repeats} updates; loadavg {' '.join(load)} "
          f"at start, {' '.join(open('/proc/loadavg').read().split()[:3])} at end; medians (ms):")
    for name, value in medians.items():
        print(f"  {value:8.3f}  {name}")
    print("timeline, median ms after send() was called:")
    for name, value in offsets.items():
        print(f"  {value:8.3f}  {name}")
    if args.json:
        args.json.write_text(json.dumps({"mode": mode, "params": args.params, "loadavg": load, "ms": medians,
                                         "timeline_ms": offsets},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
