"""The relay links between carriers (transport/torchdist_relay.py) over loopback: chunks checked by
each carrier against the digests the main process sent it, forwarded unchanged, links kept from one
update to the next; foreign keys, forged, replayed or stale chunks (also from a carrier that holds
every key), a silent, slow or vanished upstream and a malicious hello all break the relay or are
dropped (the carrier then asks the main process). The relay between hosts itself is tested across
network namespaces in tests/collectors/distributed/test_host_copies.py."""

from __future__ import annotations

import logging
import pickle
import threading
import time

import blake3
import pytest
import torch
from mocks import wait_until

from rlharvest.transport.channel import new_authkey, open_channel
from rlharvest.transport.torchdist_relay import (FROM_MAIN, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES, Forwarder, Links,
                                                 RelayPort, Stream, chunk_bytes, chunk_digests, receive, unwrap_key,
                                                 wrap_key)

pytestmark = pytest.mark.timeout(60)

SIZE = 3 * MIN_CHUNK_BYTES + 123


@pytest.fixture
def relay():
    """Two relay ports (a middle and a last carrier, each with its own key) and the main process's links."""
    keys = [new_authkey(), new_authkey()]
    ports = [RelayPort("127.0.0.1", key, 5.0, 10.0) for key in keys]
    main = Links(FROM_MAIN, 5.0, 10.0)
    yield ports, main
    main.close()
    for port in ports:
        port.close()


def _stream_from(links: Links, port: RelayPort, data: torch.Tensor, stream: Stream, upto: int | None = None,
                 key: bytes | None = None) -> Forwarder:
    """What the main process does for the first carrier: every chunk (or the first ``upto``)."""
    address = ("127.0.0.1", port.port)
    forwarder = Forwarder(lambda: links.get(address, key or port.key), lambda: links.drop(address),
                          memoryview(data.numpy()), stream, 5.0)
    if upto is None:
        forwarder.put_all()
    else:
        for index in range(upto):
            forwarder.put(index)
    return forwarder


def _data(fill: int | None = None) -> torch.Tensor:
    if fill is not None:
        return torch.full((SIZE,), fill, dtype=torch.uint8)
    return torch.randint(0, 255, (SIZE,), dtype=torch.uint8)


def _digests(data: torch.Tensor, stream: Stream) -> bytes:
    return chunk_digests(memoryview(data.numpy()), stream)


def test_chunks_are_about_an_eighth_of_an_update_within_bounds():
    assert chunk_bytes(1000) == MIN_CHUNK_BYTES
    assert chunk_bytes(4_000_000) == 500_000  # a 1M-parameter update: 8 chunks
    assert chunk_bytes(100_000_000) == MAX_CHUNK_BYTES
    stream = Stream.new(1, SIZE)
    assert stream.chunk == MIN_CHUNK_BYTES and stream.count == 4
    assert sum(len(stream.piece(memoryview(bytes(SIZE)), i)) for i in range(stream.count)) == SIZE
    assert len(_digests(_data(), stream)) == 32 * stream.count


def test_a_chunk_digest_is_the_blake3_hash_of_its_chunk():
    data = _data()
    stream = Stream.new(1, SIZE)
    pieces = [bytes(stream.piece(memoryview(data.numpy()), i)) for i in range(stream.count)]
    assert _digests(data, stream) == b"".join(blake3.blake3(piece).digest() for piece in pieces)
    assert len(pieces[-1]) == SIZE - 3 * stream.chunk  # the last chunk is hashed as it is, short


def test_a_wrapped_key_is_unwrapped_by_its_holder_only():
    key, kek = new_authkey(), new_authkey()
    wrapped = wrap_key(key, kek)
    assert len(wrapped) == 48 and key not in wrapped and wrap_key(key, kek) != wrapped  # a fresh nonce each time
    assert unwrap_key(wrapped, kek) == key and unwrap_key(wrapped, new_authkey()) != key


