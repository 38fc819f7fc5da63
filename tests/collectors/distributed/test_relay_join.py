"""A node on a new host joins a running collection and takes part in the relay between hosts
(docs/weights.md, "A relay between hosts"; docs/elastic.md, ``launcher="external"``).

Hosts (tests/netns.py, ``Hosts``): the main process (``_relay_join_main.py``) in host A, one node in each
of hosts B, C and D, all started with the collector's join command, and later one in host E. Updates 1
and 2 go down the relay chain B, C, D; D's node leaves (SIGTERM) and its slot stays empty; a node on E,
a host the collector never saw, runs the join command and takes that slot; updates 3 to 5 follow. Every
update fills the whole policy weight with one value ``k`` (policy version ``k``); every frame says the
smallest and largest value of the weight that produced it and its policy version. The bytes are host A's
veth counter: what left the learner's host.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

import netns
from mocks import wait_until
from collectors.distributed.test_host_copies import check_updates
from collectors.distributed.test_two_hosts import Lines, ns_pids, wait_exit

pytestmark = pytest.mark.netns

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(HERE, "_relay_join_main.py")
PORT = 29500
PARAMS = 250_000  # 1 MB of weights: the per-update traffic dwarfs commands and heartbeats
UPDATES = 5


def _env() -> dict:
    path = [TESTS, HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    # the key comes from the join command's key file only (docs/elastic.md)
    return {"PYTHONPATH": os.pathsep.join(path), "TORCH_CPP_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1",
            "RLHARVEST_AUTHKEY": ""}


def _join(host, argv: list[str], folder) -> subprocess.Popen:
    """Run the join command in ``host`` (with this interpreter as its ``python``)."""
    with open(folder / f"node-{host.name}.log", "w") as log:
        return host.popen([sys.executable, *argv[1:]], env=_env(), stdout=log, stderr=subprocess.STDOUT)


def _logs(folder) -> str:
    return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}"
                     for path in sorted(folder.iterdir()) if path.suffix in (".log", ".err"))


class _Logs:
    def __init__(self, folder) -> None:
        self.folder = folder

    def __str__(self) -> str:
        return _logs(self.folder)


def _check_joined(joined: dict, weight_bytes: int) -> None:
    """The first batch after the join: every node, the joiner too, runs update 2 whole, with version 2."""
    assert joined["policy_version"] == 2, joined
    assert joined["weight_min"] == joined["weight_max"], f"a node ran a partial update: {joined}"
    rows = len(joined["weight_min"])
    assert joined["weight_min"] == [[2.0] * len(joined["weight_min"][0])] * rows, f"a node does not run update 2: {joined}"
    assert joined["versions"] == [[2] * len(joined["versions"][0])] * rows, f"a node does not run version 2: {joined}"
    # one direct copy of the current weights (the chain carries only updates), its spec (a policy without
    # its weights) and ~1 KB of commands for each batch collected, slowly, while it joined
    assert weight_bytes <= joined["tx_bytes"] <= 1.3 * weight_bytes, (joined["tx_bytes"], weight_bytes)


@pytest.mark.timeout(300)
def test_a_node_on_a_new_host_joins_with_the_current_weights_and_then_relays(require_netns, tmp_path):
    """The node that joins on host E runs update 2 (values and version) in the first batch it is part of,
    before any later update; updates 3 to 5 reach every node whole with exact versions, and each leaves
    host A about once (<= 1.2x the weights: E is on the chain, not sent its own copy)."""
    with netns.Hosts(5) as net:
        a, (b, c, d, e) = net.hosts[0], net.hosts[1:]
        with open(tmp_path / "main.err", "w") as main_err:
            main = a.popen([sys.executable, SCRIPT, "--port", str(PORT), "--host-ip", a.ip, "--ifname", a.ifname,
                            "--params", str(PARAMS), "--updates", str(UPDATES)],
                           env=_env(), stdout=subprocess.PIPE, stderr=main_err, text=True)
        lines = Lines(main)
        lines.logs = _Logs(tmp_path)  # shown on a failure
        join = lines.until("join", timeout=90)
        argv, weight_bytes = join["argv"], join["weight_bytes"]
        nodes = {host.name: _join(host, argv, tmp_path) for host in (b, c, d)}
        lines.until("leave-me", timeout=180)
        nodes[d.name].send_signal(signal.SIGTERM)
        lines.until("join-me", timeout=90)
        assert wait_exit(nodes[d.name], 30, "D's node") == 0, _logs(tmp_path)
        nodes[e.name] = _join(e, argv, tmp_path)
        joined = lines.until("joined", timeout=120)
        stats = lines.until("stats", timeout=120)
        lines.until("shutdown", timeout=60)
        assert wait_exit(main, 60, "the main process") == 0, _logs(tmp_path)
        for name, node in nodes.items():
            assert wait_exit(node, 30, f"the node of {name}") == 0, _logs(tmp_path)
        wait_until(lambda: not any(ns_pids(h) for h in net.hosts), timeout=10,
                   what=lambda: f"the exit of {[ns_pids(h) for h in net.hosts]} (every host)")
    events = lines.events
    # the figures, for docs/performance.md (pytest -s shows them)
    print(json.dumps({"weight_bytes": weight_bytes, "join_tx_bytes": joined["tx_bytes"],
                      "join_batches": joined["batches"], "join_seconds": round(joined["seconds"], 1),
                      "update_tx_bytes": [e["tx_bytes"] for e in events if e["event"] == "update"],
                      "update_seconds": [round(e["seconds"], 3) for e in events if e["event"] == "update"]}))
    assert (stats["restarts"], stats["preemptions"]) == (0, 1), stats
    assert joined["active"] == [0, 1, 2] and len(joined["empty"]) == 1, joined
    _check_joined(joined, weight_bytes)
    updates = check_updates(events, nodes=3)
    assert [u["k"] for u in updates] == list(range(1, UPDATES + 1)), updates
    for update in updates:  # the chain B, C, D, then B, C, E (in some order): one copy out of host A
        assert weight_bytes <= update["tx_bytes"] <= 1.2 * weight_bytes, (update["k"], update["tx_bytes"])
