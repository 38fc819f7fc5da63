"""The relay channel between carriers (transport/torchdist_relay.py) over loopback: chunks forwarded
as they arrive, stale and foreign upstreams refused, a silent or vanished upstream reported as a
broken relay. The relay between hosts itself is tested across network namespaces in
tests/collectors/distributed/test_host_copies.py."""

from __future__ import annotations

import threading

import pytest
import torch

from rlharvest.transport.channel import new_authkey
from rlharvest.transport.torchdist_relay import CHUNK_BYTES, RelayPort, forward, open_downstream, relay_in

pytestmark = pytest.mark.timeout(60)


def _send_all(channel, flat: torch.Tensor, upto: int | None = None) -> None:
    view = memoryview(flat.numpy())
    for start in range(0, flat.numel() if upto is None else upto, CHUNK_BYTES):
        forward(channel, view[start:start + CHUNK_BYTES])


@pytest.fixture
def ports():
    key = new_authkey()
    made = [RelayPort("127.0.0.1", key, 5.0, 10.0) for _ in range(2)]
    yield key, made
    for port in made:
        port.close()


def test_a_middle_carrier_stores_and_forwards_every_chunk(ports):
    key, (middle, last) = ports
    data = torch.randint(0, 255, (2 * CHUNK_BYTES + 123,), dtype=torch.uint8)
    got_middle, got_last = torch.zeros_like(data), torch.zeros_like(data)
    upstream = open_downstream(("127.0.0.1", middle.port), key, 7, 5.0, 10.0)
    sender = threading.Thread(target=_send_all, args=(upstream, data))
    sender.start()
    channel = middle.accept(7, 10.0)
    out = open_downstream(("127.0.0.1", last.port), key, 7, 5.0, 10.0)
    results = []
    receiver = threading.Thread(target=lambda: results.append(relay_in(last.accept(7, 10.0), got_last, None, 5.0)))
    receiver.start()
    whole, out = relay_in(channel, got_middle, out, 5.0)
    assert whole and out is not None
    out.close()
    sender.join(10.0)
    receiver.join(10.0)
    assert results == [(True, None)]
    assert torch.equal(got_middle, data) and torch.equal(got_last, data)


def test_stale_and_foreign_upstreams_are_refused(ports):
    key, (port, _) = ports
    stale = open_downstream(("127.0.0.1", port.port), key, 6, 5.0, 10.0)  # a late upstream of update 6
    assert stale is not None
    assert open_downstream(("127.0.0.1", port.port), new_authkey(), 7, 1.0, 10.0) is None  # another key
    assert port.accept(7, 1.0) is None  # nobody announced update 7 within the bound
    assert open_downstream(None, key, 7, 1.0, 10.0) is None  # the last carrier forwards nothing


def test_a_silent_or_vanished_upstream_breaks_the_relay(ports):
    key, (port, _) = ports
    data = torch.ones(CHUNK_BYTES + 5, dtype=torch.uint8)
    upstream = open_downstream(("127.0.0.1", port.port), key, 3, 5.0, 10.0)
    sender = threading.Thread(target=_send_all, args=(upstream, data, 1))  # one chunk, then silence
    sender.start()
    whole, _ = relay_in(port.accept(3, 10.0), torch.zeros_like(data), None, 1.0)
    assert not whole
    sender.join(10.0)
    upstream.close()

    def one_chunk_then_die(channel) -> None:
        _send_all(channel, data, 1)
        channel.close()

    upstream = open_downstream(("127.0.0.1", port.port), key, 4, 5.0, 10.0)
    sender = threading.Thread(target=one_chunk_then_die, args=(upstream,))
    sender.start()
    whole, _ = relay_in(port.accept(4, 10.0), torch.zeros_like(data), None, 10.0)
    assert not whole
    sender.join(10.0)


def test_the_relay_is_asked_for():
    from rlharvest.weight_update import DistributedWeightSyncScheme

    assert DistributedWeightSyncScheme().relay is False and DistributedWeightSyncScheme(relay=True).relay is True
    with pytest.raises(ValueError, match="relay must be True or False, got 'yes'"):
        DistributedWeightSyncScheme(relay="yes")
