"""DistributedCollector across two "hosts" (network namespaces joined by a veth pair, tests/netns.py).

The main process (``_node_scripts.py two-hosts-main``) runs in host A with
``launcher="submitit_delayed"``; one node is started by hand in host B with
``python -m rlharvest.collectors.distributed.node --host <A's address>``. Neither namespace has a
route to anything but its own loopback and the peer, so every byte between main and node crosses
the veth pair. The main script prints one JSON object per line (batches, weight update, errors).

The link-cut restart test runs ``"mp"`` nodes instead (``two-hosts-restart-main``): node 1 is moved
into host B when first launched, so a hand-started node (which no launcher can replace) is not needed.
"""

from __future__ import annotations

import json
import os
import queue
import re
import secrets
import signal
import subprocess
import sys
import threading
import time

import pytest

import netns
from mocks import wait_until

pytestmark = pytest.mark.netns

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(HERE, "_node_scripts.py")
PORT = 29500  # the namespaces are fresh and private: any port is free there
HEARTBEAT_TIMEOUT = 3.0
AUTHKEY = secrets.token_hex(32)  # the collector's key, given to both hosts (docs/security.md)




def _env() -> dict:
    path = [TESTS, HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join(path), "TORCH_CPP_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1",
            "RLHARVEST_AUTHKEY": AUTHKEY}


