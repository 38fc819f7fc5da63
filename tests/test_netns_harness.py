"""Tests for tests/netns.py: two namespaced "hosts", partitions, gloo, cleanup.

Needs root + iproute2. If that is missing the tests *fail* with the reason
from ``netns.unavailable_reason()``; set ``RLH_NETNS_ALLOW_SKIP=1`` to turn
that into a skip on machines where it is expected (e.g. unprivileged CI).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

try:  # works whether or not tests/ becomes a package
    from . import netns  # type: ignore
    from .mocks import wait_until  # type: ignore
except ImportError:
    import netns  # type: ignore
    from mocks import wait_until  # type: ignore




def _ours():
    prefix = f"{netns.NS_PREFIX}{os.getpid()}-"
    return [n for n in netns.list_netns() if n.startswith(prefix)]


@pytest.fixture
def net():
    netns.require_in_test()
    with netns.TwoHosts() as n:
        yield n
    assert not _ours(), f"namespaces left behind: {_ours()}"


def _write(tmp_path, name, code):
    p = tmp_path / name
    p.write_text(textwrap.dedent(code))
    return str(p)


ECHO_SERVER = """
    import socket, sys, threading
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((sys.argv[1], 0))
    srv.listen(16)
    print(srv.getsockname()[1], flush=True)      # tell the parent the port

    def handle(c):
        with c:
            try:
                while True:
                    data = c.recv(4096)
                    if not data:
                        return
                    c.sendall(data)
            except OSError:
                pass

    while True:
        conn, _ = srv.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()
"""


def _start_echo_server(host, tmp_path):
    script = _write(tmp_path, "echo_server.py", ECHO_SERVER)
    proc = host.popen([sys.executable, script, host.ip], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    return proc, port


# --------------------------------------------------------------------------
# (1) basic connectivity
# --------------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_tcp_echo_across_hosts(net, tmp_path):
    a, b = net.host_a, net.host_b
    assert a.ip != b.ip and a.ip.startswith("192.0.2.") and b.ip.startswith("192.0.2.")
    assert a.ns != b.ns and len(a.ifname) <= 15 and len(b.ifname) <= 15

    _, port = _start_echo_server(a, tmp_path)
    client = _write(tmp_path, "client.py", """
        import socket, sys, json
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
        c.sendall(b"hello from b")
        got = b""
        while len(got) < 12:
            got += c.recv(100)
        print(json.dumps({"echo": got.decode(), "local": c.getsockname()[0]}))
    """)
    res = b.run([sys.executable, client, a.ip, str(port)], timeout=15, check=True)
    out = json.loads(res.stdout)
    assert out == {"echo": "hello from b", "local": b.ip}

    # The namespaces really are separate: host_a's address is not local to host_b,
    # and the shared hostname resolves to each host's own IP (hosts_file=True).
    probe = "import socket; print(socket.gethostbyname(socket.gethostname()), socket.gethostbyname('host-a'))"
    assert a.run([sys.executable, "-c", probe], timeout=10, check=True).stdout.split() == [a.ip, a.ip]
    assert b.run([sys.executable, "-c", probe], timeout=10, check=True).stdout.split() == [b.ip, a.ip]
    env = b.run(["sh", "-c", "echo $GLOO_SOCKET_IFNAME"], timeout=10, check=True).stdout.strip()
    assert env == b.ifname


# --------------------------------------------------------------------------
# (2) cut(): silent black hole, then restore()
# --------------------------------------------------------------------------

CUT_CLIENT = """
    import json, socket, sys, time
    host, port = sys.argv[1], int(sys.argv[2])

    def report(**kw):
        print(json.dumps(kw), flush=True)

    def attempt(fn):
        t = time.monotonic()
        try:
            return {"ok": fn(), "secs": round(time.monotonic() - t, 2)}
        except OSError as e:
            return {"err": type(e).__name__, "errno": e.errno, "secs": round(time.monotonic() - t, 2)}

    old = socket.create_connection((host, port), timeout=5)
    old.sendall(b"ping")
    assert old.recv(10) == b"ping"
    report(phase="connected")

    sys.stdin.readline()                        # parent has called cut()
    old.settimeout(1.0)
    sent = attempt(lambda: old.send(b"lost?"))   # buffered locally: succeeds
    recv = attempt(lambda: old.recv(10).decode())
    new = attempt(lambda: socket.create_connection((host, port), timeout=1.0).close())
    report(phase="cut", sent=sent, recv=recv, new=new)

    sys.stdin.readline()                        # parent has called restore()
    old.settimeout(10.0)
    late = attempt(lambda: old.recv(10).decode())   # retransmission gets through
    def fresh():
        c = socket.create_connection((host, port), timeout=5)
        c.sendall(b"again")
        return c.recv(10).decode()
    report(phase="restored", late=late, fresh=attempt(fresh))
