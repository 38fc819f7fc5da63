"""What this process holds open: its descriptors and the TCP ports it listens on, to check that a
collector's ``shutdown()`` releases everything the collector opened (a port, a connection, a pipe, a
shared-memory segment), whichever backend it runs on.

Usage::

    start_process_state()
    before = held()
    collector = ...; collect; collector.shutdown()
    assert held_since(before) == Held({}, set())

What a library opens once per process and keeps until the process exits is not a collector's, and is
left out (:func:`open_fds`) or opened beforehand (:func:`start_process_state`):

* multiprocessing's resource tracker (a pipe), its forkserver (a pipe it watches to know this process is
  alive), and its resource sharer (a Unix socket through which descriptors are passed to children);
* libuv's pipe (its signal handling), opened by torch's first ``TCPStore`` server.

Ray keeps connections to this process for the life of its session (its raylet and workers talk to the
driver): a Ray test compares from its second collector on.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import psutil

__all__ = ["Held", "held", "held_since", "listening_ports", "open_fds", "start_process_state"]


@dataclass(frozen=True)
class Held:
    """Descriptors (number -> what ``readlink`` says it is) and listening TCP ports ``(address, port)``."""

    fds: dict[int, str]
    ports: set[tuple[str, int]]


def held() -> Held:
    """What this process holds now (garbage collected first: a dropped object's descriptors go with it)."""
    gc.collect()
    return Held(open_fds(), listening_ports())


def held_since(before: Held) -> Held:
    """What this process holds now and did not hold at ``before`` (a descriptor number reused for
    something else counts)."""
    now = held()
    return Held({fd: target for fd, target in now.fds.items() if before.fds.get(fd) != target},
                now.ports - before.ports)


def listening_ports() -> set[tuple[str, int]]:
    """The TCP ports this process listens on, with their addresses."""
    return {(conn.laddr.ip, conn.laddr.port) for conn in psutil.Process().net_connections("inet")
            if conn.status == psutil.CONN_LISTEN}


def start_process_state() -> None:
    """Start what torch starts once per process and keeps (a pipe its first TCPStore server opens),
    so that a test comparing this process's descriptors before and after a collector sees only the
    collector's."""
    import torch.distributed as dist
    from rlharvest.transport.ports import free_port_block

    dist.TCPStore("127.0.0.1", free_port_block(1), 1, True)


def open_fds() -> dict[int, str]:
    """This process's descriptors and what each refers to (``readlink``), but those of the
    multiprocessing helpers a process starts once, on first use, and keeps until it exits (the
    resource sharer passing descriptors to children, the resource tracker, the forkserver): they are
    not any collector's."""
    import multiprocessing.forkserver
    import multiprocessing.resource_sharer
    import multiprocessing.resource_tracker

    helpers = {multiprocessing.resource_tracker._resource_tracker._fd,
               multiprocessing.forkserver._forkserver._forkserver_alive_fd}
    listener = multiprocessing.resource_sharer._resource_sharer._listener
    if listener is not None:
        helpers.add(listener._listener._socket.fileno())
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        if int(fd) in helpers:
            continue
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed meanwhile
            pass
    return out
