"""Two simulated "hosts" on one Linux machine, built from network namespaces.

Stdlib only; needs root and iproute2 (``ip``). Intended for tests that must
exercise real multi-host networking (TCP, ``torch.distributed`` gloo, ...)
including a host that silently disappears from the network.

Quick start::

    from tests.netns import TwoHosts   # or `import netns` with tests/ on sys.path

    with TwoHosts() as net:
        srv = net.host_a.popen([sys.executable, "server.py", net.host_a.ip])
        out = net.host_b.run([sys.executable, "client.py", net.host_a.ip], timeout=10)
        net.cut()        # host_b vanishes: packets silently dropped both ways
        ...
        net.restore()    # connectivity comes back, existing TCP connections resume
    # here: all processes started via popen/run are killed, namespaces deleted

API
---
``available() -> bool``, ``unavailable_reason() -> str | None``, ``require()``
    (raises :class:`NetnsUnavailable` with the reason: not root, no ``ip``,
    ``ip netns``/veth not permitted, ...). The check really creates a
    throwaway namespace + veth once per process (~15 ms) and is cached.
``TwoHosts(hosts_file=True)``: context manager (or ``.start()``/``.close()``).
    ``.host_a``, ``.host_b``, ``.hosts``, ``.cut()``, ``.restore()``,
    ``.is_cut``, ``.partitioned()`` (context manager: cut ... restore).
``Host``: ``.name`` ("host-a"/"host-b"), ``.ns``, ``.ip``, ``.ifname``,
    ``.mac``, ``.env()``, ``.popen(argv, env=None, **popen_kw)``,
    ``.run(argv, timeout, check=False, input=None, env=None, **popen_kw)``,
    ``.free_port()``, ``.sysctl(key, value)``, ``.exec_argv(argv)``,
    ``.processes``, ``.kill_all()``.
``cleanup_stale()``, ``list_netns()``.

Measured here (2 cores): setup ~50 ms, teardown ~20 ms, availability probe
~15 ms; ``free_port()`` ~50 ms (spawns a python in the namespace).

Topology
--------
``TwoHosts()`` creates two namespaces ``rlh-<pid>-<hex6>-a`` / ``...-b``
(``pid`` = creating process, so parallel runs and stale leftovers can be told
apart), connected by one veth pair ``rlh<hex6>a`` <-> ``rlh<hex6>b`` (10 chars,
within the 15-char IFNAMSIZ limit) created *directly inside* the namespaces, so
nothing ever appears in the root namespace. Addresses are ``192.0.2.N/24``
(TEST-NET-1, RFC 5737) with ``N = 10+2k`` / ``11+2k`` for a random ``k``.
Each namespace has ``lo`` up and nothing else: no default route, so traffic
can only go to loopback or to the peer; anything else (e.g. a DNS query to the
machine's resolver) fails immediately with ENETUNREACH and never leaves.
IPv6 address generation on the veth is disabled (``addrgenmode none``) so
the interface only carries the IPv4 address, and there is no DAD delay.
MAC addresses are fixed and the peers' ARP entries are installed as
``nud permanent`` -- no ARP traffic at all (this matters for ``cut()``).

Cleanup happens in ``__exit__`` (also on exceptions), in an ``atexit`` hook,
on SIGTERM (a handler is installed only if SIGTERM has the default disposition),
and -- for runs that died by SIGKILL -- ``cleanup_stale()`` (called by every
``TwoHosts.__enter__``) removes namespaces whose creating pid is dead.
Cleanup order: SIGKILL the process group of every process started with
``popen``/``run`` (they run with ``start_new_session=True``), then SIGKILL
anything still listed by ``ip netns pids <ns>`` (daemonised grandchildren),
then ``ip netns delete`` (which destroys the veth pair) and remove
``/etc/netns/<ns>``.

Running commands in a host
--------------------------
``host.popen(argv, **kw)`` runs ``ip netns exec <ns> argv...``; ``ip netns
exec`` execs in place, so ``Popen.pid`` is the pid of your program. The child
gets ``os.environ`` (PATH, PYTHONPATH, VIRTUAL_ENV, ...) + ``host.env()`` +
your ``env=`` on top (``env`` is *merged*, not a replacement). Use
``sys.executable`` to get the same venv interpreter.
``host.run(argv, timeout)`` is the ``subprocess.run`` equivalent (captures
text output, kills the whole group on timeout).

torch.distributed / gloo across namespaces (measured with torch 2.13 CPU)
------------------------------------------------------------------------
Gloo has to choose a local address to advertise to its peers. Without
``GLOO_SOCKET_IFNAME`` it resolves the machine's hostname. ``ip netns`` does
*not* isolate the UTS namespace, so both hosts share the real hostname, which
the machine's ``/etc/hosts`` maps to 127.0.0.1. Result: both ranks advertise
127.0.0.1 and ``init_process_group`` fails with "Gloo connectFullMesh failed
... Connection refused, remote=[127.0.0.1]:..." after the timeout.
Two fixes, both applied by default here:

1. ``host.env()`` sets ``GLOO_SOCKET_IFNAME=<veth name>`` (and the tensorpipe
   equivalent ``TP_SOCKET_IFNAME``); ``popen``/``run`` inject it. This alone
   is sufficient. Names differ per host (``rlh<hex6>a`` vs ``...b``), so use
   ``host.env()``, not a single value for both.
2. ``hosts_file=True`` writes ``/etc/netns/<ns>/hosts`` which ``ip netns
   exec`` bind-mounts over ``/etc/hosts``: it maps the (shared) hostname to
   *that* host's IP and the names ``host-a``/``host-b`` to their IPs. With
   this, gloo works even without ``GLOO_SOCKET_IFNAME``, and
   ``socket.gethostbyname(socket.gethostname())`` behaves like on a real host.

``init_method="tcp://<host_a.ip>:<port>"`` works as usual (use
``host_a.free_port()``). c10d prints a harmless warning "The hostname of the
client socket cannot be retrieved. err=-3" (reverse lookup of the peer
address fails); set ``TORCH_CPP_LOG_LEVEL=ERROR`` to silence it.

``cut()`` semantics
-------------------
``cut()`` points each side's (permanent) ARP entry for the peer at a
MAC address that does not exist. Frames still leave the veth but the peer's
stack discards them (wrong destination MAC). Nothing is sent back: no RST, no
FIN, no ICMP, no ENETUNREACH/EHOSTUNREACH -- exactly like a peer whose cable
was pulled. Processes keep running, interfaces stay up, routes are unchanged,
each host can still use its own loopback. ``restore()`` puts the real MAC
back. (Setting the link down instead would make the sender's connect() fail
immediately with ENETUNREACH, and plain ARP would eventually yield
EHOSTUNREACH -- both are *not* "host vanished" semantics, hence this design.)

What TCP does while cut (Linux defaults, measured here):

* ``send()`` on an established connection succeeds (data is buffered);
  a blocking ``recv()`` blocks forever -- nothing ever arrives and nothing
  errors unless a timeout mechanism is configured.
* unacked data is retransmitted with exponential backoff; the connection is
  only declared dead after ``net.ipv4.tcp_retries2`` (15, ~15 min).
* new ``connect()`` hangs; SYNs retried ``tcp_syn_retries`` (6, ~127 s).
* after ``restore()`` an established connection resumes at the next
  retransmission, so the recovery delay grows with the outage length
  (~1-3 s for a 2 s cut).

Bounding detection time (per socket):

* ``TCP_USER_TIMEOUT`` (ms): with unacked data in flight, the connection
  fails with ETIMEDOUT after roughly that time; also bounds connect().
* ``SO_KEEPALIVE`` + ``TCP_KEEPIDLE``/``TCP_KEEPINTVL``/``TCP_KEEPCNT``:
  detects a dead peer on an *idle* connection (blocked in recv with
  nothing outstanding) after about idle + intvl*cnt seconds.
* or a plain ``settimeout()`` / application-level heartbeats.

Measured while cut: ``TCP_USER_TIMEOUT=1000`` -> ETIMEDOUT after ~1.4 s
(first retransmission past 1 s) for a blocked send+recv, and ~1.5 s for a
connect() with 1500; keepalive idle=1/intvl=1/cnt=2 -> ETIMEDOUT after ~3.0 s
on an idle blocked recv; ``TCP_USER_TIMEOUT`` alone does *not* unblock an
idle recv (nothing unacked); no option -> still blocked. ``tcp_syn_retries=1``
(set in host_b only) -> connect() fails after ~3.2 s.
gloo: an ``all_reduce`` issued while cut raises ``RuntimeError("... Timed out
waiting 5000ms for recv operation to complete")`` on both ranks after exactly
the process-group ``timeout`` (5 s in that run); it does not hang forever.
  The sysctls are per-namespace, so ``host.sysctl("net.ipv4.tcp_retries2",
  5)`` only affects that host.
"""

