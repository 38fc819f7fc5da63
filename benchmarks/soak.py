"""Soak: a collector under churn for minutes to hours, and what the learner's process holds meanwhile.

    .venv/bin/python benchmarks/soak.py --collector multiasync --minutes 60 --out benchmarks/results/soak-multiasync
    .venv/bin/python benchmarks/soak.py --collector dist-async --minutes 60 --out benchmarks/results/soak-dist-async

Collectors (``--collector``): ``multisync``, ``multiasync`` (worker processes), ``dist-sync``,
``dist-async`` (``DistributedCollector``, ``launcher="mp"``), ``rpc`` (``RPCCollector``), ``ray``
(``RayCollector`` on a local Ray), ``dist-join`` (``DistributedCollector(launcher="external")``: every
node is a process this script starts with ``join_command()``, on loopback), ``dist-relay`` (as
``dist-join``, the main process in a network namespace and each node in one of 3 others: weights
travel by the relay between hosts; needs root, ``tests/netns.py``).

CountingEnv, a policy that steps the counter by one and reports its weight with every frame
(``echo_weight_policy``), 2 workers to start with. A weight update every ``--update-every`` batches;
every ``--event-every`` seconds one event drawn at random (seeded) among SIGKILL of a worker, SIGTERM
of a worker (a preemption), ``add_collectors`` and ``remove_collectors``, between 1 and 3 workers
(``dist-join``: SIGKILL or SIGTERM of a node, each followed by a new node joining, and
``remove_collectors``, whose slot the next node that joins takes back). Restarts are on: a killed or
preempted worker is replaced.

Every batch is checked (``tests/churn.py``, ``FrameCheck``): within a trajectory the counter goes up
by one (no frame lost, doubled or torn), every frame carries weights that were sent; the run stops at
the first violation. Every ``--sample-every`` seconds the learner's RSS, open descriptors, shared
memory it maps (files and bytes), the named ``/dev/shm`` files its processes map, threads and child
processes are sampled. Written: ``<out>.csv`` (the samples), ``<out>.json`` (the summary: events,
frames, and the growth of each figure: the largest value of the last quarter of the run against that
of the second, at the same number of workers, and a least-squares slope per hour over the second
half) and ``<out>.png`` (the plot, events marked). After ``shutdown()``: the children, the
``/dev/shm`` files seen that still exist, and the descriptors left once the collector is dropped.
``--events kill`` draws only SIGKILLs (the soak of docs/restarts.md, "Measured"), ``--events ''``
none (a baseline).

Not a test: how much a run collects depends on the machine and its load; what must hold whatever the
load (nothing lost, nothing growing) is checked, and the tests run the same churn briefly
(``tests/collectors/test_churn.py``, ``tests/collectors/distributed/test_churn_nodes.py``).
"""

from __future__ import annotations

import argparse
import csv
import faulthandler
import gc
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path.insert(0, str(TESTS))

from churn import EVENTS, Churn, FrameCheck, open_fds, process_tree_shm, resources, start_process_state  # noqa: E402
from mocks import counting_env_7, echo_weight_policy  # noqa: E402

COLLECTORS = ("multisync", "multiasync", "dist-sync", "dist-async", "rpc", "ray", "dist-join")
FIGURES = ("rss", "fds", "shm_files", "shm_bytes", "threads", "children", "shm_named")


def build(args, policy):
    """The collector of ``--collector``, and the nodes this script started for it (``dist-join``)."""
    common = dict(frames_per_batch=2 * args.share, total_frames=-1, max_worker_restarts=1_000_000,
                  preemption_grace=2.0)
    kind = args.collector
    if kind in ("multisync", "multiasync"):
        from rlharvest.collectors import MultiAsyncCollector, MultiSyncCollector

        cls = MultiSyncCollector if kind == "multisync" else MultiAsyncCollector
        return cls([counting_env_7] * 2, policy, **common), None
    from rlharvest.collectors.distributed import DistributedCollector, RayCollector, RPCCollector
    from rlharvest.transport.ports import free_port_block

    if kind == "ray":
        import ray

        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024**2, log_to_driver=False)
        return RayCollector([counting_env_7] * 2, policy, sync=False, remote_configs={"num_cpus": 0.5},
                            **common), None
    if kind == "rpc":
        return RPCCollector([counting_env_7] * 2, policy, launcher="mp", tcp_port=free_port_block(3), sync=True,
                            **common), None
    if kind == "dist-join":
        collector = DistributedCollector([counting_env_7] * args.slots, policy, launcher="external",
                                         tcp_port=args.port, bind_address=args.bind, sync=False, **common)
        argv = collector.join_command()
        joiners = Joiners(argv) if args.joins == "process" else AskedJoiners(argv, args.slots)
        joiners.start(args.slots)
        return collector, joiners
    return DistributedCollector([counting_env_7] * 2, policy, launcher="mp", tcp_port=free_port_block(3),
                                sync=kind == "dist-sync", **common), None


