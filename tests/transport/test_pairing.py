"""A node's group with the main process, formed over their authenticated channel (transport/pairing.py),
over loopback: the pair forms and carries tensors; a stranger who takes the main process's side of
the group (here: its gloo address handed to the main process, as a hijacked rendezvous would) fails
the proof on both sides; a peer that writes too much, or a key that does not decode, is dropped; a
flood on gloo's port while the pair forms gets nothing open.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist
from attackers import PortFlooder, listening

from rlharvest.transport import pairing
from rlharvest.transport.channel import listen, new_authkey, open_channel
from rlharvest.transport.listener import ChannelListener
from rlharvest.transport.pairing import PAIR_TAG, ChannelStore, PairingFailed, form_pair

pytestmark = pytest.mark.timeout(90)

#: connections a stranger opens to gloo's port while the pair waits for its node
FLOOD = 600


@pytest.fixture
def channels():
    """Both ends of an authenticated channel on loopback: (main process's end, node's end, key)."""
    key = new_authkey()
    listener = ChannelListener(listen("127.0.0.1", 0), key, "test", 5.0, 10.0)
    node = open_channel("127.0.0.1", listener.port, key, 10.0, 10.0, 5.0)
    node.send_hello(("hello", 1))
    main, _, _ = listener.next(10.0)
    yield main, node, key
    for channel in (main, node):
        channel.close()
    listener.close()


def listening_here() -> set:
    """The addresses this process listens on (TCP, IPv4 and IPv6)."""
    return {c.laddr for c in psutil.Process().net_connections("inet") if c.status == "LISTEN"}


def _both(main_side, node_side) -> tuple[list, list]:
    """Run both sides at once; each side's result or exception."""
    results: tuple[list, list] = ([], [])

    def run(side, out) -> None:
        try:
            out.append(side())
        except BaseException as err:  # reported by the test
            out.append(err)

    threads = [threading.Thread(target=run, args=(side, out), daemon=True)
               for side, out in ((main_side, results[0]), (node_side, results[1]))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60.0)
    return results


def test_a_pair_forms_over_its_channel_and_carries_tensors_and_closes_its_ports(channels):
    """Once connected, neither side's gloo port takes connections (gloo would keep each one forever)."""
    main, node, key = channels
    before = listening_here()
    (main_pair,), (node_pair,) = _both(
        lambda: form_pair(main, key, 0, "gloo", timeout=20.0, op_timeout=60.0, device_host="127.0.0.1"),
        lambda: form_pair(node, key, 1, "gloo", timeout=20.0, op_timeout=60.0, device_host="127.0.0.1"))
    (main_group, _), (node_group, _) = main_pair, node_pair
    sent, got = torch.arange(10, dtype=torch.float32), torch.zeros(10)
    works = [node_group.send([sent], 0, 11), main_group.recv([got], 1, 11)]
    for work in works:
        work.wait(datetime.timedelta(seconds=10))
    assert torch.equal(sent, got)
    assert listening_here() <= before
    main.send(("after", 1))  # the channel holds nothing of the pairing any more
    assert node.recv() == ("after", 1)


