"""One copy of each weight update per remote host (docs/weights.md, "One copy per host"), in network
namespaces (tests/netns.py, ``Hosts``: host A and one to three others behind a switch); with two or more
remote hosts, the relay between hosts (docs/weights.md, "A relay between hosts").

The main process (``_node_scripts.py host-copies-main``) runs in host A with ``"mp"`` nodes, which
``node_in_hosts`` moves into the other hosts when first launched (their replacements start in host A). Every
update fills the whole policy weight with one value ``k`` (update ``k`` is policy version ``k``), and
every frame says the smallest and largest value of the weight that produced it: a node running a
partial update would show two different values. The bytes are host A's veth counter: what left the
learner's host during the update.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import netns
from mocks import wait_until

pytestmark = pytest.mark.netns

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(HERE, "_node_scripts.py")
PORT = 29500
PARAMS = 250_000  # 1 MB of weights: the per-update traffic dwarfs commands and heartbeats




def _segments() -> set[str]:
    """The slots carriers create (``create_named(f"rlh-w{idx}")``)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith("rlh-w")}


def _ns_pids(host) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", host.ns], capture_output=True, text=True, timeout=10).stdout
    return [int(p) for p in out.split()]


def run_main(nodes: int, kill: str, hosts: int = 1, updates: int = 5, *extra: str, orphans: str | None = None
             ) -> list[dict]:
    """Run the main script in host A with ``nodes`` nodes on each of ``hosts`` other hosts; its events,
    and checks nothing is left behind but the slots named ``orphans*`` (removed here): those of a
    carrier killed with every node of its host, which stay until the host reboots (docs/weights.md)."""
    before = _segments()
    with netns.Hosts(hosts + 1) as net:
        a, remotes = net.hosts[0], net.hosts[1:]
        path = [TESTS, HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        placement = [f"{i + 1}=/var/run/netns/{remotes[i // nodes].ns}@{remotes[i // nodes].ifname}"
                     for i in range(hosts * nodes)]
        env = {"PYTHONPATH": os.pathsep.join(path), "TORCH_CPP_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1",
               "RLH_TEST_NODE_HOSTS": ",".join(placement)}
        result = a.run([sys.executable, SCRIPT, "host-copies-main", "--port", str(PORT), "--host-ip", a.ip,
                        "--ifname", a.ifname, "--nodes", str(hosts * nodes), "--kill", kill, "--params", str(PARAMS),
                        "--updates", str(updates), *extra], timeout=150, env=env)
        events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
        assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-4000:]}"
        wait_until(lambda: not any(_ns_pids(h) for h in net.hosts), timeout=10,
                   what=lambda: f"the exit of {[_ns_pids(h) for h in net.hosts]} (every host)")
    for name in _segments() - before:
        if orphans is not None and name.startswith(orphans):
            os.unlink(f"/dev/shm/{name}")
    assert _segments() <= before, f"slots left in /dev/shm: {_segments() - before}"
    return events


def check_updates(events: list[dict], nodes: int) -> list[dict]:
    """Every update whole and exact: each frame ran one value, equal to its policy version; the batch
    collected after ``update_policy_weights_`` returned ran update ``k`` on every node."""
    updates = [e for e in events if e["event"] == "update"]
    assert [e["k"] for e in updates] == list(range(1, len(updates) + 1)), events
    for event in updates:
        k = event["k"]
        assert event["policy_version"] == k, event
        for lows, highs, versions in zip(event["weight_min"], event["weight_max"], event["versions"]):
            assert lows == highs, f"a node ran a partial update: {event}"
            assert [[float(v) for v in row] for row in versions] == lows, f"weights and version differ: {event}"
        first, second = event["weight_min"]
        assert all(set(row) <= {k - 1.0, float(k)} for row in first), event
        assert second == [[float(k)] * len(second[0])] * nodes, f"a node does not run update {k}: {event}"
    return updates


@pytest.mark.timeout(180)
@pytest.mark.parametrize("hosts, relay", [(1, False), (2, False), (2, True)])
def test_nodes_of_one_host_share_one_copy(require_netns, hosts, relay):
    """2 nodes on each of 1 or 2 other hosts: each update leaves host A once per host (<= 1.2x the
    weights per host, not once per node); with the relay between hosts, once whatever the hosts."""
    events = run_main(2, "none", hosts, 5, *(["--relay"] if relay else []))
    copies = 1 if relay else hosts
    weight_bytes = events[0]["weight_bytes"]
    for update in check_updates(events, nodes=2 * hosts):
        assert update["tx_bytes"] <= 1.2 * copies * weight_bytes, (update["tx_bytes"], weight_bytes)
        assert update["tx_bytes"] >= copies * weight_bytes  # it did cross the link, once per copy
    assert events[-2]["event"] == "stats" and events[-2]["restarts"] == 0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kill", ["during", "between"])
