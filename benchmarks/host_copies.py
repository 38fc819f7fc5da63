"""Bytes out of the learner's host per weight update, and update latency, with nodes on other hosts
simulated by network namespaces (tests/netns.py; needs root and iproute2).

    sudo .venv/bin/python benchmarks/host_copies.py [--code PATH ...] [--layouts 2 2x2 1 2x1 4x1] [--params 1000000]
        [--modes direct relay] [--rate 1gbit [--shape learner|all]] [--output benchmarks/results/host-copies-DATE.json]

For each rlharvest tree given with ``--code`` (default: this one; give an older checkout to measure
"before") and each layout (``2``: 2 nodes on one remote host; ``HxN``: H remote hosts (up to 7) of N
nodes, behind a switch, e.g. ``4x1`` for the relay between hosts; ``--rate 1gbit`` limits the learner's
uplink to a network's speed, ``--shape all`` every host's uplink, as on a real network where the relay's
hops cross links too) and each mode (``direct``: ``DistributedWeightSyncScheme(relay=False)``, one copy
per remote host; ``relay``: ``relay=True``), alternating the trees so that they share the load, it runs ``tests/collectors/distributed/_node_scripts.py host-copies-main`` in the
learner's namespace: a ``DistributedCollector`` with ``"mp"`` nodes moved into the remote hosts, a
policy of ``--params`` float32 weights, ``--updates`` synchronous updates (each followed by two
batches). Per update: the bytes the learner's veth sent while ``update_policy_weights_()`` ran (its
``tx_bytes`` counter: load does not change it) and the seconds it took (load does: the machine's load
average is printed beside them). Nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import netns  # noqa: E402

SCRIPT = ROOT / "tests" / "collectors" / "distributed" / "_node_scripts.py"
PORT = 29500


def run(code: Path, layout: str, params: int, updates: int, rate: str | None = None, heartbeat: float = 3.0,
        relay: bool = False, shape: str = "learner") -> dict:
    hosts, per_host = (int(part) for part in layout.split("x")) if "x" in layout else (1, int(layout))
    with netns.Hosts(hosts + 1) as net:
        learner, remotes = net.hosts[0], net.hosts[1:]
        if rate is not None:  # uplinks at a network's speed (a veth alone moves memory)
            for host in (net.hosts if shape == "all" else [learner]):
                host.run(["tc", "qdisc", "add", "dev", host.ifname, "root", "tbf", "rate", rate, "burst", "1mb",
                          "latency", "200ms"], timeout=10, check=True)
        placement = []
        for index in range(hosts * per_host):
            host = remotes[index // per_host]
            placement.append(f"{index + 1}=/var/run/netns/{host.ns}@{host.ifname}")
        path = [str(code), str(ROOT / "tests"), str(SCRIPT.parent)]
        env = {"PYTHONPATH": os.pathsep.join(path), "TORCH_CPP_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1",
               "RLH_TEST_NODE_HOSTS": ",".join(placement)}
        load = os.getloadavg()[0]
        result = learner.run([sys.executable, str(SCRIPT), "host-copies-main", "--port", str(PORT), "--host-ip",
                              learner.ip, "--ifname", learner.ifname, "--nodes", str(hosts * per_host),
                              "--params", str(params), "--updates", str(updates),
                              "--heartbeat-timeout", str(heartbeat), *(["--relay"] if relay else [])],
                             timeout=600, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{code} {layout}: the main script failed\n{result.stdout}\n{result.stderr[-3000:]}")
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    steady = [e for e in events if e["event"] == "update"][1:]  # the first update also allocates buffers
    weight_bytes = events[0]["weight_bytes"]
    return {"code": str(code), "layout": layout, "rate": rate, "shape": shape if rate else None,
            "mode": "relay" if relay else "direct", "weight_bytes": weight_bytes,
            "bytes_per_update": statistics.median(e["tx_bytes"] for e in steady),
            "copies": statistics.median(e["tx_bytes"] for e in steady) / weight_bytes,
            "seconds_median": statistics.median(e["seconds"] for e in steady),
            "seconds_min": min(e["seconds"] for e in steady), "seconds_max": max(e["seconds"] for e in steady),
            "load_before": load, "load_after": os.getloadavg()[0], "updates": len(steady)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code", type=Path, nargs="+", default=[ROOT], help="rlharvest trees to measure")
    parser.add_argument("--layouts", nargs="+", default=["2", "2x2"], help="N (one remote host) or HxN")
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--updates", type=int, default=11)
    parser.add_argument("--output", type=Path, help="write every row as JSON there too")
    parser.add_argument("--heartbeat-timeout", type=float, default=3.0,
                        help="of the nodes; the relay's silence bound is a third of it")
    parser.add_argument("--relay", action="store_true", help="the same as --modes relay")
    parser.add_argument("--modes", nargs="+", choices=["direct", "relay"], default=None,
                        help="DistributedWeightSyncScheme(relay=False) and/or relay=True (trees that have it); "
                             "default: direct")
    parser.add_argument("--rate", help="limit uplinks (tc tbf), e.g. 1gbit; default: none")
    parser.add_argument("--shape", choices=["learner", "all"], default="learner",
                        help="with --rate: the learner's uplink only, or every host's")
    args = parser.parse_args()
    netns.require()
    modes = args.modes or (["relay"] if args.relay else ["direct"])
    print("| code | mode | remote nodes | weights (MB) | MB out of the learner per update | copies | update s, median (min-max) | load 1 min |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for layout in args.layouts:
        hosts = int(layout.split("x")[0]) if "x" in layout else 1
        for mode in modes if hosts >= 2 else ["direct"]:  # the relay needs 2 remote hosts: it is direct below
            for code in args.code:
                row = run(code.resolve(), layout, args.params, args.updates, args.rate, args.heartbeat_timeout,
                          mode == "relay", args.shape)
                rows.append(row)
                if args.output is not None:
                    args.output.write_text(json.dumps({"params": args.params, "rows": rows}, indent=1) + "\n")
                print(f"| {row['code']} | {mode} | {layout} | {row['weight_bytes'] / 1e6:.1f} "
                      f"| {row['bytes_per_update'] / 1e6:.2f} | {row['copies']:.2f} | {row['seconds_median']:.4f} "
                      f"({row['seconds_min']:.4f}-{row['seconds_max']:.4f}) | {row['load_before']:.1f} -> "
                      f"{row['load_after']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
