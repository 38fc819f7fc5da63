"""Authenticated channels (rlharvest/transport/channel.py) against strangers, over loopback only.

Every attack here is a peer on 127.0.0.1 without the key: silent, garbage, a slow drip, a wrong key,
a fake listener, a relay, a flood from one address. None may stall the listener, crash it, or get
anything unpickled. A peer *with* the key cannot get a pickled hello or message unpickled by the
listener either (rlharvest/transport/wire.py: nodes send wire format 2, never pickles).
"""

from __future__ import annotations

import logging
import multiprocessing.connection as mpc
import os
import pickle
import select
import socket
import struct
import threading
import time

import pytest
from attackers import Squatter
from mocks import wait_until

from rlharvest.transport.channel import (AuthenticationFailed, RefusedMessage, listen, new_authkey, open_channel,
                                         parse_authkey, slot_key)
from rlharvest.transport.handshake import MAGIC
from rlharvest.transport.keys import LearnerIdentity, NodeCredential, as_credential, parse_node_key, stretch_authkey
from rlharvest.transport.listener import ChannelListener
from rlharvest.transport.rendezvous import command_keys
from rlharvest.transport.wire import encode_from_node

pytestmark = pytest.mark.timeout(60)


class Boom:
    """Unpickling this creates ``path``: proof that a stranger's bytes were unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def listener():
    key = new_authkey()
    server = ChannelListener(listen("127.0.0.1", 0), key, "test", handshake_timeout=1.0, user_timeout=5.0)
    server.key = key
    yield server
    server.close()


def connect(listener, key=None, hello=("hello", 1)):
    channel = open_channel("127.0.0.1", listener.port, key or listener.key, timeout=5.0, user_timeout=5.0,
                           handshake_timeout=2.0)
    channel.send_hello(hello)
    return channel


def raw(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def closed_by_peer(sock: socket.socket, within: float) -> bool:
    """Whether the peer closed ``sock`` (EOF or reset) within ``within`` seconds."""
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_messages_round_trip_after_the_handshake(listener):
    peer = connect(listener, hello=("hello", 7, "x"))
    channel, hello, _ = listener.next(5.0)
    assert hello == ("hello", 7, "x")
    channel.send({"command": 1})
    assert peer.recv() == {"command": 1}
    peer.send_bytes(b"payload" * 1000)
    assert channel.recv_bytes() == b"payload" * 1000
    peer.close()
    channel.close()


@pytest.mark.parametrize("attack", ["silent", "garbage", "huge-length", "mp-challenge", "slow-drip"])
def test_strangers_are_dropped_and_logged_while_real_peers_get_in(listener, attack, caplog):
    caplog.set_level(logging.WARNING, logger="rlharvest")
    stranger = raw(listener.port)
    if attack == "garbage":
        stranger.sendall(b"\xff" * 16)
    elif attack == "huge-length":
        stranger.sendall(struct.pack("!i", -1) + struct.pack("!Q", 1 << 40))
    elif attack == "mp-challenge":  # a multiprocessing peer with some other key
        stranger.sendall(struct.pack("!i", 40) + b"#CHALLENGE#" + os.urandom(29))
    elif attack == "slow-drip":  # one byte at a time: never a complete message, never silent for long
        drip = threading.Event()

        def send_slowly() -> None:
            while not drip.wait(0.2):
                try:
                    stranger.send(b"\x00")
                except OSError:
                    return

        threading.Thread(target=send_slowly, daemon=True).start()
    # a real peer connecting after the stranger is let in at once, whatever the stranger does
    peer = connect(listener)
    channel, hello, _ = listener.next(5.0)
    assert hello == ("hello", 1)
    if attack == "silent":
        assert not closed_by_peer(stranger, 0.01), "the silent stranger delayed the real peer"
    assert closed_by_peer(stranger, 5.0)  # ... and the stranger is closed after handshake_timeout
    if attack == "slow-drip":
        drip.set()
    wait_until(lambda: any("dropped a connection" in r.getMessage() and "test port" in r.getMessage()
                           for r in caplog.records), timeout=5, what="the log line of the dropped stranger")
    # the listener still works after all that
    other = connect(listener, hello=("hello", 2))
    assert listener.next(5.0)[1] == ("hello", 2)
    for conn in (peer, channel, other):
        conn.close()
    stranger.close()


def test_a_flood_of_silent_peers_only_delays_a_real_one(listener):
    """Beyond MAX_PENDING handshakes newcomers are closed at once; a real peer retries until a slot frees."""
    flood = [raw(listener.port) for _ in range(ChannelListener.MAX_PENDING)]
    time.sleep(0.2)  # all of them are in a handshake now
    peer = connect(listener)
    assert listener.next(5.0)[1] == ("hello", 1)
    for sock in flood:
        sock.close()
    peer.close()


def test_wrong_key_is_refused_on_both_sides(listener, caplog, tmp_path):
    caplog.set_level(logging.WARNING, logger="rlharvest")
    # a node with another key refuses the listener: it proves first, under a key the node does not hold
    with pytest.raises(AuthenticationFailed, match="refused the listener.*another key"):
        connect(listener, key=new_authkey())
    assert listener.next(1.5) is None
    wait_until(lambda: "closed the connection during the handshake" in caplog.text, 5.0, "the dropped peer")
    # a listener with another key (a stranger on the port a node expects) is refused by the node
    fake = ChannelListener(listen("127.0.0.1", 0), new_authkey(), "fake", 1.0, 5.0)
    try:
        with pytest.raises(AuthenticationFailed, match="refused the listener.*another key"):
            open_channel("127.0.0.1", fake.port, listener.key, 5.0, 5.0, 2.0)
    finally:
        fake.close()


def test_a_listener_with_the_learner_identity_refuses_a_wrong_key(caplog):
    """The command port's listener signs first; a peer that checks the signature, then proves a key
    the listener does not hold for its id, is dropped ("wrong key") before anything is decoded."""
    caplog.set_level(logging.WARNING, logger="rlharvest")
    secret = new_authkey()
    server = ChannelListener(listen("127.0.0.1", 0), command_keys(secret), "command", 1.0, 5.0,
                             identity=LearnerIdentity(secret))
    try:
        forged = NodeCredential(3, new_authkey(), LearnerIdentity(secret).public)
        peer = open_channel("127.0.0.1", server.port, forged, 5.0, 5.0, 2.0)
        peer.send_hello(("hello", 3, 1, "h"))
        assert server.next(1.0) is None
        wait_until(lambda: "wrong key" in caplog.text, 5.0, "the dropped peer")
        peer.close()
    finally:
        server.close()


def test_a_fake_listener_cannot_get_a_pickle_unpickled(listener, tmp_path):
    """A stranger accepting the node's connection sends a pickle instead of its proof."""
    marker = tmp_path / "pwned"
    server = listen("127.0.0.1", 0)

    def attacker() -> None:
        sock, _ = server.accept()
        conn = mpc.Connection(sock.detach())
        conn.recv_bytes()  # the node's first message (nothing that depends on its key)
        conn.send_bytes(MAGIC + os.urandom(64) + pickle.dumps(Boom(str(marker))))  # a pickle for its proof
        conn.send_bytes(pickle.dumps(Boom(str(marker))))
        time.sleep(0.5)
        conn.close()

    thread = threading.Thread(target=attacker)
    thread.start()
    try:
        with pytest.raises(AuthenticationFailed):
            open_channel("127.0.0.1", server.getsockname()[1], listener.key, 5.0, 5.0, 2.0)
    finally:
        thread.join(5)
        server.close()
    assert not marker.exists()


