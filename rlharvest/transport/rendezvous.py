"""How the main process and its nodes find each other: the store, the command listener, the group.

Ports (``p`` = the collector's ``tcp_port``, see docs/security.md):

* ``p``   - the ``TCPStore`` served by rank 0, the main process. torch would bind it to every
  interface; rlharvest binds the socket itself, to the collector's bind address, and hands torch
  its descriptor. The store is unauthenticated: it holds only what torch needs for the process
  group and the command port's number, never a secret;
* ``p+1`` - the command listener (the next free port if taken): every node proves it holds the
  collector's key before anything is unpickled (:mod:`rlharvest.transport.channel`);
* ``p+2`` - the weight-sync listener of :class:`~rlharvest.weight_update.DistributedWeightSyncScheme`.

Process groups are created explicitly (no ``init_process_group``), so several collectors, or a
learner's own default group, coexist in one process. With gloo and nccl every node gets a group of
its own with the main process (two ranks: the main process is 0, the node 1), under a store prefix
naming the node's rank and *generation*: batches and weights only ever travel between the main
process and one node, and a node that replaces another forms a new group of its own (the next
generation) while the other nodes keep theirs. mpi and ucc can only form one group of every rank
(``init_process_group``): their nodes cannot be replaced.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import socket
import threading
import time
from typing import Any, Callable, Iterator
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist
from torch.distributed.rendezvous import register_rendezvous_handler

from .channel import Channel, ChannelListener, listen
from .ports import PortInUseError, not_this_host, port_is_free

__all__ = ["BACKENDS", "BATCH_TAG", "WEIGHTS_TAG", "PAIR_BACKENDS", "CONTROL_KEY", "check_backend",
           "make_process_group", "group_store", "node_group", "store_server", "Rendezvous", "loopback_interface",
           "distributed_state_exists", "mark_distributed_state", "serve_rpc_store", "release_rpc_store",
           "tensorpipe_interface"]

BACKENDS = ("gloo", "nccl", "mpi", "ucc")
#: tags of the point-to-point messages on a node's group: its batches, and the weights sent to it
BATCH_TAG, WEIGHTS_TAG = 11, 12
#: backends whose groups are made explicitly, so that each node can have its own
PAIR_BACKENDS = ("gloo", "nccl")
CONTROL_KEY = "rlharvest/control_port"
_STATE = {"created": False}


def distributed_state_exists() -> bool:
    """Whether this process created torch.distributed state (whose threads make fork unsafe)."""
    return _STATE["created"] or (dist.is_available() and dist.is_initialized())


def mark_distributed_state() -> None:
    """Record that torch.distributed (a store, a group, RPC) now runs threads in this process."""
    _STATE["created"] = True


def check_backend(backend: str) -> str:
    """Validate a backend name and that this torch build provides it.

    Raises:
        ValueError: for an unknown name.
        RuntimeError: for a backend this build lacks.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    available = getattr(dist, f"is_{backend}_available", lambda: False)()
    if not dist.is_available() or not available:
        raise RuntimeError(
            f"The torch.distributed backend {backend!r} is not available in this torch build "
            f"(torch.distributed.is_{backend}_available() is False); use backend='gloo'."
        )
    return backend


def loopback_interface() -> str | None:
    """The name of the loopback interface (for ``TP_SOCKET_IFNAME``), if this host has one."""
    names = {name for _, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), None)


def make_process_group(backend: str, store, rank: int, world_size: int, timeout: float,
                       device_host: str | None = None):
    """An explicit process group (no global default group involved).

    ``device_host`` pins gloo's sockets to one local address (``"127.0.0.1"`` for local nodes);
    without it gloo uses ``GLOO_SOCKET_IFNAME`` or the address this host's name resolves to.
    """
    delta = datetime.timedelta(seconds=timeout)
    if backend == "gloo":
        if device_host is None:
            return dist.ProcessGroupGloo(store, rank, world_size, delta)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = delta
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=device_host)]
        return dist.ProcessGroupGloo(store, rank, world_size, options)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size, dist.ProcessGroupNCCL.Options())
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=delta)
    return dist.group.WORLD


