"""The multi-node path against a stranger on the same host (docs/security.md).

Every attack sends traffic to 127.0.0.1 only (or inside the test's own network namespace): there is
no store to rewrite, a stranger squatting the port a node connects to cannot make it run code,
silent, garbage and wrong-key peers on every port change nothing, ``"mp"`` collectors listen on
loopback only, and a node refuses a key file others could read or replace. (The attacks of issue 36
are in test_attacks.py.)
"""

from __future__ import annotations

import json
import logging
import multiprocessing.connection as mpc
import os
import pickle
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
from mocks import CountingPolicy

import netns
from rlharvest.collectors.distributed import DistributedCollector, RPCCollector, node
from rlharvest.collectors.engine import engine_of
from rlharvest.transport.join_keys import read_key_file
from rlharvest.transport.launchers import private_job_folder
from rlharvest.envs import CountingEnv
from rlharvest.transport.channel import AuthenticationFailed, new_authkey, open_channel
from rlharvest.transport.handshake import MAGIC
from rlharvest.transport.ports import free_port_block

pytestmark = pytest.mark.timeout(120)

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(os.path.dirname(HERE))


def listening(pid: int) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("inet") if c.status == "LISTEN"}


def local_addresses(pid: int) -> set[str]:
    """Where ``pid``'s listening and connected sockets are (gloo's ports close once their pair formed); an
    IPv6 socket's IPv4-mapped address (``::ffff:127.0.0.1``) is the IPv4 address it stands for."""
    return {c.laddr.ip.removeprefix("::ffff:") for c in psutil.Process(pid).net_connections("inet")
            if c.status in ("LISTEN", "ESTABLISHED")}


def pids_of(collector) -> list[int]:
    return [os.getpid()] + collector.worker_pids()


def counting_collector(cls=DistributedCollector, policy=None, **kwargs):
    kwargs.setdefault("tcp_port", free_port_block(3))
    return cls([lambda: CountingEnv(max_steps=1000)] * 2, policy or CountingPolicy(1.0), launcher="mp",
               frames_per_batch=20, total_frames=-1, sync=True, **kwargs)


def weight_port(collector) -> int:
    return engine_of(collector).weights.sender_schemes["policy"].sender_transports.listener.port


def test_no_store_no_key_in_a_spec_and_mp_listens_on_loopback_only():
    with counting_collector() as collector:
        collector.next()
        assert engine_of(collector).backend.rendezvous.store is None  # gloo: groups form over the channels
        info = engine_of(collector).weights.sender_schemes["policy"].__getstate__()["_connection_info"]
        assert "authkey" not in info and set(info) >= {"salt", "port"}  # the weight key never travels
        assert engine_of(collector).options.network.authkey.hex() not in repr(engine_of(collector).options.network)
        for pid in pids_of(collector):
            assert local_addresses(pid) == {"127.0.0.1"}, (pid, local_addresses(pid))
        # after start-up the command and weight ports are closed: no stranger can even connect
        ports = {port for _, port in listening(os.getpid())}
        assert int(collector.tcp_port) not in ports and weight_port(collector) not in ports


def test_rpc_mp_listens_on_loopback_only():
    with counting_collector(RPCCollector) as collector:
        collector.next()
        for pid in pids_of(collector):
            assert {ip for ip, _ in listening(pid)} == {"127.0.0.1"}, (pid, listening(pid))