class Lines:
    """The main script's stdout, one parsed JSON event at a time (read by a thread, so waits are bounded)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.events: list[dict] = []
        self.raw: list[str] = []
        self.logs: object = ""  # the processes' stderr, shown on failures
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.raw.append(line)
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            event["received"] = time.monotonic()
            self._queue.put(event)
        self._queue.put(None)

    def next(self, timeout: float) -> dict | None:
        """The next event, or None at end of output; fails after ``timeout`` s without one."""
        try:
            event = self._queue.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"no output from the main script for {timeout:g} s; so far:\n{''.join(self.raw)}\n{self.logs}")
        if event is not None:
            self.events.append(event)
        return event

    def until(self, name: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            event = self.next(max(0.1, deadline - time.monotonic()))
            if event is None:
                pytest.fail(f"the main script ended before {name!r}; output:\n{''.join(self.raw)}\n{self.logs}")
            if event["event"] == name:
                return event
            if time.monotonic() > deadline:
                pytest.fail(f"no {name!r} within {timeout:g} s; output:\n{''.join(self.raw)}\n{self.logs}")


class Logs:
    """stderr of the main process and of the node, in files (pipes nobody reads could fill up)."""

    def __init__(self, folder) -> None:
        self.main, self.node = folder / "main.err", folder / "node.log"

    def __str__(self) -> str:
        return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}"
                         for path in (self.main, self.node) if path.exists())


def start(net, mode: str, folder):
    a, b = net.host_a, net.host_b
    logs = Logs(folder)
    with open(logs.main, "w") as main_err, open(logs.node, "w") as node_log:
        main = a.popen([sys.executable, SCRIPT, "two-hosts-main", "--port", str(PORT), "--mode", mode,
                        "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT)],
                       env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=main_err, text=True)
        node = b.popen([sys.executable, "-m", "rlharvest.collectors.distributed.node", "--rank", "1",
                        "--world-size", "2", "--host", a.ip, "--port", str(PORT)],
                       env=_env(), stdout=node_log, stderr=subprocess.STDOUT)
    lines = Lines(main)
    lines.logs = logs
    return main, node, lines, str(logs)


def node_connections(host, pid: int) -> list[tuple[str, str, int]]:
    """(local ip, peer ip, peer port) of the established TCP connections of ``pid`` in ``host``."""
    out = host.run(["ss", "-Htnp", "state", "established"], timeout=10, check=True).stdout
    conns = []
    for line in out.splitlines():
        if f"pid={pid}," not in line:
            continue
        fields = line.split()
        local, peer = fields[2], fields[3]

        def split(addr: str) -> tuple[str, int]:
            host_part, _, port = addr.rpartition(":")
            host_part = host_part.strip("[]")
            return re.sub(r"^::ffff:", "", host_part), int(port)

        conns.append((split(local)[0], *split(peer)))
    return conns


def ns_pids(host) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", host.ns], capture_output=True, text=True, timeout=10).stdout
    return [int(p) for p in out.split()]


def wait_exit(proc: subprocess.Popen, timeout: float, what: str) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} (pid {proc.pid}) still running {timeout:g} s later")


def check_batches(lines: Lines, count: int) -> list[dict]:
    """The first ``count`` batch events: shapes, ids and the weight update seen from the main process."""
    batches = []
    while len(batches) < count:
        event = lines.next(timeout=60)
        assert event is not None, "".join(lines.raw)
        if event["event"] == "batch":
            batches.append(event)
    for batch in batches:
        assert batch["shape"] == [20] and batch["names"] == ["time"]
        assert batch["traj_ids"] and min(batch["traj_ids"]) >= 0
    assert batches[0]["actions"] == [1.0] and batches[1]["actions"] == [1.0]
    assert any(e["event"] == "updated" for e in lines.events)
    # async, one node: the rollout in flight during the update may be stale or mixed; the next is new
    assert set(batches[2]["actions"]) <= {1.0, 2.0}
    assert all(b["actions"] == [2.0] for b in batches[3:])
    # trajectory ids only grow (one node: local id k -> k)
    assert all(min(b["traj_ids"]) >= min(p["traj_ids"]) for p, b in zip(batches, batches[1:]))
    return batches


@pytest.mark.timeout(120)
def test_two_hosts_happy_path(require_netns, tmp_path):
    with netns.TwoHosts() as net:
        a, b = net.host_a, net.host_b
        main, node, lines, logs = start(net, "happy", tmp_path)
        starting = lines.until("starting", timeout=60)
        assert starting["hostname_ip"] == a.ip  # the hostname resolves to A's veth address inside A
        started = lines.until("started", timeout=60)
        assert started["advertised"] == a.ip
        check_batches(lines, 6)
        lines.until("holding", timeout=30)
        # the node talks to A's veth address only, from B's: commands (P), weights (P+2), gloo
        conns = node_connections(b, node.pid)
        assert conns, "the node has no established connection"
        assert {(local, peer) for local, peer, _ in conns} == {(b.ip, a.ip)}, conns
        assert {PORT, PORT + 2} <= {port for _, _, port in conns}, conns
        main.stdin.write("go\n")
        main.stdin.flush()
        lines.until("shutdown", timeout=30)
        assert wait_exit(main, 30, "the main process") == 0, str(logs)
        # a clean exit, not SIGABRT: see test_node_weight_reader_thread_stops_when_closed below
        assert wait_exit(node, 30, "the node") == 0, str(logs)
        assert ns_pids(a) == [] and ns_pids(b) == []


@pytest.mark.timeout(120)
def test_two_hosts_vanished_node_is_detected(require_netns, tmp_path):
    with netns.TwoHosts() as net:
        a, b = net.host_a, net.host_b
        main, node, lines, logs = start(net, "cut", tmp_path)
        check_batches(lines, 4)
        lines.until("cut-me", timeout=30)
        net.cut()
        cut_at = time.monotonic()
        error = lines.until("worker-error", timeout=HEARTBEAT_TIMEOUT + 30)
        detected = error["received"] - cut_at
        assert error["worker_idx"] == 0 and error["type"].startswith("Worker"), error
        assert "worker 0" in error["message"], error
        assert detected < HEARTBEAT_TIMEOUT + 4, f"the vanished node was detected after {detected:.1f} s: {error}"
        shutdown = lines.until("shutdown", timeout=15)
        assert shutdown["seconds"] < 5, shutdown
        assert wait_exit(main, 15, "the main process") == 3, str(logs)
        exited = time.monotonic() - cut_at
        assert exited < HEARTBEAT_TIMEOUT + 10, f"the main process exited {exited:.1f} s after the cut"
        net.restore()
        # the main process is gone: once B can reach A again, its connections are refused and it leaves
        wait_exit(node, 30, "the node whose main process vanished")
        assert ns_pids(a) == [] and ns_pids(b) == []


@pytest.mark.timeout(300)
def test_a_node_on_host_b_joins_with_the_join_command_and_leaves_on_sigterm(require_netns, tmp_path):
    """launcher="external" (docs/elastic.md): the main process on A prints its join command; one node
    runs it on A, one on B (the key file is on the shared file system, mode 0600); B's node talks to
    A's address only, and on SIGTERM it leaves: not a restart, the collection goes on with A's."""
    with netns.TwoHosts() as net:
        a, b = net.host_a, net.host_b
        env = {**_env(), "RLHARVEST_AUTHKEY": ""}  # the key comes from the key file only
        with open(tmp_path / "main.err", "w") as main_err:
            main = a.popen([sys.executable, SCRIPT, "join-main", "--port", str(PORT), "--host-ip", a.ip], env=env,
                           stdout=subprocess.PIPE, stderr=main_err, text=True)
        lines = Lines(main)
        argv = lines.until("join", timeout=90)["argv"]
        assert argv[1:6] == ["-m", "rlharvest", "node", "--join", f"{a.ip}:{PORT}"], argv
        nodes = []
        for host in (a, b):
            with open(tmp_path / f"node-{host.ns}.log", "w") as log:
                nodes.append(host.popen([sys.executable, *argv[1:]], env=env, stdout=log, stderr=subprocess.STDOUT))
        lines.until("sigterm-me", timeout=180)
        conns = node_connections(b, nodes[1].pid)
        assert {(local, peer) for local, peer, _ in conns} == {(b.ip, a.ip)}, conns
        assert {PORT, PORT + 2} <= {port for _, _, port in conns}, conns
        nodes[1].send_signal(signal.SIGTERM)
        left = lines.until("left", timeout=90)
        assert (left["preemptions"], left["restarts"], left["workers"]) == (1, 0, 1), left
        lines.until("shutdown", timeout=60)
        assert wait_exit(main, 60, "the main process") == 0
        assert wait_exit(nodes[1], 30, "B's node") == 0 and wait_exit(nodes[0], 30, "A's node") == 0
        assert ns_pids(a) == [] and ns_pids(b) == []


@pytest.mark.timeout(30)
def test_node_weight_reader_thread_stops_when_closed():
    """DistWeightReceiver.close() must stop its reader thread (no namespaces needed: loopback).

    Why it matters: a reader blocked in recv() is not woken by closing the fd; it stayed until the
    main process closed its end. If that landed while the node's interpreter was finalizing, the
    thread's exit released the receiver's weight buffers inside a daemon thread being torn down, and
    the node died with SIGABRT after a clean shutdown (~5% of the happy-path runs).
    """
    import secrets

    from rlharvest.transport.ports import free_port_block
    from rlharvest.transport.channel import accept_channel, listen
    from rlharvest.transport.torchdist_relay import weight_key
    from rlharvest.transport.torchdist_weights import DistWeightReceiver, NodeGroupLinks
    from rlharvest.transport.wire import decode_hello

    server = listen("127.0.0.1", free_port_block(1))
    slot, salt = secrets.token_bytes(32), secrets.token_bytes(16)
    sender: dict = {}

    def serve() -> None:  # the main process's side of the weight channel, reduced to its handshake
        conn = accept_channel(server, lambda key_id: weight_key(slot, salt) if key_id == 1 else None, 10.0, 10.0)
        sender["hello"] = decode_hello(conn.recv_bytes())
        conn.send(("init", None, None))
        sender["conn"] = conn

    thread = threading.Thread(target=serve)
    thread.start()
    receiver = DistWeightReceiver({"host": "127.0.0.1", "port": server.getsockname()[1], "salt": salt.hex()},
                                  worker_idx=0, links=NodeGroupLinks(None, key=slot, rank=1))
    try:
        assert receiver.connect(10.0) is None
        thread.join(10)
        reader = receiver._thread
        time.sleep(0.3)  # the reader is now blocked waiting for an update
        assert reader.is_alive()
        receiver.close()
        reader.join(3.0)
        assert not reader.is_alive(), ("DistWeightReceiver.close() left its reader thread running (blocked in recv() "
                                       "until the main process closes its end)")
    finally:
        if "conn" in sender:
            sender["conn"].close()
        server.close()
        thread.join(5)
        receiver._thread.join(5)


def _link(host, state: str) -> None:
    """``ip link set <veth> up|down`` inside ``host``'s namespace (a host losing its link)."""
    subprocess.run(["ip", "-n", host.ns, "link", "set", "dev", host.ifname, state], check=True, timeout=10,
                   capture_output=True)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f"{pid}: " + f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return f"{pid}: gone"


