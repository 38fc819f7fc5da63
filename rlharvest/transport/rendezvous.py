"""How the main process and its nodes find each other: the command listener, the groups, and (for
backends that form one group of every node) the store.

Ports (``p`` = the collector's ``tcp_port``, see docs/security.md):

* ``p`` - the command listener: every node proves it holds its key before anything it sends is
  decoded (:mod:`rlharvest.transport.channel`). With gloo and nccl there is no store at all: a
  node's group with the main process forms over their authenticated channel
  (:mod:`rlharvest.transport.pairing`). Replacements started by the collector connect to a listener
  of their own, on a port from the OS that reaches them in their start arguments;
* ``p+2`` - the weight-sync listener of :class:`~rlharvest.weight_update.DistributedWeightSyncScheme`;
* mpi and ucc only: ``p`` is the ``TCPStore`` (torch's, unauthenticated) their one group of every
  rank forms through, and the command listener is ``p+1`` (or the next free port), which the store
  names. rlharvest binds the store's socket itself, to the collector's bind address.

Process groups are created explicitly (no ``init_process_group``), so several collectors, or a
learner's own default group, coexist in one process. With gloo and nccl every node gets a group of
its own with the main process (two ranks: the main process is 0, the node 1): batches and weights
only ever travel between the main process and one node, and a node that replaces another forms a
new group of its own while the other nodes keep theirs. mpi and ucc can only form one group of
every rank (``init_process_group``): their nodes cannot be replaced.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist
from torch.distributed.rendezvous import register_rendezvous_handler

from .channel import Channel, listen, slot_key
from .keys import MAX_RANK, LearnerIdentity, join_key
from .listener import ChannelListener
from .pairing import (PairingFailed, distributed_state_exists, form_pair, make_process_group,
                      mark_distributed_state)
from .ports import PortInUseError, not_this_host, port_is_free

__all__ = ["BACKENDS", "BATCH_TAG", "WEIGHTS_TAG", "PAIR_BACKENDS", "CONTROL_KEY", "check_backend", "command_keys",
           "make_process_group", "store_server", "Rendezvous", "Paired", "loopback_interface",
           "distributed_state_exists", "mark_distributed_state", "serve_rpc_store", "release_rpc_store",
           "tensorpipe_interface"]

BACKENDS = ("gloo", "nccl", "mpi", "ucc")
#: tags of the point-to-point messages on a node's group: its batches, and the weights sent to it
BATCH_TAG, WEIGHTS_TAG = 11, 12
#: backends whose groups are made explicitly, so that each node can have its own
PAIR_BACKENDS = ("gloo", "nccl")
#: mpi and ucc: where the store names the command port
CONTROL_KEY = "rlharvest/control_port"


def command_keys(authkey: bytes) -> Callable[[int], bytes | None]:
    """The keys the command listener takes from the collector's secret ``authkey``: the join key (id
    0, nodes that join or are started by hand) and every slot's (id = rank)."""
    joining = join_key(authkey)

    def keys(key_id: int) -> bytes | None:
        if key_id == 0:
            return joining
        return slot_key(authkey, key_id) if 0 < key_id <= MAX_RANK else None
    return keys


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


@dataclass
class Paired:
    """A node connected to the main process: its command channel and its group (and the node's rank
    in it); ``store`` is the group's store, which must live as long as the group."""

    channel: Channel
    group: Any
    peer_rank: int
    store: Any = None