"""


@pytest.mark.timeout(30)
def test_cut_blackholes_without_reset_and_restore_recovers(net, tmp_path):
    a, b = net.host_a, net.host_b
    server, port = _start_echo_server(a, tmp_path)
    script = _write(tmp_path, "cut_client.py", CUT_CLIENT)
    cli = b.popen([sys.executable, script, a.ip, str(port)],
                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def step(msg=None):
        if msg is not None:
            cli.stdin.write(msg + "\n")
            cli.stdin.flush()
        line = cli.stdout.readline()
        assert line, f"client died (rc={cli.poll()})"
        return json.loads(line)

    assert step()["phase"] == "connected"

    net.cut()
    assert net.is_cut
    r = step("cut")
    assert r["sent"].get("ok") == 5, r                       # no EPIPE/ECONNRESET on send
    assert r["recv"].get("err") == "TimeoutError", r         # blocks: no RST, no FIN (b"")
    assert r["recv"]["errno"] is None, r                     # socket.timeout, not ETIMEDOUT
    assert r["new"].get("err") == "TimeoutError", r          # not refused / unreachable
    assert r["new"]["errno"] is None, r
    assert 0.9 <= r["new"]["secs"] < 3, r
    # Processes were not touched and host_a still works locally.
    assert server.poll() is None and cli.poll() is None
    local = a.run([sys.executable, "-c",
                   f"import socket; c=socket.create_connection(('{a.ip}', {port}), timeout=2);"
                   "c.sendall(b'x'); print(c.recv(1).decode())"], timeout=10, check=True)
    assert local.stdout.strip() == "x"

    net.restore()
    assert not net.is_cut
    r = step("restore")
    assert r["late"].get("ok") == "lost?", r                 # old connection survived the cut
    assert r["fresh"].get("ok") == "again", r
    assert cli.wait(timeout=10) == 0


TCP_OPTS_CLIENT = """
    import json, socket, sys, threading, time
    host, port = sys.argv[1], int(sys.argv[2])

    def connect():
        c = socket.create_connection((host, port), timeout=5)
        c.sendall(b"hi"); assert c.recv(2) == b"hi"
        c.settimeout(None)                       # fully blocking from now on
        return c

    user_to = connect()                          # TCP_USER_TIMEOUT: bounds unacked data
    user_to.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 1000)
    keepalive = connect()                        # keepalive: bounds an idle blocked recv
    keepalive.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    keepalive.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
    keepalive.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
    keepalive.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 2)
    plain = connect()                            # no options: blocks forever
    print("ready", flush=True)
    sys.stdin.readline()

    res = {}
    def run(name, sock, send):
        t = time.monotonic()
        try:
            if send:
                sock.sendall(b"x")
            sock.recv(10)
            res[name] = {"ok": True}
        except OSError as e:
            res[name] = {"errno": e.errno, "secs": round(time.monotonic() - t, 2)}
    ths = [threading.Thread(target=run, args=a, daemon=True) for a in
           (("user_timeout", user_to, True), ("keepalive", keepalive, False), ("plain", plain, True))]
    for t in ths: t.start()
    deadline = time.monotonic() + 5.0
    for t in ths: t.join(max(0.0, deadline - time.monotonic()))
    print(json.dumps(res), flush=True)