def store_server(bind_host: str, port: int, world_size: int, timeout: float) -> dist.TCPStore:
    """Rank 0's ``TCPStore``, listening on ``bind_host`` only (torch alone would take every interface).

    Raises:
        PortInUseError: naming ``tcp_port`` when ``port`` is taken.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((bind_host, port))
        sock.listen(128)
    except OSError as err:
        sock.close()
        if (not_here := not_this_host(err, bind_host)) is not None:
            raise not_here from None
        raise PortInUseError(f"tcp_port {port} is already in use on {bind_host or 'every interface'}: pick "
                             "another tcp_port, or tcp_port=0 for free ports.") from err
    mark_distributed_state()
    # The store's own client connects to it: through loopback when it listens on every interface.
    client_host = "127.0.0.1" if bind_host in ("", "0.0.0.0") else bind_host
    fd = sock.detach()  # the store owns (and closes) the descriptor from now on
    try:
        return dist.TCPStore(client_host, port, world_size, True, datetime.timedelta(seconds=timeout),
                             wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        socket.close(fd)
        raise


def group_store(store, rank: int, generation: int):
    """Where the group of node ``rank`` (its ``generation``-th start) rendezvous in the store."""
    return dist.PrefixStore(f"group/{rank}/{generation}", store)


def node_group(backend: str, store, rank: int, world_size: int, generation: int, timeout: float,
               device_host: str | None = None) -> tuple[Any, int]:
    """A node's side of its group: ``(group, rank of the main process in it)``, which is 0."""
    if backend in PAIR_BACKENDS:
        return make_process_group(backend, group_store(store, rank, generation), 1, 2, timeout, device_host), 0
    return make_process_group(backend, store, rank, world_size, timeout, device_host), 0


def _wait_in_thread(build: Callable[[], Any], timeout: float, alive: Callable[[], None], what: str) -> Any:
    """Run ``build`` in a thread, calling ``alive()`` (which raises) while waiting at most ``timeout`` s."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = build()
        except BaseException as err:  # surfaced below
            result["error"] = err

    thread = threading.Thread(target=run, name="rlharvest-pg-init", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while thread.is_alive():
        thread.join(0.1)
        alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout:g} s.")
    if "error" in result:
        raise RuntimeError(f"{what} failed: {result['error']}") from result["error"]
    return result["value"]


class Rendezvous:
    """The main process's side of node start-up: store, command listener, process groups.

    Args:
        bind_host: local address of every listening socket ("127.0.0.1" for local nodes).
        port: the collector's ``tcp_port``.
        world_size: nodes + 1.
        authkey: the key nodes must prove they hold on the command port.
        timeout: seconds the nodes have to join.
        user_timeout: TCP user timeout of the command channels.
        handshake_timeout: seconds a peer has to authenticate on the command port.
        device_host: gloo's local address (see :func:`make_process_group`).

    Raises:
        PortInUseError: naming ``tcp_port`` when the rendezvous port is taken.
    """

    def __init__(self, bind_host: str, port: int, world_size: int, authkey: bytes, *, timeout: float,
                 user_timeout: float, handshake_timeout: float, device_host: str | None = None) -> None:
        self.bind_host, self.port, self.world_size, self.authkey = bind_host, port, world_size, authkey
        self.timeout, self.device_host = timeout, device_host
        self.user_timeout, self.handshake_timeout = user_timeout, handshake_timeout
        self.store = store_server(bind_host, port, world_size, timeout)
        self.listener: ChannelListener | None = None
        self.open_commands()

    @staticmethod
    def check_port(port: int, bind_host: str) -> None:
        """Raises PortInUseError naming ``tcp_port`` if the rendezvous port is taken."""
        if not port_is_free(port, bind_host):
            raise PortInUseError(f"tcp_port {port} is already in use: pick another tcp_port (ports {port}, "
                                 f"{port + 1} and {port + 2} should be free), or tcp_port=0 for free ports.")

    def open_commands(self) -> None:
        """Listen for command channels (``tcp_port + 1``, or the next free port) until the awaited nodes
        connected; the store says where."""
        self.listener = ChannelListener(listen(self.bind_host, self.port + 1), self.authkey, "command",
                                        self.handshake_timeout, self.user_timeout)
        self.store.set(CONTROL_KEY, str(self.listener.port))

    def form_groups(self, backend: str, ranks: list[int], generation: int, op_timeout: float,
                    alive: Callable[[], None]) -> dict[int, tuple[Any, int]]:
        """Rank 0's side of the groups of ``ranks``: ``{rank: (group, rank of the node in it)}``.

        Raises:
            TimeoutError: when the nodes did not join within the rendezvous timeout.
        """
        if backend in PAIR_BACKENDS:
            def build():
                return {rank: (make_process_group(backend, group_store(self.store, rank, generation), 0, 2, op_timeout,
                                                  self.device_host), 1) for rank in ranks}
        else:
            def build():
                group = make_process_group(backend, self.store, 0, self.world_size, op_timeout, self.device_host)
                return {rank: (group, rank) for rank in ranks}
        return _wait_in_thread(build, self.timeout, alive, f"forming the {backend} process group")

    def accept_nodes(self, ranks: list[int], alive: Callable[[], None]) -> dict[int, Channel]:
        """The command channels of ``ranks``; then the command port closes.

        A peer is taken only once it proved it holds the key, and only for a rank that is expected
        and not yet connected; any other is dropped (and logged), never fatal.
        """
        channels: dict[int, Channel] = {}
        deadline = time.monotonic() + self.timeout
        while len(channels) < len(ranks):
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(channels)} of {len(ranks)} nodes connected within {self.timeout:g} s.")
            item = self.listener.next(0.2)
            if item is None:
                alive()
                continue
            channel, hello, peer = item
            rank = _hello_rank(hello)
            if rank is None or rank not in ranks or rank in channels:
                channel.close()
                self.listener.drop(peer, f"unexpected or duplicate hello {hello!r:.80}")
                continue
            channels[rank] = channel
        self.listener.close()
        return channels

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
        self.store = None


def _hello_rank(hello: Any) -> int | None:
    """The rank in a node's ``("hello", rank, pid, hostname)``, or None for anything else."""
    if isinstance(hello, tuple) and len(hello) == 4 and hello[0] == "hello" and type(hello[1]) is int:
        return hello[1]
    return None