class Rendezvous:
    """The main process's side of node start-up: command listener, process groups (and the store of
    backends that need one).

    Args:
        bind_host: local address of every listening socket ("127.0.0.1" for local nodes).
        port: the collector's ``tcp_port``.
        world_size: nodes + 1.
        authkey: the collector's secret: nodes prove they hold a key derived from it (their slot's, or
            the join key), and the listener proves first with the learner's identity derived from it.
        backend: the process-group backend.
        timeout: seconds the nodes have to join.
        user_timeout: TCP user timeout of the command channels.
        handshake_timeout: seconds a peer has to authenticate on the command port.
        device_host: gloo's local address (see :func:`make_process_group`).
        sock: the command port's listening socket, bound already (:meth:`command_socket`).

    Raises:
        PortInUseError: naming ``tcp_port`` when the rendezvous port is taken.
    """

    def __init__(self, bind_host: str, port: int, world_size: int, authkey: bytes, *, backend: str, timeout: float,
                 user_timeout: float, handshake_timeout: float, device_host: str | None = None,
                 sock: socket.socket | None = None) -> None:
        self.bind_host, self.port, self.world_size, self.authkey = bind_host, port, world_size, authkey
        self.backend, self.timeout, self.device_host = backend, timeout, device_host
        self.user_timeout, self.handshake_timeout = user_timeout, handshake_timeout
        #: the learner's signing key: the command listener proves with it before any node does
        self.identity = LearnerIdentity(authkey)
        self.pair = backend in PAIR_BACKENDS
        self.store = None if self.pair else store_server(bind_host, port, world_size, timeout)
        self.listener: ChannelListener | None = None
        self.open_commands(sock if sock is not None else self.command_socket(bind_host, port, backend))

    @staticmethod
    def check_port(port: int, bind_host: str) -> None:
        """Raises PortInUseError naming ``tcp_port`` if the rendezvous port is taken."""
        if not port_is_free(port, bind_host):
            raise PortInUseError(f"tcp_port {port} is already in use: pick another tcp_port (ports {port}, "
                                 f"{port + 1} and {port + 2} should be free), or tcp_port=0 for free ports.")

    @staticmethod
    def command_socket(bind_host: str, port: int, backend: str) -> socket.socket:
        """The command port's socket: ``tcp_port`` itself with a pair backend (nodes connect there),
        else ``tcp_port + 1`` or the next free port (the store names it).

        Raises:
            PortInUseError: naming ``tcp_port`` when it is taken.
        """
        if backend not in PAIR_BACKENDS:
            return listen(bind_host, port + 1)
        try:
            return listen(bind_host, port, attempts=1)
        except PortInUseError:
            raise PortInUseError(f"tcp_port {port} is already in use on {bind_host or 'every interface'}: pick "
                                 "another tcp_port, or tcp_port=0 for free ports.") from None

    def open_commands(self, sock: socket.socket | None = None) -> int:
        """Listen for command channels until the awaited nodes connected; returns the port. Without
        ``sock``: a port from the OS (a replacement is told it in its start arguments)."""
        if sock is None:
            sock = listen(self.bind_host, 0, attempts=1) if self.pair else listen(self.bind_host, self.port + 1)
        self.listener = ChannelListener(sock, command_keys(self.authkey), "command", self.handshake_timeout,
                                        self.user_timeout, identity=self.identity)
        if self.store is not None:
            self.store.set(CONTROL_KEY, str(self.listener.port))
        return self.listener.port

    def connect_nodes(self, ranks: list[int], op_timeout: float, alive: Callable[[], None]) -> dict[int, Paired]:
        """The nodes of ``ranks``, each connected and in its group; then the command port closes.

        A peer is taken only once it proved it holds its rank's slot key, and only for a rank that
        is expected and not yet connected; with a pair backend its group
        must then form over its channel and pass the pairing proof (:mod:`.pairing`). Any other is
        dropped (and logged), never fatal.

        Raises:
            TimeoutError: when the nodes did not connect within the rendezvous timeout.
        """
        if not self.pair:
            group = self._form_world(ranks, op_timeout, alive)
            channels: dict[int, Channel] = {}
            self._accept(ranks, alive, lambda rank, channel, peer: channels.update({rank: channel}),
                         channels.__contains__, lambda: len(channels) == len(ranks))
            return {rank: Paired(channels[rank], group, rank) for rank in ranks}
        paired: dict[int, Paired] = {}
        results: queue.Queue = queue.Queue()
        deadline = time.monotonic() + self.timeout
        abandoned = threading.Event()  # start-up failed: a pair forming still closes its channel

        def pair(rank: int, channel: Channel, peer) -> None:
            def run() -> None:
                try:
                    group, store = form_pair(channel, slot_key(self.authkey, rank), 0, self.backend,
                                             timeout=max(0.1, deadline - time.monotonic()), op_timeout=op_timeout,
                                             device_host=self.device_host)
                    results.put((rank, Paired(channel, group, 1, store), peer))
                    if abandoned.is_set():
                        channel.close()
                except (PairingFailed, OSError, EOFError) as err:
                    channel.close()
                    results.put((rank, err, peer))
            threading.Thread(target=run, name="rlharvest-pairing", daemon=True).start()

        def take_results() -> None:
            while True:
                try:
                    rank, outcome, peer = results.get_nowait()
                except queue.Empty:
                    return
                if isinstance(outcome, Paired):
                    paired[rank] = outcome  # stays in pending: its rank is taken
                else:
                    pending.discard(rank)
                    self.listener.drop(peer, f"node {rank} failed to pair: {outcome}")

        pending: set[int] = set()
        try:
            self._accept(ranks, alive, lambda rank, channel, peer: (pending.add(rank), pair(rank, channel, peer)),
                         pending.__contains__, lambda: len(paired) == len(ranks), poll=take_results,
                         wait=lambda: 0.005 if len(pending) > len(paired) else 0.1)  # a pair forming: look often
        except BaseException:
            abandoned.set()
            take_results()
            for node in paired.values():
                node.channel.close()
            raise
        return paired

    def _form_world(self, ranks: list[int], op_timeout: float, alive: Callable[[], None]) -> Any:
        """mpi, ucc: rank 0's side of the one group of every rank, through the store."""
        def build():
            return make_process_group(self.backend, self.store, 0, self.world_size, op_timeout, self.device_host)
        return _wait_in_thread(build, self.timeout, alive, f"forming the {self.backend} process group")

    def _accept(self, ranks: list[int], alive: Callable[[], None], take: Callable, taken: Callable[[int], bool],
                done: Callable[[], bool], poll: Callable[[], None] = lambda: None,
                wait: Callable[[], float] = lambda: 0.1) -> None:
        """Authenticated hellos of ranks in ``ranks`` not ``taken`` yet, handed to ``take(rank,
        channel, peer)``, until ``done()`` (looked at every ``wait()`` seconds at least); then the
        command port closes."""
        deadline = time.monotonic() + self.timeout
        while True:
            poll()
            if done():
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"not every node of {ranks} connected within {self.timeout:g} s.")
            alive()
            item = self.listener.next(wait())
            if item is None:
                continue
            channel, hello, peer = item
            rank = _hello_rank(hello)
            if rank is None or rank not in ranks or taken(rank) or channel.key_id != rank:
                channel.close()
                self.listener.drop(peer, f"unexpected or duplicate hello {hello!r:.80}")
                continue
            take(rank, channel, peer)
        self.listener.close()

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
        self.store = None