def test_a_stranger_who_takes_the_main_process_side_of_the_group_fails_the_proof(channels, monkeypatch):
    """The main process is handed the stranger's gloo address instead of the node's: its group pairs
    with the stranger (who even answers the proof's bytes), but the node never received the main
    process's bytes, so no proof arrives on the channel: both sides refuse the pair."""
    main, node, key = channels
    theirs = dist.HashStore()  # the stranger's store: what the main process writes reaches it too
    heard = threading.Event()

    class Hijacked(ChannelStore):
        """The main process's store hands it the stranger's address (the node's store is left alone)."""

        def set(self, name, value):
            super().set(name, value)
            if self.channel is main:
                theirs.set(name, value)

        def wait(self, names, timeout=None):
            if self.channel is not main:
                return super().wait(names, timeout)
            mine = [name for name in names if name in self._data]
            super().wait(mine, timeout)
            theirs.wait([name for name in names if name not in mine], datetime.timedelta(seconds=8))

        def get(self, name):
            if self.channel is not main or name in self._data:
                return super().get(name)
            self.wait([name])
            return theirs.get(name)

    def stranger() -> None:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=8)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        group = dist.ProcessGroupGloo(theirs, 1, 2, options)
        noise, sink = torch.frombuffer(bytearray(os.urandom(32)), dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8)
        try:  # it answers the proof's bytes as a node would, over the group
            for work in (group.send([noise], 0, PAIR_TAG), group.recv([sink], 0, PAIR_TAG)):
                work.wait(datetime.timedelta(seconds=8))
            heard.set()  # the main process's bytes reached the stranger
        except RuntimeError:  # the main process dropped the group meanwhile
            pass

    attacker = threading.Thread(target=stranger, daemon=True)
    attacker.start()
    monkeypatch.setattr(pairing, "ChannelStore", Hijacked)
    started = time.monotonic()
    main_result, node_result = _both(
        lambda: form_pair(main, key, 0, "gloo", timeout=4.0, op_timeout=60.0, device_host="127.0.0.1"),
        lambda: form_pair(node, key, 1, "gloo", timeout=4.0, op_timeout=60.0, device_host="127.0.0.1"))
    # neither side overruns its 4 s deadline much: gloo alone would wait 5 x its timeout for a connection
    # the stranger's group holds (20 s), so it is given a fifth of the deadline (pairing.GLOO_CONNECT_FACTOR)
    assert time.monotonic() - started < 10.0, (main_result, node_result)
    attacker.join(30.0)
    # The stranger's side of a gloo group may report itself formed once its connect went out (under load
    # its constructor can return before the main process's gate drops the connection); what must never
    # happen is a pair the main process keeps whose bytes reached the stranger.
    assert not (heard.is_set() and not isinstance(main_result[0], PairingFailed)), "the stranger's group was taken"
    if isinstance(main_result[0], PairingFailed):  # the stranger took the main process's group, or held it
        assert isinstance(node_result[0], PairingFailed), node_result
        return
    # the node's connection reached the main process's listener: the pair is the node's, as the proofs
    # say; it must carry the main process's bytes to the node, not the stranger
    (main_group, _), (node_group, _) = main_result[0], node_result[0]
    sent, got = torch.arange(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    send, recv = main_group.send([sent], 1, 7), node_group.recv([got], 0, 7)
    send.wait(datetime.timedelta(seconds=10))
    recv.wait(datetime.timedelta(seconds=10))
    assert torch.equal(sent, got)


def test_a_peer_that_writes_too_much_into_the_pair_store_is_dropped(channels):
    main, node, key = channels
    for index in range(100):
        node.send_bytes(b"S" + len(b"k%d" % index).to_bytes(2, "big") + b"k%d" % index + b"x")
    with pytest.raises(PairingFailed, match="more than a pair's store holds"):
        form_pair(main, key, 0, "gloo", timeout=10.0, op_timeout=60.0, device_host="127.0.0.1")


def test_a_peer_that_writes_a_key_that_is_not_utf8_fails_the_pair_and_nothing_else(channels):
    """A store key that does not decode is the peer's failure (PairingFailed: the caller drops that
    node and gives its slot back), never an error escaping the pairing."""
    main, node, key = channels
    node.send_bytes(b"S" + (2).to_bytes(2, "big") + b"\xff\xfe" + b"value")
    with pytest.raises(PairingFailed, match="not UTF-8"):
        form_pair(main, key, 0, "gloo", timeout=10.0, op_timeout=60.0, device_host="127.0.0.1")


def open_on(port: int) -> list[int]:
    """The ports of this process's connections whose local end is ``port`` (accepted on it)."""
    return [c.raddr.port for c in psutil.Process().net_connections("inet")
            if c.laddr and c.laddr.port == port and c.status != "LISTEN"]


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_a_flood_on_gloo_port_while_a_pair_forms_leaves_nothing_open(channels, host):
    """A stranger who floods the main process's gloo port while its pair waits for the node gets no
    connection completed (transport/gloo_gate.py: gloo would keep each one for the group's life, and
    abort once no descriptor is left): the descriptors stay where they were, and once the pair formed
    nothing but its own connection is open on that port, which no longer listens, IPv4 or IPv6."""
    main, node, key = channels
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    me = psutil.Process()
    fds = me.num_fds()
    stranger = PortFlooder(os.getpid(), host, FLOOD)  # the main process's gloo port, the first to open
    results: dict[int, object] = {}

    def side(rank: int, channel) -> None:
        try:
            results[rank] = form_pair(channel, key, rank, "gloo", timeout=30.0, op_timeout=60.0, device_host=host)
        except Exception as err:  # reported below
            results[rank] = err

    learner = threading.Thread(target=side, args=(0, main), daemon=True)
    learner.start()
    try:
        assert stranger.done.wait(60.0), "the stranger never found gloo's port"
        side(1, node)  # the node comes once the stranger flooded the main process's port
        learner.join(60.0)
        assert all(isinstance(results[rank], tuple) for rank in (0, 1)), results
        (main_group, _), (node_group, _) = results[0], results[1]
        sent, got = torch.arange(10, dtype=torch.float32), torch.zeros(10)
        for work in (node_group.send([sent], 0, 11), main_group.recv([got], 1, 11)):
            work.wait(datetime.timedelta(seconds=10))
        assert torch.equal(sent, got)
        assert stranger.port not in listening(os.getpid(), family)  # gloo's port closed once the pair formed
        assert len(open_on(stranger.port)) <= 1, open_on(stranger.port)  # the pair's own connection at most
        # this process's descriptors: the stranger's sockets, the two groups' own, nothing of the flood
        assert me.num_fds() - len(stranger.sockets) - fds <= 24, (me.num_fds(), len(stranger.sockets), fds)
    finally:
        stranger.close()


def test_a_wait_for_a_key_returns_while_another_thread_holds_the_frames(channels):
    """While gloo connects, a thread of the pairing reads the peer's frames (:meth:`ChannelStore.reading`)
    and gloo's thread waits for a key. That thread takes the frames' lock back microseconds after each
    read, so a wait queued for the lock could last as long as the connect (a node waited 11 s for a key
    already read, its group 4-16 s late): a wait looks at what the reading thread applied instead. Here
    the reading thread holds the lock all along, as it nearly does."""
    main, node, key = channels
    store = ChannelStore(node, time.monotonic() + 30.0)
    holding, applied, release, done = threading.Event(), threading.Event(), threading.Event(), threading.Event()

    def reading_thread() -> None:
        with store._reading:  # noqa: SLF001 - the lock ChannelStore.reading's thread holds while it reads
            holding.set()
            while "0/0" not in store._data:  # noqa: SLF001
                if store.channel.poll(0.05):
                    store._apply(store.channel.recv_bytes())  # noqa: SLF001
            applied.set()
            release.wait(30.0)

    def waiter() -> None:
        store.wait(["0/0"])
        done.set()

    reader = threading.Thread(target=reading_thread, daemon=True)
    reader.start()
    assert holding.wait(10.0)
    waiting = threading.Thread(target=waiter, daemon=True)
    waiting.start()  # waits before the key comes, as gloo's thread does
    ChannelStore(main, time.monotonic() + 30.0).set("0/0", b"address")
    assert applied.wait(10.0)
    finished = done.wait(10.0)
    release.set()
    for thread in (reader, waiting):
        thread.join(30.0)
    assert finished, "a wait for a key another thread had applied queued for the frames' lock"
    assert store.get("0/0") == b"address"