def test_a_relay_cannot_inject_messages(listener, tmp_path):
    """A stranger in the middle (a tampered port) relays the handshake it cannot do itself, then
    injects a pickle: the tag check rejects it before it is unpickled, and the channel closes."""
    marker = tmp_path / "pwned"
    relay = listen("127.0.0.1", 0)

    def man_in_the_middle() -> None:
        node_side, _ = relay.accept()
        server_side = raw(listener.port)
        server_side.settimeout(None)
        node, server = mpc.Connection(node_side.detach()), mpc.Connection(server_side.detach())
        server.send_bytes(node.recv_bytes())  # <- nonce, key id, X25519 value
        node.send_bytes(server.recv_bytes())  # listener's nonce, X25519 value and proof ->
        server.send_bytes(node.recv_bytes())  # <- the node's proof
        hello = node.recv_bytes()
        server.send_bytes(hello)  # the genuine hello passes
        node.send_bytes(b"\0" * 32 + pickle.dumps(Boom(str(marker))))  # forged message to the node
        server.send_bytes(hello[:32] + pickle.dumps(Boom(str(marker))))  # and to the listener
        time.sleep(1.0)
        node.close()
        server.close()

    thread = threading.Thread(target=man_in_the_middle)
    thread.start()
    try:
        peer = open_channel("127.0.0.1", relay.getsockname()[1], listener.key, 5.0, 5.0, 2.0)
        peer.send_hello(("hello", 1))
        channel, hello, _ = listener.next(5.0)
        assert hello == ("hello", 1)  # relaying a genuine exchange is all a relay can do
        with pytest.raises(AuthenticationFailed, match="failed authentication"):
            peer.recv()
        with pytest.raises(AuthenticationFailed, match="failed authentication"):
            channel.recv()
        assert channel.closed and peer.closed
    finally:
        thread.join(5)
        relay.close()
    assert not marker.exists()