class Boom:
    """Unpickling this creates ``path``: proof that an attacker's bytes were unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_stranger_on_the_nodes_port_cannot_make_a_node_run_code(tmp_path):
    """A node started by hand connects to a stranger squatting the port it was told: it refuses it,
    and nothing the stranger sent is unpickled."""
    key, marker = new_authkey(), tmp_path / "pwned"
    attacker = socket.create_server(("127.0.0.1", 0))
    seen: list = []

    def attack() -> None:
        attacker.settimeout(60)
        sock, _ = attacker.accept()
        conn = mpc.Connection(sock.detach())
        seen.append(conn.recv_bytes())  # the node's first message (nothing keyed), then pickles instead...
        conn.send_bytes(MAGIC + os.urandom(64) + pickle.dumps(Boom(str(marker))))  # ... of the listener's proof
        for _ in range(2):  # ... and of the node's spec
            conn.send_bytes(pickle.dumps(Boom(str(marker))))
        time.sleep(1.0)
        conn.close()

    thread = threading.Thread(target=attack, daemon=True)
    thread.start()
    env = {**os.environ, "RLHARVEST_AUTHKEY": key.hex(), "TORCH_CPP_LOG_LEVEL": "ERROR"}
    node = subprocess.run([sys.executable, "-m", "rlharvest.collectors.distributed.node", "--rank", "1",
                           "--world-size", "2", "--host", "127.0.0.1", "--port", str(attacker.getsockname()[1])],
                          env=env, capture_output=True, text=True, timeout=90)
    thread.join(10)
    attacker.close()
    assert seen, f"the node never reached the attacker:\n{node.stderr[-2000:]}"
    assert node.returncode != 0 and "refused the listener" in node.stderr, node.stderr[-2000:]
    assert not marker.exists()


def _stranger(port: int, mode: str, stop: threading.Event, held: list, results: list) -> None:
    """Connects to ``port`` as soon as it listens, then stays silent, sends garbage or a wrong key."""
    while not stop.is_set():
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=1)
            break
        except OSError:
            time.sleep(0.005)
    else:
        return
    if mode == "garbage":
        sock.sendall(b"\xff" * 16 + os.urandom(64))
    elif mode == "wrong-key":
        sock.close()
        try:
            open_channel("127.0.0.1", port, new_authkey(), 5.0, 5.0, 5.0)
            results.append((port, mode, "accepted"))
        except (AuthenticationFailed, OSError) as err:
            results.append((port, mode, type(err).__name__))
        return
    held.append((port, mode, sock))


def test_strangers_on_every_port_during_startup_and_collection(caplog):
    """Silent, garbage and wrong-key peers on the command and weight ports while the collector
    starts, then garbage on every listening port (gloo) while it collects."""
    caplog.set_level(logging.WARNING, logger="rlharvest")
    port = free_port_block(3)
    stop, held, results = threading.Event(), [], []
    attacks = [(target, mode) for target in (port, port + 2) for mode in ("silent", "garbage", "wrong-key")]
    threads = [threading.Thread(target=_stranger, args=(target, mode, stop, held, results), daemon=True)
               for target, mode in attacks]
    for thread in threads:
        thread.start()
    policy = CountingPolicy(1.0)
    # A long handshake timeout: were handshakes one at a time, a silent peer would stall start-up.
    collector = counting_collector(policy=policy, tcp_port=port, handshake_timeout=30.0)
    try:
        stop.set()
        for thread in threads:
            thread.join(10)
        assert (collector.next()["action"] == 1).all()
        silent = [sock for _, mode, sock in held if mode == "silent"]
        assert len(silent) == 2  # the command and weight ports each had a silent peer: the collector started anyway
        assert sorted(r[2] for r in results) == ["AuthenticationFailed"] * 2, results
        dropped = " ".join(r.getMessage() for r in caplog.records)
        assert "command port" in dropped and "weight port" in dropped, dropped
        # during collection: the command and weight ports are closed...
        for target in (port, weight_port(collector)):
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", target), timeout=1)
        # ... and garbage on every port still listening (gloo pairs) changes nothing
        for pid in pids_of(collector):
            for _, target in listening(pid):
                with socket.create_connection(("127.0.0.1", target), timeout=1) as sock:
                    sock.sendall(b"\xff" * 16)
        for value in (2.0, 3.0):
            with torch.no_grad():
                policy.weight.fill_(value)
            collector.update_policy_weights_()
            assert (collector.next()["action"] == value).all()
    finally:
        collector.shutdown()
        for _, _, sock in held:
            sock.close()


@pytest.mark.netns
def test_local_launchers_stay_on_loopback_in_a_host_with_a_routable_address():
    """In a network namespace whose host name resolves to a routable address (and whose
    GLOO_SOCKET_IFNAME / TP_SOCKET_IFNAME name that interface), gloo and TensorPipe would listen
    there: "mp" collectors must keep every process on 127.0.0.1."""
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.fail(f"network namespaces unavailable: {reason}", pytrace=False)
    path = [TESTS, HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    with netns.TwoHosts() as net:
        host = net.host_a
        out = host.run([sys.executable, os.path.join(HERE, "_node_scripts.py"), "loopback-listeners"], timeout=100,
                       env={"PYTHONPATH": os.pathsep.join(path), "TORCH_CPP_LOG_LEVEL": "ERROR"})
    events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert events, out.stdout + out.stderr[-3000:]
    result = events[-1]
    assert result["hostname_ip"] == host.ip and result["env"]["GLOO_SOCKET_IFNAME"] == host.ifname, result
    for framework in ("distributed", "rpc"):
        assert len(result[framework]) == 3, result  # the main process and two nodes
        for pid, addresses in result[framework].items():
            assert addresses == ["127.0.0.1"], (framework, pid, result)


def test_submitit_job_folder_is_private(tmp_path):
    folder = tmp_path / "log_test"
    private_job_folder(str(folder))
    assert folder.stat().st_mode & 0o777 == 0o700
    folder.chmod(0o755)  # made by an older version, or by hand
    private_job_folder(str(folder))
    assert folder.stat().st_mode & 0o777 == 0o700
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)  # someone else's folder (the tests run as root)
    with pytest.raises(PermissionError, match="belongs to uid 65534"):
        private_job_folder(str(theirs))


def test_a_node_started_by_hand_needs_the_key(monkeypatch, tmp_path):
    monkeypatch.delenv("RLHARVEST_AUTHKEY", raising=False)
    argv = ["--rank", "1", "--world-size", "2", "--host", "127.0.0.1", "--port", str(free_port_block(3))]
    with pytest.raises(ValueError, match="RLHARVEST_AUTHKEY"):
        node.main(argv)
    keyfile = tmp_path / "key"
    keyfile.write_text(new_authkey().hex())
    keyfile.chmod(0o644)
    with pytest.raises(PermissionError, match="readable by other users"):
        node.main(argv + ["--authkey-file", str(keyfile)])
    monkeypatch.setenv("RLHARVEST_AUTHKEY", "not hex")
    with pytest.raises(ValueError, match="RLHARVEST_AUTHKEY must be hex"):
        node.main(argv)


def test_a_key_file_others_could_read_or_replace_is_refused(tmp_path):
    """The key file is checked on the open file itself: a symbolic link, a file of another user, a
    file others may read, or a folder others may write are refused, naming the node's own flag."""
    key = new_authkey().hex()
    good = tmp_path / "key"
    good.write_text(key)
    good.chmod(0o600)
    assert read_key_file(str(good)) == key
    link = tmp_path / "link"
    link.symlink_to(good)
    with pytest.raises(PermissionError, match="--key-file .* is a symbolic link"):
        read_key_file(str(link))
    theirs = tmp_path / "theirs"
    theirs.write_text(key)
    theirs.chmod(0o600)
    os.chown(theirs, 65534, 65534)  # someone else's file, though private (the tests run as root)
    with pytest.raises(PermissionError, match="--key-file .* belongs to uid 65534"):
        read_key_file(str(theirs))
    good.chmod(0o640)
    with pytest.raises(PermissionError, match="--key-file .* readable by other users"):
        read_key_file(str(good))
    with pytest.raises(PermissionError, match="--authkey-file .* readable by other users"):
        node.main(["--rank", "1", "--world-size", "2", "--host", "127.0.0.1", "--port", "1",
                   "--authkey-file", str(good)])
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone may replace a file in it (no sticky bit)
    (shared / "key").write_text(key)
    (shared / "key").chmod(0o600)
    with pytest.raises(PermissionError, match="in a folder other users may write"):
        read_key_file(str(shared / "key"))


