"""The relay links between carriers (transport/torchdist_relay.py) over loopback: chunks tagged once by
the main process, checked and forwarded unchanged by each carrier, links kept from one update to the
next; foreign keys, bad or replayed chunks, stale updates, a silent or vanished upstream all break the
relay (the carrier then asks the main process). The relay between hosts itself is tested across
network namespaces in tests/collectors/distributed/test_host_copies.py."""

from __future__ import annotations

import threading

import pytest
import torch

from rlharvest.transport.channel import new_authkey
from rlharvest.transport.torchdist_relay import (FROM_MAIN, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES, Forwarder, Links,
                                                 RelayPort, Stream, chunk_bytes, receive, relay_key)

pytestmark = pytest.mark.timeout(60)

SIZE = 3 * MIN_CHUNK_BYTES + 123


@pytest.fixture
def relay():
    """A key, two relay ports (a middle and a last carrier) and the main process's links."""
    key = new_authkey()
    ports = [RelayPort("127.0.0.1", key, 5.0, 10.0) for _ in range(2)]
    main = Links(relay_key(key), FROM_MAIN, 5.0, 10.0)
    yield key, ports, main
    main.close()
    for port in ports:
        port.close()


def _stream_from(links: Links, port: RelayPort, data: torch.Tensor, stream: Stream, key: bytes | None = None,
                 upto: int | None = None) -> Forwarder:
    """What the main process does for the first carrier: every chunk (or the first ``upto``), tagged here."""
    address = ("127.0.0.1", port.port)
    forwarder = Forwarder(lambda: links.get(address), lambda: links.drop(address), memoryview(data.numpy()), stream,
                          5.0, key=key or links.key)
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


def test_chunks_are_about_an_eighth_of_an_update_within_bounds():
    assert chunk_bytes(1000) == MIN_CHUNK_BYTES
    assert chunk_bytes(4_000_000) == 500_000  # a 1M-parameter update: 8 chunks
    assert chunk_bytes(100_000_000) == MAX_CHUNK_BYTES
    stream = Stream.new(1, SIZE)
    assert stream.chunk == MIN_CHUNK_BYTES and stream.count == 4
    assert sum(len(stream.piece(memoryview(bytes(SIZE)), i)) for i in range(stream.count)) == SIZE


def test_a_middle_carrier_checks_and_forwards_every_chunk_over_links_kept_between_updates(relay):
    key, (middle, last), main = relay
    carrier = Links(relay_key(key), 0, 5.0, 10.0)
    try:
        links_seen = []
        for version in (1, 2):
            data = _data()
            got_middle, got_last = torch.zeros_like(data), torch.zeros_like(data)
            stream = Stream.new(version, SIZE)
            sender = _stream_from(main, middle, data, stream)
            address = ("127.0.0.1", last.port)
            out = Forwarder(lambda: carrier.get(address), lambda: carrier.drop(address), memoryview(got_middle.numpy()),
                            stream, 5.0)
            results = []
            tail = threading.Thread(target=lambda: results.append(
                receive(last.upstream(0, 10.0), memoryview(got_last.numpy()), stream, last.key, 5.0)))
            tail.start()
            whole = receive(middle.upstream(FROM_MAIN, 10.0), memoryview(got_middle.numpy()), stream, middle.key, 5.0,
                            out)
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
    key, (port, _), main = relay
    data = _data()
    for version, links in ((1, main), (2, Links(relay_key(key), FROM_MAIN, 5.0, 10.0))):
        stream = Stream.new(version, SIZE)
        sender = _stream_from(links, port, data, stream)
        got = _data(0)
        assert receive(port.upstream(FROM_MAIN, 10.0), memoryview(got.numpy()), stream, port.key, 5.0)
        assert torch.equal(got, data)
        sender.wait(10.0)
        links.close()  # the sender dies: its link ends
        assert port.upstream(FROM_MAIN, 0.5) is None  # the dead link is not handed out


def test_a_foreign_key_opens_no_link(relay):
    key, (port, _), _ = relay
    stranger = Links(relay_key(new_authkey()), FROM_MAIN, 1.0, 10.0)
    try:
        assert stranger.get(("127.0.0.1", port.port)) is None
        assert port.upstream(FROM_MAIN, 1.0) is None
    finally:
        stranger.close()


@pytest.mark.parametrize("bad", ["forged tag", "replayed from another update", "stale update"])
def test_a_bad_chunk_or_stale_update_breaks_the_relay(relay, bad):
    key, (port, _), main = relay
    stream = Stream.new(5, SIZE)
    sent = {"forged tag": stream, "replayed from another update": Stream.new(5, SIZE),
            "stale update": Stream(4, stream.nonce, SIZE, stream.chunk)}[bad]
    forger = relay_key(new_authkey()) if bad == "forged tag" else None
    sender = _stream_from(main, port, _data(7), sent, key=forger)
    got = _data(0)
    assert not receive(port.upstream(FROM_MAIN, 10.0), memoryview(got.numpy()), stream, port.key, 5.0)
    port.drop(FROM_MAIN)
    sender.wait(10.0)


def test_a_silent_or_vanished_upstream_breaks_the_relay(relay):
    key, (port, _), main = relay
    stream = Stream.new(3, SIZE)
    silent = _stream_from(main, port, _data(1), stream, upto=1)  # one chunk, then silence
    assert not receive(port.upstream(FROM_MAIN, 10.0), memoryview(_data(0).numpy()), stream, port.key, 1.0)
    port.drop(FROM_MAIN)
    silent.finish(False)
    silent.wait(10.0)

    stream = Stream.new(4, SIZE)
    dying = _stream_from(main, port, _data(1), stream, upto=1)
    dying.finish(False)  # one chunk, then the link closes
    assert not receive(port.upstream(FROM_MAIN, 10.0), memoryview(_data(0).numpy()), stream, port.key, 30.0)
    dying.wait(10.0)
    assert dying.failed


def test_the_relay_is_on_unless_turned_off():
    from rlharvest.weight_update import DistributedWeightSyncScheme

    assert DistributedWeightSyncScheme().relay is True and DistributedWeightSyncScheme(relay=False).relay is False
    with pytest.raises(ValueError, match="relay must be True or False, got 'yes'"):
        DistributedWeightSyncScheme(relay="yes")