def _as_batch(event: dict):
    import torch
    from tensordict import TensorDict

    return TensorDict({"observation": torch.tensor(event["observation"]).unsqueeze(-1),
                       ("collector", "traj_ids"): torch.tensor(event["traj_ids"])}, batch_size=event["shape"])


@pytest.mark.timeout(150)
def test_two_hosts_link_cut_node_is_replaced_on_the_main_host(require_netns, tmp_path):
    """Node 1 runs in host B (an ``"mp"`` node moved into B's namespace); B's link goes down mid-run:
    no heartbeat reaches A, node 1 is declared lost (kind "heartbeat"; "died" when the node, missing the
    main process's heartbeats too, exits first) and replaced by a new node on
    host A, which starts with the current weights; the link comes back; collection goes on."""
    from mocks import check_counting_batches

    with netns.TwoHosts() as net:
        a, b = net.host_a, net.host_b
        env = {**_env(), "RLH_TEST_NODE_NETNS": f"/var/run/netns/{b.ns}", "RLH_TEST_NODE_IFNAME": b.ifname}
        with open(tmp_path / "main.err", "w") as main_err:
            main = a.popen([sys.executable, SCRIPT, "two-hosts-restart-main", "--port", str(PORT), "--host-ip", a.ip,
                            "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT)],
                           env=env, stdout=subprocess.PIPE, stderr=main_err, text=True)
        lines = Lines(main)
        lines.logs = Logs(tmp_path)
        started = lines.until("started", timeout=60)
        lines.until("cut-me", timeout=60)
        assert any(pid in ns_pids(b) for pid in started["pids"]), "node 1 does not run in host B"
        _link(b, "down")
        try:
            restarting = lines.until("restarting", timeout=HEARTBEAT_TIMEOUT + 30)
        finally:
            _link(b, "up")
            net.restore()  # the peers' addresses again (a link going down flushed them)
        # lost by heartbeat, or (on a loaded host, the node noticing the silence first) by its exit
        assert "heartbeat" in restarting["message"] or "exited with code 0" in restarting["message"], restarting
        stats = lines.until("stats", timeout=90)
        lines.until("shutdown", timeout=30)
        assert wait_exit(main, 30, "the main process") == 0, str(lines.logs)
        # no node left, in either host (the main process's forkserver leaves once the main process has)
        wait_until(lambda: not ns_pids(a) and not ns_pids(b), timeout=10,
                   what=lambda: f"the exit of {[_cmdline(pid) for pid in ns_pids(a) + ns_pids(b)]} (both hosts)")
    assert stats["restarts"] == 1 and [c[:2] for c in stats["causes"]] in ([[1, "heartbeat"]], [[1, "died"]]), stats
    assert stats["pids"][0] == started["pids"][0] and stats["pids"][1] != started["pids"][1]
    batches = [e for e in lines.events if e["event"] == "batch"]
    restarted_at = next(e["i"] for e in batches if e["restarts"])
    # every batch whole, no frame twice, observations stepping by 1 in each trajectory, ids unique per node
    check_counting_batches([_as_batch(e) for e in batches], 8, 8 * len(batches))
    assert all(e["shape"] == [2, 4] for e in batches)
    assert all(set(row) == {5.0} for e in batches[3:] for row in e["weight"])  # updated after batch 1
    assert all(e["weight"][1] == [5.0] * 4 for e in batches[restarted_at:])  # the replacement's: current
    old_ids = {i for e in batches[:restarted_at] for i in e["traj_ids"][1]}
    assert not old_ids & {i for e in batches[restarted_at:] for i in e["traj_ids"][1]}