def test_a_key_holder_gets_no_pickle_unpickled_by_the_listener(listener, tmp_path, caplog):
    """A peer holding the key sends a pickled hello (dropped: hellos are plain values), then, as a
    node would, a pickle (refused: nodes send wire format 2, never pickles) and an object of a class
    the main process did not allow (refused, nothing called)."""
    caplog.set_level(logging.WARNING, logger="rlharvest")
    marker = tmp_path / "pwned"
    peer = open_channel("127.0.0.1", listener.port, listener.key, 5.0, 5.0, 2.0)
    peer.send_bytes(pickle.dumps(Boom(str(marker))))  # a pickle where the hello goes
    assert listener.next(1.0) is None and closed_by_peer(socket.socket(fileno=os.dup(peer.fileno())), 5.0)
    wait_until(lambda: "not a JSON array" in caplog.text, 5.0, "the dropped pickled hello")
    peer.close()
    for message, refusal in ((pickle.dumps(("hb", Boom(str(marker)))), "a pickle: the node runs an older rlharvest"),
                             (encode_from_node(("hb", Boom(str(marker)))), "test_channel.Boom, which the main process "
                                                                            "does not rebuild")):
        peer = connect(listener)
        channel, _, _ = listener.next(5.0)
        peer.send(("hb", 3, {"x": [1.5, None]}))  # plain values pass
        assert channel.recv() == ("hb", 3, {"x": [1.5, None]})
        peer.send_bytes(message)
        with pytest.raises(RefusedMessage, match=refusal):  # an OSError: as if the node had gone
            channel.recv()
        assert channel.closed and not marker.exists()
        peer.close()


def test_a_slot_key_opens_a_channel_for_its_own_rank_only():
    """Nodes the collector starts hold their slot's key only: the listener learns which."""
    key = new_authkey()
    server = ChannelListener(listen("127.0.0.1", 0), command_keys(key), "command", 1.0, 5.0)
    try:
        peer = open_channel("127.0.0.1", server.port, slot_key(key, 3), 5.0, 5.0, 2.0, key_id=3)
        peer.send_hello(("hello", 3, 1, "h"))
        channel, hello, _ = server.next(5.0)
        assert channel.key_id == 3 and hello == ("hello", 3, 1, "h")
        for wrong_id in (2, 0, -1, 1 << 40):  # another rank's id, the collector's, nonsense
            with pytest.raises(AuthenticationFailed):
                open_channel("127.0.0.1", server.port, slot_key(key, 3), 5.0, 5.0, 2.0, key_id=wrong_id)
        assert server.next(0.5) is None
        peer.close()
        channel.close()
    finally:
        server.close()


def test_one_network_holds_a_few_handshakes_and_its_drops_are_logged_sparingly(caplog):
    """A flood from one network holds at most MAX_PER_NETWORK handshakes: each newcomer evicts the
    oldest; the warnings about it stay a handful plus a count, not one line per connection."""
    caplog.set_level(logging.WARNING, logger="rlharvest")
    server = ChannelListener(listen("127.0.0.1", 0), new_authkey(), "test", 2.0, 5.0)
    flood = [raw(server.port) for _ in range(3 * ChannelListener.MAX_PER_NETWORK)]
    try:
        wait_until(lambda: sum(closed_by_peer(sock, 0.01) for sock in flood) >= 2 * ChannelListener.MAX_PER_NETWORK,
                   5.0, "the oldest connections closing")
        lines = [r.getMessage() for r in caplog.records if "dropped a connection" in r.getMessage()]
        assert 1 <= len(lines) <= 5
        assert "evicted for a newer connection (8 handshakes from 127.0.0.0/8 in progress)" in lines[0]
    finally:
        for sock in flood:
            sock.close()
        server.close()


def test_closed_listener_refuses_connections(listener):
    port = listener.port
    listener.close()
    with pytest.raises(ConnectionRefusedError):
        raw(port)