def test_carrier_killed(require_netns, kill):
    """3 nodes in host B; node 0, the carrier, is killed while the main process waits for it to take
    update 3 (stopped first, so it never took it) or between updates 2 and 3. Nodes 1 and 2 still run
    update 3 (a new carrier took it) and every later one, sharing one copy; node 0 is replaced in host
    A with the current weights; no node ever ran a partial update."""
    events = run_main(nodes=3, kill=kill)
    updates = check_updates(events, nodes=3)
    weight_bytes = events[0]["weight_bytes"]
    assert [e["restarts"] for e in updates] == [0, 0, 1, 1, 1], updates
    for update in updates:  # the replacement in host A maps the sender's own generations: no bytes
        # killed during update 3: what the stopped carrier's socket took of its copy, then the new carrier's
        bound = 2.2 if kill == "during" and update["k"] == 3 else 1.2
        assert update["tx_bytes"] <= bound * weight_bytes, (update["k"], update["tx_bytes"], weight_bytes)
    started, stats = events[0], events[-2]
    assert stats["pids"][0] != started["pids"][0] and stats["pids"][1:] == started["pids"][1:], (started, stats)


@pytest.mark.timeout(180)
def test_updates_that_do_not_wait_for_acknowledgements(require_netns):
    """``DistributedWeightSyncScheme(sync=False)``: ``send`` returns before the acknowledgements (it
    still waits until the host's carrier holds the update); every node still ends up running each
    update whole, the bytes stay one copy per host, and the next update waits for the previous
    one's acknowledgements before it writes a slot."""
    events = run_main(2, "none", 1, 5, "--no-wait")
    weight_bytes = events[0]["weight_bytes"]
    updates = [e for e in events if e["event"] == "update"]
    assert [e["k"] for e in updates] == [1, 2, 3, 4, 5]
    seen = {0: 0.0, 1: 0.0}
    for event in updates:
        assert event["tx_bytes"] <= 1.2 * weight_bytes, (event["tx_bytes"], weight_bytes)
        for lows, highs, versions in zip(event["weight_min"], event["weight_max"], event["versions"]):
            assert lows == highs, f"a node ran a partial update: {event}"
            assert [[float(v) for v in row] for row in versions] == lows, f"weights and version differ: {event}"
            for node, row in enumerate(lows):
                assert all(event["k"] - 1.0 <= value <= event["k"] for value in row), event
                assert min(row) >= seen[node], f"node {node} went back to older weights: {event}"
                seen[node] = max(row)
    settled = next(e for e in events if e["event"] == "settled")
    assert settled["weight_min"] == settled["weight_max"] == [[5.0, 5.0], [5.0, 5.0]], settled


# ---------------------------------------------------------------- a relay between hosts (docs/weights.md)
HOSTS = 3  # remote hosts of one node each: the first takes an update from host A, the others from the one before
# the relay on; relay_silence is a third of the heartbeat timeout: 3 s, so that a loaded machine's pauses do not look like stalls
RELAY_ARGS = ("--relay", "--heartbeat-timeout", "9")


@pytest.mark.timeout(180)
def test_relay_sends_one_copy_whatever_the_hosts(require_netns):
    """3 remote hosts of one node: each update leaves host A once (<= 1.2x the weights), not once per
    host, and every node runs every update whole."""
    events = run_main(1, "none", HOSTS, 5, *RELAY_ARGS)
    weight_bytes = events[0]["weight_bytes"]
    for update in check_updates(events, nodes=HOSTS):
        assert weight_bytes <= update["tx_bytes"] <= 1.2 * weight_bytes, (update["k"], update["tx_bytes"])
    assert events[-2]["event"] == "stats" and events[-2]["restarts"] == 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("node", [0, 1])
def test_relay_carrier_stopped_then_killed_during_an_update(require_netns, node):
    """The first (0) or middle (1) host's carrier is stopped before update 3 and killed a second later:
    the hosts after it notice the silence of their upstream, take update 3 from the main process
    instead, and run it whole; the dead node is replaced beside the main process (shared memory) and
    later updates go down the chain of the remaining hosts again."""
    events = run_main(1, "during", HOSTS, 5, "--kill-node", str(node), *RELAY_ARGS, orphans=f"rlh-w{node}-")
    updates = check_updates(events, nodes=HOSTS)
    weight_bytes = events[0]["weight_bytes"]
    assert [e["restarts"] for e in updates] == [0, 0, 1, 1, 1], updates
    for update in updates:  # update 3: what the stopped carrier's socket took, then a copy per host after it
        bound = 3.2 if update["k"] == 3 else 1.2
        assert update["tx_bytes"] <= bound * weight_bytes, (update["k"], update["tx_bytes"], weight_bytes)
    started, stats = events[0], events[-2]
    assert stats["pids"][node] != started["pids"][node], (started, stats)


@pytest.mark.timeout(240)
def test_replacement_on_a_remote_host_gets_the_current_weights(require_netns, monkeypatch):
    """Node 1 (the middle host) is killed between updates 2 and 3, and its replacement starts on the
    same host: it receives the current weights directly from the main process when it joins, then
    takes part in the chain again (every update after it leaves host A once)."""
    monkeypatch.setenv("RLH_TEST_REPLACE_IN_HOSTS", "1")
    events = run_main(1, "between", HOSTS, 5, "--kill-node", "1", *RELAY_ARGS)
    updates = check_updates(events, nodes=HOSTS)
    weight_bytes = events[0]["weight_bytes"]
    assert [e["restarts"] for e in updates] == [0, 0, 1, 1, 1], updates
    for update in updates:
        assert update["tx_bytes"] <= 1.2 * weight_bytes, (update["k"], update["tx_bytes"], weight_bytes)