from __future__ import annotations

import atexit
import errno
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

__all__ = [
    "TwoHosts",
    "Hosts",
    "Host",
    "NetnsUnavailable",
    "available",
    "unavailable_reason",
    "require",
    "cleanup_stale",
    "list_netns",
]

NS_PREFIX = "rlh-"
SUBNET = "192.0.2"
_DEAD_MAC = "02:de:ad:be:ef:00"  # locally administered, never assigned to anything


class NetnsUnavailable(RuntimeError):
    """Raised when network namespaces cannot be used on this machine."""


# --------------------------------------------------------------------------
# ip(8) plumbing
# --------------------------------------------------------------------------

def _find_ip() -> Optional[str]:
    path = shutil.which("ip")
    if path:
        return path
    for cand in ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"):
        if os.access(cand, os.X_OK):
            return cand
    return None


_IP = _find_ip()


def _ip(*args: str, check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess:
    if _IP is None:
        raise NetnsUnavailable("iproute2 `ip` binary not found (install iproute2)")
    res = subprocess.run([_IP, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed (rc={res.returncode}): "
                           f"{res.stderr.strip()}")
    return res


def list_netns() -> List[str]:
    """Names from ``ip netns list`` (empty list if ``ip`` is unusable)."""
    try:
        res = _ip("netns", "list", check=False)
    except (NetnsUnavailable, OSError, subprocess.SubprocessError):
        return []
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def _netns_pids(ns: str) -> List[int]:
    res = _ip("netns", "pids", ns, check=False)
    return [int(x) for x in res.stdout.split() if x.strip().isdigit()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --------------------------------------------------------------------------
# availability
# --------------------------------------------------------------------------

_avail_lock = threading.Lock()
_avail_reason: Optional[str] = None
_avail_checked = False


def unavailable_reason() -> Optional[str]:
    """``None`` if namespaces + veth work here, else a human-readable reason.

    The first call really creates (and deletes) a throwaway namespace with a
    veth pair; the result is cached.
    """
    global _avail_reason, _avail_checked
    with _avail_lock:
        if _avail_checked:
            return _avail_reason
        _avail_reason = _probe()
        _avail_checked = True
        return _avail_reason


def require_in_test() -> None:
    """Fail the calling test with the reason network namespaces are unavailable here; with
    ``RLH_NETNS_ALLOW_SKIP=1``, skip it instead."""
    import pytest

    reason = unavailable_reason()
    if reason is None:
        return
    if os.environ.get("RLH_NETNS_ALLOW_SKIP") == "1":
        pytest.skip(f"network namespaces unavailable: {reason}")
    pytest.fail(f"network namespaces unavailable: {reason} (set RLH_NETNS_ALLOW_SKIP=1 to skip instead)",
                pytrace=False)


def available() -> bool:
    """True when running as root with ``ip netns`` + veth usable."""
    return unavailable_reason() is None


def require() -> None:
    """Raise :class:`NetnsUnavailable` with a clear message if unavailable."""
    reason = unavailable_reason()
    if reason is not None:
        raise NetnsUnavailable(reason)


def _probe() -> Optional[str]:
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (platform is {sys.platform})"
    if os.geteuid() != 0:
        return (f"network namespaces need root (euid={os.geteuid()}); "
                "run the tests as root or in a privileged container")
    if _IP is None:
        return "iproute2 `ip` binary not found on PATH or in /usr/sbin, /sbin (install iproute2)"
    ns = f"{NS_PREFIX}{os.getpid()}-{random.getrandbits(24):06x}-p"
    try:
        res = _ip("netns", "add", ns, check=False)
        if res.returncode != 0:
            return f"`ip netns add` failed: {res.stderr.strip()}"
        res = _ip("-n", ns, "link", "add", "rlhprobe0", "type", "veth",
                  "peer", "name", "rlhprobe1", check=False)
        if res.returncode != 0:
            return f"creating a veth pair inside a namespace failed: {res.stderr.strip()}"
        res = _ip("netns", "exec", ns, _IP, "link", "set", "lo", "up", check=False)
        if res.returncode != 0:
            return f"`ip netns exec` failed: {res.stderr.strip()}"
        return None
    except Exception as exc:  # pragma: no cover - defensive
        return f"probing network namespaces failed: {exc!r}"
    finally:
        try:
            _ip("netns", "delete", ns, check=False)
        except Exception:
            pass


# --------------------------------------------------------------------------
# stale cleanup (runs that died without atexit, e.g. SIGKILL)
# --------------------------------------------------------------------------

def _remove_etc_netns(ns: str) -> None:
    d = os.path.join("/etc/netns", ns)
    shutil.rmtree(d, ignore_errors=True)
    try:  # drop /etc/netns itself if we left it empty (harmless race: ENOTEMPTY)
        os.rmdir("/etc/netns")
    except OSError:
        pass


def _kill_ns_processes(ns: str, deadline: float) -> None:
    while True:
        pids = [p for p in _netns_pids(ns) if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            return
        time.sleep(0.02)


def cleanup_stale() -> List[str]:
    """Delete ``rlh-<pid>-...`` namespaces whose creating process is gone.

    Safe to call while other test runs are active (their pids are alive).
    Returns the names removed.
    """
    removed = []
    for ns in list_netns():
        if not ns.startswith(NS_PREFIX):
            continue
        try:
            pid = int(ns[len(NS_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if pid == os.getpid() or _pid_alive(pid):
            continue
        _kill_ns_processes(ns, time.monotonic() + 2.0)
        _ip("netns", "delete", ns, check=False)
        _remove_etc_netns(ns)
        removed.append(ns)
    return removed


# --------------------------------------------------------------------------
# hosts
# --------------------------------------------------------------------------

class Host:
    """One end of a :class:`TwoHosts` setup.

    Attributes:
        name:   logical name, ``"host-a"`` / ``"host-b"`` (resolvable inside
                both namespaces when ``hosts_file=True``)
        ns:     network namespace name (for ``ip netns exec``)
        ip:     IPv4 address (str), in 192.0.2.0/24
        ifname: veth interface name inside ``ns`` (<= 15 chars)
        mac:    MAC address of the veth
    """

    def __init__(self, name: str, ns: str, ip: str, ifname: str, mac: str):
        self.name = name
        self.ns = ns
        self.ip = ip
        self.ifname = ifname
        self.mac = mac
        self._procs: List[subprocess.Popen] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Host(name={self.name!r}, ns={self.ns!r}, ip={self.ip!r}, ifname={self.ifname!r})"

    # -- environment ------------------------------------------------------
    def env(self) -> Dict[str, str]:
        """Extra env vars a process in this host needs (merged by popen/run).

        ``GLOO_SOCKET_IFNAME`` makes gloo bind/advertise the veth address
        instead of whatever the shared hostname resolves to;
        ``TP_SOCKET_IFNAME`` does the same for tensorpipe (torch RPC).
        ``RLH_NETNS_HOST_IP``/``RLH_NETNS_NS`` are informational.
        """
        return {
            "GLOO_SOCKET_IFNAME": self.ifname,
            "TP_SOCKET_IFNAME": self.ifname,
            "RLH_NETNS_HOST_IP": self.ip,
            "RLH_NETNS_NS": self.ns,
        }

    def exec_argv(self, argv: Sequence[str]) -> List[str]:
        """``argv`` wrapped as ``ip netns exec <ns> argv...``."""
        if isinstance(argv, (str, bytes)):
            raise TypeError("argv must be a sequence of arguments, not a string")
        return [_IP or "ip", "netns", "exec", self.ns, *[os.fspath(a) for a in argv]]

    # -- processes --------------------------------------------------------
    def popen(self, argv: Sequence[str], *, env: Optional[Dict[str, str]] = None,
              **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside this host; returns the ``Popen``.

        ``env`` is merged on top of ``os.environ`` + :meth:`env`. The process
        gets its own session/process group (``start_new_session=True``) so
        that cleanup can kill the whole group. All other kwargs go to Popen.
        """
        full_env = dict(os.environ)
        full_env.update(self.env())
        if env:
            full_env.update(env)
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.exec_argv(argv), env=full_env, **kwargs)
        with self._lock:
            self._procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], timeout: float, *, check: bool = False,
            input: Optional[str] = None, env: Optional[Dict[str, str]] = None,
            **kwargs) -> subprocess.CompletedProcess:
        """Like ``subprocess.run(argv, capture_output=True, text=True)`` in this host.

        On timeout the whole process group is killed and
        ``subprocess.TimeoutExpired`` is raised (with captured output).
        """
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        kwargs.setdefault("text", True)
        if input is not None:
            kwargs.setdefault("stdin", subprocess.PIPE)
        proc = self.popen(argv, env=env, **kwargs)
        try:
            out, err = proc.communicate(input=input, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            _killpg(proc)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, output=out, stderr=err) from exc
        res = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check:
            res.check_returncode()
        return res

    def free_port(self) -> int:
        """A TCP port currently free on this host (bound to 0 inside the ns)."""
        code = ("import socket;s=socket.socket();s.bind(('',0));"
                "print(s.getsockname()[1])")
        res = self.run([sys.executable, "-c", code], timeout=10, check=True)
        return int(res.stdout.strip())

    def sysctl(self, key: str, value) -> None:
        """Set a per-namespace sysctl, e.g. ``sysctl("net.ipv4.tcp_retries2", 5)``."""
        path = "/proc/sys/" + key.replace(".", "/")
        self.run(["sh", "-c", 'echo "$1" > "$2"', "sh", str(value), path],
                 timeout=10, check=True)

    @property
    def processes(self) -> List[subprocess.Popen]:
        with self._lock:
            return list(self._procs)

    def kill_all(self, deadline: Optional[float] = None) -> None:
        """SIGKILL every process group started here + anything left in the ns."""
        if deadline is None:
            deadline = time.monotonic() + 5.0
        with self._lock:
            procs = list(self._procs)
        for p in procs:
            _killpg(p)
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            for stream in (p.stdin, p.stdout, p.stderr):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass
        _kill_ns_processes(self.ns, deadline)


def _killpg(proc: subprocess.Popen) -> None:
    """SIGKILL the process group led by ``proc`` (started with a new session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    except OSError as exc:  # pragma: no cover
        if exc.errno != errno.ESRCH:
            raise
    if proc.poll() is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass


def _write_hosts_file(h: Host, hosts: Sequence[Host]) -> None:
    """``/etc/netns/<ns>/hosts`` of ``h``: the shared hostname is ``h``'s address, every host by name."""
    d = os.path.join("/etc/netns", h.ns)
    for _ in range(5):  # racing with another run's rmdir("/etc/netns")
        try:
            os.makedirs(d, exist_ok=True)
            break
        except FileNotFoundError:
            continue
    lines = [
        "# written by rlharvest tests/netns.py; removed on cleanup",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
        f"{h.ip}\t{socket.gethostname()}",
    ]
    for x in hosts:
        lines.append(f"{x.ip}\t{x.name}")
    with open(os.path.join(d, "hosts"), "w") as f:
        f.write("\n".join(lines) + "\n")


# --------------------------------------------------------------------------
# TwoHosts
# --------------------------------------------------------------------------

_live: "set" = set()  # TwoHosts and Hosts
_live_lock = threading.Lock()


def _atexit_cleanup() -> None:
    with _live_lock:
        live = list(_live)
    for net in live:
        try:
            net.close()
        except Exception:
            pass


atexit.register(_atexit_cleanup)

_sigterm_installed = False


def _on_sigterm(signum, frame):  # pragma: no cover - exercised manually
    _atexit_cleanup()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm_hook() -> None:
    """atexit does not run on SIGTERM; clean up then die the default way.

    Only installed from the main thread and only if SIGTERM still has its
    default disposition (never overrides someone else's handler).
    """
    global _sigterm_installed
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):
        return
    _sigterm_installed = True


def _close_namespaces(network) -> None:
    """Kill every process of ``network``'s hosts, then delete the namespaces it created, in order
    (idempotent)."""
    if network._closed:
        return
    network._closed = True
    try:
        deadline = time.monotonic() + 5.0
        for h in network.hosts:
            if h.ns in network._created:
                h.kill_all(deadline)
        for ns in network._created:
            _ip("netns", "delete", ns, check=False)
            _remove_etc_netns(ns)
    finally:
        with _live_lock:
            _live.discard(network)


class TwoHosts:
    """Two network namespaces joined by a veth pair. Use as a context manager.

    Args:
        hosts_file: write ``/etc/netns/<ns>/hosts`` (see module docstring)
            so the shared hostname resolves to each host's own IP and
            ``host-a``/``host-b`` resolve to the hosts' IPs.

    Attributes: ``host_a``, ``host_b`` (:class:`Host`), ``is_cut``.
    """

    def __init__(self, hosts_file: bool = True):
        suffix = f"{random.getrandbits(24):06x}"
        k = random.randrange(0, 122)  # .10+2k / .11+2k  -> at most .253
        pid = os.getpid()
        self.tag = suffix
        self.host_a = Host("host-a", f"{NS_PREFIX}{pid}-{suffix}-a", f"{SUBNET}.{10 + 2 * k}",
                           f"rlh{suffix}a", f"02:72:6c:{suffix[0:2]}:{suffix[2:4]}:0a")
        self.host_b = Host("host-b", f"{NS_PREFIX}{pid}-{suffix}-b", f"{SUBNET}.{11 + 2 * k}",
                           f"rlh{suffix}b", f"02:72:6c:{suffix[0:2]}:{suffix[2:4]}:0b")
        assert len(self.host_a.ifname) <= 15 and len(self.host_b.ifname) <= 15
        self.hosts_file = hosts_file
        self.is_cut = False
        self._created: List[str] = []
        self._closed = False
        self._entered = False

    @property
    def hosts(self) -> List[Host]:
        return [self.host_a, self.host_b]

    def __repr__(self) -> str:
        return f"TwoHosts({self.host_a!r}, {self.host_b!r}, is_cut={self.is_cut})"

    # -- lifecycle --------------------------------------------------------
    def __enter__(self) -> "TwoHosts":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> "TwoHosts":
        if self._entered:
            raise RuntimeError("TwoHosts instances are single-use")
        self._entered = True
        require()
        cleanup_stale()
        _install_sigterm_hook()
        with _live_lock:
            _live.add(self)
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def _setup(self) -> None:
        a, b = self.host_a, self.host_b
        for h in (a, b):
            _ip("netns", "add", h.ns)
            self._created.append(h.ns)
        # veth pair created directly inside the namespaces (never in root ns)
        _ip("link", "add", a.ifname, "address", a.mac, "netns", a.ns, "type", "veth",
            "peer", "name", b.ifname, "address", b.mac, "netns", b.ns)
        for h, peer in ((a, b), (b, a)):
            n = ("-n", h.ns)
            _ip(*n, "link", "set", "dev", h.ifname, "addrgenmode", "none")
            _ip(*n, "addr", "add", f"{h.ip}/24", "dev", h.ifname)
            _ip(*n, "link", "set", "dev", "lo", "up")
            _ip(*n, "link", "set", "dev", h.ifname, "up")
            _ip(*n, "neigh", "replace", peer.ip, "lladdr", peer.mac, "nud", "permanent",
                "dev", h.ifname)
            if self.hosts_file:
                self._write_hosts(h)

    def _write_hosts(self, h: Host) -> None:
        _write_hosts_file(h, self.hosts)

    def close(self) -> None:
        """Kill all processes, delete namespaces. Idempotent."""
        _close_namespaces(self)

    # -- partition --------------------------------------------------------
    def cut(self) -> None:
        """Make the hosts unreachable from each other; packets vanish silently.

        Nothing is killed and no RST/FIN/ICMP is generated: each side's ARP
        entry for the peer is repointed to a non-existent MAC address.
        """
        self._set_peer_macs(cut=True)
        self.is_cut = True

    def restore(self) -> None:
        """Undo :meth:`cut`."""
        self._set_peer_macs(cut=False)
        self.is_cut = False

    def _set_peer_macs(self, cut: bool) -> None:
        a, b = self.host_a, self.host_b
        for h, peer in ((a, b), (b, a)):
            _ip("-n", h.ns, "neigh", "replace", peer.ip, "lladdr",
                _DEAD_MAC if cut else peer.mac, "nud", "permanent", "dev", h.ifname)

    class _Partition:
        def __init__(self, net: "TwoHosts"):
            self.net = net

        def __enter__(self):
            self.net.cut()
            return self.net

        def __exit__(self, *exc):
            self.net.restore()

    def partitioned(self) -> "TwoHosts._Partition":
        """``with net.partitioned(): ...`` -- cut() on enter, restore() on exit."""
        return TwoHosts._Partition(self)


# --------------------------------------------------------------------------
# Hosts: more than two, behind a switch
# --------------------------------------------------------------------------

class Hosts:
    """``count`` network namespaces (2-8) behind one switch: a bridge in a namespace of its own, one
    veth pair from each host to it. Use as a context manager, like :class:`TwoHosts` (same
    addresses, names, environment, processes, cleanup), without ``cut()``.

    Each host's veth counters (``/sys/class/net/<ifname>/statistics`` inside the host) count only
    that host's traffic: what the host sends is its ``tx_bytes``, whoever receives it.

    Attributes: ``hosts`` (:class:`Host` list, named ``host-a``, ``host-b``, ...), ``switch_ns``.
    """

    def __init__(self, count: int, hosts_file: bool = True):
        if not 2 <= count <= 8:
            raise ValueError(f"Hosts(count) takes 2 to 8 hosts, got {count}")
        suffix = f"{random.getrandbits(24):06x}"
        k = random.randrange(0, (244 - 10) // count)  # addresses .10+count*k ... stay below .254
        pid = os.getpid()
        self.tag = suffix
        self.switch_ns = f"{NS_PREFIX}{pid}-{suffix}-s"
        self.hosts: List[Host] = []
        for i in range(count):
            letter = "abcdefgh"[i]
            self.hosts.append(Host(f"host-{letter}", f"{NS_PREFIX}{pid}-{suffix}-{letter}",
                                   f"{SUBNET}.{10 + count * k + i}", f"rlh{suffix}{letter}",
                                   f"02:72:6c:{suffix[0:2]}:{suffix[2:4]}:{i + 1:02x}"))
        self.hosts_file = hosts_file
        self._created: List[str] = []
        self._closed = False
        self._entered = False

    def __repr__(self) -> str:
        return f"Hosts({self.hosts!r})"

    def __enter__(self) -> "Hosts":
        if self._entered:
            raise RuntimeError("Hosts instances are single-use")
        self._entered = True
        require()
        cleanup_stale()
        _install_sigterm_hook()
        with _live_lock:
            _live.add(self)
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _setup(self) -> None:
        switch = self.switch_ns
        _ip("netns", "add", switch)
        self._created.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "dev", "br0", "addrgenmode", "none")
        _ip("-n", switch, "link", "set", "dev", "br0", "up")
        for h in self.hosts:
            _ip("netns", "add", h.ns)
            self._created.append(h.ns)
            port = "rls" + h.ifname[3:]
            _ip("link", "add", h.ifname, "address", h.mac, "netns", h.ns, "type", "veth",
                "peer", "name", port, "netns", switch)
            _ip("-n", switch, "link", "set", "dev", port, "addrgenmode", "none")
            _ip("-n", switch, "link", "set", "dev", port, "master", "br0")
            _ip("-n", switch, "link", "set", "dev", port, "up")
            n = ("-n", h.ns)
            _ip(*n, "link", "set", "dev", h.ifname, "addrgenmode", "none")
            _ip(*n, "addr", "add", f"{h.ip}/24", "dev", h.ifname)
            _ip(*n, "link", "set", "dev", "lo", "up")
            _ip(*n, "link", "set", "dev", h.ifname, "up")
        for h in self.hosts:
            for peer in self.hosts:
                if peer is not h:
                    _ip("-n", h.ns, "neigh", "replace", peer.ip, "lladdr", peer.mac, "nud", "permanent",
                        "dev", h.ifname)
            if self.hosts_file:
                _write_hosts_file(h, self.hosts)

    def close(self) -> None:
        """Kill all processes, delete namespaces (the switch's last). Idempotent."""
        _close_namespaces(self)