def test_parse_authkey():
    key = new_authkey()
    assert parse_authkey(key.hex()) == key and parse_authkey(key) == key
    with pytest.raises(ValueError, match="at least 16 bytes"):
        parse_authkey("ab" * 8 + "")  # 8 bytes
    with pytest.raises(ValueError, match="hex"):
        parse_authkey("not a key")
    with pytest.raises(TypeError, match="authkey"):
        parse_authkey(1234)


def test_a_squatter_on_several_loopback_addresses_cannot_keep_a_real_peer_out():
    """36 idle connections from 127.0.0.2-5, each retaken as soon as it is closed: they count as one
    network (127.0.0.0/8), a newcomer evicts the oldest idle one, and a real peer from 127.0.0.1 gets
    in at once (before: 8 per address and 32 in all kept every slot taken until the handshakes timed
    out, here after the peer gave up, and the squatter retook most of them first)."""
    key = new_authkey()
    server = ChannelListener(listen("127.0.0.1", 0), key, "test", handshake_timeout=5.0, user_timeout=5.0)
    squatter = Squatter(server.port, [f"127.0.0.{n}" for n in range(2, 6)], 36)
    try:
        wait_until(lambda: squatter.retaken >= 36, 10.0, "the squatter to retake its slots")
        peer = open_channel("127.0.0.1", server.port, key, timeout=3.0, user_timeout=5.0, handshake_timeout=2.0)
        peer.send_hello(("hello", 1))
        channel, hello, _ = server.next(5.0)
        assert hello == ("hello", 1)
        peer.close()
        channel.close()
    finally:
        squatter.close()
        server.close()


def test_a_node_sends_nothing_that_depends_on_its_key_before_the_listener_proves(listener, monkeypatch):
    """A squatter on the port a node connects to acts as the real listener does up to its proof, and
    keeps what the node sends meanwhile: the same bytes whatever key the node holds, so there is
    nothing to test guesses of a weak key against offline."""
    with raw(listener.port) as probe:  # the real listener's greeting, if it sends one first, replayed
        probe.settimeout(None)
        # within 0.5 s, less than the listener gives a silent peer: it greets first, or waits for the peer
        speaks = select.select([probe], [], [], 0.5)[0]
        greeting = mpc.Connection(os.dup(probe.fileno())).recv_bytes() if speaks else None
    keys = [new_authkey(), new_authkey()]

    def first_message(key: bytes) -> bytes:
        squatter, seen = listen("127.0.0.1", 0), []

        def squat() -> None:
            sock, _ = squatter.accept()
            squatter.close()  # the node's retries find nothing
            conn = mpc.Connection(sock.detach())
            if greeting is not None:
                conn.send_bytes(greeting)
            seen.append(conn.recv_bytes())
            conn.close()

        thread = threading.Thread(target=squat, daemon=True)
        thread.start()
        with monkeypatch.context() as patch:
            patch.setattr(os, "urandom", lambda size: b"\x07" * size)  # the same nonces for both nodes
            with pytest.raises((AuthenticationFailed, OSError)):
                open_channel("127.0.0.1", squatter.getsockname()[1], key, timeout=1.0, user_timeout=5.0,
                             handshake_timeout=2.0)
        thread.join(5.0)
        return seen[0]

    assert first_message(keys[0]) == first_message(keys[1])


def test_a_key_too_repetitive_to_be_random_is_refused():
    """parse_authkey checked only the length: a key of 16 equal bytes passed."""
    for weak in ("00" * 16, "ab" * 32, "deadbeef" * 8):
        with pytest.raises(ValueError, match="not a random key"):
            parse_authkey(weak)
    parse_authkey(new_authkey().hex())


def test_a_node_key_is_one_line_of_hex_and_its_bytes_are_the_same_key():
    """join_command()'s key file holds hex, as a collector's key did: read as text, or as the bytes
    that hex holds (what a script reading a key file does), it is the same node key, never taken for
    a collector's key; a collector's key is still one."""
    secret = new_authkey()
    credential = NodeCredential.for_joining(secret)
    text = credential.encode()
    assert parse_node_key(text, "--key-file") == credential == as_credential(bytes.fromhex(text))
    assert secret.hex() not in text and credential.key.hex() in text
    assert parse_node_key(secret.hex(), "--key-file") == stretch_authkey(secret)
    with pytest.raises(ValueError, match="--key-file is not a node key"):
        NodeCredential.decode(secret.hex(), "--key-file")
