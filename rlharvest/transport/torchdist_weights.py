"""Weights to nodes (the transport of DistributedWeightSyncScheme).

An update is announced on a per-node TCP channel (served by the sender on ``tcp_port + 2``) with its
version; the node applies it between two env steps by swapping its model's tensors (no copy) and
acknowledges the version once it applied (and cascaded) it. The payload travels

* to nodes on another host: as one flat tensor sent point-to-point over the process group, once per
  host: a host's *carrier* receives it into a named shared-memory slot it created and reports it
  (``staged``), then the host's other nodes map that slot (``torchdist_hosts``, docs/weights.md, "One
  copy per host"); a node alone on its host receives it into its own alternating pair of buffers;
  with two or more remote hosts, it leaves once, streamed over a link to the first host's carrier,
  and the carriers forward it host to host (``torchdist_relay``, docs/weights.md, "A relay between
  hosts");
* to a node on this host (it reached us through loopback, same kernel): through a named
  shared-memory generation buffer (``weight_pool``), copied once by the sender whatever the number
  of local nodes, instead of through loopback TCP.

The node's receiver (:mod:`.torchdist_receiver`) reads its channel in a thread, so the per-step check
is a flag read. A node that
replaces another connects a channel of its own after start-up (``replace`` reopens the listener,
``attach`` takes the new node and hands it the weights of the last update with that version); a
node added after start-up (``add_collectors``, the sender is ``growable``) is connected the same way
at a new index. The listener stays open while any replaced or added node has not connected yet.
"""

from __future__ import annotations

import datetime
import multiprocessing.connection as mpc
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from tensordict import TensorDictBase

from ..data.flat import FlatLayout, copy_leaves_
from ..errors import WorkerError, WorkerTimeoutError
from .base import WeightLinks, WeightSender, receive_from
from .channel import listen, slot_key
from .listener import ChannelListener
from .ports import boot_id
from .rendezvous import WEIGHTS_TAG
from .torchdist_hosts import RemoteHost, RemoteHosts
from .torchdist_receiver import DistWeightReceiver, NodeGroupLinks, is_receiver_message
from .torchdist_relay import (FROM_MAIN, Forwarder, Links, Stream, chunk_digests, relay_port_key, weight_key,
                              wrap_key)
from .weight_pool import GenerationBook, NamedShmAllocator

__all__ = ["NodeWeightLinks", "NodeGroupLinks", "DistWeightSender", "DistWeightReceiver"]

#: ``peer(worker) -> (group, rank)``: the process group reaching a node, and the node's rank in it
Peer = Callable[[int], "tuple[Any, int]"]


@dataclass
class NodeWeightLinks(WeightLinks):
    """What the weight senders of nodes need: where to listen, how to reach each node's group.

    Attributes:
        host: the address nodes connect to; bind_host: the address the listener binds.
        port: the weight channel's port.
        peer: the group reaching a node, and the node's rank in it.
        user_timeout: seconds of silence after which a blocked socket fails.
        handshake_timeout: seconds a node has to authenticate on the weight port.
        relay_silence: seconds a carrier waits for the carrier before it on the relay between hosts
            (to connect, or between two chunks) before it takes the update from the main process;
            below the heartbeat timeout, so that nodes waiting on a relay do not look dead.
        authkey: the collector's key, which every node's weight key derives from (never in a repr).
    """

    host: str = "127.0.0.1"
    bind_host: str = "127.0.0.1"
    port: int = 0
    peer: Peer | None = None
    user_timeout: float = 10.0
    handshake_timeout: float = 5.0
    relay_silence: float = 3.0
    authkey: bytes | None = field(default=None, repr=False)