class Joiners:
    """The node processes of a ``launcher="external"`` collector, each started with its join command."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = [sys.executable, *argv[1:]]
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(TESTS)])}
        self.nodes: list[subprocess.Popen] = []

    def start(self, count: int = 1) -> None:
        for _ in range(count):
            self.nodes.append(subprocess.Popen(self.argv, env=self.env, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL))

    def signal(self, kind: str, rng) -> bool:
        """SIGKILL or SIGTERM one of the nodes (a node that joined has no pid the collector can name);
        False while one is still joining (it may not hold a slot yet)."""
        live = [node for node in self.nodes if node.poll() is None]
        if len(live) != self.slots_held():
            return False
        rng.choice(live).send_signal(signal.SIGKILL if kind == "kill" else signal.SIGTERM)
        return True

    slots_held: Callable[[], int] = staticmethod(lambda: -1)  # set by Soak: the collector's active nodes

    def stop(self, timeout: float = 60.0) -> list[int | None]:
        """Wait for every node to exit (they do once the collector shut down), then kill any left."""
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            try:
                node.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait(10.0)
        return [node.returncode for node in self.nodes]


class AskedJoiners:
    """``--joins stdout`` (the main process of ``dist-relay``, in a network namespace): nodes are started
    elsewhere, by the process reading this one's output, asked for one JSON line at a time."""

    def __init__(self, argv: list[str], slots: int) -> None:
        self.argv, self.slots = argv, slots

    def start(self, count: int = 1) -> None:
        print(json.dumps({"join": self.argv, "count": count}), flush=True)

    def signal(self, kind: str, rng) -> bool:
        """Ask the reader to signal one of the nodes it started, once every slot holds one (none is
        joining: every node it started and not ended holds a slot)."""
        if self.slots_held() != self.slots:
            return False
        print(json.dumps({"signal": kind}), flush=True)
        return True

    slots_held: Callable[[], int] = staticmethod(lambda: -1)  # set by Soak: the collector's active nodes

    def stop(self, timeout: float = 60.0) -> list[int | None]:
        return []  # the reader's