def test_a_key_file_in_a_folder_of_another_user_is_refused(tmp_path):
    """Whoever owns a folder on the way to the key may rename its entries, so replace the key (or the
    folder holding it), even when the folder is mode 0755 and the file is the node's own, mode 0600."""
    key = new_authkey().hex()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "key").write_text(key)
    (theirs / "key").chmod(0o600)
    theirs.chmod(0o755)
    os.chown(theirs, 65534, 65534)  # the tests run as root: the folder is now someone else's
    with pytest.raises(PermissionError, match="--key-file .* in a folder of another user .uid 65534"):
        read_key_file(str(theirs / "key"))
    mine = theirs / "mine"  # a folder of the node's user does not help inside theirs
    mine.mkdir(mode=0o700)
    os.chown(mine, os.getuid(), os.getgid())
    (mine / "key").write_text(key)
    (mine / "key").chmod(0o600)
    with pytest.raises(PermissionError, match="in a folder of another user"):
        node.main(["--rank", "1", "--world-size", "2", "--host", "127.0.0.1", "--port", "1",
                   "--key-file", str(mine / "key")])


@pytest.mark.parametrize("ending", ["an exception", "sys.exit(3)"])
def test_the_join_key_file_is_removed_however_the_process_ends(ending):
    """The key file of a collector whose process ends without shutting it down (a crash, an exit)."""
    script = ("import sys\nfrom rlharvest.transport.join_keys import JoinKey\n"
              "key = JoinKey(bytes(32))\nprint(key.path, flush=True)\n"
              + ("raise RuntimeError('crash')\n" if ending == "an exception" else "sys.exit(3)\n"))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    path = out.stdout.strip()
    assert out.returncode != 0 and path.endswith("authkey"), out.stderr
    assert not os.path.exists(os.path.dirname(path))