def _hello_rank(hello: Any) -> int | None:
    """The rank in a node's ``("hello", rank, pid, hostname)``, or None for anything else."""
    if (isinstance(hello, tuple) and len(hello) == 4 and hello[0] == "hello" and type(hello[1]) is int
            and type(hello[2]) is int and isinstance(hello[3], str)):
        return hello[1]
    return None


# torch's tcp:// rendezvous would serve rank 0's store on every interface: the main process serves
# its own (store_server) and hands it to init_rpc through this URL scheme.
_SCHEME = "rlharvest"
#: token -> the forwarder torch RPC's agent is given, until the collector releases it
_STORES: dict[str, "_ReleasableStore"] = {}
_REGISTERED: list = []


class _ReleasableStore(dist.Store):
    """What torch RPC's agent is given as its store: it forwards to the group's ``TCPStore`` until
    :meth:`release`, which drops the store, so its server stops listening and its connections close.

    torch keeps the first RPC agent of a process for the process's life (its RRef context, a leaky
    singleton, holds it), and with it the store the agent was given: that store's server listened on
    ``tcp_port`` after ``shutdown()``, with two connections to itself, and the next collector on the
    port could not start. A released forwarder holds nothing: what that first agent keeps is a few
    TensorPipe descriptors, and no port.
    """

    def __init__(self, store: dist.TCPStore) -> None:
        super().__init__()
        self._store: dist.TCPStore | None = store

    def release(self) -> None:
        self._store = None

    def _target(self) -> dist.TCPStore:
        store = self._store
        if store is None:
            raise RuntimeError("the collector that served this RPC group's store was shut down")
        return store

    def set(self, key, value):
        return self._target().set(key, value)

    def get(self, key):
        return self._target().get(key)

    def add(self, key, value):
        return self._target().add(key, value)

    def compare_set(self, key, expected, desired):
        return self._target().compare_set(key, expected, desired)

    def delete_key(self, key):
        return self._target().delete_key(key)

    def num_keys(self):
        return self._target().num_keys()

    def check(self, keys):
        return self._target().check(keys)

    def wait(self, keys, timeout=None):
        return self._target().wait(keys) if timeout is None else self._target().wait(keys, timeout)

    def set_timeout(self, timeout):
        super().set_timeout(timeout)
        self._target().set_timeout(timeout)


def _store_rendezvous(url: str, **kwargs):
    parsed = urlparse(url)
    query = parse_qs(parsed.query)
    yield _STORES[parsed.netloc], int(query["rank"][0]), int(query["world_size"][0])
    raise RuntimeError("the rlharvest rendezvous cannot be repeated")


def serve_rpc_store(bind_host: str, port: int, world_size: int, timeout: float) -> tuple[str, Any]:
    """Serve an RPC group's store on ``bind_host`` only; returns the ``init_method`` that uses it, and it
    (:func:`release_rpc_store` closes it)."""
    if not _REGISTERED:
        register_rendezvous_handler(_SCHEME, _store_rendezvous)
        _REGISTERED.append(True)
    token = secrets.token_hex(8)
    store = store_server(bind_host, port, world_size, timeout)
    _STORES[token] = _ReleasableStore(store)
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
    """Drop the store served for ``init_method``: once the caller drops its own reference too, its
    server stops listening and its connections close (whatever torch keeps of the RPC agent)."""
    forwarder = _STORES.pop(urlparse(init_method).netloc, None)
    if forwarder is not None:
        forwarder.release()