def relay(args) -> None:
    """``--collector dist-relay``: the main process (``dist-join``) in network namespace A, each node
    joining from one of ``--remote-hosts`` others (``tests/netns.py``): weights travel by the relay
    between hosts (docs/weights.md), and after each departure a node joins from a host drawn at
    random. This process only starts nodes; the main process samples, checks and writes the results."""
    import netns

    netns.require()
    with netns.Hosts(1 + args.remote_hosts) as net:
        main_host, remotes = net.hosts[0], net.hosts[1:]
        argv = [sys.executable, str(Path(__file__).resolve()), "--collector", "dist-join", "--joins", "stdout",
                "--bind", main_host.ip, "--port", str(args.port), "--slots", str(len(remotes)),
                "--minutes", str(args.minutes), "--seed", str(args.seed), "--share", str(args.share),
                "--update-every", str(args.update_every), "--event-every", str(args.event_every),
                "--sample-every", str(args.sample_every), "--events", ",".join(args.events),
                "--stall-seconds", str(args.stall_seconds),
                "--out", str(args.out)]
        env = {"PYTHONPATH": os.pathsep.join([str(HERE.parent), str(TESTS)]), "OMP_NUM_THREADS": "1"}
        main = main_host.popen(argv, env=env, stdout=subprocess.PIPE, text=True)
        rng, nodes, started = random.Random(args.seed), [], 0
        for line in main.stdout:
            asked = json.loads(line) if line.startswith(('{"join"', '{"signal"')) else None
            if asked is None:
                sys.stdout.write(line)
            elif "signal" in asked:  # one of the nodes started here, each in a slot (none joining)
                live = [node for node in nodes if node.poll() is None]
                rng.choice(live).send_signal(signal.SIGKILL if asked["signal"] == "kill" else signal.SIGTERM)
            else:
                join = [sys.executable, *asked["join"][1:]]
                for _ in range(asked["count"]):  # the first nodes one per host, then a host at random
                    host = remotes[started] if started < len(remotes) else rng.choice(remotes)
                    nodes.append(host.popen(join, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                    started += 1
        main.wait()
        for node in nodes:
            try:
                node.wait(60)
            except subprocess.TimeoutExpired:
                node.kill()
        print(json.dumps({"relay_nodes_started": started, "node_exits": [node.returncode for node in nodes]}))


def dev_shm_count() -> int:
    try:
        return len(os.listdir("/dev/shm"))
    except OSError:
        return -1


def ray_pid_of():
    """``pid_of`` for Ray actors: asked of the actor once (its repr names its id); None once dead."""
    import ray

    pids: dict[str, int | None] = {}

    def pid_of(collector, worker: int) -> int | None:
        actor = collector.remote_collectors[worker]
        if repr(actor) not in pids:
            try:
                pids[repr(actor)] = ray.get(actor.pid.remote(), timeout=60)
            except ray.exceptions.RayError:  # signalled, and its end not met yet
                pids[repr(actor)] = None
        return pids[repr(actor)]
    return pid_of


class Soak:
    """One run: the collector, its churn and checks, the samples, the events' marks."""

    def __init__(self, args) -> None:
        self.args = args
        self.policy = echo_weight_policy(1.0)
        self.collector, self.joiners = build(args, self.policy)
        events = tuple(args.events)
        #: nodes that join: this script signals them (through ``joiners``); the churn only removes
        self.signals = tuple(event for event in events if event in ("kill", "term")) if self.joiners else ()
        if self.joiners is not None:
            events = ("remove",) if "remove" in events else ()  # the slots are fixed: no add
            self.joiners.slots_held = lambda: len(self.collector.active_workers)
        self.churn = Churn(self.collector, counting_env_7, seed=args.seed, events=events,
                           pid_of=ray_pid_of() if args.collector == "ray" else None)
        self.check, self.weight = FrameCheck(), 1.0
        self.check.sent(self.weight)
        #: the samples and the events' marks, kept on disk: the learner's own memory is what is sampled
        self.records = Records()
        #: named /dev/shm files seen that still exist (a name once gone never comes back)
        self.shm_seen: set[str] = set()
        self.batches = 0
        self.start = time.monotonic()

    def sample(self) -> None:
        named = process_tree_shm()
        self.shm_seen = {name for name in self.shm_seen if os.path.exists(name)} | named
        stats, collector = self.collector.stats(), self.collector
        last = {"t": round(time.monotonic() - self.start, 2), **resources(), "shm_named": len(named),
                "dev_shm": dev_shm_count(), "workers": len(collector.active_workers),
                "frames": self.check.frames, "batches": self.batches, "events": len(self.churn.done),
                "restarts": stats.get("restarts", 0), "preemptions": stats.get("preemptions", 0)}
        self.records.add("sample", last)
        print(f"[{last['t']:7.0f} s] {last['frames']} frames, {last['events']} events, {last['workers']} workers, "
              f"fds {last['fds']}, rss {last['rss'] / 2**20:.0f} MB", file=sys.stderr, flush=True)

    def update(self) -> None:
        self.weight += 1.0
        with torch.no_grad():
            self.policy.module.weight.fill_(self.weight)
        self.check.sent(self.weight)
        self.collector.update_policy_weights_()

    def event(self) -> None:
        kind = self.churn.rng.choice(self.signals + self.churn.events) if self.signals else None
        if kind in ("kill", "term"):  # a node that joined: signalled through the joiners
            event = kind if self.joiners.signal(kind, self.churn.rng) else "none"
        else:
            event = self.churn.step()
        self.records.add("mark", (round(time.monotonic() - self.start, 2), event))
        if self.joiners is not None and event in ("kill", "term", "remove"):
            self.joiners.start(1)  # a new node joins: it takes the slot (after a removal: at the next batch)

    def loop(self, watchdog: "Watchdog") -> float:
        """Collect until the run's end; returns its seconds."""
        args = self.args
        end = self.start + args.minutes * 60.0
        next_event, next_sample = self.start + args.event_every, self.start
        iterator = iter(self.collector)
        while time.monotonic() < end:
            if time.monotonic() >= next_sample:
                self.sample()
                next_sample = time.monotonic() + args.sample_every
            self.check.check(next(iterator))
            watchdog.beat()
            self.batches += 1
            if self.batches % args.update_every == 0:
                self.update()
            if (self.churn.events or self.signals) and time.monotonic() >= next_event:
                self.event()
                next_event = time.monotonic() + args.event_every
        self.sample()
        return time.monotonic() - self.start


def run(args) -> dict:
    torch.set_num_threads(1)
    if args.collector not in ("multisync", "multiasync", "ray"):
        start_process_state()  # torch's, once per process: not the collector's
    before = open_fds()
    soak = Soak(args)
    watchdog = Watchdog(args.stall_seconds)
    elapsed = soak.loop(watchdog)
    watchdog.stop()
    causes = [cause.kind for cause in soak.collector.restart_causes]
    soak.collector.shutdown()
    exits = soak.joiners.stop() if soak.joiners is not None else []  # nodes that joined exit by themselves
    after_shutdown = resources()
    if args.collector == "ray":
        import ray

        ray.shutdown()
    soak.collector = soak.churn = None
    samples, marks = soak.records.read()
    soak.records.close()  # the harness's own descriptor, not the collector's
    gc.collect()
    fds_left = {fd: target for fd, target in open_fds().items() if before.get(fd) != target}
    frames = soak.check.frames
    return {"collector": args.collector, "minutes": args.minutes, "seconds": round(elapsed, 1), "seed": args.seed,
            "frames": frames, "batches": soak.batches, "frames_per_s": round(frames / elapsed, 1),
            "events": {kind: sum(1 for _, e in marks if e == kind) for kind in EVENTS},
            "restart_causes": {kind: causes.count(kind) for kind in sorted(set(causes))},
            "growth": growth(samples),
            "after_shutdown": {"children": after_shutdown["children"],
                               "shm_left": sorted(n for n in soak.shm_seen if os.path.exists(n)), "node_exits": exits},
            "fds_left_after_drop": {str(fd): target for fd, target in sorted(fds_left.items())},
            "stalls": watchdog.stalls, "samples": samples, "marks": marks}


class Records:
    """What a run records, one JSON line each in a temporary file, read back at the end: held in the
    learner's process, samples and marks would themselves grow its RSS (an hour of samples every 5 s
    and the names of every worker's shared-memory files: about 0.8 MiB)."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile("w+")

    def add(self, kind: str, value) -> None:
        self._file.write(json.dumps([kind, value]) + "\n")
        self._file.flush()

    def read(self) -> tuple[list[dict], list[tuple[float, str]]]:
        """The samples and the marks, in order."""
        self._file.seek(0)
        samples, marks = [], []
        for line in self._file:
            kind, value = json.loads(line)
            (samples if kind == "sample" else marks).append(value if kind == "sample" else tuple(value))
        return samples, marks

    def close(self) -> None:
        self._file.close()


class Watchdog:
    """Reports a stall: when no batch came for ``seconds``, the stack of every thread goes to stderr
    (once per stall), and the stall is counted. Every wait of a collector is bounded, but a bound of a
    minute is a stall a soak must show."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.stalls = seconds, []
        self._start = self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="soak-watchdog", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        self._last = time.monotonic()

    def _watch(self) -> None:
        reported = None
        while not self._stop.wait(1.0):
            if time.monotonic() - self._last > self.seconds and reported != self._last:
                reported = self._last
                self.stalls.append(round(self._last - self._start, 1))  # seconds into the run
                print(f"soak: no batch for {self.seconds:g} s; every thread's stack:", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)


def growth(samples: list[dict]) -> dict:
    """For each figure: the largest value of the last quarter of the run against that of the second
    (the first is warm-up), at each number of workers seen in both (a sample may fall between a
    worker's start and its first batch, whose buffer is then missing: the largest is the settled
    state); and a least-squares slope per hour over the second half of the run."""
    if len(samples) < 8:
        return {}
    quarter = len(samples) // 4
    early, late = samples[quarter:2 * quarter], samples[-quarter:]
    out: dict = {}
    for workers in sorted({s["workers"] for s in early} & {s["workers"] for s in late}):
        before = [s for s in early if s["workers"] == workers]
        after = [s for s in late if s["workers"] == workers]
        out[f"{workers}_workers"] = {key: max(s[key] for s in after) - max(s[key] for s in before) for key in FIGURES}
    half = samples[len(samples) // 2:]
    for key in FIGURES:
        out[f"{key}_per_hour"] = round(_slope([s["t"] for s in half], [s[key] for s in half]) * 3600.0, 2)
    return out


def _slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var if var else 0.0


def write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    samples = result["samples"]
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(samples[0]))
        writer.writeheader()
        writer.writerows(samples)
    with open(out.with_suffix(".json"), "w") as f:
        json.dump({k: v for k, v in result.items() if k != "samples"}, f, indent=1)
    plot(result, out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    minutes = [s["t"] / 60.0 for s in samples]
    panels = [("rss", "RSS (MB)", 1 / 2**20), ("fds", "open descriptors", 1), ("shm_bytes", "shared memory mapped (MB)",
              1 / 2**20), ("shm_named", "named /dev/shm files mapped", 1), ("threads", "threads", 1),
              ("children", "child processes", 1), ("workers", "workers", 1)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.0 * len(panels)), sharex=True)
    colors = {"kill": "tab:red", "term": "tab:orange", "add": "tab:green", "remove": "tab:blue"}
    for ax, (key, label, scale) in zip(axes, panels):
        ax.plot(minutes, [s[key] * scale for s in samples], lw=1.0, color="black")
        ax.set_ylabel(label, fontsize=8)
        for t, event in result["marks"]:
            ax.axvline(t / 60.0, color=colors.get(event, "grey"), lw=0.3, alpha=0.5)
    axes[-1].set_xlabel("minutes")
    events = ", ".join(f"{n} {kind}" for kind, n in result["events"].items())
    fig.suptitle(f"soak: {result['collector']}, {result['frames']} frames, {events} (red kill, orange SIGTERM, "
                 f"green add, blue remove)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collector", choices=COLLECTORS + ("dist-relay",), default="multiasync")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--share", type=int, default=100, help="frames of one worker's rollout")
    parser.add_argument("--update-every", type=int, default=3, help="batches between weight updates")
    parser.add_argument("--event-every", type=float, default=10.0, help="seconds between events")
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--stall-seconds", type=float, default=20.0,
                        help="seconds without a batch after which every thread's stack is printed")
    parser.add_argument("--events", type=lambda text: [e for e in text.split(",") if e], default=list(EVENTS),
                        help="comma-separated events drawn from (kill,term,add,remove); '' for none")
    parser.add_argument("--out", type=Path, default=None, help="prefix of the .csv, .json and .png written")
    parser.add_argument("--slots", type=int, default=2, help="dist-join: the collector's slots (nodes)")
    parser.add_argument("--bind", default="127.0.0.1", help="dist-join: the address the collector listens on")
    parser.add_argument("--port", type=int, default=0, help="dist-join: its port (0: a free one)")
    parser.add_argument("--joins", choices=("process", "stdout"), default="process",
                        help="dist-join: start the nodes here, or ask for them on stdout (dist-relay)")
    parser.add_argument("--remote-hosts", type=int, default=3, help="dist-relay: hosts the nodes join from")
    args = parser.parse_args()
    args.out = (args.out or HERE / "results" / f"soak-{args.collector}-{time.strftime('%Y-%m-%d-%H%M')}").resolve()
    if args.collector == "dist-relay":
        relay(args)
        return
    out = args.out
    result = run(args)
    write(result, out)
    summary = {k: v for k, v in result.items() if k not in ("samples", "marks")}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
