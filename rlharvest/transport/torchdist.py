"""The ``torchdist`` backend: nodes (on this or other machines) started through a launcher, a
torch.distributed process group per node for tensors, an authenticated TCP channel for commands.

Start-up (command listener, groups) is :mod:`rlharvest.transport.rendezvous` and
:mod:`rlharvest.transport.pairing`; the launchers (``mp``, ``submitit``, ``submitit_delayed``) are
:mod:`rlharvest.transport.launchers`; nodes that join (``"external"``) are
:mod:`rlharvest.transport.torchdist_join`. The command channel of a node (authenticated, see
:mod:`rlharvest.transport.channel`) carries typed commands and replies, the same messages as the
worker processes' pipes, plus heartbeats from the node (:mod:`.torchdist_endpoints`). A node that
replaces another is launched like the first ones, told a command port of its own: it forms a group
of its own with the main process, the other nodes keep theirs.

Keys (docs/security.md, "The key"): nodes the collector starts itself get only their slot's
credential (:class:`~rlharvest.transport.keys.NodeCredential`: its slot key and the learner's
public key), never the collector's secret: no node can act as the learner to another.
"""

from __future__ import annotations

import functools
import os
import socket
import time
from typing import Any, Sequence

import cloudpickle
import torch.distributed as dist

from ..errors import WorkerError
from ..protocol import WorkerSpec
from .base import Backend
from .channel import open_channel
from .keys import AUTHKEY_ENV, NodeCredential, parse_node_key
from .launchers import LaunchedNode, NodeTarget, launch_nodes
from .pairing import form_pair, make_process_group
from .rendezvous import CONTROL_KEY, PAIR_BACKENDS, Paired, Rendezvous
from .torchdist_endpoints import DistWorkerEndpoint, DistWorkerHandle, is_node_message
from .torchdist_join import JoinService, JoinWatcher
from .torchdist_weights import NodeWeightLinks

__all__ = ["TorchDistBackend", "DistWorkerHandle", "DistWorkerEndpoint", "join_as_node", "node_credential"]


def node_credential(rank: int, key: NodeCredential | str | bytes | None) -> NodeCredential:
    """What node ``rank`` proves it holds: ``key`` if it is a credential (or its text, as in the
    start arguments the collector gives), else its slot's credential derived from the collector's
    secret ``key`` (bytes: what :func:`~.keys.parse_node_key` returns for the collector's key;
    None: ``$RLHARVEST_AUTHKEY``).

    Raises:
        ValueError: no key, a malformed one, or the credential of another rank.
    """
    if key is None:
        text = os.environ.get(AUTHKEY_ENV)
        if not text:
            raise ValueError(f"this node has no key to authenticate with the main process: set {AUTHKEY_ENV} to "
                             "the collector's key (hex), see docs/security.md.")
        key = parse_node_key(text, AUTHKEY_ENV)
    elif isinstance(key, str):
        key = parse_node_key(key, "the node's key")
    if isinstance(key, (bytes, bytearray)):
        return NodeCredential.for_slot(bytes(key), rank)
    if key.key_id != rank:
        raise ValueError(f"the node's key is the one of rank {key.key_id} (0: nodes that join a collector of "
                         f"launcher='external', with --join), not of rank {rank}")
    return key


def join_as_node(rank: int, world_size: int, host: str, port: int, backend: str = "gloo", *,
                 credential: NodeCredential | str | bytes | None = None, command_port: int | None = None,
                 timeout: float = 120.0, op_timeout: float = 1800.0, user_timeout: float = 10.0,
                 heartbeat_interval: float = 1.0, handshake_timeout: float = 5.0,
                 device_host: str | None = None) -> tuple[DistWorkerEndpoint, bytes]:
    """A node's side of start-up: connect its command channel, form its group, receive its spec.

    ``credential``: see :func:`node_credential`; ``command_port``: where a replacement's listener is
    (else the collector's ``port``). Returns the endpoint the worker loop serves and the (pickled)
    spec. The node sends nothing that depends on its key before the main process proved it is the
    learner (a signature no node can make), and uses its group only once the main process proved
    it is the group's other end (:mod:`.pairing`).

    Raises:
        AuthenticationFailed: the command listener did not prove it is the learner.
        PairingFailed: the group did not form, or its peer is not the main process.
    """
    mine = node_credential(rank, credential)
    hello = ("hello", rank, os.getpid(), socket.gethostname())
    if backend in PAIR_BACKENDS:
        conn = open_channel(host, int(command_port or port), mine, timeout, user_timeout, handshake_timeout)
        conn.send_hello(hello)
        group, store = form_pair(conn, mine.key, 1, backend, timeout=timeout, op_timeout=op_timeout,
                                 device_host=device_host)
    else:  # mpi, ucc: one group of every rank, through torch's store at ``port``
        import datetime

        store = dist.TCPStore(host, int(port), world_size, False, datetime.timedelta(seconds=timeout))
        group = make_process_group(backend, store, rank, world_size, op_timeout, device_host)
        conn = open_channel(host, int(store.get(CONTROL_KEY)), mine, timeout, user_timeout, handshake_timeout)
        conn.send_hello(hello)
    payload = conn.recv_bytes()
    return DistWorkerEndpoint(conn, group, rank - 1, heartbeat_interval, store, mine.key), payload