def test_a_middle_carrier_checks_and_forwards_every_chunk_over_links_kept_between_updates(relay):
    (middle, last), main = relay
    carrier = Links(0, 5.0, 10.0)
    try:
        links_seen = []
        for version in (1, 2):
            data = _data()
            got_middle, got_last = torch.zeros_like(data), torch.zeros_like(data)
            stream = Stream.new(version, SIZE)
            digests = _digests(data, stream)
            sender = _stream_from(main, middle, data, stream)
            address = ("127.0.0.1", last.port)
            out = Forwarder(lambda: carrier.get(address, last.key), lambda: carrier.drop(address),
                            memoryview(got_middle.numpy()), stream, 5.0)
            results = []
            tail = threading.Thread(target=lambda: results.append(
                receive(last.upstream(0, 10.0), memoryview(got_last.numpy()), stream, digests, 5.0)))
            tail.start()
            whole = receive(middle.upstream(FROM_MAIN, 10.0), memoryview(got_middle.numpy()), stream, digests, 5.0, out)
            out.finish(whole)
            out.wait(10.0)
            sender.wait(10.0)
            tail.join(10.0)
            assert whole and results == [True] and not out.failed and not sender.failed
            assert torch.equal(got_middle, data) and torch.equal(got_last, data)
            links_seen.append((middle.upstream(FROM_MAIN, 0.0), last.upstream(0, 0.0)))
        assert links_seen[0] == links_seen[1]  # the second update went over the links the first opened
    finally:
        carrier.close()


def test_a_link_whose_sender_died_gives_way_to_the_link_of_its_replacement(relay):
    (port, _), main = relay
    data = _data()
    for version, links in ((1, main), (2, Links(FROM_MAIN, 5.0, 10.0))):
        stream = Stream.new(version, SIZE)
        sender = _stream_from(links, port, data, stream)
        got = _data(0)
        assert receive(port.upstream(FROM_MAIN, 10.0), memoryview(got.numpy()), stream, _digests(data, stream), 5.0)
        assert torch.equal(got, data)
        sender.wait(10.0)
        links.close()  # the sender dies: its link ends
        assert port.upstream(FROM_MAIN, 0.5) is None  # the dead link is not handed out


def test_a_foreign_key_opens_no_link(relay):
    (port, other), _ = relay
    stranger = Links(FROM_MAIN, 1.0, 10.0)
    try:
        for key in (new_authkey(), other.key):  # a stranger's key; another carrier's relay key
            assert stranger.get(("127.0.0.1", port.port), key) is None
        assert port.upstream(FROM_MAIN, 1.0) is None
    finally:
        stranger.close()


def _one_byte_altered_in_last_chunk(data: torch.Tensor) -> torch.Tensor:
    altered = data.clone()
    altered[-1] ^= 1
    return altered


@pytest.mark.parametrize("bad", ["forged by a carrier upstream", "one byte altered in the last chunk",
                                 "replayed from another update", "stale update"])
def test_a_forged_chunk_or_stale_update_breaks_the_relay(relay, bad):
    """Whoever opens the link (here with the right key: a carrier upstream holds it) cannot make the
    carrier accept bytes other than those the main process's digests name."""
    (port, _), main = relay
    data = _data(7)
    stream = Stream.new(5, SIZE)
    digests = _digests(data, stream)
    sent_data, sent = {"forged by a carrier upstream": (_data(9), stream),
                       "one byte altered in the last chunk": (_one_byte_altered_in_last_chunk(data), stream),
                       "replayed from another update": (data, Stream.new(5, SIZE)),
                       "stale update": (data, Stream(4, stream.nonce, SIZE, stream.chunk))}[bad]
    sender = _stream_from(main, port, sent_data, sent)
    got = _data(0)
    assert not receive(port.upstream(FROM_MAIN, 10.0), memoryview(got.numpy()), stream, digests, 5.0)
    port.drop(FROM_MAIN)
    sender.wait(10.0)