"""


@pytest.mark.timeout(30)
def test_cut_detection_is_bounded_by_tcp_user_timeout_and_keepalive(net, tmp_path):
    import errno
    _, port = _start_echo_server(net.host_a, tmp_path)
    script = _write(tmp_path, "opts_client.py", TCP_OPTS_CLIENT)
    cli = net.host_b.popen([sys.executable, script, net.host_a.ip, str(port)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert cli.stdout.readline().strip() == "ready"
    net.cut()
    cli.stdin.write("go\n"); cli.stdin.flush()
    res = json.loads(cli.stdout.readline())
    # measured: ~1.4 s (next retransmission after 1 s) and ~3.0 s (idle 1 + 2 x 1 s)
    ut, ka = res.get("user_timeout", {}), res.get("keepalive", {})
    assert ut.get("errno") == errno.ETIMEDOUT and ut["secs"] < 4, res
    assert ka.get("errno") == errno.ETIMEDOUT and ka["secs"] < 5, res
    assert "plain" not in res, res            # still blocked after 5 s (default retries: ~15 min)


# --------------------------------------------------------------------------
# (3) torch.distributed gloo across the two hosts
# --------------------------------------------------------------------------

GLOO_RANK = """
    import datetime, json, os, sys, time
    rank, url, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    if mode == "hostsfile":                       # rely on /etc/netns/<ns>/hosts only
        os.environ.pop("GLOO_SOCKET_IFNAME", None)
    import torch
    import torch.distributed as dist
    t = time.monotonic()
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    x = torch.arange(4, dtype=torch.float32) * (rank + 1)   # rank0: 0,1,2,3  rank1: 0,2,4,6
    dist.all_reduce(x)
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "result": x.tolist(),
                      "secs": round(time.monotonic() - t, 2)}), flush=True)
