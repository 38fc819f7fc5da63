"""Ends with a wake-up pipe close it once: a handle terminated twice (by ``remove_collectors``, again
at shutdown) or an endpoint closed twice (by the worker loop, again by the node's entry point) must
not close the descriptors that reused the numbers in between. And a node's endpoint, closed, leaves no
reader thread behind."""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading

import pytest
from mocks import wait_until

from rlharvest.transport.pipes import Doorbell
from rlharvest.transport.rpc import RPCWorkerHandle
from rlharvest.transport.torchdist import DistWorkerEndpoint
from rlharvest.transport.torchdist_receiver import DistWeightReceiver

pytestmark = pytest.mark.timeout(30)


class _Launched:
    """A node launched nowhere: terminating it does nothing."""

    pid = None

    def terminate(self, deadline: float) -> None:
        return None

    def is_alive(self) -> bool:
        return False


def _rpc_handle():
    handle = RPCWorkerHandle(0, "COLLECTOR_NODE_1", _Launched(), 1.0, calls=None)
    return handle, lambda: handle.terminate(0.0)


def _node_endpoint():
    parent, child = multiprocessing.Pipe()
    endpoint = DistWorkerEndpoint(child, group=None, worker_idx=0, heartbeat_interval=0.05)
    return endpoint, lambda: (endpoint.close(), parent.close())


def _weight_receiver():
    receiver = DistWeightReceiver({}, 0)
    return receiver, receiver.close


def _doorbell():
    bell = Doorbell()
    return bell, bell.close


@pytest.mark.parametrize("make", [_rpc_handle, _node_endpoint, _weight_receiver, _doorbell],
                         ids=["rpc-handle", "torchdist-endpoint", "torchdist-weight-receiver", "doorbell"])
def test_closing_twice_leaves_a_descriptor_opened_in_between_intact(make):
    _, close = make()
    close()
    pipes = [os.pipe() for _ in range(4)]  # take the lowest free numbers: those just closed among them
    try:
        close()
        for read, write in pipes:
            os.write(write, b"y")
            assert os.read(read, 1) == b"y"
    finally:
        for fds in pipes:
            for fd in fds:
                os.close(fd)


def test_a_closed_node_endpoint_leaves_no_reader_polling_until_its_next_heartbeat():
    """The reader polls the channel until its next heartbeat is due: close() wakes it (before, every
    node's exit waited up to ``heartbeat_interval``, and a longer interval outlived close())."""
    parent, child = multiprocessing.Pipe()
    endpoint = DistWorkerEndpoint(child, group=None, worker_idx=0, heartbeat_interval=60.0)
    try:
        assert parent.recv() == ("hb", 0)  # the reader runs, and polls for up to 60 s once in select()
        reader = next(t for t in threading.enumerate() if t.name == "rlharvest-node-reader")
        wait_until(lambda: sys._current_frames()[reader.ident].f_code.co_name == "select", 10.0,
                   "the reader polling the channel")
        endpoint.close()
        readers = [t for t in threading.enumerate() if t.name == "rlharvest-node-reader" and t.is_alive()]
        assert readers == []
    finally:
        parent.close()
