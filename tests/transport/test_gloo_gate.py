"""gloo's port while a pair forms (transport/gloo_gate.py), over loopback, IPv4 and IPv6: a stranger
who floods it gets no connection completed (gloo would keep each one for the group's life, and abort
the process once no descriptor is left), the process's descriptors stay where they were, and once
the pair formed nothing but the pair's own connection is open on that port, which no longer listens.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading

import psutil
import pytest
import torch
from attackers import PortFlooder, listening

from rlharvest.transport.channel import listen, new_authkey, open_channel
from rlharvest.transport.listener import ChannelListener
from rlharvest.transport.pairing import form_pair

pytestmark = pytest.mark.timeout(120)

#: connections the stranger opens to gloo's port while the pair waits for its node
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


def open_on(port: int) -> list[int]:
    """The ports of this process's connections whose local end is ``port`` (accepted on it)."""
    return [c.raddr.port for c in psutil.Process().net_connections("inet")
            if c.laddr and c.laddr.port == port and c.status != "LISTEN"]


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_a_flood_on_gloo_port_while_a_pair_forms_leaves_nothing_open(channels, host):
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