class DistWeightSender(WeightSender):
    """Parent end: a listener for the nodes' weight channels, a shared-memory generation pool for
    nodes on this host and a flat send buffer for the others."""

    growable = True

    def __init__(self, num_workers: int, host: str, bind_host: str, port: int, peer: Peer,
                 liveness: Callable[[int], tuple[bool, str]] | None, user_timeout: float = 10.0,
                 handshake_timeout: float = 5.0, relay_silence: float = 3.0, relay: bool = True, *,
                 authkey: bytes) -> None:
        self.num_workers = num_workers
        self.host, self.bind_host, self.port = host, bind_host, port
        self.peer = peer
        self.liveness = liveness
        self.user_timeout, self.handshake_timeout = user_timeout, handshake_timeout
        self.relay_silence, self.relay = relay_silence, relay
        # Each node's weight key derives from its slot key and this salt: the salt reaches the nodes in
        # their spec, the keys never travel (docs/security.md, "The key").
        self._authkey, self.salt = authkey, os.urandom(16)
        self._keys: dict[int, bytes] = {}
        self.listener = self._listen()
        self.conns: dict[int, Any] = {}
        self.local: dict[int, bool] = {}
        #: the generations of nodes on this host, and the host slots of the others (ids of both kinds)
        self.book = GenerationBook(NamedShmAllocator)
        self._layout: FlatLayout | None = None
        self._flat: torch.Tensor | None = None
        self._view: TensorDictBase | None = None
        self._layout_sent: set[int] = set()
        self._works: list[tuple[int, Any]] = []
        self._unacked: dict[int, int] = {}
        self._hosts = RemoteHosts()
        #: ``worker -> (version, slot id)``: what a carrier last reported it holds
        self._staged: dict[int, tuple] = {}
        #: failures a node reported while the sender was busy elsewhere, raised by ``wait_acks``
        self._failures: dict[int, Any] = {}
        #: version of the last weights announced, and where they are (("shm", generation) or ("pg", None))
        self._latest: tuple[int, tuple] | None = None
        #: replaced or added nodes whose weight channel has not connected yet (the listener stays open)
        self._awaited: set[int] = set()
        #: ``worker -> (address, port)`` of a remote node's relay listener (docs/weights.md, "A relay between hosts")
        self._relay_at: dict[int, tuple[str, int]] = {}
        #: ``worker -> version``: carriers whose relay broke, which wait for the update from this process
        self._unrelayed: dict[int, int] = {}
        #: links to the first carrier of the chain, kept from one update to the next
        self._links = Links(FROM_MAIN, handshake_timeout, user_timeout)

    def key_of(self, worker: int) -> bytes:
        """The weight key of node ``worker`` (what it derives from its slot key and :attr:`salt`)."""
        key = self._keys.get(worker)
        if key is None:
            key = self._keys[worker] = weight_key(slot_key(self._authkey, worker + 1), self.salt)
        return key

    def _listen_keys(self, key_id: int) -> bytes | None:
        return self.key_of(key_id - 1) if 1 <= key_id <= self.num_workers else None  # key id: the node's rank

    def _listen(self) -> ChannelListener:
        return ChannelListener(listen(self.bind_host, self.port), self._listen_keys, "weight", self.handshake_timeout,
                               self.user_timeout)

    def connection_info(self) -> dict:
        return {"host": self.host, "port": self.listener.port, "salt": self.salt.hex(),
                "handshake_timeout": self.listener.handshake_timeout, "relay": self.relay}

    def connect(self, initial, timeout: float = 120.0) -> None:
        self._accept(list(range(self.num_workers)), timeout, "to connect its weight channel")
        if initial is None:
            for conn in self.conns.values():
                conn.send(("init", 0, None))
            return
        self._announce(initial, 0, list(range(self.num_workers)), "init", timeout)
        self._finish_sends(timeout)

    def _accept(self, workers: list[int], timeout: float, what: str) -> None:
        """The weight channels of ``workers`` (and of other awaited nodes that connect meanwhile); then,
        once no node is awaited, the port closes."""
        deadline = time.monotonic() + timeout
        here = boot_id()
        while any(w not in self.conns for w in workers):
            item = self.listener.next(0.2)
            if item is not None:
                conn, hello, peer = item
                worker = _hello_worker(hello, self.num_workers)
                expected = set(workers) | self._awaited
                if worker is None or worker not in expected or worker in self.conns or conn.key_id != worker + 1:
                    conn.close()
                    self.listener.drop(peer, f"unexpected or duplicate hello {hello!r:.80}")
                    continue
                conn.expect(is_receiver_message, "an acknowledgement, a failure or a staged update")
                self.conns[worker] = conn
                self._awaited.discard(worker)
                self.local[worker] = bool(hello[2]) and hello[3] == here
                if not self.local[worker] and len(hello) >= 5 and peer:
                    self._hosts.join(worker, (peer[0], hello[3], hello[4]))
                    self._relay_at.update({worker: (peer[0], hello[5])} if len(hello) == 6 else {})
                continue
            self._check_peers([w for w in workers if w not in self.conns], what)
            if time.monotonic() > deadline:
                missing = sum(w not in self.conns for w in workers)
                raise WorkerTimeoutError(f"{missing} of {len(workers)} nodes did not connect their weight channel "
                                         "in time.")
        if not self._awaited:
            self.listener.close()  # every awaited node is connected: the port closes

    # ------------------------------------------------------------------ replacements
    def retire(self, worker: int) -> None:
        """Node ``worker`` left for good: close its weight channel and forget it (its slot stays)."""
        self._forget(worker)
        self._awaited.discard(worker)
        if not self._awaited and not self.listener.closed:
            self.listener.close()

    def replace(self, worker: int) -> None:
        if worker >= self.num_workers:  # a node added after start-up (Backend.grow)
            self.num_workers = worker + 1
        self._forget(worker)
        self._awaited.add(worker)
        if self.listener.closed:  # else it is still open for another awaited node: its port stays
            self.listener = self._listen()  # connection_info() now names its port

    def _forget(self, worker: int) -> None:
        conn = self.conns.pop(worker, None)
        if conn is not None:
            conn.close()
        self.local.pop(worker, None)
        self._hosts.leave(worker)
        self._links.drop(self._relay_at.get(worker))
        self.book.forget(worker)
        self._layout_sent.discard(worker)
        for state in (self._unacked, self._staged, self._failures, self._relay_at,
                      self._unrelayed):
            state.pop(worker, None)

    def attach(self, worker: int, timeout: float) -> None:
        """Take the new node's channel and hand it the last weights announced, with their version."""
        self._accept([worker], timeout, "to connect its weight channel")
        if self._latest is None:
            self.conns[worker].send(("init", 0, None))
            return
        version, (where, generation) = self._latest
        self._finish_sends(timeout)  # the flat buffer is re-sent from, or re-staged into
        self._announce(generation.view if where == "shm" else self._view, version, [worker], "init", timeout)
        self._finish_sends(timeout)

    def _announce(self, payload: TensorDictBase, version: int, workers: list[int], kind: str,
                  timeout: float) -> None:
        local = [w for w in workers if self.local[w]]
        remote = [w for w in workers if not self.local[w]]
        if kind != "init":  # before sending: a carrier's acknowledgement may be read while relaying
            self._unacked.update({w: version for w in workers})
        if local:
            generation = self.book.stage(payload)
            self._latest = (version, ("shm", generation))
            for worker in local:
                handle = self.book.hand(worker, generation.gen_id, generation.handle)
                self.conns[worker].send((kind, version, ("shm", generation.gen_id, handle)))
        if remote:
            self._stage_flat(payload)
            self._latest = (version, ("pg", None))
            direct, shared, chain = self._plan(remote)
            for worker in direct:
                self._send_flat(worker, (kind, version, ("pg", self._layout_for(worker))))
            routes = {host: self._to_carrier(host, targets, kind, version) for host, targets in shared.items()}
            routes.update(self._to_chain(chain, kind, version))
            self._relay(routes, kind, version, timeout)
        if kind == "init":  # initial weights are not acknowledged: the node runs on them once connected
            for worker in workers:
                self.book.acknowledged(worker)

    def _layout_for(self, worker: int) -> FlatLayout | None:
        """The layout, the first time ``worker`` gets a flat tensor (it keeps it)."""
        if worker in self._layout_sent:
            return None
        self._layout_sent.add(worker)
        return self._layout

    def _send_flat(self, worker: int, message: tuple) -> None:
        self.conns[worker].send(message)
        group, rank = self.peer(worker)
        self._works.append((worker, group.send([self._flat], rank, WEIGHTS_TAG)))

    # ------------------------------------------------------------------ one copy per remote host
    def _to_carrier(self, host: RemoteHost, targets: list[int], kind: str, version: int) -> list[int]:
        """Send the update once to ``host``: to its carrier, the first live node of ``targets`` (the
        current carrier if it is one, so its slots are reused). Returns the targets still waiting,
        carrier first; nodes found dead are left out (``wait_acks`` reports them)."""
        waiting = self._pick_carrier(host, targets)
        if waiting:
            self._announce_slot(host, kind, version, None)
        return waiting

    def _pick_carrier(self, host: RemoteHost, targets: list[int]) -> list[int]:
        alive = [w for w in targets if self._alive(w)]
        if not alive:
            return []
        if host.carrier not in alive:
            host.retire_carrier()
            host.carrier = alive[0]
        return [host.carrier] + [w for w in alive if w != host.carrier]

    def _announce_slot(self, host: RemoteHost, kind: str, version: int, relay: tuple | None) -> None:
        """Tell ``host``'s carrier which slot to take the update into; from this process over its
        group unless ``relay`` (``(upstream, downstream carrier, silence, stream, chunk digests)``)
        puts it on the relay between hosts."""
        carrier = host.carrier
        members = [w for w in host.members if w in self.conns]
        slot_id, _ = host.choose_slot(self.book.busy(members))
        unlink, host.orphans = host.orphans, []
        self.book.pending[carrier] = slot_id  # the carrier made the slot: it maps it without a handle
        body = ("pg-host", slot_id, host.slots[slot_id], self._layout_for(carrier), unlink)
        try:
            if relay is None:
                self._send_flat(carrier, (kind, version, body))
                return
            upstream, downstream, silence, stream, digests = relay
            if downstream is not None:  # the next carrier's relay key, for this carrier only
                downstream = (*self._relay_at[downstream], wrap_key(self._relay_key(downstream), self.key_of(carrier)))
            self.conns[carrier].send((kind, version, body + ((upstream, downstream, silence, stream.nonce,
                                                              stream.chunk, digests),)))
        except OSError:  # its channel broke: _relay finds it lost and picks another carrier
            return
        if upstream == FROM_MAIN:  # the first of the chain: streamed over its link, tagged once here
            self._stream_to(carrier, stream, silence)

    def _stream_to(self, carrier: int, stream: Stream, silence: float) -> None:
        """The update to ``carrier`` over the link to its relay port, from a thread (``_finish_sends``
        waits for it before the flat buffer is written again)."""
        address, key = self._relay_at[carrier], self._relay_key(carrier)
        forwarder = Forwarder(lambda: self._links.get(address, key), lambda: self._links.drop(address),
                              memoryview(self._flat.numpy()), stream, silence)
        forwarder.put_all()
        self._works.append((carrier, forwarder))

    # ------------------------------------------------------------------ a relay between hosts
    def _relay_key(self, carrier: int) -> bytes:
        """The key of ``carrier``'s relay port (derived from its weight key)."""
        return relay_port_key(self.key_of(carrier))

    def _plan(self, remote: list[int]) -> tuple[list[int], dict, dict]:
        """``remote`` split into nodes sent their own copy, hosts sent one copy each, and hosts on the
        relay chain (every host whose nodes all listen for a relay, when there are two or more)."""
        if not self.relay:
            return (*self._hosts.route(remote), {})
        every = self._hosts.route(remote, min_shared=1)[1]
        chain = {h: t for h, t in every.items() if all(w in self._relay_at for w in t)}
        if len(chain) < 2:
            return (*self._hosts.route(remote), {})
        direct, shared = self._hosts.route([w for w in remote if all(w not in t for t in chain.values())])
        return direct, shared, chain

    def _to_chain(self, chain: dict[RemoteHost, list[int]], kind: str, version: int) -> dict:
        """The update to the first host's carrier over a link from this process, forwarded carrier to
        carrier along the hosts of ``chain``; returns the targets still waiting per host, as
        ``_to_carrier``."""
        routes = {host: self._pick_carrier(host, targets) for host, targets in chain.items()}
        # nodes that reached this process from its own address come first: their copy crosses no
        # link, and the one copy out of this machine is then theirs, to the next host
        here = {self.host, self.bind_host}
        links = sorted((host for host, waiting in routes.items() if waiting), key=lambda h: h.address not in here)
        stream = Stream.new(version, self._flat.numel())  # its nonce ties the stream to this update
        digests = chunk_digests(memoryview(self._flat.numpy()), stream) if links else b""
        for index, host in enumerate(links):
            upstream = links[index - 1].carrier if index > 0 else FROM_MAIN
            downstream = links[index + 1].carrier if index + 1 < len(links) else None
            self._announce_slot(host, kind, version, (upstream, downstream, self.relay_silence, stream, digests))
        return routes

    def _send_unrelayed(self, carrier: int, version: int) -> None:
        """A carrier's relay broke: it waits for the update from this process, over its group."""
        if self._unrelayed.pop(carrier, None) != version:
            return
        group, rank = self.peer(carrier)
        self._works.append((carrier, group.send([self._flat], rank, WEIGHTS_TAG)))

    def _relay(self, routes: dict[RemoteHost, list[int]], kind: str, version: int, timeout: float) -> None:
        """Wait until each host's carrier holds the update, then let the host's other nodes map it.

        A carrier that dies (or fails) before it reported the update is replaced by the next live node
        of its host, which is sent the update instead: the others never wait on a dead node.
        """
        deadline = time.monotonic() + timeout
        waiting = {host: targets for host, targets in routes.items() if targets}
        while waiting:
            for host in list(waiting):
                carrier, *others = waiting[host]
                state = self._carrier_state(carrier, version)
                if state == "waiting":
                    self._send_unrelayed(carrier, version)
                    continue
                if state == "staged" and self._staged[carrier][1] not in host.slots:  # not a slot it was given
                    state = "lost"
                if state == "staged":
                    _, slot_id = self._staged[carrier]
                    handle = (host.slots[slot_id], self._layout)
                    for worker in others:
                        self._map_slot(worker, kind, version, slot_id, handle)
                    del waiting[host]
                    continue
                self.book.dropped(carrier)  # lost: the update goes to the next node of the host
                host.retire_carrier()
                waiting[host] = self._to_carrier(host, others, kind, version) if others else []
                if not waiting[host]:
                    del waiting[host]
            if not waiting:
                return
            if time.monotonic() > deadline:
                stuck = sorted(targets[0] for targets in waiting.values())
                raise WorkerTimeoutError(f"nodes {stuck} did not receive the weights of their host within "
                                         f"{timeout:g} s.", worker_idx=stuck[0])
            mpc.wait([self.conns[targets[0]] for targets in waiting.values()], 0.2)

    def _carrier_state(self, carrier: int, version: int) -> str:
        """``"staged"`` (it holds ``version``), ``"waiting"`` or ``"lost"`` (dead, or it failed first)."""
        conn = self.conns[carrier]
        try:
            while conn.poll(0):
                self._take(carrier, conn.recv())
        except (EOFError, OSError):
            return "lost"
        staged = self._staged.get(carrier)
        if staged is not None and staged[0] == version:
            return "staged"
        if carrier in self._failures or not self._alive(carrier):
            return "lost"
        return "waiting"

    def _map_slot(self, worker: int, kind: str, version: int, slot_id: tuple, handle) -> None:
        handle = self.book.hand(worker, slot_id, handle)
        try:
            self.conns[worker].send((kind, version, ("shm", slot_id, handle)))
        except OSError:
            pass  # its channel broke: wait_acks reports the node

    def _alive(self, worker: int) -> bool:
        conn = self.conns.get(worker)
        if conn is None or conn.closed:
            return False
        return self.liveness is None or self.liveness(worker)[0]

    def _take(self, worker: int, message) -> None:
        """One message of ``worker``'s weight channel: an acknowledgement, a failure, a staged slot."""
        if message[0] == "ack":
            _, acked, gen_id = message
            if gen_id is not None:
                self.book.acknowledged(worker, gen_id)
            else:  # it runs on its own buffers
                self.book.current.pop(worker, None)
            if worker in self._unacked and acked >= self._unacked[worker]:
                del self._unacked[worker]
        elif message[0] == "error":
            self._unacked.pop(worker, None)
            self.book.dropped(worker)
            self._failures[worker] = message[1]
        elif message[0] == "unrelayed":
            self._unrelayed[worker] = message[1]
        elif message[0] == "staged":
            _, version, slot_id = message
            self._staged[worker] = (version, slot_id)

    def _stage_flat(self, weights: TensorDictBase) -> None:
        if self._layout is None:
            self._layout = FlatLayout.of(weights)
            self._flat, self._view = self._layout.allocate()
        copy_leaves_(self._view, weights)

    def _finish_sends(self, timeout: float) -> None:
        works, self._works = self._works, []
        for worker, work in works:
            try:
                work.wait(datetime.timedelta(seconds=timeout))
            except RuntimeError as err:  # the node died (or its host vanished) while receiving
                raise WorkerError(f"sending it new weights failed ({err}).", worker_idx=worker) from err

    def deliver(self, payload, version: int, worker_ids: list[int]) -> None:
        self._finish_sends(120.0)  # the flat buffer may still be read by an unfinished (sync=False) send
        if self.book.pending:  # a generation announced without acknowledgement may still be mapped in
            self.wait_acks(version - 1, list(self.book.pending), 120.0)
        self._announce(payload, version, worker_ids, "update", 120.0)

    def wait_acks(self, version: int, worker_ids: list[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._finish_sends(timeout)
        for worker in worker_ids:
            while worker in self._unacked:
                self._take(worker, self._recv(worker, deadline))
            failure = self._failures.pop(worker, None)
            if failure is not None:
                raise failure.to_exception(context="applying new weights")

    def _recv(self, worker: int, deadline: float):
        return receive_from(self.conns[worker], worker, deadline, "an acknowledgement of new weights", self.liveness)

    def _check_peers(self, workers: list[int], what: str) -> None:
        if self.liveness is None:
            return
        for worker in workers:
            alive, description = self.liveness(worker)
            if not alive:
                raise WorkerError(f"died while the main process waited for it {what}: {description}.",
                                  worker_idx=worker)

    def close(self) -> None:
        for conn in self.conns.values():
            try:
                conn.close()
            except OSError:
                pass
        self.listener.close()
        self._links.close()
        self.book.close()


def _hello_worker(hello: Any, num_workers: int) -> int | None:
    """The worker index in a node's ``("hello", worker, local, boot_id, shm_identity)`` if it is a valid one
    (a node of an earlier release says no ``shm_identity``: it gets its own copy of each update)."""
    if (isinstance(hello, tuple) and len(hello) in (4, 5, 6) and hello[0] == "hello" and type(hello[1]) is int
            and 0 <= hello[1] < num_workers and (len(hello) < 6 or type(hello[5]) is int)):
        return hello[1]
    return None