class TorchDistBackend(Backend):
    """Nodes in torch.distributed process groups, started through a launcher.

    Args:
        num_workers: how many nodes.
        target: what every node runs (the node entry point, ``rlharvest.worker.nodes.node_main``).
        net: addresses, ports, key and timeouts (``collectors.options.network.NetworkConfig``).
        launcher: ``"mp"``, ``"submitit"`` or ``"submitit_delayed"``.
        backend: the process-group backend (``"gloo"``, ...).
        slurm_kwargs: SLURM parameters of the node jobs; start_method: of ``"mp"`` nodes.
        op_timeout: seconds a group operation may take.
    """

    noun = "node"

    def __init__(self, num_workers: int, target: NodeTarget, net: Any, *, launcher: str, backend: str = "gloo",
                 slurm_kwargs: dict | None = None, start_method: str | None = None, op_timeout: float = 1800.0) -> None:
        super().__init__(num_workers)
        self.target, self.net, self.launcher, self.backend = target, net, launcher, backend
        self.slurm_kwargs, self.start_method, self.op_timeout = slurm_kwargs, start_method, op_timeout
        self.launched: list[LaunchedNode | None] = [None] * num_workers
        self.rendezvous: Rendezvous | None = None
        #: ``launcher="external"``: the acceptor giving joining nodes their slots (torchdist_join)
        self.joins: JoinService | None = None
        #: seconds the last nodes took to connect and form their groups, once launched
        self.last_group_seconds: float | None = None

    @property
    def replaceable(self) -> bool:
        """Nodes started elsewhere (``launcher="submitit_delayed"``) cannot be started again: they only leave."""
        return self.launcher != "submitit_delayed"

    @property
    def refills_slots(self) -> bool:
        """``launcher="external"``: a node that joins takes the slot of one that left."""
        return self.launcher == "external"

    @property
    def growable(self) -> bool:
        """Nodes can be added where one can be replaced: each forms a group of its own with this process,
        like a replacement (``add_collectors``; with ``"external"``, the autoscaler takes nodes that joined
        the slots it opened, docs/elastic.md "Autoscaling")."""
        return self.backend in PAIR_BACKENDS and self.launcher != "submitit_delayed"

    def grow(self, count: int, options: Sequence[dict] | None = None) -> None:
        super().grow(count, options)
        self.launched.extend([None] * count)

    def truncate(self, num_workers: int) -> None:
        super().truncate(num_workers)
        del self.launched[num_workers:]

    def _launch(self, indices: list[int], command_port: int | None = None) -> None:
        """Start the nodes of ``indices``, each given its slot's credential only (and, for a
        replacement, the port of its own command listener)."""
        net = self.net
        for index in indices:
            kwargs = {**net.node_kwargs(), "command_port": command_port}
            if net.authkey is not None:
                kwargs.update(credential=NodeCredential.for_slot(net.authkey, index + 1).encode())
            self.launched[index], = launch_nodes(
                self.launcher, [index + 1], self.num_workers + 1, net.advertised_host, net.tcp_port, self.backend,
                target=self.target, slurm_kwargs=self.slurm_kwargs, start_method=self.start_method,
                node_kwargs=kwargs, warm_replacements=self.replacements_expected)

    def _alive(self, indices: list[int]):
        def check() -> None:
            for index in indices:
                node = self.launched[index]
                if not node.is_alive():
                    raise WorkerError(f"the node died while starting: {node.exit_description()}.", worker_idx=index)
        return check

    def _connect(self, specs: list[WorkerSpec]) -> list[DistWorkerHandle]:
        """Take the launched nodes' channels and groups, send them their specs."""
        indices = [spec.worker_idx for spec in specs]
        start = time.monotonic()
        paired = self.rendezvous.connect_nodes([index + 1 for index in indices], self.op_timeout,
                                               self._alive(indices))
        self.last_group_seconds = time.monotonic() - start
        return [self._handle(spec, paired[spec.worker_idx + 1], self.launched[spec.worker_idx]) for spec in specs]

    def _handle(self, spec: WorkerSpec, node: Paired, launched: LaunchedNode) -> DistWorkerHandle:
        node.channel.expect(functools.partial(is_node_message, worker_idx=spec.worker_idx),
                            f"a reply of node {spec.worker_idx} or a heartbeat")
        handle = DistWorkerHandle(node.channel, node.group, node.peer_rank, spec.worker_idx, launched,
                                  self.net.heartbeat_timeout, node.store)
        handle.conn.send_bytes(cloudpickle.dumps(spec))
        self.handles[spec.worker_idx] = handle
        return handle

    # ------------------------------------------------------------------ nodes that join (launcher="external")
    def open_joins(self, command: list[str] | None = None, watcher: JoinWatcher | None = None) -> None:
        """``launcher="external"``: listen on ``tcp_port`` and take joining nodes from now on
        (idempotent). ``command``: the argv that joins a node, named in the log while slots wait;
        ``watcher``: told of each node that joins and each refused."""
        if self.joins is not None:
            return
        net = self.net
        Rendezvous.check_port(net.tcp_port, net.bind_host)
        self.rendezvous = self._rendezvous()
        kwargs = {key: value for key, value in net.node_kwargs().items() if key in ("heartbeat_interval",)}
        self.joins = JoinService(self.rendezvous, self.backend, self.num_workers, kwargs, timeout=net.worker_timeout,
                                 op_timeout=self.op_timeout, command=" ".join(command) if command else None,
                                 watcher=watcher)

    def _take_joined(self, specs: list[WorkerSpec], what: str) -> list[DistWorkerHandle]:
        """The handles of the nodes that joined the slots of ``specs`` (waiting up to ``worker_timeout``)."""
        joined = self.joins.take([spec.worker_idx for spec in specs], self.net.worker_timeout, what)
        handles = []
        for spec in specs:
            node = joined[spec.worker_idx]
            self.launched[spec.worker_idx] = node.node
            handles.append(self._handle(spec, Paired(node.channel, node.group, 1, node.store), node.node))
        return handles

    def _rendezvous(self) -> Rendezvous:
        net = self.net
        return Rendezvous(net.bind_host, net.tcp_port, self.num_workers + 1, net.authkey, backend=self.backend,
                          timeout=net.worker_timeout, user_timeout=net.user_timeout,
                          handshake_timeout=net.handshake_timeout, device_host=net.device_host)

    def start_all(self, specs) -> list[DistWorkerHandle]:
        if self.launcher == "external":
            self.open_joins()
            return self._take_joined(list(specs), "the first batch waits for every slot")
        net = self.net
        Rendezvous.check_port(net.tcp_port, net.bind_host)
        # Nodes first (they retry until the command port listens): forking happens before this process
        # starts threads, and forked nodes inherit no listening socket of it.
        self._launch([spec.worker_idx for spec in specs])
        self.rendezvous = self._rendezvous()
        return self._connect(list(specs))

    def start_one(self, index: int, spec: WorkerSpec) -> DistWorkerHandle:
        """Launch a node in place of node ``index``, or a node added at index ``index`` after
        :meth:`grow`, which connects to a command listener of its own (a port from the OS, in its
        start arguments) and forms a group of its own with this process; the other nodes keep theirs.

        Raises:
            NotImplementedError: for nodes started elsewhere (``submitit_delayed``), or a backend
                whose group spans every node (mpi, ucc).
        """
        if self.launcher == "submitit_delayed":
            raise NotImplementedError("launcher='submitit_delayed': nodes are started elsewhere, so the collector "
                                      "cannot start one in place of another.")
        if self.backend not in PAIR_BACKENDS:
            raise NotImplementedError(f"backend={self.backend!r} forms one group of every node: a node cannot be "
                                      f"replaced (use one of {list(PAIR_BACKENDS)}).")
        if self.launcher == "external":  # the next node that joins this slot
            return self._take_joined([spec], f"replacing node {index}")[0]
        port = self.rendezvous.open_commands()
        try:
            self._launch([index], command_port=port)
        except BaseException:
            self.rendezvous.listener.close()
            raise
        return self._connect([spec])[0]

    def stop_one(self, index: int, deadline: float) -> None:
        handle, node = self.handles[index], self.launched[index]
        if handle is not None:
            handle.terminate(deadline)
        elif node is not None:
            node.terminate(deadline)
        if self.joins is not None and (handle is not None or node is not None):
            self.joins.want(index)  # an empty slot: the next node that joins takes it

    def retire(self, index: int) -> None:
        self.launched[index] = None  # its launcher's record (a process or a job) goes with it
        super().retire(index)

    def stop_all(self, deadline: float, closing=()) -> None:
        if self.joins is not None:
            self.joins.close()
            self.joins = None
        super().stop_all(deadline, closing)
        if self.rendezvous is not None:
            self.rendezvous.close()
            self.rendezvous = None

    def default_scheme(self) -> str:
        return "distributed"

    def peer(self, index: int) -> tuple[Any, int]:
        """The group reaching node ``index``, and the node's rank in it."""
        handle = self.handles[index]
        return handle.group, handle.peer_rank

    def weight_links(self) -> NodeWeightLinks:
        net = self.net
        return NodeWeightLinks(self.num_workers, self.liveness, host=net.advertised_host, bind_host=net.bind_host,
                               port=net.tcp_port + 2, peer=self.peer, user_timeout=net.user_timeout,
                               handshake_timeout=net.handshake_timeout,
                               relay_silence=min(net.user_timeout, net.heartbeat_timeout / 3), authkey=net.authkey)