# torch's tcp:// rendezvous would serve rank 0's store on every interface: the main process serves
# its own (store_server) and hands it to init_rpc through this URL scheme.
_SCHEME = "rlharvest"
_STORES: dict[str, Any] = {}
_REGISTERED: list = []


def _store_rendezvous(url: str, **kwargs):
    parsed = urlparse(url)
    query = parse_qs(parsed.query)
    yield _STORES[parsed.netloc], int(query["rank"][0]), int(query["world_size"][0])
    raise RuntimeError("the rlharvest rendezvous cannot be repeated")


def serve_rpc_store(bind_host: str, port: int, world_size: int, timeout: float) -> tuple[str, Any]:
    """Serve an RPC group's store on ``bind_host`` only; returns the ``init_method`` that uses it, and it."""
    if not _REGISTERED:
        register_rendezvous_handler(_SCHEME, _store_rendezvous)
        _REGISTERED.append(True)
    token = secrets.token_hex(8)
    store = _STORES[token] = store_server(bind_host, port, world_size, timeout)
    return f"{_SCHEME}://{token}", store


@contextlib.contextmanager
def tensorpipe_interface(name: str | None) -> Iterator[None]:
    """TensorPipe listens on the address of ``$TP_SOCKET_IFNAME`` (else of this host's name): set it
    to ``name`` while an agent starts. torch reads it once per process, at the first agent."""
    if name is None:
        yield
        return
    previous = os.environ.get("TP_SOCKET_IFNAME")
    os.environ["TP_SOCKET_IFNAME"] = name
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TP_SOCKET_IFNAME", None)
        else:
            os.environ["TP_SOCKET_IFNAME"] = previous


def release_rpc_store(init_method: str) -> None:
    _STORES.pop(urlparse(init_method).netloc, None)
