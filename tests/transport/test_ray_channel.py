"""The direct weight channel to Ray actors on the driver's node, both ends in this process (no Ray)."""

from __future__ import annotations

import os
import socket
import time
from multiprocessing.connection import Connection

import pytest

from rlharvest import WorkerError
from rlharvest.errors import WorkerTimeoutError
from rlharvest.transport.ray_channel import ChannelClient, ChannelServer, Wakeup

pytestmark = pytest.mark.timeout(30)


def alive():
    return True, "alive"


@pytest.fixture
def server():
    server = ChannelServer(num_workers=2)
    yield server
    server.close()


def test_an_invited_actor_reads_the_board_then_the_notice_and_acknowledges(server):
    client = ChannelClient(server.invite(1, "node-a"), timeout=5.0)
    try:
        conn = server.connection(1, time.monotonic() + 5.0, alive)
        assert set(server.conns) == {1} and client.announced() == 0
        server.announce(1, 3, ("shm", 0, None))
        assert client.announced() == 3  # the board is written before the notice is sent
        assert client.conn.poll(5.0) and client.conn.recv() == ("update", 3, ("shm", 0, None))
        client.conn.send(("ack", 3))
        assert conn.poll(5.0) and conn.recv() == ("ack", 3)
    finally:
        client.close()


def test_a_stranger_or_a_stale_invitation_is_dropped_unheard(server):
    stale = server.invite(0, "node-a")
    fresh = server.invite(0, "node-a")  # a replacement's invitation voids the one before
    stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stranger.connect(server.path)
    stranger_conn = Connection(stranger.detach())
    stranger_conn.send_bytes(b"not-a-token")
    old = ChannelClient(stale, timeout=5.0)
    new = ChannelClient(fresh, timeout=5.0)
    try:
        server.connection(0, time.monotonic() + 5.0, alive)
        assert stranger_conn.poll(5.0) and _closed(stranger_conn)
        assert old.conn.poll(5.0) and _closed(old.conn)
        server.announce(0, 1, None)
        assert new.conn.poll(5.0) and new.conn.recv() == ("update", 1, None)
    finally:
        for end in (old, new):
            end.close()
        stranger_conn.close()


def _closed(conn: Connection) -> bool:
    try:
        conn.recv_bytes()
    except EOFError:
        return True
    return False


def test_waiting_for_an_actor_that_never_connects_is_bounded_and_checks_liveness(server):
    with pytest.raises(WorkerTimeoutError, match="weight channel"):
        server.connection(0, time.monotonic() + 0.3, alive)
    with pytest.raises(WorkerError, match="died before it opened") as info:
        server.connection(1, time.monotonic() + 30.0, lambda: (False, "killed"))
    assert info.value.worker_idx == 1


def test_an_unreachable_driver_names_the_way_around():
    with pytest.raises(ConnectionError, match="use_shared_memory=False"):
        ChannelClient({"path": "/nonexistent/s", "token": b"x", "board": "x", "slots": 1, "slot": 0}, timeout=1.0)


def test_close_leaves_no_socket_and_no_board_segment():
    server = ChannelServer(num_workers=1)
    path, board = server.path, f"/dev/shm/{server.invite(0, None)['board'].lstrip('/')}"
    assert os.path.exists(path) and os.path.exists(board)
    server.close()
    assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path)) and not os.path.exists(board)


def test_a_wakeup_is_ready_while_any_member_is():
    import multiprocessing.connection

    left, right = multiprocessing.Pipe()
    other_left, other_right = multiprocessing.Pipe()
    wakeup = Wakeup(left)
    wakeup.add(other_left)
    try:
        assert multiprocessing.connection.wait([wakeup], timeout=0) == []
        other_right.send(1)
        assert multiprocessing.connection.wait([wakeup], timeout=1.0) == [wakeup]
        other_left.recv()
        assert multiprocessing.connection.wait([wakeup], timeout=0) == []
    finally:
        wakeup.close()
        for conn in (left, right, other_left, other_right):
            conn.close()