def test_a_silent_slow_or_vanished_upstream_breaks_the_relay(relay):
    (port, _), main = relay
    stream = Stream.new(3, SIZE)
    digests = _digests(_data(1), stream)
    silent = _stream_from(main, port, _data(1), stream, upto=1)  # one chunk, then silence
    assert not receive(port.upstream(FROM_MAIN, 10.0), memoryview(_data(0).numpy()), stream, digests, 1.0)
    port.drop(FROM_MAIN)
    silent.finish(False)
    silent.wait(10.0)

    stream = Stream.new(4, SIZE)
    dying = _stream_from(main, port, _data(1), stream, upto=1)
    dying.finish(False)  # one chunk, then the link closes
    assert not receive(port.upstream(FROM_MAIN, 10.0), memoryview(_data(0).numpy()), stream, digests, 30.0)
    dying.wait(10.0)
    assert dying.failed

    stream = Stream.new(6, SIZE)
    slow = _stream_from(main, port, _data(1), stream, upto=1)  # never silent for `silence`, never done
    start = time.monotonic()
    assert not receive(port.upstream(FROM_MAIN, 10.0), memoryview(_data(0).numpy()), stream, _digests(_data(1), stream),
                       5.0, deadline=time.monotonic() + 1.0)
    assert time.monotonic() - start < 5.0  # the update's deadline, not the silence, ended it
    port.drop(FROM_MAIN)
    slow.finish(False)
    slow.wait(10.0)


def test_a_forwarder_owns_its_buffer_until_its_thread_ends(relay):
    """``wait`` with a timeout does not return while the thread still reads the buffer: it aborts
    the link, then waits for the thread."""
    (port, _), main = relay
    big = torch.ones(32 * MAX_CHUNK_BYTES, dtype=torch.uint8)  # far more than the sockets buffer
    forwarder = _stream_from(main, port, big, Stream.new(1, big.numel()))
    assert port.upstream(FROM_MAIN, 10.0) is not None  # the link is open, and nobody reads it
    forwarder.wait(0.2)
    assert not forwarder._thread.is_alive() and forwarder.failed


def test_a_malicious_hello_on_a_relay_port_is_dropped_unread(relay, tmp_path, caplog):
    """A peer holding the relay key sends a pickle as its hello, or a hello naming nobody: dropped,
    nothing unpickled, the port still takes real links."""
    caplog.set_level(logging.WARNING, logger="rlharvest")
    (port, _), main = relay
    marker = tmp_path / "pwned"

    class Boom:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    evil = open_channel("127.0.0.1", port.port, port.key, 5.0, 5.0, 2.0)
    evil.send_bytes(pickle.dumps(Boom()))
    odd = open_channel("127.0.0.1", port.port, port.key, 5.0, 5.0, 2.0)
    odd.send_hello(("relay-link", "me"))
    assert port.upstream(FROM_MAIN, 1.0) is None
    wait_until(lambda: sum("relay port" in r.getMessage() for r in caplog.records) >= 2, 5.0, "both drops")
    assert not marker.exists()
    data = _data()
    stream = Stream.new(1, SIZE)
    sender = _stream_from(main, port, data, stream)
    got = _data(0)
    assert receive(port.upstream(FROM_MAIN, 10.0), memoryview(got.numpy()), stream, _digests(data, stream), 5.0)
    assert torch.equal(got, data)
    sender.wait(10.0)
    evil.close()
    odd.close()


def test_the_relay_is_on_unless_turned_off():
    from rlharvest.weight_update import DistributedWeightSyncScheme

    assert DistributedWeightSyncScheme().relay is True and DistributedWeightSyncScheme(relay=False).relay is False
    with pytest.raises(ValueError, match="relay must be True or False, got 'yes'"):
        DistributedWeightSyncScheme(relay="yes")