"""


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["ifname", "hostsfile"])
def test_gloo_all_reduce_across_hosts(net, tmp_path, mode):
    a, b = net.host_a, net.host_b
    script = _write(tmp_path, "gloo_rank.py", GLOO_RANK)
    url = f"tcp://{a.ip}:{a.free_port()}"
    env = {"TORCH_CPP_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1"}
    procs = [h.popen([sys.executable, script, str(rank), url, mode], env=env,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, h in enumerate((a, b))]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=25)
        assert p.returncode == 0, f"rank failed (rc={p.returncode}):\n{err[-3000:]}"
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert [o["rank"] for o in outs] == [0, 1]
    for o in outs:
        assert o["result"] == [0.0, 3.0, 6.0, 9.0], outs


# --------------------------------------------------------------------------
# (4) nothing left behind
# --------------------------------------------------------------------------

def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def _children(pid):
    kids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if ppid == pid and _alive(int(d)):
            kids.append(int(d))
    return kids


@pytest.mark.timeout(30)
def test_cleanup_kills_processes_and_deletes_namespaces(tmp_path):
    netns.require_in_test()
    pidfile = tmp_path / "daemon.pid"
    before = set(_children(os.getpid()))   # e.g. multiprocessing helpers left by earlier tests
    net = netns.TwoHosts()
    with pytest.raises(RuntimeError, match="boom"):
        with net:
            names = [net.host_a.ns, net.host_b.ns]
            assert set(names) <= set(netns.list_netns())
            assert all(os.path.isfile(f"/etc/netns/{n}/hosts") for n in names)
            # a plain long-running child, a child with its own grandchildren,
            # and a fully daemonised grandchild (new session, not in our group)
            p1 = net.host_a.popen(["sleep", "300"])
            p2 = net.host_b.popen(["sh", "-c", "sleep 300 & sleep 301 & wait"])
            net.host_b.popen(["sh", "-c", f"setsid sleep 302 & echo $! > {pidfile}; wait"])
            net.cut()
            wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), timeout=5,
                       what="the daemonised grandchild's pid file")
            daemon_pid = int(pidfile.read_text())
            assert _alive(daemon_pid)
            raise RuntimeError("boom")           # cleanup must also happen on errors

    listed = netns.list_netns()
    assert not any(n in listed for n in names), listed
    assert not _ours()
    assert not any(os.path.exists(f"/etc/netns/{n}") for n in names)
    assert p1.returncode is not None and p2.returncode is not None
    assert not _alive(p1.pid) and not _alive(p2.pid)
    # reparented: reaped by init asynchronously
    wait_until(lambda: not _alive(daemon_pid), timeout=5, what=f"the exit of daemonised pid {daemon_pid}")
    assert set(_children(os.getpid())) - before == set()
    net.close()                                  # idempotent


@pytest.mark.timeout(30)
def test_parallel_instances_do_not_collide():
    netns.require_in_test()
    before = set(_children(os.getpid()))
    with netns.TwoHosts() as n1, netns.TwoHosts() as n2:
        names = {n1.host_a.ns, n1.host_b.ns, n2.host_a.ns, n2.host_b.ns}
        assert len(names) == 4
        assert len({n1.host_a.ifname, n1.host_b.ifname, n2.host_a.ifname, n2.host_b.ifname}) == 4
        # each pair is isolated: cutting one does not affect the other
        n1.cut()
        ping = "import socket,sys; socket.create_connection((sys.argv[1], 9), timeout=1)"
        r1 = n1.host_b.run([sys.executable, "-c", ping, n1.host_a.ip], timeout=10)
        r2 = n2.host_b.run([sys.executable, "-c", ping, n2.host_a.ip], timeout=10)
        assert "timed out" in r1.stderr                      # black hole
        assert "ConnectionRefusedError" in r2.stderr         # reachable; RST from closed port
    assert not _ours()
    assert set(_children(os.getpid())) - before == set()


@pytest.mark.timeout(30)
def test_hosts_behind_a_switch_reach_each_other_and_count_their_own_bytes():
    """netns.Hosts(3): every host reaches every other through the switch; a host's tx counter counts
    what it sends (the bytes host A sends to C do not show on B's); everything is removed on exit."""
    netns.require_in_test()
    payload = 200_000
    code = ("import socket, sys\n"
            "peer, port = sys.argv[1], int(sys.argv[2])\n"
            "s = socket.create_connection((peer, port), timeout=5); s.sendall(b'x' * %d); s.close()\n" % payload)
    receive = ("import socket, sys\n"
               "srv = socket.socket(); srv.bind((sys.argv[1], 0)); srv.listen(1)\n"
               "print(srv.getsockname()[1], flush=True)\n"
               "c, _ = srv.accept(); n = 0\n"
               "while (chunk := c.recv(65536)): n += len(chunk)\n"
               "print(n, flush=True)\n")

    def tx(host) -> int:
        out = host.run(["cat", f"/sys/class/net/{host.ifname}/statistics/tx_bytes"], timeout=10, check=True)
        return int(out.stdout)

    with netns.Hosts(3) as net:
        a, b, c = net.hosts
        assert len({h.ip for h in net.hosts}) == 3
        for sender, receiver in ((a, c), (c, b), (b, a)):
            server = receiver.popen([sys.executable, "-c", receive, receiver.ip], stdout=subprocess.PIPE, text=True)
            port = int(server.stdout.readline())
            before = {h.name: tx(h) for h in net.hosts}
            sender.run([sys.executable, "-c", code, receiver.ip, str(port)], timeout=10, check=True)
            assert int(server.stdout.readline()) == payload
            server.wait(10)
            sent = {h.name: tx(h) - before[h.name] for h in net.hosts}
            bystander = next(h for h in net.hosts if h not in (sender, receiver))
            assert payload <= sent[sender.name] < 1.2 * payload, sent
            assert sent[bystander.name] < 0.1 * payload, sent
        names = [h.ns for h in net.hosts] + [net.switch_ns]
    assert not set(names) & set(netns.list_netns()), "namespaces left behind"
